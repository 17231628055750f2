"""Named places where a test kills this process with SIGKILL, to prove that a crash there loses nothing.

A test sets FEMTOTRON_CRASH_AT to a point's name, and FEMTOTRON_CRASH_RANK to kill only that rank
(RANK as torchrun sets it; a process without RANK is rank 0). In a normal run neither is set and a
point costs one environment lookup. SIGKILL, not an exception: nothing in this process gets to
clean up, as after `kill -9`, an OOM kill or a node losing power.
"""

from __future__ import annotations

import os
import signal


def crash_point(name: str) -> None:
    """Die here, at once, if a test asked for a crash at `name` (on this rank)."""
    if os.environ.get("FEMTOTRON_CRASH_AT") != name:
        return
    wanted_rank = os.environ.get("FEMTOTRON_CRASH_RANK")
    if wanted_rank is not None and wanted_rank != os.environ.get("RANK", "0"):
        return
    os.kill(os.getpid(), signal.SIGKILL)
