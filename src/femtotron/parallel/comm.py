"""Every torch.distributed collective and point-to-point op of femtotron, behind one class: `Comm`.

Process groups are made in parallel/context.py and messages through the rendezvous store go through
store.py; nothing else calls torch.distributed. Everything the library knows about its own
communication is learnt at this one door. `Comm` counts the calls and the bytes this rank sends per (group
kind, op kind), so tests and benchmarks know the exact communication volume. It times each group kind, so
the trainer can log the share of a step spent in, say, tensor-parallel communication. It keeps every op
until the op has completed, so a hang reads "rank 3 waits in all_reduce on tp[2,3] for a (4, 256) bfloat16
tensor". An op issued anywhere else would be missing from all three, and the NCCL emulation below would not
apply to it.

On NCCL a call returns as soon as its op is queued on the GPU, and so does a wait on its work. What a rank
waits for is then not the call it is in but its oldest op not yet complete. `unfinished` finds those ops by
polling each one's work without blocking, from any thread. The places where the host waits for the device
(reading a loss, the end of a step) are recorded as ops too (`read`, `synchronize`), because that is where
a stuck collective holds the host up.

The watchdog (diagnostics/watchdog.py) reads `unfinished` and `last_op` from a thread of its own every few
seconds and publishes them through the store. Once an op is older than parallelism.hang_timeout_seconds, it
ends the job with one report of what every rank waits on. The process groups themselves give up after
parallelism.collective_timeout_seconds (set in parallel/context.py). An op that fails then, or for any
other reason, is raised here as a DistributedError that names the op (`collective_failed`). Running out of
memory is no collective's fault, so that error passes through unwrapped.

Tests run on CPUs with gloo, which forgives what NCCL does not: code that passes there can read stale data
or hang on GPUs. With `FEMTOTRON_EMULATE_NCCL=1` (or `Comm(emulate_nccl=True)`) gloo behaves as NCCL in
three ways, so those bugs fail on a CPU too. First, the result of an op started without waiting (`start_*`)
reaches its tensor only at the wait. The op runs on private buffers, and the caller's tensors hold NaN until
then (`_Delayed`), so reading one early shows. Second, a send completes only once its receive is posted.
That is gloo's own rule and NCCL's for large messages, so it needs no code: a schedule whose send waits on
a receive posted later deadlocks on both. Third, NCCL connects two ranks lazily, on their first transfer on
a communicator, and the host blocks in that set-up until the peer posts its own first transfer on the same
communicator (NVIDIA/nccl#783). Gloo connects every pair when it makes the group, so first transfers posted
in a cycle (every pipeline stage sending first) pass on a CPU and hang on GPUs. `_connect` emulates the
set-up per communicator rather than per group kind, because kinds with equal ranks share one process group.

The connection set-up is emulated through the store. Each rank posts that it has reached its first transfer
with a peer, then waits for the peer's post. The store lies outside the process groups, so the handshake
adds no transfer to the communicator it models, and it stays reachable when collectives are stuck. A rank
that waits there longer than `connect_timeout` (the collective timeout) raises an error naming the pair and
the group, where NCCL would hang forever. `connect` makes every link's first transfer at start-up, in the
order every rank created the links, so that on NCCL no later transfer waits for a connection. A `Comm`
without a store (one made apart, as tests and memory estimates do) has nothing to meet at, and its first
transfers are not held back.

Bytes are what a ring algorithm sends from this rank: all_reduce 2(n-1)/n of the tensor, all_gather and
reduce_scatter (n-1)/n of the full tensor, send the tensor itself, all_to_all the rows it sends to the other
ranks. On the meta device (memory estimates: shapes without data) every collective only produces its
output's shape.
"""

from __future__ import annotations

import math
import os
import threading
import time
from collections import Counter, defaultdict, deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Self

import torch
import torch.distributed as dist

from femtotron.atomic import atomic_path
from femtotron.errors import DistributedError, is_out_of_memory

if TYPE_CHECKING:
    from femtotron.store import Store

Work = Any  # what an op started without waiting returns: a torch.distributed Work, or one of the below
EMULATE_NCCL = "FEMTOTRON_EMULATE_NCCL"
# The tag of a link's first transfer (`Comm.connect`), apart from the pipeline's and the ring's.
CONNECT_TAG = 2**31 - 1
# On CUDA, collectives are timed (two events per op, which cost host time) on one step in this many.
CUDA_TIMING_EVERY = 10


@dataclass(frozen=True)
class Group:
    """A process group together with its global ranks and a readable name such as `tp[2,3]`."""

    kind: str
    ranks: tuple[int, ...]
    handle: dist.ProcessGroup | None = field(default=None, compare=False)
    one_way: bool = False  # carries transfers from ranks[0] to ranks[1] only: named `pp[0->1]`

    @property
    def size(self) -> int:
        return len(self.ranks)

    @property
    def name(self) -> str:
        return f"{self.kind}[{('->' if self.one_way else ',').join(map(str, self.ranks))}]"


@dataclass(frozen=True)
class GroupMember:
    """This rank's place in one group of a parallel dimension (tp, cp, ep: `KIND`), as its layers use it."""

    KIND: ClassVar[str]
    comm: Comm
    group: Group
    rank: int

    @property
    def size(self) -> int:
        return self.group.size

    @classmethod
    def single(cls) -> Self:
        """The dimension at size 1: every collective over it returns at once."""
        return cls(Comm(), Group(cls.KIND, (0,)), 0)


@dataclass(kw_only=True)
class OpInFlight:
    kind: str
    group: str | None  # None: the host waits for its own device
    peer: int | None
    shape: tuple[int, ...]
    dtype: str
    started: float


class _Slot:
    """An issued op, as its start's work: complete on the backend's word or once waited for on the host (a
    CPU wait blocks to the end; gloo's word can lag), never if failed. Waited for once (twice can block)."""

    def __init__(self, on_host: bool) -> None:
        self.on_host = on_host
        self.work: Work | None = None
        self.waited = False
        self.failed = False

    def wait(self) -> bool:
        if not self.waited:
            self.work.wait()
            self.waited = True
        return True

    def is_completed(self) -> bool:
        done = (self.waited and self.on_host) or (self.work is not None and self.work.is_completed())
        return done and not self.failed


class _Delayed:
    """NCCL emulation: the op runs on private buffers; its result reaches `output` at the wait, and until then
    the caller's tensors hold NaN, so reading one early shows. A separate source gets its values back at the
    wait (ZeRO-3's parameter shards outlive their all-gathers); one written meanwhile loses the write, as a
    buffer NCCL is still reading would be undefined."""

    def __init__(
        self,
        work: Work,
        output: torch.Tensor,
        result: torch.Tensor,
        source: tuple[torch.Tensor, torch.Tensor] | None,
    ):
        self.work = work
        self.output = output
        self.result = result
        self.source = source
        for tensor in (output, *(source[:1] if source else ())):
            if tensor.is_floating_point():
                tensor.fill_(float("nan"))

    def wait(self) -> bool:
        self.work.wait()
        if self.source is not None:
            caller, values = self.source
            caller.copy_(values)
        self.output.copy_(self.result)
        return True

    def is_completed(self) -> bool:
        return self.work.is_completed()


class Comm:
    """Collectives over `Group`s. A group of one rank is a no-op, so a world of 1 needs no init. `store`: the
    rendezvous store, through which the NCCL emulation makes a pair's first transfer wait for the peer's,
    for at most `connect_timeout` seconds (then it raises, where NCCL would hang)."""

    def __init__(
        self, emulate_nccl: bool | None = None, store: Store | None = None, connect_timeout: float = 600.0
    ) -> None:
        if emulate_nccl is None:
            emulate_nccl = os.environ.get(EMULATE_NCCL) == "1"
        self.emulate_nccl = emulate_nccl
        self.store = store
        self.connect_timeout = connect_timeout
        self._connected: set[tuple[str, int]] = set()  # (communicator, peer) pairs already connected
        self.bytes_sent: Counter[tuple[str, str]] = Counter()  # (group kind, op kind) -> bytes
        self.calls: Counter[tuple[str, str]] = Counter()
        self._seconds: Counter[str] = Counter()  # group kind -> seconds in collectives
        self._pending_events: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []
        self._time_cuda = True
        # Per group (None: the host's waits), oldest first, the ops not yet seen complete. A group's ops
        # complete in order (one NCCL stream each), so dropping the finished ones from the front keeps no
        # finished op's work, and with it its tensors, alive for long.
        self._issued: defaultdict[str | None, deque[tuple[OpInFlight, _Slot]]] = defaultdict(deque)
        self._lock = threading.Lock()  # the watchdog thread reads `_issued`
        self.last_op: OpInFlight | None = None  # the op issued last, finished or not

    def unfinished(self, limit: int = 4) -> list[OpInFlight]:
        """The oldest ops this rank issued that have not completed, oldest first: polled without blocking,
        from any thread. An op that failed stays, for the reports."""
        with self._lock:
            for issued in self._issued.values():
                _drop_finished(issued)
            kept = [entry for issued in self._issued.values() for entry in issued]
        ops = [op for op, slot in kept if not slot.is_completed()]  # gloo may finish out of order
        return sorted(ops, key=lambda op: op.started)[:limit]

    def new_step(self, step: int) -> None:
        """On CUDA, collectives are timed on every CUDA_TIMING_EVERY-th step only, the first one included."""
        self._time_cuda = step % CUDA_TIMING_EVERY == 1

    @contextmanager
    def _record(
        self,
        kind: str,
        group: Group | None,
        tensor: torch.Tensor,
        sent: float = 0,
        peer: int | None = None,
        track: bool = True,
    ) -> Iterator[_Slot]:
        """Around issuing one op: the body puts its work in the yielded slot. group None: the host waits for
        its device (no op counted). `track`: kept until complete (a wait is not: what it awaits is)."""
        name = group and group.name
        op = OpInFlight(
            kind=kind,
            group=name,
            peer=peer,
            shape=tuple(tensor.shape),
            dtype=str(tensor.dtype),
            started=time.monotonic(),
        )
        slot = _Slot(on_host=not tensor.is_cuda)
        with self._lock:
            issued = self._issued[op.group]
            _drop_finished(issued)
            if track:
                issued.append((op, slot))
        self.last_op = op
        # On CUDA a call returns before the transfer ends: time it with events on the stream.
        timed_on_cuda = tensor.is_cuda and self._time_cuda and group is not None
        events = [torch.cuda.Event(enable_timing=True) for _ in range(2)] if timed_on_cuda else []
        if events:
            events[0].record()
        start = time.perf_counter()
        try:
            yield slot
        except RuntimeError as e:  # torch's DistBackendError and gloo's transport errors are RuntimeErrors
            slot.failed = True
            if is_out_of_memory(e) or group is None:  # not a collective's fault
                raise
            raise collective_failed(op, e) from None
        except BaseException:
            slot.failed = True
            raise
        if group is None:  # the host's wait is over: so is whatever it waited for
            slot.on_host = True
            slot.waited = True
            return
        if events:
            events[1].record()
            self._pending_events.append((group.kind, events[0], events[1]))
        elif not tensor.is_cuda:
            self._seconds[group.kind] += time.perf_counter() - start
        self.calls[group.kind, kind] += 1
        self.bytes_sent[group.kind, kind] += int(sent)

    def _issue(
        self,
        kind: str,
        group: Group,
        output: torch.Tensor,
        sent: float,
        launch: Callable[[torch.Tensor, torch.Tensor | None], Work],
        source: torch.Tensor | None = None,
        *,
        wait: bool = False,
        peer: int | None = None,
    ) -> Work:
        """Issue `launch(output, source)` (source None: in place on `output`) as one recorded op; return its
        work; `wait`: as a blocking call (on GPUs the compute stream waits for it, the host does not)."""
        recorded = output if source is None else source
        with self._record(kind, group, recorded, sent, peer) as slot:
            if self.emulate_nccl and not wait and kind != "send":
                private = output.clone() if source is None else torch.empty_like(output)
                private_source = None if source is None else source.clone()
                work = launch(private, private_source)
                kept = None if source is None else (source, private_source)
                slot.work = _Delayed(work, output=output, result=private, source=kept)
            else:
                slot.work = launch(output, source)
            if wait:
                slot.wait()
        return slot

    def take_seconds(self) -> dict[str, float]:
        """Seconds spent in collectives per group kind since the last call (waits for CUDA ones)."""
        if self._pending_events:
            self._pending_events[-1][2].synchronize()  # the stream's last event: all earlier ones are done
        for kind, begin, end in self._pending_events:
            self._seconds[kind] += begin.elapsed_time(end) / 1000
        self._pending_events.clear()
        seconds = dict(self._seconds)
        self._seconds = Counter()
        return seconds

    def read(self, tensor: torch.Tensor, what: str) -> float:
        """`tensor.item()`, recorded as the host waiting for the device (where stuck collectives block)."""
        with self._record(f"wait for the device ({what})", None, tensor):
            return tensor.item()

    def synchronize(self, device: torch.device) -> None:
        """Wait until the device has done all the work queued so far (a step's end, so its time is true)."""
        if device.type == "cuda":
            with self._record("wait for the device (end of step)", None, torch.empty(0)):
                torch.cuda.synchronize(device)

    def all_reduce(self, tensor: torch.Tensor, group: Group, op: str = "sum") -> torch.Tensor:
        """In-place reduction across `group`; `op` is "sum", "max" or "avg". On the meta device (memory
        estimates: shapes without data) every collective only produces its output's shape."""
        if group.size == 1 or tensor.is_meta:
            return tensor
        n = group.size
        reduce = _reduce_into(group, "sum" if op == "avg" else op)  # avg: a sum, divided below
        sent = 2 * (n - 1) / n * _nbytes(tensor)
        self._issue("all_reduce", group, tensor, sent, reduce, wait=True)
        return tensor.div_(n) if op == "avg" else tensor

    def all_reduce_many(self, tensors: list[torch.Tensor], group: Group) -> None:
        """Sum several tensors over `group` in place, as one collective of their concatenation."""
        if not tensors or group.size == 1:
            return
        flat = self.all_reduce(torch.cat([t.flatten() for t in tensors]), group)
        parts = flat.split([t.numel() for t in tensors])
        torch._foreach_copy_(tensors, [f.view_as(t) for f, t in zip(parts, tensors, strict=True)])

    def all_gather(self, tensor: torch.Tensor, group: Group, dim: int = 0) -> torch.Tensor:
        """Concatenate every rank's `tensor` along `dim`, in group-rank order: one collective into one buffer,
        copied once more only when a dimension before `dim` is longer than 1."""
        if group.size == 1:
            return tensor
        n = group.size
        part = tensor.contiguous()
        dim = dim % tensor.dim()
        gathered = torch.empty((n * part.shape[0], *part.shape[1:]), dtype=part.dtype, device=part.device)
        if not part.is_meta:
            sent = (n - 1) * _nbytes(part)
            self._issue("all_gather", group, gathered, sent, _gather_into(group), source=part, wait=True)
        shape = list(part.shape)
        shape[dim] *= n
        return gathered.view(n, *part.shape).movedim(0, dim).reshape(shape)

    def reduce_scatter(self, tensor: torch.Tensor, group: Group, dim: int = 0) -> torch.Tensor:
        """Sum `tensor` (its `dim` divisible by the group size) across the group and return this rank's chunk
        along `dim`; copied once first only when a dimension before `dim` is longer than 1."""
        if group.size == 1:
            return tensor
        n = group.size
        shape = list(tensor.shape)
        dim = dim % tensor.dim()
        shape[dim] //= n
        by_rank = tensor.unflatten(dim, (n, shape[dim])).movedim(dim, 0).contiguous().flatten(0, 1)
        out = torch.empty(shape, dtype=tensor.dtype, device=tensor.device)
        if not tensor.is_meta:
            sent = (n - 1) / n * _nbytes(tensor)
            self._issue("reduce_scatter", group, out, sent, _scatter_into(group), source=by_rank, wait=True)
        return out

    def all_to_all(
        self, tensor: torch.Tensor, group: Group, sent_rows: list[int], received_rows: list[int]
    ) -> torch.Tensor:
        """Send rows [sum(sent_rows[:j]), sum(sent_rows[:j + 1])) of `tensor` to group rank j; return what
        every rank sent here, in group-rank order (`received_rows[j]` rows from rank j)."""
        if group.size == 1:
            return tensor
        tensor = tensor.contiguous()
        out = tensor.new_empty((sum(received_rows), *tensor.shape[1:]))
        if not tensor.is_meta:
            me = group.ranks.index(dist.get_rank())
            sent = (sum(sent_rows) - sent_rows[me]) * math.prod(tensor.shape[1:]) * tensor.element_size()

            def launch(output: torch.Tensor, source: torch.Tensor) -> Work:
                return dist.all_to_all_single(
                    output, source, received_rows, sent_rows, group=group.handle, async_op=True
                )

            self._issue("all_to_all", group, out, sent, launch, source=tensor, wait=True)
        return out

    def start_all_reduce(self, tensor: torch.Tensor, group: Group) -> Work | None:
        """Start an in-place sum over `group`; `wait` for the result (None: nothing to wait for)."""
        if group.size == 1 or tensor.is_meta:
            return None
        sent = 2 * (group.size - 1) / group.size * _nbytes(tensor)
        return self._issue("all_reduce", group, tensor, sent, _reduce_into(group))

    def start_reduce_scatter(self, shard: torch.Tensor, tensor: torch.Tensor, group: Group) -> Work | None:
        """Start summing `tensor` over `group` into `shard`, this rank's equal part of it (`shard` may be a
        view of that part of `tensor`: the reduction is then in place)."""
        if group.size == 1 or tensor.is_meta:
            return None
        sent = (group.size - 1) / group.size * _nbytes(tensor)
        return self._issue("reduce_scatter", group, shard, sent, _scatter_into(group), source=tensor)

    def start_all_gather(self, tensor: torch.Tensor, shard: torch.Tensor, group: Group) -> Work | None:
        """Start filling `tensor` with every rank's `shard` in group order (`shard` may be a view into it)."""
        if group.size == 1 or shard.is_meta:
            return None
        sent = (group.size - 1) * _nbytes(shard)
        return self._issue("all_gather", group, tensor, sent, _gather_into(group), source=shard)

    def start_p2p(self, kind: str, tensor: torch.Tensor, peer: int, group: Group, tag: int) -> Work:
        """Start sending `tensor` to global rank `peer` ("send") or receiving it from there ("recv"); returns
        the work to `wait` for. NCCL ignores the tag (parallel/pipeline/p2p.py says what that means)."""
        start_one = dist.isend if kind == "send" else dist.irecv

        def launch(out: torch.Tensor, _: None) -> Work:
            if self.emulate_nccl:
                self._connect(kind, group, peer)
            return start_one(out, peer, group=group.handle, tag=tag)

        return self._issue(kind, group, tensor, _nbytes(tensor) * (kind == "send"), launch, peer=peer)

    def connect(self, links: list[Group], device: torch.device) -> None:
        """Make the first transfer of every one-way link this rank is on, in the order of `links`: the order
        every rank created them in. NCCL connects a pair on its first transfer on a communicator, the host
        blocking until the peer posts one too; walked in one order, the earliest link not yet connected always
        has both its ranks at it, so this cannot deadlock, and no later transfer waits for a connection, in
        whatever order the schedules post them. The tokens sent are not counted as traffic."""
        if not links:
            return
        me = dist.get_rank()
        for link in links:
            if me not in link.ranks:
                continue
            sender, receiver = link.ranks
            kind = "send" if me == sender else "recv"
            peer = receiver if me == sender else sender
            token = torch.zeros(1, device=device)
            work = self.start_p2p(kind, token, peer, link, CONNECT_TAG)
            self.wait(work, link, token, peer=peer, kind=kind)
        self.bytes_sent.clear()
        self.calls.clear()

    def _connect(self, kind: str, group: Group, peer: int) -> None:
        """NCCL emulation: NCCL connects two ranks on their first transfer on a communicator, and the host
        blocks in that set-up until the peer posts its own first transfer on the same communicator
        (NVIDIA/nccl#783). So first transfers posted in a cycle (every stage sending first, each on its own
        one-way group) hang on GPUs: here they raise after `connect_timeout`, naming the pair and group."""
        # Per communicator: kinds with equal ranks share one (parallel/context.py); torch names it alike on
        # every rank.
        communicator = (group.handle or dist.group.WORLD).group_name
        if self.store is None or (communicator, peer) in self._connected:
            return
        me = dist.get_rank()
        self.store.post(f"nccl-connect/{communicator}/{me}-{peer}", "")
        key = f"nccl-connect/{communicator}/{peer}-{me}"
        if key not in self.store.collect([key], self.connect_timeout):
            raise DistributedError(
                f"rank {me}: its first {kind} on {group.name} waited {self.connect_timeout:g} s for rank "
                f"{peer} to post a transfer on that group too. On NCCL this hangs forever: NCCL connects two "
                "ranks on their first transfer on a communicator, and the host blocks until both have posted "
                "one. Every rank must make its first transfer on each group in an order that cannot form a "
                "cycle: ParallelContext connects the pipeline's and the cp ring's links at start-up for this."
            )
        self._connected.add((communicator, peer))

    def wait(
        self,
        work: Work | None,
        group: Group,
        tensor: torch.Tensor,
        peer: int | None = None,
        kind: str = "wait",
    ) -> None:
        """Wait for an op started by a `start_*` method to finish (the time spent here is time spent idle).
        `kind` names what is awaited in the op record ("recv", "send"), for hang reports."""
        if work is None:
            return
        with self._record(kind, group, tensor, peer=peer, track=False) as slot:
            slot.work = work
            work.wait()

    def barrier(self, group: Group) -> None:
        if group.size == 1:
            return

        def launch(_: torch.Tensor, __: None) -> Work:
            return dist.barrier(group=group.handle, async_op=True)

        self._issue("barrier", group, torch.empty(0), 0, launch, wait=True)


def write_flight_recorder(path: Path, backend: str) -> bool:
    """Write this rank's flight recorder (torch's record of its last collectives and transfers, kept when
    TORCH_FR_BUFFER_SIZE is set) to `path`, in the format NCCL's own watchdog dumps on a timeout (which
    `python -m torch.distributed.flight_recorder.fr_trace` reads). False: torch has none for `backend`."""
    name = "_dump_nccl_trace" if backend == "nccl" else "_dump_fr_trace"
    dump = getattr(torch._C._distributed_c10d, name, None)
    if dump is None:
        return False
    with atomic_path(path) as tmp:
        Path(tmp).write_bytes(dump())
    return True


def collective_failed(op: OpInFlight, error: Exception) -> DistributedError:
    """Turn a failed or timed-out collective into a message that names what this rank was doing."""
    seconds = time.monotonic() - op.started
    peer = f", peer rank {op.peer}" if op.peer is not None else ""
    cause = (str(error).strip().splitlines() or [type(error).__name__])[0]
    return DistributedError(
        f"rank {dist.get_rank()}: {op.kind} on {op.group}{peer} for a {op.shape} {op.dtype} tensor failed "
        f"after {seconds:.1f} s: {cause}\n"
        "If another rank stopped first, its own error (above) says why. If this is a timeout, some rank "
        "never reached the same collective: check that every rank runs the same steps and code path; "
        "raise parallelism.collective_timeout_seconds only if a step is genuinely that slow."
    )


# Renamed in torch 2.13; the old names still work there, with a deprecation warning.
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)
_all_gather_single = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)

_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}


def _drop_finished(issued: deque[tuple[OpInFlight, _Slot]]) -> None:
    while issued and issued[0][1].is_completed():
        issued.popleft()


def _reduce_into(group: Group, op: str = "sum") -> Callable[[torch.Tensor, None], Work]:
    return lambda out, _: dist.all_reduce(out, op=_REDUCE_OPS[op], group=group.handle, async_op=True)


def _gather_into(group: Group) -> Callable[[torch.Tensor, torch.Tensor], Work]:
    return lambda out, part: _all_gather_single(out, part, group=group.handle, async_op=True)


def _scatter_into(group: Group) -> Callable[[torch.Tensor, torch.Tensor], Work]:
    return lambda out, full: _reduce_scatter_single(out, full, group=group.handle, async_op=True)


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()
