"""bench/gpu_check.py (`make gpu-check`) on the CPU, with a tiny model: its arguments, the report it writes,
what it skips without CUDA, and its measurements and test counting run for real."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import gpu_check  # noqa: E402
from helpers import NEEDS_CXX  # noqa: E402

# The example's 1B model shrunk to ~40k parameters (vocabulary 256 above intermediate 128: the LM head is the
# largest matmul).
TINY = [
    "model.model_config.hidden_size=64",
    "model.model_config.intermediate_size=128",
    "model.model_config.num_hidden_layers=2",
    "model.model_config.num_attention_heads=4",
    "model.model_config.num_key_value_heads=2",
    "model.model_config.vocab_size=256",
    "model.model_config.max_position_embeddings=32",
    "tokens.sequence_length=32",
    "tokens.micro_batch_size=2",
]
TINY_ARGS = [arg for override in TINY for arg in ("--set", override)]


@pytest.fixture
def no_cuda(monkeypatch):
    """The script's CPU path, on any machine (on a GPU it would train the 1B model); the allocator setting it
    makes, as `femtotron train` does, is undone afterwards."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "")
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF")


def test_arguments_and_their_defaults():
    args = gpu_check.parse_args([])
    assert (args.steps, args.warmup, args.skip_tests, args.skip_hf, args.set) == (30, 3, False, False, [])
    assert args.out == Path(gpu_check.ROOT) / "docs" / "benchmarks-gpu.md"
    quick = gpu_check.parse_args(["--quick", "--out", "r.md", "--set", "a=1", "--set", "b=2"])
    assert (quick.steps, quick.warmup, quick.out, quick.set) == (5, 1, Path("r.md"), ["a=1", "b=2"])
    assert gpu_check.parse_args(["--quick", "--steps", "12"]).steps == 12


@pytest.mark.parametrize("steps", ["0", "-3", "two"])
def test_a_step_count_below_one_is_refused(steps, capsys):
    with pytest.raises(SystemExit) as info:
        gpu_check.parse_args(["--steps", steps])
    assert info.value.code == 2
    assert f"{steps!r} is not a whole number >= 1" in capsys.readouterr().err


def test_without_cuda_the_report_says_what_was_skipped_and_the_exit_code_is_0(no_cuda, tmp_path):
    out = tmp_path / "docs" / "benchmarks-gpu.md"
    assert gpu_check.main(["--out", str(out), *TINY_ARGS]) == 0
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    report = out.read_text()
    assert report.startswith("# GPU check\n")
    assert re.search(r"on \d{4}-\d\d-\d\d \d\d:\d\d UTC in \d+ s:\n`python bench/gpu_check.py --out ", report)
    assert "- GPU: none (`torch.cuda.is_available()` is False)" in report
    assert f"- torch {torch.__version__}, CUDA " in report
    skipped = report.split("## Skipped\n")[1]
    assert "- no CUDA device: skipped the CUDA-marked tests (`python -m pytest -q -m cuda`)" in skipped
    assert "- no CUDA device: skipped the femtotron run (tokens/s, MFU" in skipped
    assert "the HF transformers baseline and the measured peak memory" in skipped
    # doctor's estimate needs no GPU: it is there, with the command that prints it
    memory = report.split("## Memory: doctor's estimate against the measured peak\n")[1]
    doctor = "`femtotron doctor examples/llama_1b_gpu.yaml parallelism.dp=1 "
    assert doctor in memory and "tokens.micro_batch_size=2`: " in memory
    assert re.search(r"MiB per rank = params [\d.]+ MiB \+ grads", memory)
    assert "max_memory_allocated()` over" not in memory and "## Failed" not in report
    assert [p.name for p in out.parent.iterdir()] == ["benchmarks-gpu.md"]  # written atomically


def test_skip_flags_are_reported_as_the_reason(no_cuda, tmp_path):
    out = tmp_path / "report.md"
    assert gpu_check.main(["--skip-tests", "--skip-hf", "--out", str(out), *TINY_ARGS]) == 0
    skipped = out.read_text().split("## Skipped\n")[1]
    assert "- --skip-tests: skipped the CUDA-marked tests\n" in skipped
    assert "- --skip-hf: skipped the HF transformers baseline\n" in skipped
    assert "(tokens/s, MFU against the data-sheet peak and a measured GEMM) and the measured peak" in skipped


def test_a_bad_override_stops_before_anything_runs(no_cuda, tmp_path, capsys):
    out = tmp_path / "report.md"
    assert gpu_check.main(["--set", "tokens.micro_batch_size=0", "--out", str(out)]) == 2
    assert "tokens.micro_batch_size" in capsys.readouterr().err
    assert not out.exists()


@NEEDS_CXX
@pytest.mark.distributed  # the compiled runs start the C++ compiler
def test_femtotron_and_hf_are_measured_and_reported(tmp_path):
    """The measurements themselves, eager and compiled, on the CPU (or the GPU where there is one) with the
    tiny model."""
    config = gpu_check.gpu_config(TINY, tmp_path)
    report = gpu_check.Report("python bench/gpu_check.py --quick")
    ours = gpu_check.training_sections(report, config, 2, 1, hf=True, gemm_seconds=0.05, compiled=True)
    gpu_check.memory_section(report, config, TINY, ours)
    assert report.failures == [] and report.skipped == []
    assert ours.tokens_per_second > 0 and ours.logged_tokens_per_second > 0 and ours.micro_batch == 2
    assert (ours.peak_bytes is None) == (not torch.cuda.is_available())
    gpu_check.write_report(tmp_path / "report.md", report, seconds=3.0)
    text = (tmp_path / "report.md").read_text()
    throughput = text.split("## Training throughput: femtotron against HF transformers\n")[1]
    for run in (
        "femtotron (synchronised wall clock)",
        "femtotron as it logs it",
        "HF transformers",
        "femtotron compiled (`model.compile: true`)",
        "HF transformers compiled (`torch.compile`)",
    ):
        assert re.search(rf"\| {re.escape(run)}[^|]*\| [\d,]+ \| [-\d.%]+ \| [\d.]+ \|", throughput), run
    assert "bf16 64x64 -> 256 (the LM head)" in throughput
    for ratio in ("femtotron / HF", "femtotron compiled / HF", "femtotron compiled / HF compiled"):
        assert re.search(rf"\*\*{ratio}: [\d.]+x\*\* tokens/s", throughput), ratio
    assert "micro-batch 2 x 1 per step" in throughput
    assert "random tokens, 2 timed steps after 1 warm-up step(s)" in throughput
    assert "## Skipped\n\nNothing.\n" in text


def test_a_part_that_breaks_is_reported_and_fails_the_check(tmp_path):
    report = gpu_check.Report("python bench/gpu_check.py")

    def broken():
        raise RuntimeError("CUDA error: an illegal memory access was encountered\nmore lines")

    def not_here():
        raise gpu_check.Skipped("no CUDA device: skipped this")

    assert report.attempt("the femtotron run", broken) is None
    assert report.attempt("the HF baseline", not_here) is None
    assert report.attempt("the sum", lambda: 1 + 1) == 2
    gpu_check.write_report(tmp_path / "report.md", report, seconds=1.0)
    text = (tmp_path / "report.md").read_text()
    assert "## Skipped\n\n- no CUDA device: skipped this\n" in text
    assert text.endswith(
        "## Failed\n\n- the femtotron run: RuntimeError: CUDA error: an illegal memory access was "
        "encountered\n"
    )


SOME_TESTS = """
import pytest

def test_passes():
    pass

def test_fails():
    assert 1 == 2, "one is not two"

@pytest.mark.skip(reason="not here")
def test_skipped():
    pass

@pytest.fixture
def broken():
    raise RuntimeError("the fixture broke")

def test_errors(broken):
    pass
"""


@pytest.mark.distributed
def test_pytest_outcomes_are_counted_and_failures_named(tmp_path):
    (tmp_path / "test_some.py").write_text(SOME_TESTS)
    result = gpu_check.run_pytest([str(tmp_path / "test_some.py")], timeout=120)
    assert (result.passed, result.skipped, len(result.failed)) == (1, 1, 2)
    errors, fails = sorted(result.failed)
    # JUnit's class name is the module's path from pytest's root: more of it when tmp_path lies near the repo
    assert re.match(r"(\S+\.)?test_some::test_fails: AssertionError: one is not two", fails), fails
    assert re.match(r"(\S+\.)?test_some::test_errors: ", errors) and "the fixture broke" in errors


def test_the_mixture_of_experts_part_reports_both_ratios(monkeypatch):
    """Part 6 on the CPU with a tiny model (on a GPU: bf16 through torch's grouped GEMM)."""
    monkeypatch.setattr(
        gpu_check, "MOE_SHAPE", dict(gpu_check.MOE_SHAPE, hidden_size=64, num_hidden_layers=1, vocab_size=256)
    )
    monkeypatch.setattr(gpu_check, "MOE", dict(gpu_check.MOE, intermediate_size=64))
    monkeypatch.setattr(gpu_check, "MOE_BATCH", (2, 64))
    report = gpu_check.Report("test")
    gpu_check.moe_section(report, 1, "cpu")
    ((title, lines),) = report.sections
    assert title.startswith("Mixture of experts") and len(lines) == 3
    assert "a loop over the experts" in lines[1] and "HF `MixtralForCausalLM`" in lines[2]
