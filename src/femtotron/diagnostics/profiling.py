"""profiling.profile_steps: [first, last] wraps those training steps in torch.profiler and writes one Chrome
trace per rank, <run dir>/profile/rank-R.json (chrome://tracing or ui.perfetto.dev). On CUDA also the
allocator's history over those steps, rank-R-memory.pickle, and its state when a step runs out of memory,
rank-R-oom.pickle (both for pytorch.org/memory_viz)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from femtotron.errors import OutOfMemory

if TYPE_CHECKING:
    from femtotron.config import Config
    from femtotron.parallel.context import ParallelContext
    from femtotron.run_log import RunLog

HISTORY_ENTRIES = 100_000  # allocations and frees kept in the CUDA memory history


class StepProfiler:
    def __init__(self, config: Config, ctx: ParallelContext, log: RunLog) -> None:
        steps = config.profiling.profile_steps
        if steps:
            self.first = steps[0]
            self.last = min(steps[1], config.tokens.train_steps)
        else:  # an empty range: no step is profiled
            self.first = 0
            self.last = -1
        self.out_dir = config.run_dir / "profile"
        self.rank = ctx.rank
        self.log = log
        self.cuda = ctx.device.type == "cuda"
        self.profiler: torch.profiler.profile | None = None

    @contextmanager
    def step(self, step: int) -> Iterator[None]:
        """Around one training step: starts profiling at the first step of the range (or the first step a
        resumed run takes in it), writes the files after the last."""
        if self.first <= step <= self.last and self.profiler is None:
            self.start()
        labelled = torch.profiler.record_function(f"step {step}") if self.profiler else nullcontext()
        try:
            with labelled:
                yield
        except OutOfMemory as e:
            if self.cuda:
                path = self.memory_snapshot("oom")
                e.args = (
                    f"{e}\nThe allocator's state at the failure: {path} (open it in "
                    "https://pytorch.org/memory_viz).",
                )
            raise
        if step == self.last:
            self.stop()

    def start(self) -> None:
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.cuda:
            activities.append(torch.profiler.ProfilerActivity.CUDA)
            torch.cuda.memory._record_memory_history(max_entries=HISTORY_ENTRIES)
        self.profiler = torch.profiler.profile(activities=activities, record_shapes=True, profile_memory=True)
        self.profiler.start()

    def stop(self) -> None:
        self.profiler.stop()
        self.out_dir.mkdir(parents=True, exist_ok=True)
        trace = self.out_dir / f"rank-{self.rank}.json"
        self.profiler.export_chrome_trace(str(trace))
        self.profiler = None
        written = [trace]
        if self.cuda:
            written.append(self.memory_snapshot("memory"))
            torch.cuda.memory._record_memory_history(enabled=None)
        names = ", ".join(p.name for p in written)
        self.log.info(f"profiled steps {self.first}-{self.last}: {names} in {self.out_dir}")

    def memory_snapshot(self, what: str) -> Path:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        path = self.out_dir / f"rank-{self.rank}-{what}.pickle"
        torch.cuda.memory._dump_snapshot(str(path))
        return path
