"""Run a function on N forked ranks with a real gloo process group, from inside pytest.

Each child gets RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT like torchrun would set, one thread, and
short timeouts. When a rank fails, the parent re-raises *that* rank's exception (the earliest
failure), not the "connection closed by peer" the other ranks see afterwards.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any


class RankFailed(AssertionError):
    pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(
    fn: Callable[..., Any], rank: int, world_size: int, port: int, results: Any, done: Any, args: tuple
) -> None:
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    import torch

    torch.set_num_threads(1)
    try:
        results.put((rank, time.monotonic(), "ok", fn(rank, *args)))
    except BaseException as e:  # noqa: BLE001 - every failure must reach the parent
        results.put((rank, time.monotonic(), "error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    # Tensors travel through shared memory owned by this process: stay alive until the parent has them.
    done.wait(timeout=60)


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 120.0) -> list[Any]:
    """Call `fn(rank, *args)` on `world_size` forked processes; return the results by rank."""
    ctx = mp.get_context("fork")
    results, done = ctx.Queue(), ctx.Event()
    port = free_port()
    procs = [
        ctx.Process(target=_child, args=(fn, r, world_size, port, results, done, args), daemon=True)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    outcomes: dict[int, tuple[float, str, Any]] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(outcomes) < world_size:
            try:
                rank, when, status, value = results.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                missing = sorted(set(range(world_size)) - set(outcomes))
                raise RankFailed(f"ranks {missing} did not finish within {timeout:g} s") from None
            outcomes[rank] = (when, status, value)
    finally:
        done.set()
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
    failures = sorted(
        (when, rank, value) for rank, (when, status, value) in outcomes.items() if status == "error"
    )
    if failures:
        _, rank, message = failures[0]
        raise RankFailed(f"rank {rank} failed first:\n{message}")
    return [outcomes[r][2] for r in range(world_size)]
