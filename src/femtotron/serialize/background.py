"""checkpoints.async_save: training goes on while a checkpoint is written.

At a save step every rank copies its slices into host staging buffers (`Staging`: pinned on CUDA, so the
copy runs at the link's speed; kept from one save to the next), which is all the time training stops for.
A background thread then writes the rank's file and commits the checkpoint exactly as a synchronous save
does (`saving.finish_save`: same files, manifest and commit by rename), so nothing half-written is ever
taken as a checkpoint: a rank killed during the write leaves a `.tmp-step-*` that every reader ignores.

A thread, not a process: what it does is write(2), fsync(2) and XXH3 hashing (serialize/files.py), all of
which release the GIL, and it reads the staging buffers where they are; a process would need them copied
into shared memory and a second interpreter per rank. It talks to the rendezvous store through a
connection of its own, as the watchdog does.

One save at a time: the next save waits for the previous one before it copies into the same buffers, and so
do the run's end and a stop on SIGTERM/SIGUSR1. The training loop learns of a finished write between steps
(`finished`), without waiting; a write that failed stops the run at the next save or at the end, on every
rank together, as a failed synchronous save would have at once. After an exception the write is given up to
the collective timeout to finish, then left unfinished: its temporary directory is ignored.
"""

from __future__ import annotations

import os
import threading
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path

import torch

from femtotron.errors import ConfigError
from femtotron.parallel.context import ParallelContext
from femtotron.serialize import saving
from femtotron.serialize.files import Slice
from femtotron.store import Store
from femtotron.train_state import TrainingParts


def page_lock(buffer: torch.Tensor) -> None:
    """Pin `buffer` at exactly its size, as torch.distributed.checkpoint's staging does (cudaHostRegister).
    Not `pin_memory=True`: torch's pinned allocator rounds every request up to a power of two (torch 2.13:
    include/ATen/core/CachingHostAllocator.h lines 300-312; no size exempt by default, as
    c10/core/AllocatorConfig.h lines 361-363 set), which pins up to twice the bytes the host-memory
    check counts."""
    cudart = torch.cuda.cudart()
    # 1: cudaHostRegisterPortable, pinned for every CUDA context, whichever device is current here
    error = int(cudart.cudaHostRegister(buffer.data_ptr(), buffer.nbytes, 1))
    if error:
        raise ConfigError(
            f"checkpoints.async_save=true: the host could not page-lock {buffer.nbytes / 2**30:.2f} GiB of "
            f"{buffer.dtype} staging buffer (cudaHostRegister: CUDA error {error}). Fix: set "
            "checkpoints.async_save=false, or run fewer ranks per host"
        )
    # Unlocked before its memory is freed: a buffer outgrown by a larger save, or at exit.
    weakref.finalize(buffer, cudart.cudaHostUnregister, buffer.data_ptr())


class Staging:
    """Host buffers, one per dtype, that a save's slices are copied into; reused by every later save of the
    same sizes (a layout saves the same slices each time)."""

    def __init__(self, pinned: bool) -> None:
        self.pinned = pinned
        self.buffers: dict[torch.dtype, torch.Tensor] = {}

    def stage(self, slices: list[Slice]) -> list[Slice]:
        """The slices with their values copied into the buffers (grown when too small)."""
        needed: dict[torch.dtype, int] = {}
        for piece in slices:
            needed[piece.values.dtype] = needed.get(piece.values.dtype, 0) + piece.values.numel()
        for dtype, count in needed.items():
            if dtype not in self.buffers or self.buffers[dtype].numel() < count:
                # zeros: the pages are taken now (at `reserve`), not by the first save's copy
                self.buffers[dtype] = torch.zeros(count, dtype=dtype)
                if self.pinned and count:
                    page_lock(self.buffers[dtype])
        used = dict.fromkeys(needed, 0)
        staged = []
        for piece in slices:
            values = piece.values
            start = used[values.dtype]
            used[values.dtype] += values.numel()
            copy = self.buffers[values.dtype][start : used[values.dtype]].view(values.shape)
            copy.copy_(values, non_blocking=self.pinned)
            staged.append(piece._replace(values=copy))
        if self.pinned:
            torch.cuda.synchronize()  # the copies have landed before the writer reads them
        return staged

    def bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers.values())


@dataclass(frozen=True, kw_only=True)
class Written:
    """A save that committed (by rank 0; the others heard so)."""

    path: Path
    step: int
    stall_seconds: float  # training stopped: the staging copy and the barrier
    write_seconds: float  # the background write and commit
    warnings: list[str] = field(default_factory=list)


class BackgroundSaves:
    """The background writer of one rank (see the module's docstring)."""

    def __init__(self, ctx: ParallelContext) -> None:
        self.ctx = ctx
        self.staging = Staging(pinned=ctx.device.type == "cuda")
        self.store: Store | None = None  # the thread's own connection, made at the first save
        self.thread: threading.Thread | None = None
        self.outcome: Written | BaseException | None = None
        self.reported = True

    def reserve(self, parts: TrainingParts) -> None:
        """Take the staging buffers before step 1, so that the first save stops training no longer than the
        others, and a host short of memory fails now rather than at the first save."""
        self.staging.stage(saving.rank_slices(parts.model, parts.optimizer))

    def start(self, parts: TrainingParts) -> float:
        """Wait for the previous save (raising its failure), take this step's values, start writing them;
        return the seconds training stopped for."""
        self.wait()
        start = time.perf_counter()
        pending = saving.begin_save(parts, stage=self.staging.stage)
        stall = time.perf_counter() - start
        if self.store is None:
            self.store = self.ctx.store.for_another_thread()
        self.outcome = None
        self.reported = False
        self.thread = threading.Thread(
            target=self._write, args=(pending, parts.state.step, stall), name="checkpoint-writer", daemon=True
        )
        self.thread.start()
        return stall

    def _write(self, pending: saving.PendingSave, step: int, stall: float) -> None:
        # The lowest CPU priority, for this thread alone (Linux): where training keeps every core busy (a CPU
        # run) the write takes the cores' idle moments instead of slowing the steps.
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        start = time.perf_counter()
        try:
            path, warnings = saving.finish_save(pending, self.store)
        except BaseException as e:  # noqa: BLE001 - the training thread raises it at the next wait
            self.outcome = e
            return
        seconds = time.perf_counter() - start
        self.outcome = Written(
            path=path, step=step, stall_seconds=stall, write_seconds=seconds, warnings=warnings
        )

    def finished(self) -> Written | None:
        """The save that finished since the last call, without waiting (a failure waits for `wait`)."""
        if self.reported or self.thread is None or self.thread.is_alive():
            return None
        if isinstance(self.outcome, Written):
            self.reported = True
            return self.outcome
        return None

    def wait(self) -> Written | None:
        """Wait for the save in flight; its result if not yet reported by `finished`. Its failure raises."""
        if self.thread is None:
            return None
        self.thread.join()
        self.thread = None
        if isinstance(self.outcome, BaseException):
            raise self.outcome
        was_reported = self.reported
        self.reported = True
        return None if was_reported else self.outcome

    def abandon(self) -> None:
        """After an exception: give the write up to the collective timeout, then leave it unfinished."""
        if self.thread is not None:
            self.thread.join(self.ctx.collective_timeout_seconds)
            self.thread = None


def available_host_bytes() -> int:
    """The memory this process may still take: the kernel's MemAvailable, or less under a cgroup's limit (a
    container or a Slurm job)."""
    meminfo = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
    available = int(meminfo["MemAvailable"].split()[0]) * 1024
    limit = Path("/sys/fs/cgroup/memory.max")
    current = Path("/sys/fs/cgroup/memory.current")
    if limit.is_file() and current.is_file() and limit.read_text().strip() != "max":
        available = min(available, int(limit.read_text()) - int(current.read_text()))
    return available


def staging_shortfall(per_rank: int, ranks_here: int, available: int) -> str | None:
    """Why this host cannot hold the staging buffers of its ranks, with the fix; None when it can."""
    if per_rank * ranks_here <= available:
        return None
    gib = 2**30
    return (
        f"checkpoints.async_save=true stages each save in host memory: {per_rank / gib:.2f} GiB per rank, "
        f"{per_rank * ranks_here / gib:.2f} GiB for the {ranks_here} rank(s) on this host, which has "
        f"{available / gib:.2f} GiB available. Fix: set checkpoints.async_save=false (a synchronous save "
        "stages nothing), or shard the optimizer state over more ranks (optimizer.zero_stage, "
        "parallelism.dp) or run fewer ranks per host"
    )


def check_host_memory(parts: TrainingParts) -> None:
    """Refuse, on every rank together and before step 1, a host without room for its ranks' staging."""
    ctx = parts.ctx
    here = ctx.hosts.count(ctx.hosts[ctx.rank])
    problem = staging_shortfall(
        parts.model.data_parallel.state.checkpoint_bytes(), here, available_host_bytes()
    )
    short = torch.tensor(float(problem is not None), device=ctx.device)
    ctx.comm.all_reduce(short, ctx.world_group, op="max")
    if problem is not None:
        raise ConfigError(f"{problem}.")
    if short.item():
        raise ConfigError(
            "checkpoints.async_save=true: another host has no room for its ranks' staging buffers; its "
            "rank's error says how much. Fix: set checkpoints.async_save=false."
        )
