"""The one module that calls torch.distributed collectives and point-to-point ops.

Every op goes through `Comm`, which remembers the op in flight (so a hang can be reported as
"rank 3 waits in all_reduce on tp[2,3] for a (4, 256) bfloat16 tensor"), counts the calls and the
bytes this rank sends per (group kind, op kind) (so tests and benchmarks know the exact
communication volume), and the time spent per group kind (so the trainer can log the share of a
step spent in, say, tensor-parallel communication).

Byte counts are the volume a ring algorithm sends from this rank: all_reduce 2(n-1)/n of the
tensor, all_gather and reduce_scatter (n-1)/n of the full tensor, send the tensor itself.
"""

from __future__ import annotations

import os
import socket
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from femtotron.errors import DistributedError


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
        self.store: dist.Store | None = None  # set by ParallelContext with more than one process
        self.store_address: tuple[str, int] | None = None
        self._posted: dict[str, str] = {}
        self._keys = 0
        # torchrun's store outlives a worker restart: keys carry the attempt, so none is read from the last one
        self.key_prefix = f"femtotron/attempt{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"
        self.last_op: OpInFlight | None = None  # the op issued last, finished or not (on GPUs most return at once)

    @contextmanager
    def _record(self, kind: str, group: Group, tensor: torch.Tensor, peer: int | None, sent: float) -> Iterator[None]:
        op = OpInFlight(kind, group.name, peer, tuple(tensor.shape), str(tensor.dtype), time.monotonic())
        self.in_flight = self.last_op = op
        # On CUDA the call returns before the transfer ends: time it with events on the stream.
        events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) if tensor.is_cuda else None
        if events:
            events[0].record()
        start = time.perf_counter()
        try:
            yield
        except torch.OutOfMemoryError:  # a RuntimeError too, but not the collective's fault
            raise
        except RuntimeError as e:  # torch's DistBackendError and gloo's transport errors are RuntimeErrors
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

    def start_all_reduce(self, tensor: torch.Tensor, group: Group) -> dist.Work | None:
        """Start an in-place sum over `group` and return at once; `wait` for the result (None: nothing to wait for)."""
        if group.size == 1 or tensor.is_meta:
            return None
        n = group.size
        with self._record("all_reduce", group, tensor, None, 2 * (n - 1) / n * _nbytes(tensor)):
            return dist.all_reduce(tensor, group=group.handle, async_op=True)

    def start_reduce_scatter(self, shard: torch.Tensor, tensor: torch.Tensor, group: Group) -> dist.Work | None:
        """Start summing `tensor` over `group` into `shard`, this rank's equal part of it (`shard` may be a view
        of that part of `tensor`: the reduction is then in place)."""
        if group.size == 1 or tensor.is_meta:
            return None
        n = group.size
        with self._record("reduce_scatter", group, tensor, None, (n - 1) / n * _nbytes(tensor)):
            return _reduce_scatter_single(shard, tensor, group=group.handle, async_op=True)

    def start_all_gather(self, tensor: torch.Tensor, shard: torch.Tensor, group: Group) -> dist.Work | None:
        """Start filling `tensor` with every rank's `shard` in group-rank order (`shard` may be a view of this
        rank's part of `tensor`)."""
        if group.size == 1 or shard.is_meta:
            return None
        n = group.size
        with self._record("all_gather", group, shard, None, (n - 1) * _nbytes(shard)):
            return _all_gather_single(tensor, shard, group=group.handle, async_op=True)

    def send(self, tensor: torch.Tensor, group: Group, dst: int) -> None:
        with self._record("send", group, tensor, dst, _nbytes(tensor)):
            dist.send(tensor.contiguous(), dst=dst, group=group.handle)

    def batch_p2p(self, ops: list[tuple[str, torch.Tensor, int, int]], group: Group) -> list[dist.Work]:
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
            return dist.batch_isend_irecv([
                dist.P2POp(dist.isend if op == "send" else dist.irecv, t, peer=p, group=group.handle, tag=tag)
                for op, t, p, tag in ops])

    def wait(self, work: dist.Work | None, group: Group, tensor: torch.Tensor, peer: int | None = None,
             kind: str = "wait") -> None:
        """Wait for an op started by `batch_p2p` or a `start_*` method to finish (the time spent here is time
        spent idle). `kind` names what is awaited in the op record ("recv", "send"), for hang reports."""
        if work is None:
            return
        with self._record(kind, group, tensor, peer, 0):
            work.wait()

    def recv(self, tensor: torch.Tensor, group: Group, src: int) -> torch.Tensor:
        with self._record("recv", group, tensor, src, 0):
            dist.recv(tensor, src=src, group=group.handle)
        return tensor

    def fresh_key(self, prefix: str) -> str:
        """A store key no earlier call used. Every rank calls it in the same order, so all get the same one."""
        self._keys += 1
        return f"{prefix}{self._keys}"

    def new_store_client(self) -> dist.Store:
        """Another connection to the rendezvous store: a client serves one request at a time, so a thread that
        must get through while the main thread waits on the store (the watchdog) needs its own."""
        host, port = self.store_address
        return dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=30), wait_for_workers=False)

    def post(self, key: str, value: str) -> None:
        """Publish a string under `key` in the rendezvous store (a dict when there is one process)."""
        if self.store is None:
            self._posted[key] = value
        else:
            self.store.set(f"{self.key_prefix}post/{key}", value)

    def collect(self, keys: list[str], timeout: float, remove: bool = False) -> dict[str, str]:
        """Wait up to `timeout` seconds for every key to be posted; return those that were (all of them,
        unless the wait timed out: the caller names the missing ones). `remove`: delete them from the store
        (when only this rank reads them), so a long run does not pile them up."""
        if self.store is None:
            return {k: (self._posted.pop if remove else self._posted.get)(k) for k in keys if k in self._posted}
        full = [f"{self.key_prefix}post/{k}" for k in keys]
        try:
            self.store.wait(full, timedelta(seconds=timeout))
        except (RuntimeError, OSError):  # a timeout: some key never came
            pass
        got = {k: self.store.get(f).decode() for k, f in zip(keys, full, strict=True) if self.store.check([f])}
        if remove:
            for key in got:
                self.store.delete_key(f"{self.key_prefix}post/{key}")
        return got

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


def rendezvous(
    rank: int, world_size: int, host: str, port: int, backend: str, init_timeout: float, collective_timeout: float
) -> tuple[list[str], dist.Store]:
    """Join the job and create the default process group; return each rank's hostname, and the store
    (it stays reachable when collectives are stuck, so it carries what must get through regardless).

    Every rank first checks in under its own key in the rendezvous store, so when somebody never
    arrives the timeout can say exactly which ranks joined and which did not, instead of hanging.
    """
    # Under torchrun the agent already serves the store on MASTER_PORT; every worker is a client.
    is_server = rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"
    where = f"{host}:{port} (backend {backend}, rank {rank} of {world_size})"
    try:
        store = dist.TCPStore(host, port, world_size, is_master=is_server,
                              timeout=timedelta(seconds=init_timeout), wait_for_workers=False)
    except (RuntimeError, OSError) as e:
        raise DistributedError(
            f"Could not reach the rendezvous store at {where} within {init_timeout:g} s: {e}.\n"
            f"{_NETWORK_ADVICE}"
        ) from None
    attempt = f"femtotron/attempt{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"  # torchrun restarts
    keys = [f"{attempt}/joined/{r}" for r in range(world_size)]
    store.set(keys[rank], socket.gethostname())
    try:
        store.wait(keys, timedelta(seconds=init_timeout))
    except (RuntimeError, OSError):
        joined = [r for r in range(world_size) if store.check([keys[r]])]
        missing = sorted(set(range(world_size)) - set(joined))
        raise DistributedError(
            f"Process-group init timed out after {init_timeout:g} s at {where}: "
            f"ranks {_ranges(joined)} joined, ranks {_ranges(missing)} never did.\n"
            f"Check that those ranks were launched, that WORLD_SIZE={world_size} matches the launcher, "
            f"and that they can reach {host}:{port}. {_NETWORK_ADVICE}\n"
            "Raise parallelism.init_timeout_seconds if nodes start slowly."
        ) from None
    hosts = [store.get(k).decode() for k in keys]
    dist.init_process_group(backend, store=dist.PrefixStore(f"{attempt}/pg", store), rank=rank,
                            world_size=world_size, timeout=timedelta(seconds=collective_timeout))
    return hosts, store


def new_group(kind: str, ranks: list[int], timeout_seconds: float) -> Group:
    """Every rank must call this for every group, in the same order (torch.distributed's rule).

    The timeout is passed again: subgroups do not inherit the one given to init_process_group.
    """
    return Group(kind, tuple(ranks), dist.new_group(ranks, timeout=timedelta(seconds=timeout_seconds)))


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


_NETWORK_ADVICE = (
    "On several nodes, the usual cause is the wrong network interface: set NCCL_SOCKET_IFNAME and "
    "GLOO_SOCKET_IFNAME (e.g. =eth0; `ip -br addr` lists them) on every node, and check MASTER_ADDR/MASTER_PORT."
)


def _ranges(ranks: list[int]) -> str:
    """[0, 1, 2, 5] -> "0-2,5"."""
    spans: list[list[int]] = []
    for r in ranks:
        if spans and r == spans[-1][1] + 1:
            spans[-1][1] = r
        else:
            spans.append([r, r])
    return ",".join(f"{a}" if a == b else f"{a}-{b}" for a, b in spans) or "none"


# Renamed in torch 2.13; the old names still work there, with a deprecation warning.
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)
_all_gather_single = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)

_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()
