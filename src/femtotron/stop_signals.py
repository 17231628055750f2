"""SIGTERM and SIGUSR1, what schedulers send before preempting a job: training stops cleanly.

While training, the signals only set a flag; the step in progress finishes, then every rank learns that
some rank was signalled (one all-reduce), all save a checkpoint and stop together (exit code 7).
"""

from __future__ import annotations

import signal
import threading

import torch

from femtotron.parallel.context import ParallelContext

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class StopSignals:
    """A context manager: inside it SIGTERM and SIGUSR1 are noted instead of ending the process (signal
    handlers belong to the main thread: elsewhere, e.g. in a test's thread, nothing changes)."""

    def __init__(self) -> None:
        self.received: int | None = None
        self._previous: dict[int, object] = {}

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            self._previous = {sig: signal.signal(sig, self._note) for sig in STOP_SIGNALS}
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _note(self, signum: int, _frame: object) -> None:
        self.received = signum

    def agreed(self, ctx: ParallelContext) -> int:
        """The signal any rank received (0: none). Every rank calls this at the same point of every step."""
        flag = torch.tensor(float(self.received or 0), device=ctx.device)
        # Signal numbers are positive, so the max over the ranks is 0 only when no rank was signalled.
        reduced = ctx.comm.all_reduce(flag, ctx.world_group, op="max")
        return int(ctx.comm.read(reduced, "stop signal"))
