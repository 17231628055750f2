"""The run's log: console lines prefixed by the rank (`[rank 3 dp1 tp1 pp0]`), and one JSON record per
logged step in metrics.jsonl, kept by a resumed run up to its step and appended to: each step once, in order.
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from femtotron.atomic import atomic_path
from femtotron.config import Config
from femtotron.dashboards import Dashboards
from femtotron.mesh import NAMED
from femtotron.metrics import describe_memory, memory_gib, peak_flops
from femtotron.parallel.context import ParallelContext


class RunLog:
    """Rank-prefixed console lines, and metrics.jsonl, written by the rank that owns the logged loss (and
    copied to TensorBoard or W&B by `dashboards`)."""

    dashboards: Dashboards | None = None

    def __init__(
        self, prefix: str, run_dir: Path, *, is_main: bool, console: bool = True, level: str = "info"
    ) -> None:
        self.prefix = prefix
        self.is_main = is_main
        self.console = console
        self.level = level
        self.metrics_path = run_dir / "metrics.jsonl"

    def start_at(self, step: int) -> None:
        """The run (re)starts after `step`: keep the records up to it, drop those of later steps (logged by an
        attempt that died before its next checkpoint). Called only once training is known to start."""
        if not self.is_main:
            return
        if self.dashboards:
            self.dashboards.open(step)
        lines = self.metrics_path.read_text().splitlines() if self.metrics_path.is_file() else []
        kept = [line for line in lines if _step_of(line) <= step]
        with atomic_path(self.metrics_path) as tmp:
            Path(tmp).write_text("".join(f"{line}\n" for line in kept))

    def info(self, message: str, every_rank: bool = False) -> None:
        """Print on the main rank (all with `every_rank` or at level debug); tqdm.write keeps the bar."""
        shown_here = self.is_main or every_rank or self.level == "debug"
        if self.console and self.level in ("debug", "info") and shown_here:
            self._write(message)

    def warn(self, message: str) -> None:
        if self.console and self.level != "error" and (self.is_main or self.level == "debug"):
            self._write(f"WARNING: {message}")

    def _write(self, message: str) -> None:
        tqdm.write("\n".join(f"{self.prefix} {line}" for line in message.splitlines()), file=sys.stdout)

    def record(self, values: dict[str, Any]) -> None:
        if self.is_main:
            self.metrics_path.parent.mkdir(parents=True, exist_ok=True)
            with self.metrics_path.open("a") as f:
                f.write(json.dumps(values) + "\n")
            if self.dashboards:
                self.dashboards.write(values)

    def close(self) -> None:
        if self.dashboards:
            self.dashboards.close()


@dataclass(kw_only=True)
class StepResult:
    loss: float
    grad_norm: float
    lr: float
    tokens: int
    seconds: float
    comm_seconds: dict[str, float]  # group kind ("tp", "dp", ...) -> seconds in its collectives
    loss_scale: float | None = None  # fp16: the scale the next step uses (after this step's update)
    skipped: bool = False  # the optimizer step was skipped (fp16 overflow, or on_non_finite=skip)
    moe: dict[str, float] = field(default_factory=dict)  # a mixture of experts' `moe/` metrics


# Shown whatever logging.iteration_step_info_interval says: a run (or a resumed one) shows at once that it
# trains, and how fast, before the first interval ends.
FIRST_STEPS_SHOWN = 5


@dataclass(kw_only=True)
class StepLogger:
    """Turns a step's result into its metrics.jsonl record and console line, every `interval` steps (and the
    first steps this process runs and the last step: the first loss should be near ln(vocab_size), a quick
    check the data is sane)."""

    log: RunLog
    train_steps: int
    interval: int
    world_size: int
    device: torch.device
    flops_per_token: float
    peak_flops: float
    peak_source: str
    steps_run: int = 0  # by this process
    timed_seconds: float = 0.0  # of those steps after this process's first, which pays for warming up

    @classmethod
    def for_run(
        cls, config: Config, ctx: ParallelContext, log: RunLog, matmul_dtype: torch.dtype
    ) -> StepLogger:
        """MFU against the peak of the matmul the model runs most: its largest weight times a micro-batch.
        Rank 0 measures it (where it is not a data sheet's) while the other ranks wait, so that no other
        rank of this run loads the machine meanwhile; they take its figure, the one the run's MFU is logged
        with."""
        tokens = config.tokens
        mcfg = config.model.model_config_
        rows = tokens.micro_batch_size * tokens.sequence_length
        columns = max(mcfg.intermediate_size, mcfg.vocab_size)
        peak = 0.0
        source = "measured by rank 0"
        if ctx.rank == 0:
            peak, source = peak_flops(ctx.device, matmul_dtype, (rows, columns, mcfg.hidden_size))
        measured = torch.tensor(peak, dtype=torch.float64, device=ctx.device)
        peak = ctx.comm.read(ctx.comm.all_reduce(measured, ctx.world_group, op="max"), "MFU yardstick")
        return cls(
            log=log,
            train_steps=tokens.train_steps,
            interval=config.logging.iteration_step_info_interval,
            world_size=ctx.world_size,
            device=ctx.device,
            flops_per_token=mcfg.flops_per_token(tokens.sequence_length),
            peak_flops=peak,
            peak_source=source,
        )

    @property
    def yardstick(self) -> str:
        return f"{self.peak_flops / 1e12:.2f} TFLOP/s ({self.peak_source})"

    def __call__(
        self, step: int, result: StepResult, *, consumed_tokens: int, skipped_steps: int | None = None
    ) -> None:
        """Called after every step. `consumed_tokens`: the run's, up to this step; `skipped_steps`: fp16 only,
        the overflowed steps so far."""
        self.steps_run += 1
        if self.steps_run > 1:
            self.timed_seconds += result.seconds
        shown = self.steps_run <= FIRST_STEPS_SHOWN or step % self.interval == 0 or step == self.train_steps
        if not shown:
            return
        seconds_per_step = self.timed_seconds / (self.steps_run - 1) if self.steps_run > 1 else result.seconds
        eta_seconds = (self.train_steps - step) * seconds_per_step
        eta = timedelta(seconds=round(eta_seconds))  # "0:03:44", "2 days, 4:00:00"
        tokens_per_sec = result.tokens / result.seconds
        achieved = tokens_per_sec * self.flops_per_token / self.world_size
        record = {
            "step": step,
            "loss": result.loss,
            "lr": result.lr,
            "grad_norm": result.grad_norm if math.isfinite(result.grad_norm) else None,  # None: skipped
            "consumed_tokens": consumed_tokens,
            "tokens_per_sec": tokens_per_sec,
            "tokens_per_sec_per_device": tokens_per_sec / self.world_size,
            "model_tflops_per_device": achieved / 1e12,
            "mfu": achieved / self.peak_flops,
            "step_seconds": result.seconds,
            "eta_seconds": eta_seconds,
            **memory_gib(self.device),
            **{f"{kind}_comm_share": s / result.seconds for kind, s in result.comm_seconds.items()},
            **result.moe,
        }
        if skipped_steps is not None:
            record.update(loss_scale=result.loss_scale, skipped_steps=skipped_steps)
        self.log.record(record)
        # The console names the time in each dimension's collectives (dp_cp's counts as dp's), not in the
        # groups that are only bookkeeping (mp, embedding, edp).
        comm = "".join(
            f" | {kind} comm {seconds / result.seconds:.0%}"
            for kind, seconds in result.comm_seconds.items()
            if kind.split("_")[0] in NAMED
        )
        if result.moe:
            comm += f" | moe aux {result.moe['moe/aux_loss']:.3f}"
        self.log.info(
            f"step {step}/{self.train_steps} | loss {result.loss:.4f} | lr {result.lr:.3e} | grad_norm "
            f"{result.grad_norm:.3f} | {result.seconds * 1000:,.0f} ms | ETA {eta} | {consumed_tokens:,} "
            f"tokens | {tokens_per_sec:,.0f} tok/s | {achieved / 1e12:.2f} TFLOP/s | MFU "
            f"{record['mfu']:.1%} | mem {describe_memory(record)}{comm}"
            + (f" | loss scale {result.loss_scale:g}" if skipped_steps is not None else "")
            + (" | step skipped" if result.skipped else "")
        )


def _step_of(line: str) -> float:
    """The step a metrics.jsonl line records; infinite (dropped) for a line cut short by a killed process."""
    try:
        return json.loads(line)["step"]
    except (ValueError, KeyError, TypeError):
        return float("inf")
