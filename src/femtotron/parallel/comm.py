"""The one module that calls torch.distributed collectives and point-to-point ops.

(Process groups are made in parallel/context.py, messages through the rendezvous store travel through
parallel/store.py; nothing else touches torch.distributed.)

Every op goes through `Comm`, which remembers the op in flight (so a hang can be reported as
"rank 3 waits in all_reduce on tp[2,3] for a (4, 256) bfloat16 tensor"), counts the calls and the
bytes this rank sends per (group kind, op kind) (so tests and benchmarks know the exact
communication volume), and the time spent per group kind (so the trainer can log the share of a
step spent in, say, tensor-parallel communication).

Byte counts are the volume a ring algorithm sends from this rank: all_reduce 2(n-1)/n of the
tensor, all_gather and reduce_scatter (n-1)/n of the full tensor, send the tensor itself.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from femtotron.errors import DistributedError, is_out_of_memory

Work = dist.Work  # what an op started without waiting returns


@dataclass(frozen=True)
class Group:
    """A process group together with its global ranks and a readable name such as `tp[2,3]`."""

    kind: str
    ranks: tuple[int, ...]
    handle: dist.ProcessGroup | None = field(default=None, compare=False)

    @property
    def size(self) -> int:
        return len(self.ranks)

    @property
    def name(self) -> str:
        return f"{self.kind}[{','.join(map(str, self.ranks))}]"


@dataclass
class OpInFlight:
    kind: str
    group: str
    peer: int | None
    shape: tuple[int, ...]
    dtype: str
    started: float


class Comm:
    """Collectives over `Group`s. A group of one rank is a no-op, so a world of 1 needs no init."""

    def __init__(self) -> None:
        self.in_flight: OpInFlight | None = None
        self.bytes_sent: Counter[tuple[str, str]] = Counter()  # (group kind, op kind) -> bytes
        self.calls: Counter[tuple[str, str]] = Counter()
        self._seconds: Counter[str] = Counter()  # group kind -> seconds in collectives
        self._pending_events: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []
        self.last_op: OpInFlight | None = (
            None  # the op issued last, finished or not (on GPUs most return at once)
        )

    @contextmanager
    def _record(
        self, kind: str, group: Group, tensor: torch.Tensor, peer: int | None, sent: float
    ) -> Iterator[None]:
        op = OpInFlight(kind, group.name, peer, tuple(tensor.shape), str(tensor.dtype), time.monotonic())
        self.in_flight = self.last_op = op
        # On CUDA the call returns before the transfer ends: time it with events on the stream.
        events = (
            (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            if tensor.is_cuda
            else None
        )
        if events:
            events[0].record()
        start = time.perf_counter()
        try:
            yield
        except RuntimeError as e:  # torch's DistBackendError and gloo's transport errors are RuntimeErrors
            if is_out_of_memory(e):  # a RuntimeError too, but not the collective's fault
                raise
            raise collective_failed(op, e) from None  # `in_flight` keeps the failed op, for the reports
        if events:
            events[1].record()
            self._pending_events.append((group.kind, *events))
        else:
            self._seconds[group.kind] += time.perf_counter() - start
        self.in_flight = None
        self.calls[group.kind, kind] += 1
        self.bytes_sent[group.kind, kind] += int(sent)

    def take_seconds(self) -> dict[str, float]:
        """Seconds spent in collectives per group kind since the last call (waits for CUDA ones)."""
        for kind, begin, end in self._pending_events:
            end.synchronize()
            self._seconds[kind] += begin.elapsed_time(end) / 1000
        self._pending_events.clear()
        seconds, self._seconds = dict(self._seconds), Counter()
        return seconds

    def all_reduce(self, tensor: torch.Tensor, group: Group, op: str = "sum") -> torch.Tensor:
        """In-place reduction across `group`; `op` is "sum", "max" or "avg". On the meta device (memory
        estimates: shapes without data) every collective only produces its output's shape."""
        if group.size == 1 or tensor.is_meta:
            return tensor
        n = group.size
        with self._record("all_reduce", group, tensor, None, 2 * (n - 1) / n * _nbytes(tensor)):
            if op == "avg":
                dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group.handle)
                tensor.div_(n)
            else:
                dist.all_reduce(tensor, op=_REDUCE_OPS[op], group=group.handle)
        return tensor

    def all_reduce_many(self, tensors: list[torch.Tensor], group: Group) -> None:
        """Sum several tensors over `group` in place, as one collective of their concatenation."""
        if not tensors or group.size == 1:
            return
        flat = self.all_reduce(torch.cat([t.flatten() for t in tensors]), group)
        torch._foreach_copy_(
            tensors,
            [f.view_as(t) for f, t in zip(flat.split([t.numel() for t in tensors]), tensors, strict=True)],
        )

    def all_gather(self, tensor: torch.Tensor, group: Group, dim: int = 0) -> torch.Tensor:
        """Concatenate every rank's `tensor` along `dim`, in group-rank order."""
        if group.size == 1:
            return tensor
        n = group.size
        parts = [torch.empty_like(tensor) for _ in range(n)]
        if tensor.is_meta:
            return torch.cat(parts, dim=dim)
        with self._record("all_gather", group, tensor, None, (n - 1) * _nbytes(tensor)):
            dist.all_gather(parts, tensor.contiguous(), group=group.handle)
        return torch.cat(parts, dim=dim)

    def reduce_scatter(self, tensor: torch.Tensor, group: Group, dim: int = 0) -> torch.Tensor:
        """Sum `tensor` across the group and return this rank's chunk along `dim`."""
        if group.size == 1:
            return tensor
        n = group.size
        chunks = [c.contiguous() for c in tensor.chunk(n, dim=dim)]
        out = torch.empty_like(chunks[0])
        if tensor.is_meta:
            return out
        with self._record("reduce_scatter", group, tensor, None, (n - 1) / n * _nbytes(tensor)):
            dist.reduce_scatter(out, chunks, group=group.handle)
        return out

    def start_all_reduce(self, tensor: torch.Tensor, group: Group) -> Work | None:
        """Start an in-place sum over `group` and return at once; `wait` for the result (None: nothing to wait
        for)."""
        if group.size == 1 or tensor.is_meta:
            return None
        n = group.size
        with self._record("all_reduce", group, tensor, None, 2 * (n - 1) / n * _nbytes(tensor)):
            return dist.all_reduce(tensor, group=group.handle, async_op=True)

    def start_reduce_scatter(self, shard: torch.Tensor, tensor: torch.Tensor, group: Group) -> Work | None:
        """Start summing `tensor` over `group` into `shard`, this rank's equal part of it (`shard` may be a
        view of that part of `tensor`: the reduction is then in place)."""
        if group.size == 1 or tensor.is_meta:
            return None
        n = group.size
        with self._record("reduce_scatter", group, tensor, None, (n - 1) / n * _nbytes(tensor)):
            return _reduce_scatter_single(shard, tensor, group=group.handle, async_op=True)

    def start_all_gather(self, tensor: torch.Tensor, shard: torch.Tensor, group: Group) -> Work | None:
        """Start filling `tensor` with every rank's `shard` in group-rank order (`shard` may be a view of this
        rank's part of `tensor`)."""
        if group.size == 1 or shard.is_meta:
            return None
        n = group.size
        with self._record("all_gather", group, shard, None, (n - 1) * _nbytes(shard)):
            return _all_gather_single(tensor, shard, group=group.handle, async_op=True)

    def batch_p2p(self, ops: list[tuple[str, torch.Tensor, int, int]], group: Group) -> list[Work]:
        """Start a batch of ("send" | "recv", tensor, peer, tag) ops together and return their works.

        NCCL pairs the transfers between two ranks in the order they are issued, on one stream; sends
        and receives issued as one batch progress together, so two neighbours that both send and both
        receive cannot block each other (Megatron-LM's batched send/receive pairs).
        """
        if not ops:
            return []
        sent = sum(_nbytes(tensor) for kind, tensor, _, _ in ops if kind == "send")
        kind, tensor, peer, _ = ops[0]
        with self._record("send" if sent else "recv", group, tensor, peer, sent):
            return dist.batch_isend_irecv(
                [
                    dist.P2POp(
                        dist.isend if op == "send" else dist.irecv, t, peer=p, group=group.handle, tag=tag
                    )
                    for op, t, p, tag in ops
                ]
            )

    def wait(
        self,
        work: Work | None,
        group: Group,
        tensor: torch.Tensor,
        peer: int | None = None,
        kind: str = "wait",
    ) -> None:
        """Wait for an op started by `batch_p2p` or a `start_*` method to finish (the time spent here is time
        spent idle). `kind` names what is awaited in the op record ("recv", "send"), for hang reports."""
        if work is None:
            return
        with self._record(kind, group, tensor, peer, 0):
            work.wait()

    def barrier(self, group: Group) -> None:
        if group.size == 1:
            return
        with self._record("barrier", group, torch.empty(0), None, 0):
            dist.barrier(group=group.handle)


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


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()
