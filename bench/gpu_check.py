"""`make gpu-check`: what one CUDA GPU shows about femtotron, written to docs/benchmarks-gpu.md.

1. the CUDA-marked tests (`python -m pytest -q -m cuda`): pass/fail counts and the failures' names;
2. the model of examples/llama_1b_gpu.yaml (~1.2B parameters) at dp = tp = pp = 1 in bf16, trained by
   femtotron's Trainer for a few dozen steps on random tokens: tokens/s, and MFU against the GPU's bf16
   data-sheet peak and against a measured bf16 GEMM of the model's largest matmul;
3. the same shape and batch in HF transformers' `LlamaForCausalLM` (sdpa attention, bf16 autocast over fp32
   weights, fused AdamW) as the baseline: the ratio of the two;
4. `femtotron doctor`'s per-rank memory estimate against `torch.cuda.max_memory_allocated()` of the run;
5. both compiled, unless --skip-compile (femtotron with `model.compile: true`, HF with
   `torch.compile(model)`): the ratios eager and compiled, each against HF eager and compiled;
6. a mixture of experts (bench/moe.py, bf16): femtotron's grouped-GEMM experts against a loop over them and
   against transformers' MixtralForCausalLM, forward + backward.

It needs nothing but the GPU (no network, no install) and takes under 8 minutes on an H100/H200. Without
CUDA every part that needs it is skipped with a line in the report saying so; the report is still written
and the exit code is 0. The exit code is 1 when a CUDA-marked test failed or a part broke (the report says
which), 2 for a bad argument.

    python bench/gpu_check.py [--steps 30] [--quick] [--skip-tests] [--skip-hf] [--skip-compile] [--out PATH]
                              [--set KEY=VALUE ...]   (config overrides, e.g. tokens.micro_batch_size=2)
"""

from __future__ import annotations

import argparse
import gc
import importlib.metadata
import importlib.util
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import xml.etree.ElementTree as ElementTree
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
from common import write_random_tokens

from femtotron.atomic import atomic_path
from femtotron.config import Config, load_config
from femtotron.diagnostics.doctor import worst_stage
from femtotron.diagnostics.memory import human
from femtotron.errors import ConfigError
from femtotron.metrics import matmul_flops_rate, peak_flops
from femtotron.parallel.context import ParallelContext
from femtotron.trainer import Trainer

ROOT = Path(__file__).resolve().parents[1]
CONFIG = "examples/llama_1b_gpu.yaml"
# The example's model and micro-batch on one GPU, one micro-batch per step.
ONE_GPU = ("parallelism.dp=1", "tokens.batch_accumulation_per_replica=1")
PYTEST = ("-m", "pytest", "-q", "-m", "cuda")
PYTEST_TIMEOUT = 300  # seconds: the tests' share of the 8 minutes


class Skipped(Exception):
    """A part that cannot run here; the message is the report's line."""


@dataclass
class Report:
    command: str
    sections: list[tuple[str, list[str]]] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)

    def attempt(self, what: str, part: Callable[[], Any]) -> Any:
        """`part()`, or None when it is skipped (noted) or breaks (a failure noted, traceback on stderr)."""
        try:
            return part()
        except Skipped as skip:
            self.skipped.append(str(skip))
        except Exception as e:  # one broken part must not lose the others' figures
            traceback.print_exc()
            self.failures.append(f"{what}: {type(e).__name__}: {(str(e).splitlines() or [''])[0][:300]}")
        return None


@dataclass
class Run:
    tokens_per_second: float
    logged_tokens_per_second: float | None  # from femtotron's own step_seconds
    peak_bytes: int | None  # torch.cuda.max_memory_allocated over the timed steps, less what was there before
    micro_batch: int
    accumulation: int
    losses: tuple[float, float]  # of the first and the last timed step


def positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number >= 1")
    return int(text)


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=positive, help="timed steps per run (default 30, 5 with --quick)")
    parser.add_argument("--quick", action="store_true", help="5 timed steps after 1 warm-up, short GEMM")
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
    args = parser.parse_args(argv)
    args.steps = args.steps or (5 if args.quick else 30)
    args.warmup = 1 if args.quick else 3
    return args


def gpu_config(overrides: Sequence[str], workdir: Path) -> Config:
    """The example config on one GPU with `overrides`, training on random tokens written under `workdir`."""
    prefix = workdir / "random"
    config = load_config(
        ROOT / CONFIG,
        [
            *ONE_GPU,
            *overrides,
            f"data.dataset_folder={prefix}",
            f"logging.output_dir={workdir / 'runs'}",
            "tokenizer.tokenizer_name_or_path=null",
            "checkpoints.save_final_state=false",
        ],
    )
    tokens = config.tokens
    # uint16 tokens hold ids below 2^16 only: a larger vocabulary is trained on its first 65535 ids.
    vocab = min(config.model.model_config_.vocab_size, 2**16 - 1)
    write_random_tokens(prefix, vocab, 8 * (tokens.micro_batch_size + 1) * (tokens.sequence_length + 1))
    return config


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def timed(step: Callable[[], Any], steps: int, warmup: int, device: torch.device) -> tuple[float, list, int]:
    """Seconds of `steps` calls of `step` after `warmup` (GPU work included), their results, and the peak
    of allocated CUDA memory meanwhile (0 elsewhere)."""
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


def run_femtotron(config: Config, steps: int, warmup: int) -> Run:
    with ParallelContext() as ctx:
        cuda = ctx.device.type == "cuda"
        before = torch.cuda.memory_allocated(ctx.device) if cuda else 0
        trainer = Trainer(config, ctx, log_to_console=False)
        seconds, results, peak = timed(trainer.train_step, steps, warmup, ctx.device)
        tokens = sum(result.tokens for result in results)
        logged = tokens / sum(result.seconds for result in results)
        micro_batch = config.tokens.micro_batch_size
        losses = (results[0].loss, results[-1].loss)
    del trainer, results
    free_memory()
    return Run(tokens / seconds, logged, peak - before if cuda else None, micro_batch, 1, losses)


class HFTraining:
    """`LlamaForCausalLM` of the config's shape trained the way HF's Trainer does with bf16=True: fp32 weights
    under bf16 autocast, fused AdamW, gradient clipping at 1.0; random tokens."""

    def __init__(
        self, config: Config, device: torch.device, micro_batch: int, accumulation: int, compiled: bool
    ) -> None:
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


def training_sections(
    report: Report,
    config: Config,
    steps: int,
    warmup: int,
    hf: bool,
    gemm_seconds: float,
    compiled: bool = False,
) -> Run | None:
    """Parts 2, 3 and 5 into `report` (on the device ParallelContext picks); femtotron's run, for part 4."""
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    ours = report.attempt("the femtotron run", lambda: run_femtotron(config, steps, warmup))
    theirs = (
        report.attempt("the HF transformers baseline", lambda: run_hf(config, device, steps, warmup))
        if hf
        else None
    )
    ours_compiled = theirs_compiled = None
    if compiled:  # compiling happens in the warm-up steps (at least one), which are not timed
        with_compile = config.model_copy(update={"model": config.model.model_copy(update={"compile": True})})
        ours_compiled = report.attempt(
            "the femtotron run with model.compile", lambda: run_femtotron(with_compile, steps, max(warmup, 1))
        )
        theirs_compiled = (
            report.attempt(
                "the HF transformers baseline compiled",
                lambda: run_hf(config, device, steps, max(warmup, 1), compiled=True),
            )
            if hf
            else None
        )
    (m, n, k), what = largest_matmul(config)
    gemm = matmul_flops_rate(m, n, k, torch.bfloat16, device, seconds=gemm_seconds)
    peak, peak_source = (
        peak_flops(device, torch.bfloat16, (m, n, k))
        if device.type == "cuda"
        else (None, "no GPU: no data sheet")
    )
    flops_per_token = config.model.model_config_.flops_per_token(config.tokens.sequence_length)
    rows = [("femtotron (synchronised wall clock)", ours and ours.tokens_per_second)]
    rows.append(("femtotron as it logs it (its own `step_seconds`)", ours and ours.logged_tokens_per_second))
    rows.append(("HF transformers `LlamaForCausalLM`", theirs and theirs.tokens_per_second))
    rows.append(
        ("femtotron compiled (`model.compile: true`)", ours_compiled and ours_compiled.tokens_per_second)
    )
    rows.append(
        ("HF transformers compiled (`torch.compile`)", theirs_compiled and theirs_compiled.tokens_per_second)
    )
    lines = [
        f"`{report.command}`: the model of `{CONFIG}` at dp = tp = pp = 1 in bf16 "
        f"({describe_shape(config)}), random tokens, {steps} timed steps after {warmup} warm-up step(s), "
        "the clock read after `torch.cuda.synchronize()`.",
        "",
        "| run | tokens/s | MFU against the data-sheet peak | model FLOP/s / measured GEMM |",
        "|---|---|---|---|",
    ]
    for label, rate in rows:
        if rate is not None:
            mfu = f"{rate * flops_per_token / peak:.1%}" if peak else "-"
            lines.append(f"| {label} | {rate:,.0f} | {mfu} | {rate * flops_per_token / gemm:.2f} |")
    lines += [
        "",
        f"- Model FLOPs per token: {flops_per_token / 1e9:.3g} GFLOP (`LlamaConfig.flops_per_token`).",
        f"- Peak: {f'{peak / 1e12:,.0f} TFLOP/s' if peak else 'none'} ({peak_source}; `metrics.peak_flops`).",
        f"- Measured GEMM: bf16 {m}x{k} -> {n} ({what}), {gemm / 1e12:.3g} TFLOP/s "
        "(`metrics.matmul_flops_rate`, best of 3 trials).",
    ]
    for name, a, b in (
        ("femtotron / HF", ours, theirs),
        ("femtotron compiled / HF", ours_compiled, theirs),
        ("femtotron compiled / HF compiled", ours_compiled, theirs_compiled),
    ):
        if a and b:
            lines.append(f"- **{name}: {a.tokens_per_second / b.tokens_per_second:.2f}x** tokens/s.")
    if theirs:
        lines.append(
            f"- HF baseline: transformers {package_version('transformers')}, sdpa attention, fp32 weights "
            "under bf16 autocast, `torch.optim.AdamW(fused=True)`, gradient clipping at 1.0; micro-batch "
            f"{theirs.micro_batch} x {theirs.accumulation} per step"
            + (" (halved after running out of memory)" if theirs.accumulation > 1 else "")
            + (f"; peak allocated {human(theirs.peak_bytes)}" if theirs.peak_bytes else "")
            + "."
        )
    for name, run in (("femtotron", ours), ("HF", theirs)):
        if run:
            lines.append(
                f"- {name} loss, first and last timed step: {run.losses[0]:.3f}, {run.losses[1]:.3f}."
            )
    report.sections.append(("Training throughput: femtotron against HF transformers", lines))
    return ours


MOE_SHAPE = dict(
    hidden_size=1024, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=8, vocab_size=32000
)
MOE = dict(num_experts=8, num_experts_per_tok=2, intermediate_size=2816, aux_loss_coef=0.0)
MOE_BATCH = (8, 1024)  # sequences, tokens each


def moe_section(report: Report, rounds: int, device: str = "cuda") -> None:
    """Part 6: bench/moe.py's three variants on the GPU in bf16."""
    import moe as moe_bench

    (batch, sequence), shape = MOE_BATCH, MOE_SHAPE
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
            f"- femtotron {ours * 1e3:.1f} ms, {label} {theirs * 1e3:.1f} ms: "
            f"**{statistics.median(ratios):.2f}x** (min {min(ratios):.2f}, max {max(ratios):.2f})"
        )
    report.sections.append(("Mixture of experts: step time against a loop and HF Mixtral", lines))


def memory_section(report: Report, config: Config, overrides: Sequence[str], run: Run | None) -> None:
    estimate = worst_stage(config, on_cpu=False)
    state = " + ".join(f"{k.replace('_', ' ')} {human(v)}" for k, v in estimate.state.items())
    doctor = shlex.join(["femtotron", "doctor", CONFIG, *ONE_GPU, *overrides])
    lines = [
        f"`{doctor}`: {human(estimate.total)} per rank = {state} + the activations' peak "
        f"{human(estimate.micro_batch_peak)} (`diagnostics.doctor.worst_stage`).",
    ]
    if run is not None and run.peak_bytes:
        lines.append(
            f"`{report.command}`: `torch.cuda.max_memory_allocated()` over the timed steps of the femtotron "
            f"run, less what was allocated before its Trainer: {human(run.peak_bytes)}; **estimate / "
            f"measured = {estimate.total / run.peak_bytes:.3f}**."
        )
    report.sections.append(("Memory: doctor's estimate against the measured peak", lines))


@dataclass
class TestRun:
    passed: int
    failed: list[str]  # "name: first line of the message"
    skipped: int
    seconds: float


def run_pytest(args: Sequence[str], timeout: float = PYTEST_TIMEOUT) -> TestRun:
    """`python -m pytest ARGS` in the repository, counted from its JUnit XML."""
    with tempfile.TemporaryDirectory() as tmp:
        xml = Path(tmp) / "junit.xml"
        start = time.perf_counter()
        # a test module that cannot be imported here is counted as an error; the others still run
        options = ["--continue-on-collection-errors", f"--junitxml={xml}", "-p", "no:cacheprovider"]
        done = subprocess.run(
            [sys.executable, "-m", "pytest", *args, *options],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if not xml.is_file():
            raise RuntimeError(
                f"pytest exited {done.returncode} without a report: {(done.stdout + done.stderr)[-500:]}"
            )
        cases = list(ElementTree.parse(xml).getroot().iter("testcase"))
    passed = skipped = 0
    failed = []
    for case in cases:
        outcome = {child.tag: child.get("message") or "" for child in case}
        name = f"{case.get('classname')}::{case.get('name')}"
        problem = outcome.get("failure", outcome.get("error"))
        if problem is not None:
            failed.append(f"{name}: {(problem.splitlines() or [''])[0][:300]}")
        elif "skipped" in outcome:
            skipped += 1
        else:
            passed += 1
    return TestRun(passed, failed, skipped, time.perf_counter() - start)


def tests_section(report: Report) -> None:
    if importlib.util.find_spec("pytest") is None:
        raise Skipped(f"pytest is not installed for {sys.executable}: skipped the CUDA-marked tests")
    result = run_pytest(PYTEST[2:])
    lines = [
        f"`python {shlex.join(PYTEST)}`: {result.passed} passed, {len(result.failed)} failed, "
        f"{result.skipped} skipped ({result.seconds:.0f} s)."
    ]
    if result.failed:
        report.failures.append(f"{len(result.failed)} CUDA-marked test(s) failed (listed above)")
        lines += ["", "Failed:", *(f"- `{failure}`" for failure in result.failed)]
    report.sections.append(("CUDA-marked tests", lines))


def package_version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def environment() -> list[str]:
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        memory, capability = props.total_memory / 2**30, f"{props.major}.{props.minor}"
        gpu = f"{props.name} ({memory:.1f} GiB, compute capability {capability})"
    else:
        gpu = "none (`torch.cuda.is_available()` is False)"
    return [
        f"- GPU: {gpu}",
        f"- torch {torch.__version__}, CUDA {torch.version.cuda or 'none (a CPU build of torch)'}, Python "
        f"{platform.python_version()}, transformers {package_version('transformers')}",
    ]


def write_report(path: Path, report: Report, seconds: float) -> None:
    date = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        "# GPU check",
        "",
        f"Written by `bench/gpu_check.py` (`make gpu-check`) on {date} in {seconds:.0f} s:",
        f"`{report.command}`.",
        "",
        *environment(),
    ]
    for title, body in report.sections:
        lines += ["", f"## {title}", "", *body]
    lines += ["", "## Skipped", "", *([f"- {line}" for line in report.skipped] or ["Nothing."])]
    if report.failures:
        lines += ["", "## Failed", "", *(f"- {line}" for line in report.failures)]
    with atomic_path(path) as tmp:
        Path(tmp).write_text("\n".join(lines) + "\n")


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    start, cuda = time.perf_counter(), torch.cuda.is_available()
    report = Report(shlex.join(["python", "bench/gpu_check.py", *argv]))
    no_cuda = "no CUDA device: skipped"
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as workdir:
        try:
            config = gpu_config(args.set, Path(workdir))
        except ConfigError as e:
            print(f"gpu_check: error in --set: {e}", file=sys.stderr)
            return 2
        if config.general.cuda_expandable_segments:  # as `femtotron train` does, before CUDA starts (M2)
            os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
        if args.skip_tests:
            report.skipped.append("--skip-tests: skipped the CUDA-marked tests")
        elif not cuda:
            report.skipped.append(f"{no_cuda} the CUDA-marked tests (`python {shlex.join(PYTEST)}`)")
        else:
            report.attempt("the CUDA-marked tests", lambda: tests_section(report))
        hf = not args.skip_hf and package_version("transformers") != "not installed"
        if args.skip_hf:
            report.skipped.append("--skip-hf: skipped the HF transformers baseline")
        elif not hf:
            report.skipped.append("transformers is not installed: skipped the HF transformers baseline")
        run = None
        if args.skip_compile:
            report.skipped.append("--skip-compile: skipped the compiled runs")
        if cuda:
            gemm_seconds = 0.1 if args.quick else 0.3
            run = report.attempt(
                "the training measurements",
                lambda: training_sections(
                    report, config, args.steps, args.warmup, hf, gemm_seconds, not args.skip_compile
                ),
            )
        else:
            report.skipped.append(
                f"{no_cuda} the femtotron run (tokens/s, MFU against the data-sheet peak and a measured GEMM)"
                + (", the HF transformers baseline" if hf else "")
                + " and the measured peak memory (`torch.cuda.max_memory_allocated`)"
            )
        report.attempt("doctor's memory estimate", lambda: memory_section(report, config, args.set, run))
        if cuda and hf:
            report.attempt("the mixture of experts", lambda: moe_section(report, 3 if args.quick else 10))
    write_report(args.out, report, time.perf_counter() - start)
    print(
        f"gpu_check: wrote {args.out}"
        + (f"; failed: {'; '.join(report.failures)}" if report.failures else "")
    )
    return 1 if report.failures else 0


if __name__ == "__main__":
    sys.exit(main())
