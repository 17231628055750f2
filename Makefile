# The two commands a new user runs: `make demo` and `make test`. Both create .venv when missing.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# torch first and pinned, so no other requirement makes pip resolve a different torch build.
# Override for another build, e.g. TORCH_SPEC="torch==2.13.0 --index-url URL" (PyTorch's CPU or CUDA index).
TORCH_SPEC ?= torch==2.13.0
DATA := examples/data/shakespeare

.PHONY: demo test lint bench clean

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

test: $(BIN)/femtotron
	$(BIN)/python -m pytest -q

lint: $(BIN)/femtotron
	$(BIN)/ruff format --check src tests bench
	$(BIN)/ruff check src tests bench

bench: $(BIN)/femtotron
	$(BIN)/python bench/throughput.py

clean:
	rm -rf runs $(DATA).bin $(DATA).idx
