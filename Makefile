# The two commands a new user runs: `make demo` and `make test`. Both create .venv when missing.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# torch first and pinned, so no other requirement makes pip resolve a different torch build.
# Override for another build, e.g. TORCH_SPEC="torch==2.13.0 --index-url URL" (PyTorch's CPU or CUDA index).
TORCH_SPEC ?= torch==2.13.0
DATA := examples/data/shakespeare

.PHONY: demo test lint size bench gpu-check clean

$(BIN)/femtotron: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet $(TORCH_SPEC)
	$(BIN)/pip install --quiet -e ".[dev]"
	touch $@

$(DATA).bin $(DATA).idx: $(BIN)/femtotron examples/data/shakespeare.jsonl.gz examples/tokenizer.json
	$(BIN)/femtotron preprocess --input examples/data/shakespeare.jsonl.gz \
		--tokenizer examples/tokenizer.json --output-prefix $(DATA)

demo: $(DATA).bin
	$(BIN)/femtotron train examples/debug.yaml
	$(BIN)/femtotron generate runs/debug --prompt "ROMEO:" --max-new-tokens 120
	$(BIN)/femtotron plot runs/debug

test: $(BIN)/femtotron
	$(BIN)/python -m pytest -q

lint: $(BIN)/femtotron
	$(BIN)/ruff format --check src tests bench
	$(BIN)/ruff check src tests bench

# The code's size in syntax-tree nodes (docstrings and line breaks do not count), per room, over the modules
# the `femtotron` command imports, with packed tuple assignments per 1,000 lines and the largest functions.
size: $(BIN)/femtotron
	$(BIN)/python bench/size.py

# Every bench script; their headline figures go into one table in runs/bench/benchmarks.md (untracked).
# BENCH_ARGS=--quick: 1-2 minutes on 2 cores; without it their own defaults, about 5.
# BENCH_ARGS=--docs: a full run whose table replaces the one at the top of docs/benchmarks.md.
BENCH_ARGS ?=
bench: $(BIN)/femtotron
	$(BIN)/python bench/run_all.py $(BENCH_ARGS)

# On one CUDA GPU: the CUDA-marked tests, a ~1B Llama against HF transformers, doctor's memory estimate against
# the measured peak, a mixture of experts, the new code against what it replaces (ZeRO-3, zb-h1, Muon, the
# sliding window, async saves), the compiled runs; within --budget seconds (default 600), each part in
# its own process, docs/benchmarks-gpu.md rewritten after every part (bench/gpu_check.py). No venv or install
# step, so it runs on a GPU machine without network: .venv's python where there is one, else $(PYTHON),
# importing femtotron from src.
GPU_CHECK_PYTHON = $(if $(wildcard $(BIN)/python),$(BIN)/python,$(PYTHON))
GPU_CHECK_ARGS ?=
gpu-check:
	PYTHONPATH=src$${PYTHONPATH:+:$$PYTHONPATH} $(GPU_CHECK_PYTHON) bench/gpu_check.py $(GPU_CHECK_ARGS)

clean:
	rm -rf runs $(DATA).bin $(DATA).idx
