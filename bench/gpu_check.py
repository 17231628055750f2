"""`make gpu-check`: what one CUDA GPU shows about femtotron, written to docs/benchmarks-gpu.md.

The parts, the most valuable first (a budget that runs out cuts the least):
1. the CUDA-marked tests (`python -m pytest -v -m cuda` over the test files that hold them): pass/fail counts,
   the failures' names, and the modules that could not be collected, on their own line;
2. the model of examples/llama_1b_gpu.yaml (~1.2B parameters) at dp = tp = pp = 1 in bf16, trained by
   femtotron's Trainer for a few dozen steps on random tokens: tokens/s, and MFU against the GPU's bf16
   data-sheet peak and against a measured bf16 GEMM of the model's largest matmul;
3. the same shape and batch in HF transformers' `LlamaForCausalLM` (sdpa attention, bf16 autocast over fp32
   weights, fused AdamW) as the baseline: the ratio of the two;
4. `femtotron doctor`'s per-rank memory estimate against `torch.cuda.max_memory_allocated()` of the run;
5. a mixture of experts (bench/moe.py, bf16): femtotron's grouped-GEMM experts against a loop over them and
   against transformers' MixtralForCausalLM, forward + backward;
6. the new code, each comparison in a process of its own, its two runs in turn with a ~48M-parameter model
   on one sequence of 8192 tokens per step: ZeRO-3 against ZeRO-1, zb-h1 against 1f1b at pp = 1, Muon
   against AdamW, a sliding window of 1024 against none (losses, step time, peak memory, and the host syncs
   of one more step under `torch.cuda.set_sync_debug_mode("warn")`), and a run of two steps saving a
   checkpoint before the first and after each in the background (checkpoints.async_save) against the same
   run saving synchronously (how long training stopped, the step-0 checkpoints' files compared byte for
   byte, the whole runs' host syncs);
7. both compiled, unless --skip-compile (femtotron with `model.compile: true`, HF with
   `torch.compile(model)`): the ratios eager and compiled, each against HF eager and compiled.

A GPU is lent rarely and briefly, so no part can lose the others' figures: each runs in a process of its own
(its own CUDA context: a sticky CUDA error or a segfault ends that part only) that returns its result as
JSON, in a session of its own, stopped with every process it started when it passes its timeout; the report
is rewritten (atomically) after every part and each finished section printed at once; `--budget` seconds
cover everything, and a part whose expected time no longer fits is skipped, saying so. This process imports
neither torch nor the measurements, the parts do (in functions, below): it never starts CUDA, and a part
that needs no torch (the tests' fake ones) starts in a fraction of a second.

It needs nothing but the GPU (no network, no install). Without CUDA every part that needs it is skipped with
a line in the report saying so; the report is still written and the exit code is 0. The exit code is 1 when
a CUDA-marked test failed or a part broke, timed out or was stopped (the report says which), 2 for a bad
argument.

    python bench/gpu_check.py [--steps 30] [--quick] [--budget 600] [--skip-tests] [--skip-hf]
                              [--skip-compile] [--out PATH] [--logs DIR]
                              [--set KEY=VALUE ...]   (config overrides, e.g. tokens.micro_batch_size=2)
"""

from __future__ import annotations

import argparse
import filecmp
import importlib.metadata
import importlib.util
import inspect
import json
import math
import os
import platform
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import xml.etree.ElementTree as ElementTree
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from datetime import datetime, timezone
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from femtotron.atomic import atomic_path
from femtotron.config import Config, load_config
from femtotron.errors import ConfigError

if TYPE_CHECKING:
    import torch

ROOT = Path(__file__).resolve().parents[1]
CONFIG = "examples/llama_1b_gpu.yaml"
# The example's model and micro-batch on one GPU, one micro-batch per step.
ONE_GPU = ("parallelism.dp=1", "tokens.batch_accumulation_per_replica=1")
PYTEST = ("-m", "pytest", "-v", "-m", "cuda")  # -v: the log names each test as it starts (a hung one too)
CUDA_MARK = "mark.cuda"  # how a test file marks CUDA tests (`@pytest.mark.cuda`, `pytestmark = ...`)
DEFAULT_BUDGET = 600  # seconds: a lent GPU's 15 minutes less its start-up and the transfers
STOP_GRACE_SECONDS = 5.0  # between a part's SIGINT (it says where it was) and its group's SIGKILL
TAIL_LINES = 25  # of a failed part's output, quoted in the report
PART_FLAG = "--part"  # `gpu_check.py --part FILE:FUNCTION SETTINGS RESULT`: how a part's process starts
FAILURES = "failures"  # a result's lines for the report's "Failed" list


class PartFailed(Exception):
    """A part that crashed, timed out or wrote no result; `tail` is the end of its output."""

    def __init__(self, message: str, tail: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.tail = list(tail)


class Stopped(BaseException):
    """This check was sent SIGTERM or SIGHUP: the running part is stopped and the report written (a
    BaseException, as KeyboardInterrupt is, so that no part's error handling takes it for the part's)."""


@dataclass
class Settings:
    """What every part's process is given (as JSON)."""

    overrides: list[str]  # --set, over the example config on one GPU
    workdir: str  # the random tokens, the runs' folders, the parts' files
    steps: int
    warmup: int
    gemm_seconds: float
    moe_rounds: int
    report: str  # the report's path (rewritten after every part)
    command: str  # this check's command line, as the report quotes it
    earlier: dict[str, dict[str, Any]] = field(default_factory=dict)  # the finished parts' results, by key


@dataclass(frozen=True)
class Part:
    key: str  # its result's name in Report.results, and its log's
    what: str  # how the report names it
    estimate_seconds: float  # expected on an H100/H200: skipped when less of the budget is left
    limit_seconds: float  # its timeout (at most what is left of the budget)

    def run(self, settings: Settings, log: Path, timeout: float) -> dict[str, Any]:
        raise NotImplementedError(f"{type(self).__name__} must define run()")


@dataclass(frozen=True)
class FunctionPart(Part):
    """`function(settings)` in a process of its own; its result is the dict it returns (JSON)."""

    function: Callable[[Settings], dict[str, Any]]

    def run(self, settings: Settings, log: Path, timeout: float) -> dict[str, Any]:
        settings_file = Path(settings.workdir) / f"{self.key}.settings.json"
        result_file = Path(settings.workdir) / f"{self.key}.json"
        settings_file.write_text(json.dumps(asdict(settings)))
        result_file.unlink(missing_ok=True)
        command = [sys.executable, str(Path(__file__).resolve()), PART_FLAG, function_target(self.function)]
        finished = run_in_own_session([*command, str(settings_file), str(result_file)], log, timeout)
        tail = log_tail(log)
        if finished.timed_out:
            raise PartFailed(f"timed out after {timeout:.0f} s (stopped with its process group)", tail)
        if finished.returncode != 0:
            last = f": {tail[-1]}" if tail else ""
            raise PartFailed(f"{finished.ending()} after {finished.seconds:.0f} s{last}", tail)
        if not result_file.is_file():
            raise PartFailed(
                f"exited with code 0 after {finished.seconds:.0f} s without writing {result_file}"
            )
        return json.loads(result_file.read_text())


@dataclass(frozen=True)
class PytestPart(Part):
    """pytest over `files`, selecting the CUDA-marked tests, counted from its JUnit XML."""

    files: tuple[str, ...]

    def run(self, settings: Settings, log: Path, timeout: float) -> dict[str, Any]:
        tests = run_pytest(self.files, log, timeout)
        failures = []
        if tests.failed:
            failures.append(f"{len(tests.failed)} CUDA-marked test(s) failed (listed above)")
        if tests.not_collected:
            failures.append(
                f"{len(tests.not_collected)} test module(s) with CUDA-marked tests could not be collected "
                "(listed above)"
            )
        if tests.timed_out:
            failures.append(
                f"{self.what}: timed out after {tests.seconds:.0f} s in `{tests.last_test}` (quoted above)"
            )
        return {**asdict(tests), FAILURES: failures}


@dataclass(frozen=True)
class Section:
    title: str
    render: Callable[[dict[str, dict[str, Any]]], list[str] | None]  # the results -> its lines, or None


@dataclass
class Failure:
    line: str
    tail: list[str] = field(default_factory=list)  # the end of the part's output


@dataclass
class Report:
    command: str
    sections: list[Section] = field(default_factory=list)
    results: dict[str, dict[str, Any]] = field(default_factory=dict)  # by part key
    skipped: list[str] = field(default_factory=list)
    failures: list[Failure] = field(default_factory=list)
    times: list[str] = field(default_factory=list)  # each part's seconds, against its estimate
    started: float = field(default_factory=time.monotonic)
    printed: dict[str, list[str]] = field(default_factory=dict)  # the sections as last printed

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def skip(self, line: str) -> None:
        self.skipped.append(line)
        print(f"gpu_check: skipped: {line}", flush=True)

    def fail(self, line: str, tail: Sequence[str] = ()) -> None:
        self.failures.append(Failure(line, list(tail)))
        print(f"gpu_check: failed: {line}", flush=True)

    def rendered_sections(self) -> list[tuple[str, list[str]]]:
        sections = []
        for section in self.sections:
            try:
                lines = section.render(self.results)
            except Exception as e:  # a result of an unexpected shape must not lose the other sections
                lines = [f"(not rendered: {type(e).__name__}: {e})"]
            if lines:
                sections.append((section.title, lines))
        return sections

    def text(self, finished: bool) -> str:
        date = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        if finished:
            when = f"in {self.elapsed():.0f} s:"
        else:
            when = f"{self.elapsed():.0f} s into the check (unfinished: rewritten after every part):"
        lines = [
            "# GPU check",
            "",
            f"Written by `bench/gpu_check.py` (`make gpu-check`) on {date} {when}",
            f"`{self.command}`.",
            "",
            *self.environment_lines(),
        ]
        for title, body in self.rendered_sections():
            lines += ["", f"## {title}", "", *body]
        lines += ["", "## Skipped", "", *([f"- {line}" for line in self.skipped] or ["Nothing."])]
        if self.failures:
            lines += ["", "## Failed", ""]
            for failure in self.failures:
                lines.append(f"- {failure.line}")
                if failure.tail:
                    lines += ["", "  ```", *(f"  {line}" for line in failure.tail), "  ```", ""]
        if self.times:
            lines += ["", "## Time per part", "", *(f"- {line}" for line in self.times)]
        return "\n".join(lines).rstrip("\n") + "\n"

    def environment_lines(self) -> list[str]:
        return self.results.get("environment", {}).get("lines") or [
            "- GPU: unknown (no result from the probe of the device, the first part)",
            f"- Python {platform.python_version()}, transformers {package_version('transformers')}",
        ]

    def write(self, path: Path, finished: bool) -> None:
        """The report at `path` (atomically), and each section that changed since the last write on stdout,
        so that a run stopped from outside still shows what it measured."""
        with atomic_path(path) as tmp:
            Path(tmp).write_text(self.text(finished))
        environment = [("Environment", self.environment_lines())] if "environment" in self.results else []
        for title, lines in [*environment, *self.rendered_sections()]:
            if self.printed.get(title) != lines:
                print("\n".join(["", f"## {title}", "", *lines, ""]), flush=True)
                self.printed[title] = lines


@dataclass
class Check:
    """The parts in order within `budget` seconds, the report rewritten after each."""

    report: Report
    settings: Settings
    budget: float
    logs: Path  # one log per part
    running: Part | None = None

    def run_all(self, parts: Iterable[Part]) -> None:
        """Every part in order (`parts` is read as they run: a part may depend on the results before it).
        Stopped from outside (Ctrl-C; SIGTERM or SIGHUP under stop_on_signals), the running part is stopped
        with its processes and the report says so."""
        self.write()
        try:
            for part in parts:
                self.run(part)
        except (Stopped, KeyboardInterrupt) as stop:
            reason = str(stop) or "this check was interrupted"
            where = f"during {self.running.what}" if self.running else "between parts"
            self.report.fail(f"{reason} {where}: the parts after it did not run")
        self.write(finished=True)

    def run(self, part: Part) -> None:
        left = self.budget - self.report.elapsed()
        if part.estimate_seconds > left:
            self.report.skip(
                f"{part.what}: skipped, {left:.0f} s of the {self.budget:.0f} s budget (`--budget`) left "
                f"and it takes about {part.estimate_seconds:.0f} s"
            )
            self.write()
            return
        timeout = max(1.0, min(part.limit_seconds, left - STOP_GRACE_SECONDS))
        print(
            f"gpu_check: {part.what}: about {part.estimate_seconds:.0f} s, timeout {timeout:.0f} s, "
            f"{left:.0f} s of the budget left",
            flush=True,
        )
        start = time.monotonic()
        self.running = part
        try:
            result = part.run(
                replace(self.settings, earlier=dict(self.report.results)), self.log(part), timeout
            )
        except PartFailed as failure:
            self.report.fail(f"{part.what}: {failure}", failure.tail)
        except Exception as e:  # this script's own error about one part must not lose the others
            traceback.print_exc()
            self.report.fail(f"{part.what}: {type(e).__name__}: {(str(e).splitlines() or [''])[0][:300]}")
        else:
            self.report.results[part.key] = result
            for line in result.get(FAILURES, []):
                self.report.fail(line)
        self.running = None
        self.report.times.append(
            f"{part.what}: {time.monotonic() - start:.0f} s (about {part.estimate_seconds:.0f} s "
            f"expected, timeout {timeout:.0f} s)"
        )
        self.write()

    def log(self, part: Part) -> Path:
        self.logs.mkdir(parents=True, exist_ok=True)
        return self.logs / f"{part.key}.log"

    def write(self, finished: bool = False) -> None:
        self.report.write(Path(self.settings.report), finished)


@dataclass
class Finished:
    returncode: int | None  # negative: the signal that ended it; None: it outlived even SIGKILL
    seconds: float
    timed_out: bool  # stopped at its timeout

    def ending(self) -> str:
        if self.returncode is None:
            return f"did not exit {STOP_GRACE_SECONDS:.0f} s after SIGKILL (stuck in the kernel or driver)"
        if self.returncode >= 0:
            return f"exited with code {self.returncode}"
        try:
            return f"was killed by {signal.Signals(-self.returncode).name}"
        except ValueError:
            return f"was killed by signal {-self.returncode}"


def signal_group(group: int, signal_number: int) -> None:
    try:
        os.killpg(group, signal_number)
    except (ProcessLookupError, PermissionError):  # the group is gone (or only a reaped leader is left)
        pass


def stop_process_group(process: subprocess.Popen) -> None:
    """SIGINT to the process's group first (pytest still writes its JUnit XML, Python prints where it was),
    SIGKILL to the whole group STOP_GRACE_SECONDS later (a process stuck in a CUDA call)."""
    signal_group(process.pid, signal.SIGINT)
    try:
        process.wait(STOP_GRACE_SECONDS)
    except subprocess.TimeoutExpired:
        pass
    signal_group(process.pid, signal.SIGKILL)
    try:
        process.wait(STOP_GRACE_SECONDS)
    except subprocess.TimeoutExpired:  # in the GPU driver, SIGKILL can take long: the next part goes on
        print(f"gpu_check: process {process.pid} did not exit after SIGKILL; going on", flush=True)


def run_in_own_session(command: Sequence[str], log: Path, timeout: float) -> Finished:
    """`command` in the repository in a session of its own, its output streamed to `log`: at `timeout` it is
    stopped with every process it started; when it ends, whatever it left running in its group is killed."""
    environment = {**os.environ, "PYTHONUNBUFFERED": "1"}  # a killed process's last lines are in the log
    start = time.monotonic()
    with open(log, "wb") as output:
        process = subprocess.Popen(
            command,
            cwd=ROOT,
            stdin=subprocess.DEVNULL,
            stdout=output,
            stderr=subprocess.STDOUT,
            env=environment,
            start_new_session=True,
            # A check started under nohup or as a background job has SIGINT ignored, and its parts would
            # inherit that: the SIGINT that makes a part say where it was would do nothing.
            preexec_fn=_default_sigint,
        )
        timed_out = False
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            stop_process_group(process)
        except BaseException:  # this check itself is stopped: no part may outlive it on the GPU
            stop_process_group(process)
            raise
        signal_group(process.pid, signal.SIGKILL)
    return Finished(process.returncode, time.monotonic() - start, timed_out)


def _default_sigint() -> None:
    """In a part's process, between fork and exec: SIGINT back to its default (Python's KeyboardInterrupt)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def log_tail(log: Path, lines: int = TAIL_LINES) -> list[str]:
    """The last `lines` non-empty lines of `log`, each cut at 300 characters."""
    try:
        with open(log, "rb") as file:
            file.seek(max(0, file.seek(0, os.SEEK_END) - 64 * 1024))
            text = file.read().decode(errors="replace")
    except FileNotFoundError:
        return []
    return [line[:300] for line in text.splitlines() if line.strip()][-lines:]


def function_target(function: Callable[..., Any]) -> str:
    """FILE:NAME of a module-level function, which a part's process imports and calls."""
    if "<" in function.__qualname__:
        raise ValueError(
            f"a part's function must be defined at the top level of its module (its process imports it "
            f"from there): {function.__module__}.{function.__qualname__} is not"
        )
    return f"{inspect.getfile(function)}:{function.__qualname__}"


def load_function(target: str) -> Callable[[Settings], dict[str, Any]]:
    file, name = target.rsplit(":", 1)
    path = Path(file).resolve()
    if path == Path(__file__).resolve():
        return globals()[name]
    sys.path.insert(0, str(path.parent))  # the module's own imports of its neighbours
    spec = importlib.util.spec_from_file_location(path.stem, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"{path} is not a Python module: give a part's function as FILE.py:NAME")
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module
    spec.loader.exec_module(module)
    return getattr(module, name)


def part_main(argv: Sequence[str]) -> int:
    """One part in this process: the function's result written (atomically) as JSON."""
    parser = argparse.ArgumentParser(
        prog=f"gpu_check.py {PART_FLAG}",
        description="run one part of the GPU check (how the check starts it)",
    )
    parser.add_argument(
        "target", help="FILE:NAME of a module-level function taking Settings, returning a dict"
    )
    parser.add_argument("settings", type=Path, help="the Settings as JSON")
    parser.add_argument("result", type=Path, help="where its result is written as JSON")
    args = parser.parse_args(argv)
    settings = Settings(**json.loads(args.settings.read_text()))
    result = load_function(args.target)(settings)
    with atomic_path(args.result) as tmp:
        Path(tmp).write_text(json.dumps(result))
    return 0


@dataclass
class Run:
    tokens_per_second: float
    logged_tokens_per_second: float | None  # from femtotron's own step_seconds
    peak_bytes: int | None  # torch.cuda.max_memory_allocated over the timed steps, less what was there before
    micro_batch: int
    accumulation: int
    losses: tuple[float, float]  # of the first and the last timed step
    host_syncs: list[str] | None = None  # where one more step waited for the GPU (`host_syncs`)


def positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number >= 1")
    return int(text)


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=positive, help="timed steps per run (default 30, 5 with --quick)")
    parser.add_argument("--quick", action="store_true", help="5 timed steps after 1 warm-up, short GEMM")
    parser.add_argument(
        "--budget",
        type=positive,
        default=DEFAULT_BUDGET,
        help=f"seconds for the whole check (default {DEFAULT_BUDGET}): a part that no longer fits is skipped",
    )
    parser.add_argument("--skip-tests", action="store_true", help="do not run the CUDA-marked tests")
    parser.add_argument("--skip-hf", action="store_true", help="no Hugging Face transformers baseline")
    parser.add_argument("--skip-compile", action="store_true", help="no compiled runs (femtotron nor HF)")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help=f"a dotted override of {CONFIG}, e.g. tokens.micro_batch_size=2 (repeatable)",
    )
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "benchmarks-gpu.md", help="the report")
    parser.add_argument(
        "--logs", type=Path, help="keep each part's output here (default: a temporary folder, removed)"
    )
    args = parser.parse_args(argv)
    args.steps = args.steps or (5 if args.quick else 30)
    args.warmup = 1 if args.quick else 3
    return args


def gpu_config(overrides: Sequence[str], workdir: Path) -> Config:
    """The example config on one GPU with `overrides`, training on random tokens under `workdir` (written by
    `with_random_tokens`)."""
    return load_config(
        ROOT / CONFIG,
        [
            *ONE_GPU,
            *overrides,
            f"data.dataset_folder={workdir / 'random'}",
            f"logging.output_dir={workdir / 'runs'}",
            "tokenizer.tokenizer_name_or_path=null",
            "checkpoints.save_final_state=false",
        ],
    )


def with_random_tokens(config: Config) -> Config:
    from common import write_random_tokens

    tokens = config.tokens
    # uint16 tokens hold ids below 2^16 only: a larger vocabulary is trained on its first 65535 ids.
    vocab = min(config.model.model_config_.vocab_size, 2**16 - 1)
    count = 8 * (tokens.micro_batch_size + 1) * (tokens.sequence_length + 1)
    write_random_tokens(Path(config.data.dataset_folder), vocab, count)
    return config


def free_memory() -> None:
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def timed(step: Callable[[], Any], steps: int, warmup: int, device: torch.device) -> tuple[float, list, int]:
    """Seconds of `steps` calls of `step` after `warmup` (GPU work included), their results, and the peak
    of allocated CUDA memory meanwhile (0 elsewhere)."""
    import torch

    for _ in range(warmup):
        step()
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    start = time.perf_counter()
    results = [step() for _ in range(steps)]
    if cuda:
        torch.cuda.synchronize(device)
    return time.perf_counter() - start, results, torch.cuda.max_memory_allocated(device) if cuda else 0


def run_femtotron(config: Config, steps: int, warmup: int, count_host_syncs: bool = False) -> Run:
    import torch

    from femtotron.parallel.context import ParallelContext
    from femtotron.trainer import Trainer

    with ParallelContext() as ctx:
        cuda = ctx.device.type == "cuda"
        before = torch.cuda.memory_allocated(ctx.device) if cuda else 0
        trainer = Trainer(config, ctx, log_to_console=False)
        seconds, results, peak = timed(trainer.train_step, steps, warmup, ctx.device)
        tokens = sum(result.tokens for result in results)
        logged = tokens / sum(result.seconds for result in results)
        micro_batch = config.tokens.micro_batch_size
        losses = (results[0].loss, results[-1].loss)
        syncs = host_syncs(trainer.train_step) if count_host_syncs else None
    del trainer, results
    free_memory()
    return Run(tokens / seconds, logged, peak - before if cuda else None, micro_batch, 1, losses, syncs)


class HFTraining:
    """`LlamaForCausalLM` of the config's shape trained the way HF's Trainer does with bf16=True: fp32 weights
    under bf16 autocast, fused AdamW, gradient clipping at 1.0; random tokens."""

    def __init__(
        self, config: Config, device: torch.device, micro_batch: int, accumulation: int, compiled: bool
    ) -> None:
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM

        shape, self.sequence = config.model.model_config_, config.tokens.sequence_length
        self.vocab, self.device = shape.vocab_size, device
        self.micro_batch, self.accumulation = micro_batch, accumulation
        hf_config = LlamaConfig(
            vocab_size=shape.vocab_size,
            hidden_size=shape.hidden_size,
            intermediate_size=shape.intermediate_size,
            num_hidden_layers=shape.num_hidden_layers,
            num_attention_heads=shape.num_attention_heads,
            num_key_value_heads=shape.num_key_value_heads,
            max_position_embeddings=self.sequence,
            rope_theta=shape.rope_theta,
            rms_norm_eps=shape.rms_norm_eps,
            tie_word_embeddings=shape.tie_word_embeddings,
            attn_implementation="sdpa",
        )
        with device:  # initialised where it trains: a CPU init of 1B parameters takes long
            self.model = LlamaForCausalLM(hf_config).float().train()
        optimizer = config.optimizer
        lr = optimizer.learning_rate_scheduler.learning_rate
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=lr, weight_decay=optimizer.weight_decay, fused=True
        )
        self.generator = torch.Generator(device).manual_seed(0)
        # As HF's Trainer does with torch_compile=True: the whole model through torch.compile.
        self.forward = torch.compile(self.model) if compiled else self.model

    def step(self) -> torch.Tensor:
        import torch

        shape = (self.micro_batch, self.sequence)
        total = torch.zeros((), device=self.device)
        for _ in range(self.accumulation):
            ids = torch.randint(1, self.vocab, shape, device=self.device, generator=self.generator)
            with torch.autocast(self.device.type, dtype=torch.bfloat16):
                loss = self.forward(input_ids=ids, labels=ids, use_cache=False).loss / self.accumulation
            loss.backward()
            total += loss.detach()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return total


def run_hf(config: Config, device: torch.device, steps: int, warmup: int, compiled: bool = False) -> Run:
    """The HF baseline on the same batch; out of memory, the micro-batch is halved and accumulated twice."""
    import torch

    micro_batch, accumulation = config.tokens.micro_batch_size, 1
    while True:
        try:
            before = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
            hf = HFTraining(config, device, micro_batch, accumulation, compiled)
            seconds, losses, peak = timed(hf.step, steps, warmup, device)
            tokens = steps * micro_batch * accumulation * config.tokens.sequence_length
            first_and_last = (float(losses[0]), float(losses[-1]))
            del hf, losses
            free_memory()
            return Run(
                tokens / seconds,
                None,
                peak - before if peak else None,
                micro_batch,
                accumulation,
                first_and_last,
            )
        except torch.OutOfMemoryError:
            if micro_batch == 1:
                raise
        hf = None  # the failed attempt's model, so that its memory can go
        free_memory()
        micro_batch, accumulation = micro_batch // 2, accumulation * 2


def attention_share(config: Config) -> float:
    """How much lower femtotron's MFU reads than with causal attention counted whole (torchtitan's count)."""
    shape, sequence = config.model.model_config_, config.tokens.sequence_length
    ours = shape.flops_per_token(sequence)
    return 1 - ours / (ours + 6 * shape.num_hidden_layers * sequence * shape.hidden_size)


def largest_matmul(config: Config) -> tuple[tuple[int, int, int], str]:
    """(m, n, k) of the model's largest matmul for one micro-batch, and what it is."""
    shape, tokens = config.model.model_config_, config.tokens
    m = tokens.micro_batch_size * tokens.sequence_length
    if shape.vocab_size >= shape.intermediate_size:
        return (m, shape.vocab_size, shape.hidden_size), "the LM head"
    return (m, shape.intermediate_size, shape.hidden_size), "the MLP's up projection"


def describe_shape(config: Config) -> str:
    shape, tokens = config.model.model_config_, config.tokens
    return (
        f"{shape.parameter_count:,} parameters: hidden {shape.hidden_size}, "
        f"{shape.num_hidden_layers} layers, {shape.num_attention_heads} heads with "
        f"{shape.num_key_value_heads} key/value heads, "
        f"intermediate {shape.intermediate_size}, vocabulary {shape.vocab_size}, "
        f"{'tied' if shape.tie_word_embeddings else 'untied'} embeddings; micro-batch "
        f"{tokens.micro_batch_size} x {tokens.sequence_length} tokens, one micro-batch per step"
    )


def training_device() -> torch.device:
    import torch

    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def environment_part(settings: Settings) -> dict[str, Any]:
    """Part: the GPU and the versions, the report's first lines; whether CUDA is there at all."""
    import torch

    available = torch.cuda.is_available()
    if available:
        props = torch.cuda.get_device_properties(0)
        capability = f"{props.major}.{props.minor}"
        gpu = f"{props.name} ({props.total_memory / 2**30:.1f} GiB, compute capability {capability})"
    else:
        gpu = "none (`torch.cuda.is_available()` is False)"
    lines = [
        f"- GPU: {gpu}",
        f"- torch {torch.__version__}, CUDA {torch.version.cuda or 'none (a CPU build of torch)'}, Python "
        f"{platform.python_version()}, transformers {package_version('transformers')}",
    ]
    return {"cuda_available": available, "lines": lines}


def femtotron_part(settings: Settings) -> dict[str, Any]:
    """Part: femtotron eager, then what its MFU is measured against: the data-sheet peak, a measured GEMM of
    the model's largest matmul."""
    import torch

    from femtotron.metrics import matmul_flops_rate, peak_flops

    config = with_random_tokens(gpu_config(settings.overrides, Path(settings.workdir)))
    run = run_femtotron(config, settings.steps, settings.warmup)
    device = training_device()
    (m, n, k), _ = largest_matmul(config)
    gemm = matmul_flops_rate(m, n, k, torch.bfloat16, device, seconds=settings.gemm_seconds)
    if device.type == "cuda":
        peak, peak_source = peak_flops(device, torch.bfloat16, (m, n, k))
    else:
        peak, peak_source = None, "no GPU: no data sheet"
    return {"run": asdict(run), "gemm_flops": gemm, "peak_flops": peak, "peak_source": peak_source}


def femtotron_compiled_part(settings: Settings) -> dict[str, Any]:
    """Part: femtotron with `model.compile: true`, compiling in the warm-up steps (at least one, untimed)."""
    config = with_random_tokens(
        gpu_config([*settings.overrides, "model.compile=true"], Path(settings.workdir))
    )
    return {"run": asdict(run_femtotron(config, settings.steps, max(settings.warmup, 1)))}


def hf_part(settings: Settings) -> dict[str, Any]:
    """Part: the HF transformers baseline, eager; its peak memory as the report writes it."""
    from femtotron.diagnostics.memory import human

    config = gpu_config(settings.overrides, Path(settings.workdir))
    run = run_hf(config, training_device(), settings.steps, settings.warmup)
    return {"run": asdict(run), "peak_allocated": human(run.peak_bytes) if run.peak_bytes else None}


def hf_compiled_part(settings: Settings) -> dict[str, Any]:
    """Part: the HF transformers baseline through `torch.compile`, compiling in the untimed warm-up."""
    config = gpu_config(settings.overrides, Path(settings.workdir))
    warmup = max(settings.warmup, 1)
    return {"run": asdict(run_hf(config, training_device(), settings.steps, warmup, compiled=True))}


def memory_part(settings: Settings) -> dict[str, Any]:
    """Part: doctor's estimate (no GPU needed), against the femtotron run's measured peak where it ran."""
    from femtotron.diagnostics.doctor import worst_stage
    from femtotron.diagnostics.memory import human

    estimate = worst_stage(gpu_config(settings.overrides, Path(settings.workdir)), on_cpu=False)
    state = " + ".join(f"{k.replace('_', ' ')} {human(v)}" for k, v in estimate.state.items())
    doctor = shlex.join(["femtotron", "doctor", CONFIG, *ONE_GPU, *settings.overrides])
    lines = [
        f"`{doctor}`: {human(estimate.total)} per rank = {state} + the activations' peak "
        f"{human(estimate.micro_batch_peak)} (`diagnostics.doctor.worst_stage`).",
    ]
    measured = settings.earlier.get("femtotron", {}).get("run", {}).get("peak_bytes")
    if measured:
        lines.append(
            f"`{settings.command}`: `torch.cuda.max_memory_allocated()` over the timed steps of the "
            f"femtotron run, less what was allocated before its Trainer: {human(measured)}; **estimate / "
            f"measured = {estimate.total / measured:.3f}**."
        )
    return {"lines": lines, "estimate_bytes": estimate.total}


MOE_SHAPE = dict(
    hidden_size=1024, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=8, vocab_size=32000
)
MOE = dict(num_experts=8, num_experts_per_tok=2, intermediate_size=2816, aux_loss_coef=0.0)
MOE_BATCH = (8, 1024)  # sequences, tokens each


def measure_moe(rounds: int, device: str) -> dict[str, Any]:
    """bench/moe.py's three variants on `device` in bf16: the section's lines."""
    import moe as moe_bench
    import torch

    batch, sequence = MOE_BATCH
    shape = MOE_SHAPE
    times = moe_bench.measure(shape, MOE, batch, sequence, rounds, torch.device(device), torch.bfloat16)
    lines = [
        f"hidden {shape['hidden_size']}, {shape['num_hidden_layers']} layers, top-2 of 8 experts of "
        f"{MOE['intermediate_size']}, {batch} x {sequence} tokens, bf16, {rounds} alternating rounds "
        "(`bench/moe.py`'s "
        "`measure`; femtotron's experts are `torch._grouped_mm`):"
    ]
    for name, ours, theirs, ratios in moe_bench.ratio_lines(times):
        label = "a loop over the experts" if name == "loop" else "HF `MixtralForCausalLM`"
        lines.append(
            f"- femtotron {ours * 1e3:.1f} ms, {label} {theirs * 1e3:.1f} ms (the median round): "
            f"**{ours / theirs:.2f}x** (min {min(ratios):.2f}, max {max(ratios):.2f})"
        )
    return {"lines": lines}


def moe_part(settings: Settings) -> dict[str, Any]:
    """Part: the mixture of experts on the GPU."""
    return measure_moe(settings.moe_rounds, "cuda")


# The new code's parts: a model small enough that their five processes, two runs each, take about two
# minutes on one GPU; one sequence of 8192 tokens per step, where a window of 1024 keeps an eighth.
NEW_CODE_MODEL = (
    "model.model_config.hidden_size=512",
    "model.model_config.intermediate_size=2048",
    "model.model_config.num_hidden_layers=8",
    "model.model_config.num_attention_heads=8",
    "model.model_config.num_key_value_heads=4",
    "model.model_config.vocab_size=32000",
    "model.model_config.max_position_embeddings=8192",
    "tokens.sequence_length=8192",
    "tokens.micro_batch_size=1",
    # the example's 2000 steps of warm-up would keep the steps measured near a learning rate of 0
    "optimizer.learning_rate_scheduler.lr_warmup_steps=0",
)
SYNC_WARNING = "called a synchronizing CUDA operation"  # torch's, at each under set_sync_debug_mode("warn")
SAVED_STEPS = 2  # the async-save runs' steps: a checkpoint before the first and after each


@dataclass(frozen=True)
class Variant:
    label: str  # how the report names it
    override: str  # what it sets over NEW_CODE_MODEL


# The new code against what it is compared with (key: (new, baseline)), both trained in one process.
COMPARISONS = {
    "zero3": (Variant("ZeRO-3", "optimizer.zero_stage=3"), Variant("ZeRO-1", "optimizer.zero_stage=1")),
    "zb_h1": (
        Variant("zb-h1 at pp = 1", "parallelism.pp_engine=zb-h1"),
        Variant("1f1b", "parallelism.pp_engine=1f1b"),
    ),
    "muon": (
        Variant("Muon", "optimizer.optimizer_factory.name=muon"),
        Variant("AdamW", "optimizer.optimizer_factory.name=adamW"),
    ),
    "window": (
        Variant("a sliding window of 1024", "model.model_config.sliding_window=1024"),
        Variant("none", "model.model_config.sliding_window=null"),
    ),
}
NEW_CODE_KEYS = (*COMPARISONS, "async_save")


def host_syncs(step: Callable[[], Any]) -> list[str] | None:
    """`step()` under `torch.cuda.set_sync_debug_mode("warn")`: where it made the host wait for the GPU,
    "folder/file.py:line" once per wait (torch warns at each implicit one: `.item()`, a copy to the host,
    `nonzero`, a stream's synchronize; not at `torch.cuda.synchronize()`). None without CUDA, the step run
    all the same."""
    import warnings

    import torch

    if not torch.cuda.is_available():
        step()
        return None
    previous = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # every wait, not only the first at each line
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode(previous)
    return [
        f"{Path(warning.filename).parent.name}/{Path(warning.filename).name}:{warning.lineno}"
        for warning in caught
        if SYNC_WARNING in str(warning.message)
    ]


def variant_config(settings: Settings, folder: str, overrides: Sequence[str]) -> Config:
    """NEW_CODE_MODEL with `overrides`, on random tokens and in a run directory of its own under `folder`."""
    workdir = Path(settings.workdir) / folder
    workdir.mkdir(parents=True, exist_ok=True)
    return with_random_tokens(gpu_config([*settings.overrides, *NEW_CODE_MODEL, *overrides], workdir))


def compare(settings: Settings, key: str) -> dict[str, Any]:
    """Both runs of COMPARISONS[key] in turn, each with the host syncs of one more step; a failure where a
    loss was not finite."""
    result: dict[str, Any] = {FAILURES: []}
    for side, variant in zip(("new", "baseline"), COMPARISONS[key], strict=True):
        config = variant_config(settings, f"{key}/{side}", [variant.override])
        run = run_femtotron(config, settings.steps, settings.warmup, count_host_syncs=True)
        result[side] = asdict(run)
        if not all(math.isfinite(loss) for loss in run.losses):
            result[FAILURES].append(f"{variant.label}: a loss was not finite (first and last: {run.losses})")
    tokens = config.tokens
    return result | {
        "step_tokens": tokens.micro_batch_size * tokens.sequence_length,
        "shape": describe_shape(config),
    }


def zero3_part(settings: Settings) -> dict[str, Any]:
    """Part: ZeRO-3 against ZeRO-1 (losses, peaks)."""
    return compare(settings, "zero3")


def zb_h1_part(settings: Settings) -> dict[str, Any]:
    """Part: zb-h1 against 1f1b at pp = 1 (losses, step time: W's one autograd call per deferred weight)."""
    return compare(settings, "zb_h1")


def muon_part(settings: Settings) -> dict[str, Any]:
    """Part: Muon against AdamW (a finite loss, step time)."""
    return compare(settings, "muon")


def window_part(settings: Settings) -> dict[str, Any]:
    """Part: a sliding window of 1024 against none at sequence 8192 (peak, step time)."""
    return compare(settings, "window")


def async_save_part(settings: Settings) -> dict[str, Any]:
    """Part: the same run saving in the background (checkpoints.async_save) and synchronously, a checkpoint
    before the first step and after each: how long training stopped for each save, whether the step-0
    checkpoints' files are equal (the steps after it overlap its background write), and the host syncs of
    each whole run; a failure where the files differ."""
    import torch

    from femtotron.parallel.context import ParallelContext
    from femtotron.serialize.files import MANIFEST
    from femtotron.serialize.resume_source import checkpoint_root, committed_checkpoints
    from femtotron.trainer import Trainer

    result: dict[str, Any] = {}
    first: dict[str, Path] = {}  # each run's step-0 checkpoint
    for side, background in (("new", "true"), ("baseline", "false")):
        config = variant_config(
            settings,
            f"async_save/{side}",
            [
                f"checkpoints.async_save={background}",
                "checkpoints.save_initial_state=true",
                "checkpoints.checkpoint_interval=1",
                f"tokens.train_steps={SAVED_STEPS}",
            ],
        )
        # The checkpoints hold the RNG states: the same in both runs, as in two new processes.
        torch.manual_seed(0)
        with ParallelContext() as ctx:
            trainer = Trainer(config, ctx, log_to_console=False)
            syncs = host_syncs(trainer.train)
        del trainer
        free_memory()
        records = [json.loads(line) for line in (config.run_dir / "metrics.jsonl").read_text().splitlines()]
        stalls = {
            r["checkpoint_step"]: r["checkpoint_stall_seconds"] for r in records if "checkpoint_step" in r
        }
        result[side] = {"stall_seconds": [stalls[step] for step in sorted(stalls)], "host_syncs": syncs}
        first[side] = committed_checkpoints(checkpoint_root(config))[0]
    # The manifest records the time and the config (async_save): every other file must be equal.
    files = {
        side: sorted(p.name for p in path.iterdir() if p.name != MANIFEST) for side, path in first.items()
    }
    differ = sorted(set(files["new"]) ^ set(files["baseline"])) or [
        name
        for name in files["new"]
        if not filecmp.cmp(first["new"] / name, first["baseline"] / name, shallow=False)
    ]
    failures = [f"async save: the step-0 checkpoint differs from a synchronous save's in {', '.join(differ)}"]
    return result | {
        "files": files["new"],
        "differ": differ,
        "checkpoint_bytes": sum(p.stat().st_size for p in first["new"].iterdir()),
        "shape": describe_shape(config),
        FAILURES: failures if differ else [],
    }


def gib(size: int) -> str:
    return f"{size / 2**30:.2f} GiB"


def host_syncs_text(new: list[str] | None, baseline: list[str] | None) -> str:
    """The new code's host syncs against the baseline's, with where most of the new code's were."""
    if new is None or baseline is None:
        return "not counted (no CUDA)"
    places = ", ".join(f"`{site}` x{count}" for site, count in Counter(new).most_common(3))
    return f"{len(new)} against {len(baseline)}" + (f" (most at {places})" if places else "")


def comparison_line(key: str, result: dict[str, Any]) -> str:
    new_variant, baseline_variant = COMPARISONS[key]
    new = Run(**result["new"])
    baseline = Run(**result["baseline"])
    new_ms, baseline_ms = (result["step_tokens"] / run.tokens_per_second * 1e3 for run in (new, baseline))
    figures = [
        f"loss at the first and last timed step {new.losses[0]:.4f}, {new.losses[1]:.4f} against "
        f"{baseline.losses[0]:.4f}, {baseline.losses[1]:.4f}",
        f"step {new_ms:.1f} ms against {baseline_ms:.1f} ms (**{new_ms / baseline_ms:.2f}x**)",
    ]
    if new.peak_bytes and baseline.peak_bytes:
        figures.append(
            f"peak allocated {gib(new.peak_bytes)} against {gib(baseline.peak_bytes)} "
            f"(**{new.peak_bytes / baseline.peak_bytes:.2f}x**)"
        )
    figures.append(f"host syncs in one more step {host_syncs_text(new.host_syncs, baseline.host_syncs)}")
    return (
        f"- **{new_variant.label}** (`{new_variant.override}`) against {baseline_variant.label} "
        f"(`{baseline_variant.override}`): " + "; ".join(figures) + "."
    )


def async_save_line(result: dict[str, Any]) -> str:
    new_stalls, baseline_stalls = (
        ", ".join(f"{seconds:.3f}" for seconds in result[side]["stall_seconds"])
        for side in ("new", "baseline")
    )
    if result["differ"]:
        files = f"**the step-0 checkpoints differ** in {', '.join(result['differ'])}"
    else:
        files = (
            f"the step-0 checkpoints' {len(result['files'])} file(s) are equal byte for byte (the manifest "
            "apart: it records the time and the config)"
        )
    syncs = host_syncs_text(result["new"]["host_syncs"], result["baseline"]["host_syncs"])
    return (
        "- **async save** (`checkpoints.async_save=true`) against a synchronous save, a checkpoint of "
        f"{result['checkpoint_bytes'] / 2**20:,.1f} MiB before the first step and after each of "
        f"{SAVED_STEPS}: training stopped {new_stalls} s against {baseline_stalls} s; {files}; host syncs "
        f"over each whole run {syncs}."
    )


def new_code_lines(
    command: str, steps: int, warmup: int, results: dict[str, dict[str, Any]]
) -> list[str] | None:
    """The new code's parts in one section, rewritten as each of them finishes."""
    done = [key for key in NEW_CODE_KEYS if key in results]
    if not done:
        return None
    lines = [
        f"`{command}`: each comparison in a process of its own, its two runs in turn, at dp = tp = pp = 1: "
        f"{results[done[0]]['shape']}; random tokens, {steps} timed steps after {warmup} warm-up step(s). "
        'Host syncs: the warnings of `torch.cuda.set_sync_debug_mode("warn")`, one per implicit wait for the '
        "GPU (`.item()`, a copy to the host, `nonzero`; `torch.cuda.synchronize()` is not counted).",
        "",
        *(comparison_line(key, results[key]) for key in done if key in COMPARISONS),
    ]
    if "async_save" in results:
        lines.append(async_save_line(results["async_save"]))
    return lines


@dataclass
class Outcomes:
    passed: int = 0
    failed: list[str] = field(default_factory=list)  # "name: first line of the message"
    skipped: int = 0
    not_collected: list[str] = field(default_factory=list)  # "module: the import's error"


@dataclass
class TestRun:
    command: str  # as the report quotes it
    passed: int
    failed: list[str]
    skipped: int
    not_collected: list[str]
    counted: bool  # False: pytest was killed before writing its JUnit XML
    seconds: float
    timed_out: bool
    last_test: str | None  # the last test pytest started: the hung one after a timeout
    tail: list[str]  # the log's last lines, after a timeout


def junit_outcomes(xml: Path) -> Outcomes | None:
    """The outcomes in pytest's JUnit XML; None when there is none or only part of one (pytest killed)."""
    try:
        root = ElementTree.parse(xml).getroot()
    except (FileNotFoundError, ElementTree.ParseError):
        return None
    outcomes = Outcomes()
    for case in root.iter("testcase"):
        name = case.get("name")
        if not name:  # the test a SIGINT interrupted: pytest writes an empty <testcase/> for it
            continue
        children = {child.tag: child for child in case}
        problem = children.get("failure", children.get("error"))
        if problem is not None and problem.get("message") == "collection failure":
            outcomes.not_collected.append(f"{name}: {error_line(problem.text or '')}")
        elif problem is not None:
            message = problem.get("message") or ""
            outcomes.failed.append(
                f"{case.get('classname')}::{name}: {(message.splitlines() or [''])[0][:300]}"
            )
        elif "skipped" in children:
            outcomes.skipped += 1
        else:
            outcomes.passed += 1
    return outcomes


def error_line(text: str) -> str:
    """The error of a traceback pytest printed: its last `E   ` line, else its last line."""
    lines = [line for line in text.splitlines() if line.strip()]
    errors = [line[1:].strip() for line in lines if line.startswith("E ")]
    return (errors or lines or [""])[-1][:300]


TEST_ID = re.compile(r"^(\S+\.py::\S+)")


def last_started_test(log: Path) -> str | None:
    """The node id of the last test `pytest -v` started (it prints the id before running the test)."""
    tests = [match.group(1) for line in log_tail(log, 10_000) if (match := TEST_ID.match(line))]
    return tests[-1] if tests else None


def cuda_test_files(folder: Path = ROOT / "tests") -> list[Path]:
    """The test files under `folder` that hold CUDA-marked tests: only these are collected, so a module that
    cannot be imported on the GPU machine and has no CUDA test is no concern of the check."""
    return sorted(path for path in folder.rglob("test_*.py") if CUDA_MARK in path.read_text())


def pytest_command(files: Sequence[str | Path], xml: Path, timeout: float) -> list[str]:
    return [
        sys.executable,
        *PYTEST,
        *(os.path.relpath(file, ROOT) for file in files),
        # a module that cannot be imported is reported as such; the others still run
        "--continue-on-collection-errors",
        f"--junitxml={xml}",
        "-p",
        "no:cacheprovider",
        # a test stuck past (nearly) the whole timeout prints every thread's stack into the log
        "-o",
        f"faulthandler_timeout={max(1, int(timeout - STOP_GRACE_SECONDS))}",
    ]


def run_pytest(files: Sequence[str | Path], log: Path, timeout: float) -> TestRun:
    """pytest over `files` (the CUDA-marked tests), streamed to `log`, counted from its JUnit XML."""
    xml = log.with_suffix(".xml")
    xml.unlink(missing_ok=True)
    command = pytest_command(files, xml, timeout)
    finished = run_in_own_session(command, log, timeout)
    outcomes = junit_outcomes(xml)
    if outcomes is None and not finished.timed_out:
        raise PartFailed(f"pytest {finished.ending()} without writing its JUnit XML", log_tail(log))
    shown = shlex.join(["python", *command[1 : len(PYTEST) + 1 + len(files)]])
    return TestRun(
        command=shown,
        **asdict(outcomes or Outcomes()),
        counted=outcomes is not None,
        seconds=finished.seconds,
        timed_out=finished.timed_out,
        last_test=last_started_test(log),
        tail=log_tail(log) if finished.timed_out else [],
    )


def tests_lines(results: dict[str, dict[str, Any]]) -> list[str] | None:
    tests = results.get("tests")
    if tests is None:
        return None
    if tests["counted"]:
        counts = f"{tests['passed']} passed, {len(tests['failed'])} failed, {tests['skipped']} skipped"
    else:
        counts = "no counts (pytest was killed before writing its JUnit XML)"
    lines = [f"`{tests['command']}`: {counts} ({tests['seconds']:.0f} s)."]
    if tests["timed_out"]:
        lines += [
            "",
            f"**Timed out after {tests['seconds']:.0f} s**, stopped with its process group, in "
            f"`{tests['last_test']}` (the last test it started)"
            + ("; the counts are of the tests before it" if tests["counted"] else "")
            + ". The end of its output:",
            "",
            "```",
            *tests["tail"],
            "```",
        ]
    if tests["not_collected"]:
        lines += [
            "",
            "Not collected (the module could not be imported here: its CUDA-marked tests did not run, and "
            "are not counted above):",
            *(f"- `{module}`" for module in tests["not_collected"]),
        ]
    if tests["failed"]:
        lines += ["", "Failed:", *(f"- `{failure}`" for failure in tests["failed"])]
    return lines


TRAINING_RUNS = (
    ("femtotron", "femtotron (synchronised wall clock)"),
    ("hf", "HF transformers `LlamaForCausalLM`"),
    ("femtotron_compiled", "femtotron compiled (`model.compile: true`)"),
    ("hf_compiled", "HF transformers compiled (`torch.compile`)"),
)


def throughput_lines(
    config: Config, command: str, steps: int, warmup: int, results: dict[str, dict[str, Any]]
) -> list[str] | None:
    """Parts 2, 3 and 7 in one table, rewritten as each of them finishes."""
    runs = {key: Run(**results[key]["run"]) for key, _ in TRAINING_RUNS if key in results}
    if not runs:
        return None
    ours = runs.get("femtotron")
    theirs = runs.get("hf")
    yardstick = results.get("femtotron", {})
    gemm = yardstick.get("gemm_flops")
    peak = yardstick.get("peak_flops")
    flops_per_token = config.model.model_config_.flops_per_token(config.tokens.sequence_length)
    rows = [(label, runs[key].tokens_per_second) for key, label in TRAINING_RUNS if key in runs]
    if ours:
        rows.insert(1, ("femtotron as it logs it (its own `step_seconds`)", ours.logged_tokens_per_second))
    lines = [
        f"`{command}`: the model of `{CONFIG}` at dp = tp = pp = 1 in bf16 "
        f"({describe_shape(config)}), random tokens, {steps} timed steps after {warmup} warm-up step(s), "
        "the clock read after `torch.cuda.synchronize()`.",
        "",
        "| run | tokens/s | MFU against the data-sheet peak | model FLOP/s / measured GEMM |",
        "|---|---|---|---|",
    ]
    for label, rate in rows:
        if rate is not None:
            mfu = f"{rate * flops_per_token / peak:.1%}" if peak else "-"
            against_gemm = f"{rate * flops_per_token / gemm:.2f}" if gemm else "-"
            lines.append(f"| {label} | {rate:,.0f} | {mfu} | {against_gemm} |")
    (m, n, k), what = largest_matmul(config)
    lines += [
        "",
        f"- Model FLOPs per token: {flops_per_token / 1e9:.3g} GFLOP (`LlamaConfig.flops_per_token`). "
        "Causal attention counts as half of full attention (the FLOPs a flash kernel does); torchtitan and "
        "Megatron count it whole, so this MFU reads lower than theirs would for the same run "
        f"({attention_share(config):.0%} here; docs/training.md, Model FLOPs).",
    ]
    if gemm:
        lines += [
            f"- Peak: {f'{peak / 1e12:,.0f} TFLOP/s' if peak else 'none'} ({yardstick['peak_source']}; "
            "`metrics.peak_flops`).",
            f"- Measured GEMM: bf16 {m}x{k} -> {n} ({what}), {gemm / 1e12:.3g} TFLOP/s "
            "(`metrics.matmul_flops_rate`, best of 3 trials).",
        ]
    else:
        lines.append("- No peak nor measured GEMM: the femtotron run measures them, and it did not finish.")
    compiled = runs.get("femtotron_compiled")
    for name, a, b in (
        ("femtotron / HF", ours, theirs),
        ("femtotron compiled / HF", compiled, theirs),
        ("femtotron compiled / HF compiled", compiled, runs.get("hf_compiled")),
    ):
        if a and b:
            lines.append(f"- **{name}: {a.tokens_per_second / b.tokens_per_second:.2f}x** tokens/s.")
    if theirs:
        peak_allocated = results["hf"].get("peak_allocated")
        peak_memory = f"; peak allocated {peak_allocated}" if peak_allocated else ""
        lines.append(
            f"- HF baseline: transformers {package_version('transformers')}, sdpa attention, fp32 weights "
            "under bf16 autocast, `torch.optim.AdamW(fused=True)`, gradient clipping at 1.0; micro-batch "
            f"{theirs.micro_batch} x {theirs.accumulation} per step"
            + (" (halved after running out of memory)" if theirs.accumulation > 1 else "")
            + f"{peak_memory}."
        )
    for name, run in (("femtotron", ours), ("HF", theirs)):
        if run:
            lines.append(
                f"- {name} loss, first and last timed step: {run.losses[0]:.3f}, {run.losses[1]:.3f}."
            )
    return lines


def part_lines(key: str, results: dict[str, dict[str, Any]]) -> list[str] | None:
    """The lines a part wrote for its own section."""
    return results.get(key, {}).get("lines")


def package_version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


# Seconds each part is expected to take on an H100/H200 and the most it may run: estimates until a GPU run
# measures them (the report's "Time per part").
ENVIRONMENT_PART = FunctionPart("environment", "the probe of the device", 15, 90, environment_part)
FEMTOTRON_PART = FunctionPart("femtotron", "the femtotron run", 45, 150, femtotron_part)
HF_PART = FunctionPart("hf", "the HF transformers baseline", 45, 150, hf_part)
MEMORY_PART = FunctionPart("memory", "doctor's memory estimate", 15, 90, memory_part)
MOE_PART = FunctionPart("moe", "the mixture of experts", 30, 120, moe_part)
NEW_CODE_PARTS = (
    FunctionPart("zero3", "ZeRO-3 against ZeRO-1", 25, 120, zero3_part),
    FunctionPart("zb_h1", "zb-h1 against 1f1b at pp = 1", 25, 120, zb_h1_part),
    FunctionPart("muon", "Muon against AdamW", 25, 120, muon_part),
    FunctionPart("window", "a sliding window of 1024 against none at sequence 8192", 25, 120, window_part),
    FunctionPart("async_save", "async saves against synchronous ones", 30, 120, async_save_part),
)
FEMTOTRON_COMPILED_PART = FunctionPart(
    "femtotron_compiled", "the femtotron run with model.compile", 90, 240, femtotron_compiled_part
)
HF_COMPILED_PART = FunctionPart(
    "hf_compiled", "the HF transformers baseline compiled", 90, 240, hf_compiled_part
)


def cuda_tests_part() -> PytestPart:
    files = tuple(os.path.relpath(path, ROOT) for path in cuda_test_files())
    return PytestPart("tests", "the CUDA-marked tests", 90, 180, files)


def plan(args: argparse.Namespace, cuda: bool, hf: bool, skip: Callable[[str], None]) -> list[Part]:
    """The parts after the probe of the device, in order; what is left out is passed to `skip`."""
    no_cuda = "no CUDA device: skipped"
    parts: list[Part] = []
    if args.skip_tests:
        skip("--skip-tests: skipped the CUDA-marked tests")
    elif not cuda:
        skip(f"{no_cuda} the CUDA-marked tests (`python {shlex.join(PYTEST)}`)")
    elif importlib.util.find_spec("pytest") is None:
        skip(f"pytest is not installed for {sys.executable}: skipped the CUDA-marked tests")
    else:
        parts.append(cuda_tests_part())
    if args.skip_hf:
        skip("--skip-hf: skipped the HF transformers baseline")
    elif not hf:
        skip("transformers is not installed: skipped the HF transformers baseline")
    if cuda:
        parts += [FEMTOTRON_PART, HF_PART] if hf else [FEMTOTRON_PART]
    else:
        skip(
            f"{no_cuda} the femtotron run (tokens/s, MFU against the data-sheet peak and a measured GEMM)"
            + (", the HF transformers baseline" if hf else "")
            + " and the measured peak memory (`torch.cuda.max_memory_allocated`)"
        )
    parts.append(MEMORY_PART)
    if not cuda:
        skip(f"{no_cuda} the mixture of experts (`bench/moe.py` in bf16)")
    elif not hf:
        skip("no HF transformers: skipped the mixture of experts (it compares with `MixtralForCausalLM`)")
    else:
        parts.append(MOE_PART)
    if cuda:
        parts += NEW_CODE_PARTS
    else:
        skip(
            f"{no_cuda} the new code (ZeRO-3, zb-h1, Muon, the sliding window, async saves, their host syncs)"
        )
    if args.skip_compile:
        skip("--skip-compile: skipped the compiled runs")
    elif not cuda:
        skip(f"{no_cuda} the compiled runs (`model.compile: true`, `torch.compile`)")
    else:
        parts += [FEMTOTRON_COMPILED_PART, HF_COMPILED_PART] if hf else [FEMTOTRON_COMPILED_PART]
    return parts


def check_sections(config: Config, args: argparse.Namespace, command: str) -> list[Section]:
    return [
        Section("CUDA-marked tests", tests_lines),
        Section(
            "Training throughput: femtotron against HF transformers",
            partial(throughput_lines, config, command, args.steps, args.warmup),
        ),
        Section("Memory: doctor's estimate against the measured peak", partial(part_lines, "memory")),
        Section("Mixture of experts: step time against a loop and HF Mixtral", partial(part_lines, "moe")),
        Section(
            "The new code: ZeRO-3, zb-h1, Muon, the sliding window, async saves",
            partial(new_code_lines, command, args.steps, args.warmup),
        ),
    ]


def raise_stopped(signal_number: int, frame: Any) -> None:
    raise Stopped(f"this check was sent {signal.Signals(signal_number).name}")


@contextmanager
def stop_on_signals() -> Iterator[None]:
    """SIGTERM and SIGHUP raise Stopped meanwhile (a part's processes are in sessions of their own: only
    this check can stop them)."""
    handlers = {number: signal.signal(number, raise_stopped) for number in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for number, handler in handlers.items():
            signal.signal(number, handler)


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    command = shlex.join(["python", "bench/gpu_check.py", *argv])
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as workdir:
        try:
            config = gpu_config(args.set, Path(workdir))
        except ConfigError as e:
            print(f"gpu_check: error in --set: {e}", file=sys.stderr)
            return 2
        if config.general.cuda_expandable_segments:  # as `femtotron train` does, before CUDA starts (M2)
            os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")  # for the parts
        settings = Settings(
            overrides=list(args.set),
            workdir=workdir,
            steps=args.steps,
            warmup=args.warmup,
            gemm_seconds=0.1 if args.quick else 0.3,
            moe_rounds=3 if args.quick else 10,
            report=str(args.out),
            command=command,
        )
        report = Report(command, check_sections(config, args, command))
        check = Check(report, settings, args.budget, args.logs or Path(workdir) / "logs")
        hf = not args.skip_hf and package_version("transformers") != "not installed"

        def parts() -> Iterator[Part]:
            yield ENVIRONMENT_PART
            # a probe that broke says nothing about CUDA: the parts run, and each says what breaks
            cuda = report.results.get("environment", {}).get("cuda_available", True)
            yield from plan(args, cuda, hf, report.skip)

        with stop_on_signals():
            check.run_all(parts())
    print(
        f"gpu_check: wrote {args.out}"
        + (f"; failed: {'; '.join(failure.line for failure in report.failures)}" if report.failures else "")
    )
    return 1 if report.failures else 0


if __name__ == "__main__":
    if sys.argv[1:2] == [PART_FLAG]:
        sys.exit(part_main(sys.argv[2:]))
    sys.exit(main())
