"""One run at a time in a run directory: a second `femtotron train` on it is refused, naming the first.

Two runs on one directory would delete each other's checkpoints mid-write, resume each other's live
checkpoints and interleave their metrics. The lock is `flock` on `<run dir>/.femtotron.lock`, held for
the run's whole life; the kernel releases it when the process ends however it ends (kill -9 included),
so a crashed run leaves no stale lock. The file holds the holder's host, pid and start time, for the
refusal. `femtotron train` without a launcher takes it before it starts the ranks, which find
FEMTOTRON_RUN_LOCKED set; under torchrun or srun rank 0 takes it and tells the others through the store,
so that every rank stops together when another run holds it.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

from femtotron.errors import ConfigError
from femtotron.store import Store

LOCK_FILE = ".femtotron.lock"
LOCKED_ENV = "FEMTOTRON_RUN_LOCKED"  # set while held: the processes this one starts are part of its run


@contextmanager
def run_lock(run_dir: Path) -> Iterator[None]:
    """Hold `run_dir`'s lock while the block runs; a ConfigError naming the holder when another run has it.
    Inside a run that holds it already (LOCKED_ENV) this does nothing."""
    if os.environ.get(LOCKED_ENV):
        yield
        return
    path = run_dir / LOCK_FILE
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        # O_NOFOLLOW: a link planted in a downloaded run directory is refused, not followed.
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    except OSError as e:
        raise ConfigError(
            f"cannot open the run's lock file {path} ({type(e).__name__}: {e}). Check that the run directory "
            "is writable and that the lock file is a plain file (remove it if it is a link)."
        ) from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ConfigError(refusal(path, os.pread(fd, 4096, 0))) from None
        holder = {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "started": time.strftime("%Y-%m-%d %H:%M:%S"),
        }
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(holder).encode(), 0)
        os.environ[LOCKED_ENV] = str(path)
        try:
            yield
        finally:
            del os.environ[LOCKED_ENV]
    finally:
        os.close(fd)  # releases the lock


def refusal(path: Path, written: bytes) -> str:
    """The message for a run directory another run holds, from what its holder wrote into the lock file."""
    try:
        holder = json.loads(written)
        who = f"process {holder['pid']} on host {holder['host']} (started {holder['started']})"
    except (ValueError, TypeError, KeyError, RecursionError):
        who = "another process (its details are not written yet)"
    return (
        f"the run directory {path.parent} is in use by {who}: it holds {path}. Two runs in one directory "
        "would overwrite each other's checkpoints and metrics. Wait for that run to end (or stop it), or "
        "give this run another general.run."
    )


@contextmanager
def held_by_rank_0(run_dir: Path, store: Store, rank: int, timeout: float) -> Iterator[None]:
    """`run_lock` taken by rank 0 alone, its outcome posted to every rank: all go on, or all stop with the
    holder named."""
    key = store.fresh_key("run-lock")
    if rank != 0:
        outcome = store.collect([key], timeout).get(
            key, f"rank {rank}: no word from rank 0 on the run's lock"
        )
        if outcome != "ok":
            raise ConfigError(outcome)
        yield
        return
    with ExitStack() as held:
        try:
            held.enter_context(run_lock(run_dir))
        except ConfigError as e:
            store.post(key, str(e))
            raise
        store.post(key, "ok")
        yield
