"""SIGTERM and SIGUSR1, what schedulers send before preempting a job, and Ctrl-C (SIGINT): training stops
cleanly.

While training, the signals only set a flag; the step in progress finishes, then every rank learns that
some rank was signalled (one all-reduce), all save a checkpoint and stop together (exit code 7). A second
Ctrl-C stops at once, saving nothing: the first one hands SIGINT back to the operating system's default.
"""

from __future__ import annotations

import os
import signal
import threading

import torch

from femtotron.parallel.context import ParallelContext

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)


def signal_name(signum: int) -> str:
    """ "SIGINT (Ctrl-C)", "SIGTERM": as a user sent it."""
    name = signal.Signals(signum).name
    return f"{name} (Ctrl-C)" if signum == signal.SIGINT else name


class StopSignals:
    """A context manager: inside it SIGTERM, SIGUSR1 and a first SIGINT are noted instead of ending the
    process (signal handlers belong to the main thread: elsewhere, e.g. in a test's thread, nothing changes).
    `announce`: say at once that the run will stop after this step (the rank that prints for the run)."""

    def __init__(self, announce: bool = True) -> None:
        self.announce = announce
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
        if signum != signal.SIGINT:
            return
        # The next Ctrl-C ends the process where it is, even inside a collective that never returns.
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        if self.announce:  # os.write: print() may be in the middle of a write this handler interrupted
            os.write(
                2,
                b"\nfemtotron: Ctrl-C: finishing this step, then saving a checkpoint and stopping "
                b"(Ctrl-C again to stop at once, saving nothing)\n",
            )

    def agreed(self, ctx: ParallelContext) -> int:
        """The signal any rank received (0: none). Every rank calls this at the same point of every step."""
        flag = torch.tensor(float(self.received or 0), device=ctx.device)
        # Signal numbers are positive, so the max over the ranks is 0 only when no rank was signalled.
        reduced = ctx.comm.all_reduce(flag, ctx.world_group, op="max")
        return int(ctx.comm.read(reduced, "stop signal"))
