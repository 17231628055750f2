"""bench/gpu_check.py (`make gpu-check`) on the CPU: its arguments, the report it writes, what it skips
without CUDA, its measurements with a tiny model, its counting of test outcomes, and that no part can lose
the others' figures: a part that hangs, crashes or no longer fits the budget, with fake parts run as the real
ones are (each in its own process).

This module is also what the fake parts' processes import: it imports torch only inside the tests that use
it, so that such a process starts in well under a second."""

from __future__ import annotations

import inspect
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import replace
from functools import partial
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import gpu_check  # noqa: E402

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
# A process that only a SIGKILL ends: what must not outlive a part that is stopped.
# The new code's parts, in the order they run: four comparisons, then async saves.
NEW_CODE_KEYS = ["zero3", "zb_h1", "muon", "window", "async_save"]
IGNORES_SIGINT = "import signal, time; signal.signal(signal.SIGINT, signal.SIG_IGN); time.sleep(600)"


@pytest.fixture
def no_cuda(monkeypatch):
    """The script's CPU path, on any machine (on a GPU it would train the 1B model): its parts' processes see
    no GPU; the allocator setting it makes, as `femtotron train` does, is undone afterwards."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "")
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF")


def gone(pid: int, within: float = 5.0) -> bool:
    """Whether process `pid` has ended (a zombie waiting for its new parent to reap it has) within `within`
    seconds; one still running is killed afterwards so that no test leaves it behind."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            return True
        if state == "Z":
            return True
        time.sleep(0.1)
    os.kill(pid, signal.SIGKILL)
    return False


# Fake parts: module-level functions, run in processes of their own as the real parts are.


def fast_part(settings):
    return {"lines": [f"finished after {len(settings.earlier)} earlier part(s)"]}


def sleeping_part(settings):
    """Sleeps far past any timeout, with a child process that ignores SIGINT."""
    child = subprocess.Popen([sys.executable, "-c", IGNORES_SIGINT])
    (Path(settings.workdir) / "grandchild.pid").write_text(str(child.pid))
    print("sleeping now", flush=True)
    time.sleep(600)


def exiting_part(settings):
    print("about to exit", file=sys.stderr, flush=True)
    os._exit(3)


def raising_part(settings):
    raise RuntimeError("CUDA error: an illegal memory access was encountered")


def killed_part(settings):
    print("about to be killed", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def reading_part(settings):
    return {"lines": ["read the report"], "report_then": Path(settings.report).read_text()}


def terminating_part(settings):
    """Sends SIGTERM to the check (its parent) and sleeps, with a child process that ignores SIGINT."""
    child = subprocess.Popen([sys.executable, "-c", IGNORES_SIGINT])
    (Path(settings.workdir) / "grandchild.pid").write_text(str(child.pid))
    os.kill(os.getppid(), signal.SIGTERM)
    time.sleep(600)


def fake_part(key: str, function, limit_seconds: float = 60, estimate_seconds: float = 1):
    return gpu_check.FunctionPart(key, f"the {key} part", estimate_seconds, limit_seconds, function)


def fake_check(tmp_path: Path, keys: list[str], budget: float = 120) -> gpu_check.Check:
    """A check of fake parts, a section for each of `keys` (the lines its part returns)."""
    sections = [gpu_check.Section(f"Section of {key}", partial(gpu_check.part_lines, key)) for key in keys]
    report = gpu_check.Report("python bench/gpu_check.py (fake parts)", sections)
    settings = gpu_check.Settings(
        overrides=[],
        workdir=str(tmp_path),
        steps=1,
        warmup=0,
        gemm_seconds=0.01,
        moe_rounds=1,
        report=str(tmp_path / "report.md"),
        command=report.command,
    )
    return gpu_check.Check(report, settings, budget, tmp_path / "logs")


def test_arguments_and_their_defaults():
    args = gpu_check.parse_args([])
    assert (args.steps, args.warmup, args.skip_tests, args.skip_hf, args.set) == (30, 3, False, False, [])
    assert (args.budget, args.logs) == (600, None)
    assert args.out == Path(gpu_check.ROOT) / "docs" / "benchmarks-gpu.md"
    quick = gpu_check.parse_args(["--quick", "--out", "r.md", "--set", "a=1", "--set", "b=2"])
    assert (quick.steps, quick.warmup, quick.out, quick.set) == (5, 1, Path("r.md"), ["a=1", "b=2"])
    assert gpu_check.parse_args(["--quick", "--steps", "12", "--budget", "300"]).steps == 12


@pytest.mark.parametrize("flag", ["--steps", "--budget"])
@pytest.mark.parametrize("value", ["0", "-3", "two"])
def test_a_count_below_one_is_refused(flag, value, capsys):
    with pytest.raises(SystemExit) as info:
        gpu_check.parse_args([flag, value])
    assert info.value.code == 2
    assert f"{value!r} is not a whole number >= 1" in capsys.readouterr().err


@pytest.mark.distributed  # each part in its own process
def test_without_cuda_the_report_says_what_was_skipped_and_the_exit_code_is_0(no_cuda, tmp_path, capsys):
    import torch

    out = tmp_path / "docs" / "benchmarks-gpu.md"
    assert gpu_check.main(["--out", str(out), *TINY_ARGS]) == 0
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    report = out.read_text()
    assert report.startswith("# GPU check\n")
    assert re.search(r"on \d{4}-\d\d-\d\d \d\d:\d\d UTC in \d+ s:\n`python bench/gpu_check.py --out ", report)
    assert "- GPU: none (`torch.cuda.is_available()` is False)" in report
    assert f"- torch {torch.__version__}, CUDA " in report
    skipped = report.split("## Skipped\n")[1]
    assert "- no CUDA device: skipped the CUDA-marked tests (`python -m pytest -v -m cuda`)" in skipped
    assert "- no CUDA device: skipped the femtotron run (tokens/s, MFU" in skipped
    assert "the HF transformers baseline and the measured peak memory" in skipped
    assert "- no CUDA device: skipped the mixture of experts" in skipped
    assert (
        "- no CUDA device: skipped the new code (ZeRO-3, zb-h1, Muon, the sliding window, async saves"
        in skipped
    )
    assert "- no CUDA device: skipped the compiled runs" in skipped
    # doctor's estimate needs no GPU: it is there, with the command that prints it
    memory = report.split("## Memory: doctor's estimate against the measured peak\n")[1]
    doctor = "`femtotron doctor examples/llama_1b_gpu.yaml parallelism.dp=1 "
    assert doctor in memory and "tokens.micro_batch_size=2`: " in memory
    assert re.search(r"MiB per rank = params [\d.]+ MiB \+ grads", memory)
    assert "max_memory_allocated()` over" not in memory and "## Failed" not in report
    times = report.split("## Time per part\n")[1]
    assert re.search(r"- the probe of the device: \d+ s \(about 15 s expected, timeout \d+ s\)", times)
    assert "- doctor's memory estimate: " in times
    assert [p.name for p in out.parent.iterdir()] == ["benchmarks-gpu.md"]  # written atomically
    printed = capsys.readouterr().out  # each section as it finished
    assert "\n## Memory: doctor's estimate against the measured peak\n\n`femtotron doctor " in printed
    assert printed.rstrip().endswith(f"gpu_check: wrote {out}")


def test_the_parts_run_the_most_valuable_first_and_what_is_left_out_says_why():
    every = gpu_check.plan(gpu_check.parse_args([]), cuda=True, hf=True, skip=pytest.fail)
    assert [part.key for part in every] == [
        "tests",
        "femtotron",
        "hf",
        "memory",
        "moe",
        *NEW_CODE_KEYS,
        "femtotron_compiled",
        "hf_compiled",
    ]
    assert "tests/test_cuda.py" in every[0].files
    skipped = []
    flags = gpu_check.parse_args(["--skip-tests", "--skip-hf", "--skip-compile"])
    parts = gpu_check.plan(flags, cuda=True, hf=False, skip=skipped.append)
    assert [part.key for part in parts] == ["femtotron", "memory", *NEW_CODE_KEYS]
    assert skipped == [
        "--skip-tests: skipped the CUDA-marked tests",
        "--skip-hf: skipped the HF transformers baseline",
        "no HF transformers: skipped the mixture of experts (it compares with `MixtralForCausalLM`)",
        "--skip-compile: skipped the compiled runs",
    ]
    skipped.clear()
    assert [part.key for part in gpu_check.plan(flags, cuda=False, hf=False, skip=skipped.append)] == [
        "memory"
    ]
    assert (
        "(tokens/s, MFU against the data-sheet peak and a measured GEMM) and the measured peak" in skipped[2]
    )
    assert skipped[4] == (
        "no CUDA device: skipped the new code (ZeRO-3, zb-h1, Muon, the sliding window, async saves, their "
        "host syncs)"
    )


def test_a_bad_override_stops_before_anything_runs(no_cuda, tmp_path, capsys):
    out = tmp_path / "report.md"
    assert gpu_check.main(["--set", "tokens.micro_batch_size=0", "--out", str(out)]) == 2
    assert "tokens.micro_batch_size" in capsys.readouterr().err
    assert not out.exists()


def test_only_the_files_with_cuda_marked_tests_are_collected(tmp_path):
    (tmp_path / "test_marked.py").write_text(
        f"import pytest\n\n\n@pytest.{gpu_check.CUDA_MARK}\ndef test_a(): pass\n"
    )
    (tmp_path / "test_unmarked.py").write_text("import tensorboard\n\n\ndef test_b(): pass\n")
    assert gpu_check.cuda_test_files(tmp_path) == [tmp_path / "test_marked.py"]
    in_the_repository = gpu_check.cuda_test_files()
    assert gpu_check.ROOT / "tests" / "test_cuda.py" in in_the_repository
    assert gpu_check.ROOT / "tests" / "test_dashboards.py" not in in_the_repository


@pytest.mark.distributed  # the compiled runs start the C++ compiler
def test_femtotron_and_hf_are_measured_and_reported(tmp_path):
    """The measurements themselves, eager and compiled, on the CPU (or the GPU where there is one) with the
    tiny model: the parts' functions called here, their results through JSON as from their processes."""
    import torch

    if shutil.which(os.environ.get("CXX", "g++")) is None:
        pytest.skip("model.compile: needs a C++ compiler ($CXX or g++) for TorchInductor on the CPU")
    args = gpu_check.parse_args(["--quick", "--steps", "2", *TINY_ARGS])
    command = "python bench/gpu_check.py --quick"
    config = gpu_check.gpu_config(TINY, tmp_path)
    settings = gpu_check.Settings(TINY, str(tmp_path), 2, 1, 0.05, 1, str(tmp_path / "report.md"), command)
    report = gpu_check.Report(command, gpu_check.check_sections(config, args, command))
    for key in ("femtotron", "hf", "memory", "femtotron_compiled", "hf_compiled"):
        function = getattr(gpu_check, f"{key}_part")
        result = function(replace(settings, earlier=dict(report.results)))
        report.results[key] = json.loads(json.dumps(result))
    ours = gpu_check.Run(**report.results["femtotron"]["run"])
    assert ours.tokens_per_second > 0 and ours.logged_tokens_per_second > 0 and ours.micro_batch == 2
    assert (ours.peak_bytes is None) == (not torch.cuda.is_available())
    text = report.text(finished=True)
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
    assert "## Memory: doctor's estimate against the measured peak\n\n`femtotron doctor " in text
    assert "## Skipped\n\nNothing.\n" in text


def test_a_part_must_be_a_function_its_process_can_import():
    def local(settings):
        return {}

    with pytest.raises(ValueError, match=r"defined at the top level of its module .*\.local is not"):
        gpu_check.function_target(local)
    assert gpu_check.function_target(fast_part) == f"{Path(__file__).resolve()}:fast_part"


@pytest.mark.distributed  # each part in its own process
def test_a_part_past_its_timeout_is_stopped_with_its_processes_and_the_next_still_runs(tmp_path):
    check = fake_check(tmp_path, ["first", "sleeping", "last"])
    parts = [
        fake_part("first", fast_part),
        fake_part("sleeping", sleeping_part, 3),
        fake_part("last", fast_part),
    ]
    check.run_all(parts)
    report = check.report
    (failure,) = report.failures
    assert failure.line == "the sleeping part: timed out after 3 s (stopped with its process group)"
    assert "sleeping now" in failure.tail and "KeyboardInterrupt" in failure.tail[-1]  # where it was
    assert gone(int((tmp_path / "grandchild.pid").read_text()))
    assert report.results["last"] == {"lines": ["finished after 1 earlier part(s)"]}
    text = (tmp_path / "report.md").read_text()
    assert "## Section of first\n\nfinished after 0 earlier part(s)\n" in text
    assert "## Section of last\n\nfinished after 1 earlier part(s)\n" in text
    assert "- the sleeping part: timed out after 3 s (stopped with its process group)\n\n  ```\n" in text
    assert "sleeping now" in (tmp_path / "logs" / "sleeping.log").read_text()


@pytest.mark.distributed  # each part in its own process
def test_a_part_that_crashes_is_reported_with_the_end_of_its_output_and_the_next_still_runs(tmp_path):
    check = fake_check(tmp_path, ["last"])
    check.run_all(
        [
            fake_part("exiting", exiting_part),
            fake_part("raising", raising_part),
            fake_part("killed", killed_part),
            fake_part("last", fast_part),
        ]
    )
    lines = [failure.line for failure in check.report.failures]
    assert re.fullmatch(r"the exiting part: exited with code 3 after \d+ s: about to exit", lines[0]), lines
    assert re.fullmatch(
        r"the raising part: exited with code 1 after \d+ s: RuntimeError: CUDA error: an illegal memory "
        "access was encountered",
        lines[1],
    )
    assert re.fullmatch(r"the killed part: was killed by SIGKILL after \d+ s: about to be killed", lines[2])
    assert len(lines) == 3 and "Traceback (most recent call last):" in check.report.failures[1].tail
    assert check.report.results["last"] == {"lines": ["finished after 0 earlier part(s)"]}
    text = (tmp_path / "report.md").read_text()
    assert "## Section of last\n" in text and text.count("\n- the ") == 3 + 4  # the failures, the times
    assert "  RuntimeError: CUDA error: an illegal memory access was encountered\n  ```\n" in text


@pytest.mark.distributed  # the first part runs in its own process
def test_a_part_that_no_longer_fits_the_budget_is_skipped_saying_so(tmp_path):
    check = fake_check(tmp_path, ["first"], budget=30)
    check.run_all([fake_part("first", fast_part, 1000), fake_part("big", fast_part, estimate_seconds=1000)])
    assert list(check.report.results) == ["first"]
    (skipped,) = check.report.skipped
    assert re.fullmatch(
        r"the big part: skipped, (2\d|30) s of the 30 s budget \(`--budget`\) left and it takes about 1000 s",
        skipped,
    )
    # the first part's timeout was what was left of the budget (less the grace to stop it), not its limit
    assert re.fullmatch(
        r"the first part: \d+ s \(about 1 s expected, timeout 2[45] s\)", check.report.times[0]
    )
    assert f"## Skipped\n\n- {skipped}\n" in (tmp_path / "report.md").read_text()


@pytest.mark.distributed  # each part in its own process
def test_the_report_is_rewritten_and_each_section_printed_after_every_part(tmp_path, capsys):
    check = fake_check(tmp_path, ["first", "reading"])
    check.run_all([fake_part("first", fast_part), fake_part("reading", reading_part)])
    then = check.report.results["reading"]["report_then"]  # as the second part found it, while it ran
    assert re.search(r"UTC \d+ s into the check \(unfinished: rewritten after every part\):\n", then)
    assert "## Section of first\n\nfinished after 0 earlier part(s)\n" in then
    assert "## Section of reading" not in then
    final = (tmp_path / "report.md").read_text()
    assert "unfinished" not in final and "## Section of reading\n\nread the report\n" in final
    printed = capsys.readouterr().out
    assert printed.index("## Section of first") < printed.index("gpu_check: the reading part: about 1 s")
    assert printed.count("## Section of first") == 1  # printed when it changed only


@pytest.mark.distributed  # the part runs in its own process
def test_a_check_sent_sigterm_stops_the_running_part_with_its_processes_and_writes_the_report(tmp_path):
    check = fake_check(tmp_path, ["last"])
    with gpu_check.stop_on_signals():
        check.run_all([fake_part("terminating", terminating_part), fake_part("last", fast_part)])
    assert [failure.line for failure in check.report.failures] == [
        "this check was sent SIGTERM during the terminating part: the parts after it did not run"
    ]
    assert gone(int((tmp_path / "grandchild.pid").read_text()))
    assert "last" not in check.report.results
    assert " UTC in " in (tmp_path / "report.md").read_text()  # the final report, not an unfinished one


SOME_TESTS = f"""
import pytest

pytestmark = pytest.{gpu_check.CUDA_MARK}

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
NOT_IMPORTABLE = f"""
import not_installed_anywhere
import pytest

@pytest.{gpu_check.CUDA_MARK}
def test_never_runs():
    pass
"""


@pytest.mark.distributed
def test_pytest_outcomes_are_counted_failures_named_and_modules_not_collected_apart(tmp_path):
    (tmp_path / "test_some.py").write_text(SOME_TESTS)
    (tmp_path / "test_not_importable.py").write_text(NOT_IMPORTABLE)
    files = [tmp_path / "test_some.py", tmp_path / "test_not_importable.py"]
    tests = gpu_check.run_pytest(files, tmp_path / "pytest.log", timeout=120)
    assert (tests.passed, tests.skipped, len(tests.failed), tests.counted, tests.timed_out) == (
        1,
        1,
        2,
        True,
        False,
    )
    errors, fails = sorted(tests.failed)
    # JUnit's class name is the module's path from pytest's root: more of it when tmp_path lies near the repo
    assert re.match(r"(\S+\.)?test_some::test_fails: AssertionError: one is not two", fails), fails
    assert re.match(r"(\S+\.)?test_some::test_errors: ", errors) and "the fixture broke" in errors
    (not_collected,) = tests.not_collected
    assert re.fullmatch(
        r"(\S+\.)?test_not_importable: ModuleNotFoundError: No module named 'not_installed_anywhere'",
        not_collected,
    ), not_collected
    assert tests.command.startswith("python -m pytest -v -m cuda ") and tests.command.endswith(
        "test_not_importable.py"
    )
    lines = gpu_check.tests_lines({"tests": vars(tests)})
    assert lines[0].endswith(f": 1 passed, 2 failed, 1 skipped ({tests.seconds:.0f} s).")
    not_collected_line = lines.index(next(line for line in lines if line.startswith("Not collected")))
    assert lines[not_collected_line + 1] == f"- `{not_collected}`" and lines[-3] == "Failed:"


HANGING_TESTS = f"""
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.{gpu_check.CUDA_MARK}


def test_passes():
    pass


def test_hangs():
    child = subprocess.Popen([sys.executable, "-c", {IGNORES_SIGINT!r}])
    (Path(__file__).parent / "grandchild.pid").write_text(str(child.pid))
    time.sleep(600)
"""


@pytest.mark.distributed
def test_pytest_is_streamed_to_its_log_and_stopped_with_its_processes_at_its_timeout(tmp_path):
    (tmp_path / "test_hanging.py").write_text(HANGING_TESTS)
    log = tmp_path / "pytest.log"
    tests = gpu_check.run_pytest([tmp_path / "test_hanging.py"], log, timeout=5)
    assert gone(int((tmp_path / "grandchild.pid").read_text()))  # SIGINT alone would not have ended it
    assert tests.timed_out and tests.last_test.endswith("test_hanging.py::test_hangs")
    # stopped with SIGINT first, pytest wrote the JUnit XML of what it finished
    assert (tests.counted, tests.passed, tests.failed) == (True, 1, [])
    assert "test_hanging.py::test_passes PASSED" in log.read_text() and tests.tail[-1] in log.read_text()
    lines = gpu_check.tests_lines({"tests": vars(tests)})
    assert lines[2].startswith(
        f"**Timed out after {tests.seconds:.0f} s**, stopped with its process group, in "
    )
    assert lines[2].endswith(
        "test_hangs` (the last test it started); the counts are of the tests before it. The end of its "
        "output:"
    )


def test_without_a_whole_junit_xml_the_tests_section_still_says_what_happened(tmp_path):
    assert gpu_check.junit_outcomes(tmp_path / "none.xml") is None
    (tmp_path / "half.xml").write_text('<?xml version="1.0"?><testsuites><testsuite><testcase name="a"')
    assert gpu_check.junit_outcomes(tmp_path / "half.xml") is None
    killed = gpu_check.TestRun(
        command="python -m pytest -v -m cuda tests/test_cuda.py",
        passed=0,
        failed=[],
        skipped=0,
        not_collected=[],
        counted=False,
        seconds=180.4,
        timed_out=True,
        last_test="tests/test_cuda.py::test_the_hang_report",
        tail=["tests/test_cuda.py::test_the_hang_report", "Timeout (0:02:55)!"],
    )
    lines = gpu_check.tests_lines({"tests": vars(killed)})
    assert lines[0] == (
        "`python -m pytest -v -m cuda tests/test_cuda.py`: no counts (pytest was killed before writing its "
        "JUnit XML) (180 s)."
    )
    assert lines[2] == (
        "**Timed out after 180 s**, stopped with its process group, in "
        "`tests/test_cuda.py::test_the_hang_report` (the last test it started). The end of its output:"
    )
    assert lines[4:] == ["```", *killed.tail, "```"]


def test_the_mixture_of_experts_part_reports_both_ratios(monkeypatch):
    """Part 5 on the CPU with a tiny model (on a GPU: bf16 through torch's grouped GEMM)."""
    monkeypatch.setattr(
        gpu_check, "MOE_SHAPE", dict(gpu_check.MOE_SHAPE, hidden_size=64, num_hidden_layers=1, vocab_size=256)
    )
    monkeypatch.setattr(gpu_check, "MOE", dict(gpu_check.MOE, intermediate_size=64))
    monkeypatch.setattr(gpu_check, "MOE_BATCH", (2, 64))
    lines = gpu_check.measure_moe(1, "cpu")["lines"]
    assert (
        lines[0].startswith("hidden 64, 1 layers, top-2 of 8 experts of 64, 2 x 64 tokens")
        and len(lines) == 3
    )
    assert "a loop over the experts" in lines[1] and "HF `MixtralForCausalLM`" in lines[2]


def test_every_part_fits_the_default_budget():
    """A lent GPU's 15 minutes, less its start-up, hold every part at its expected time: none is skipped."""
    every = [gpu_check.ENVIRONMENT_PART, *gpu_check.plan(gpu_check.parse_args([]), True, True, pytest.fail)]
    assert sum(part.estimate_seconds for part in every) <= gpu_check.DEFAULT_BUDGET


def test_the_new_code_parts_that_no_longer_fit_the_budget_are_skipped_saying_so(tmp_path):
    check = fake_check(tmp_path, [], budget=20)
    check.run_all(gpu_check.NEW_CODE_PARTS)  # each takes about 25 s or more: none starts
    assert check.report.results == {} and len(check.report.skipped) == len(NEW_CODE_KEYS)
    assert re.fullmatch(
        r"ZeRO-3 against ZeRO-1: skipped, (1\d|20) s of the 20 s budget \(`--budget`\) left and it takes "
        r"about 25 s",
        check.report.skipped[0],
    )
    assert check.report.skipped[-1].startswith("async saves against synchronous ones: skipped, ")


def sync_and_other_warnings():
    """A fake step: two host syncs on one line, one on another, and a warning that is no sync."""
    import warnings

    for _ in range(2):
        warnings.warn(gpu_check.SYNC_WARNING, stacklevel=1)
    warnings.warn(gpu_check.SYNC_WARNING, stacklevel=1)
    warnings.warn("something else", stacklevel=1)


def test_host_syncs_are_the_sync_warnings_of_the_step_and_the_mode_is_restored(monkeypatch):
    import torch

    modes = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_sync_debug_mode", lambda: 0)  # torch's "default"
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", modes.append)
    sites = gpu_check.host_syncs(sync_and_other_warnings)
    source, first = inspect.getsourcelines(sync_and_other_warnings)
    lines = [first + i for i, text in enumerate(source) if "warn(gpu_check.SYNC_WARNING" in text]
    assert sites == [f"tests/test_gpu_check.py:{line}" for line in (lines[0], lines[0], lines[1])]
    assert modes == ["warn", 0]
    with pytest.raises(ZeroDivisionError):  # a step that fails leaves the mode as it found it
        gpu_check.host_syncs(lambda: 1 / 0)
    assert modes[-2:] == ["warn", 0]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    ran = []
    assert gpu_check.host_syncs(lambda: ran.append(1)) is None and ran == [1]  # run, not counted


def measured(losses, peak, milliseconds, syncs):
    """A run's result as a comparison part returns it, for 8192 tokens per step."""
    return vars(gpu_check.Run(8192 / milliseconds * 1e3, None, peak, 1, 1, losses, syncs))


def test_the_new_code_section_states_each_figure_against_what_it_is_compared_with():
    """Results as a GPU would return them (peaks, host syncs) written into the new code's section."""
    shape = "47,849,984 parameters: ..."
    gib = 2**30
    results = {
        "zero3": {
            "new": measured(
                (10.4, 9.5), 1 * gib, 50.0, ["femtotron/trainer.py:230"] * 3 + ["optim/clip.py:40"]
            ),
            "baseline": measured((10.4, 9.5001), 2 * gib, 40.0, ["femtotron/trainer.py:230"] * 2),
            "step_tokens": 8192,
            "shape": shape,
        },
        "async_save": {
            "new": {"stall_seconds": [0.1, 0.05], "host_syncs": ["serialize/background.py:70"]},
            "baseline": {"stall_seconds": [1.5, 1.25], "host_syncs": []},
            "files": ["rank-00000.safetensors"],
            "differ": [],
            "checkpoint_bytes": 672 * 2**20,
            "shape": shape,
        },
    }
    lines = gpu_check.new_code_lines("python bench/gpu_check.py", 30, 3, results)
    assert lines[0].startswith(
        "`python bench/gpu_check.py`: each comparison in a process of its own, its two runs in turn, at "
        "dp = tp = pp = 1: 47,849,984 parameters: ...; random tokens, 30 timed steps after 3 warm-up "
        "step(s). "
    )
    assert lines[2] == (
        "- **ZeRO-3** (`optimizer.zero_stage=3`) against ZeRO-1 (`optimizer.zero_stage=1`): loss at the "
        "first and last timed step 10.4000, 9.5000 against 10.4000, 9.5001; step 50.0 ms against 40.0 ms "
        "(**1.25x**); peak allocated 1.00 GiB against 2.00 GiB (**0.50x**); host syncs in one more step 4 "
        "against 2 (most at `femtotron/trainer.py:230` x3, `optim/clip.py:40` x1)."
    )
    assert lines[3] == (
        "- **async save** (`checkpoints.async_save=true`) against a synchronous save, a checkpoint of "
        "672.0 MiB before the first step and after each of 2: training stopped 0.100, 0.050 s against "
        "1.500, 1.250 s; the step-0 checkpoints' 1 file(s) are equal byte for byte (the manifest apart: it "
        "records the time and the config); host syncs over each whole run 1 against 0 (most at "
        "`serialize/background.py:70` x1)."
    )
    results["async_save"]["differ"] = ["rank-00000.safetensors"]
    assert "; **the step-0 checkpoints differ** in rank-00000.safetensors; " in gpu_check.async_save_line(
        results["async_save"]
    )
    assert gpu_check.new_code_lines("python bench/gpu_check.py", 30, 3, {"moe": {}}) is None


def test_a_loss_that_is_not_finite_fails_the_check(monkeypatch, tmp_path):
    def fake_run(config, steps, warmup, count_host_syncs):
        muon = config.optimizer.optimizer_factory.name == "muon"
        return gpu_check.Run(1.0, None, None, 1, 1, (10.4, math.nan if muon else 9.5), None)

    monkeypatch.setattr(gpu_check, "run_femtotron", fake_run)
    settings = gpu_check.Settings([], str(tmp_path), 1, 0, 0.01, 1, str(tmp_path / "r.md"), "command")
    assert gpu_check.muon_part(settings)["failures"] == [
        "Muon: a loss was not finite (first and last: (10.4, nan))"
    ]
    assert gpu_check.zero3_part(settings)["failures"] == []


def test_the_new_code_is_measured_on_the_cpu(monkeypatch, tmp_path):
    """The new code's parts themselves with the tiny model (on a GPU: ~48M parameters at sequence 8192):
    every run trains, the async save's step-0 checkpoint equals the synchronous one's, and the section is
    written; host syncs and peaks need CUDA."""
    monkeypatch.setattr(
        gpu_check, "NEW_CODE_MODEL", (*TINY, "optimizer.learning_rate_scheduler.lr_warmup_steps=0")
    )
    settings = gpu_check.Settings([], str(tmp_path), 1, 0, 0.01, 1, str(tmp_path / "r.md"), "command")
    results = {
        key: json.loads(json.dumps(getattr(gpu_check, f"{key}_part")(settings))) for key in NEW_CODE_KEYS
    }
    assert all(result["failures"] == [] for result in results.values())
    async_save = results["async_save"]
    assert async_save["files"] == ["rank-00000.safetensors"] and async_save["differ"] == []
    assert [len(async_save[side]["stall_seconds"]) for side in ("new", "baseline")] == [3, 3]
    lines = gpu_check.new_code_lines("command", 1, 0, results)
    assert len(lines) == 2 + len(NEW_CODE_KEYS) and "micro-batch 2 x 32 tokens" in lines[0]
    assert all(
        " against " in line and "host syncs" in line and "not counted (no CUDA)" in line for line in lines[2:]
    )
