"""Activations and gradients between neighbouring pipeline stages, through parallel/comm.py.

The first time a pair of ranks exchanges a tensor of a given shape and dtype, the sender first sends
a small description of it and the receiver checks it against what it expects (P1). A mismatch (ranks
started with different configs, a stage returning the wrong shape) is then an error naming both
ranks and both shapes, instead of a receive that hangs or fills a buffer with the wrong numbers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from femtotron.errors import DistributedError
from femtotron.parallel.comm import Comm, Group

_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
_MAX_DIMS = 8
_DESCRIPTION_TAG = 1 << 30  # apart from the data tags, which count up from 0


def _describe(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    dims = list(shape) + [-1] * (_MAX_DIMS - len(shape))
    return torch.tensor([len(shape), *dims, _DTYPES.index(dtype)], dtype=torch.int64)


def _read(description: torch.Tensor) -> tuple[tuple[int, ...], torch.dtype]:
    values = description.tolist()
    return tuple(values[1 : 1 + values[0]]), _DTYPES[values[-1]]


@dataclass
class PendingRecv:
    from_pp_rank: int
    src: int
    tag: int
    what: str
    description: tuple[dist.Work, torch.Tensor] | None  # only on the first transfer of its kind
    work: dist.Work | None  # None until the description is checked
    buffer: torch.Tensor


class PipelineP2P:
    """Point-to-point over the pp group; peers are named by pp rank."""

    def __init__(self, comm: Comm, group: Group, pp_rank: int, device: torch.device) -> None:
        self.comm, self.group, self.pp_rank, self.device = comm, group, pp_rank, device
        self.described: set[tuple] = set()
        self.pending: list[tuple[dist.Work, torch.Tensor, int]] = []

    def send(self, tensor: torch.Tensor, to_pp_rank: int, tag: int, what: str) -> None:
        dst = self.group.ranks[to_pp_rank]
        tensor = tensor.detach().contiguous()
        key = ("send", dst, tuple(tensor.shape), tensor.dtype)
        if key not in self.described:
            self.described.add(key)
            description = _describe(tuple(tensor.shape), tensor.dtype).to(self.device)
            self.pending.append((self.comm.isend(description, self.group, dst, _DESCRIPTION_TAG), description, dst))
        self.pending.append((self.comm.isend(tensor, self.group, dst, tag), tensor, dst))
        # Let go of sends that have finished, so their buffers (whole activations) do not pile up
        # until the end of the step: 1F1B's point is holding only pp micro-batches at a time.
        unfinished = []
        for work, sent, peer in self.pending:
            if work.is_completed():
                self.comm.wait(work, self.group, sent, peer)  # instant; raises if the transfer failed
            else:
                unfinished.append((work, sent, peer))
        self.pending = unfinished

    def post_recv(self, shape: tuple[int, ...], dtype: torch.dtype, from_pp_rank: int, tag: int,
                  what: str) -> PendingRecv:
        """Start receiving now, so the transfer overlaps this rank's compute; `take` it when needed.

        Nothing here waits: a rank may post the receive for its next action before it sends what the
        peer needs to produce it.
        """
        src = self.group.ranks[from_pp_rank]
        key = ("recv", src, shape, dtype)
        description = None
        if key not in self.described:
            self.described.add(key)
            description = torch.empty(_MAX_DIMS + 2, dtype=torch.int64, device=self.device)
            description = (self.comm.irecv(description, self.group, src, _DESCRIPTION_TAG), description)
        buffer = torch.empty(shape, dtype=dtype, device=self.device)
        # The first transfer's data is received only once its description matched: a receive posted
        # with the wrong size could never complete, and would keep the process from shutting down.
        work = self.comm.irecv(buffer, self.group, src, tag) if description is None else None
        return PendingRecv(from_pp_rank, src, tag, what, description, work, buffer)

    def take(self, pending: PendingRecv) -> torch.Tensor:
        """Wait for a posted receive; the first one from a peer checks the sender's shape and dtype (P1)."""
        if pending.description is not None:
            work, description = pending.description
            self.comm.wait(work, self.group, description, pending.src)
            sent_shape, sent_dtype = _read(description.cpu())
            shape, dtype = tuple(pending.buffer.shape), pending.buffer.dtype
            if (sent_shape, sent_dtype) != (shape, dtype):
                me = self.group.ranks[self.pp_rank]
                raise DistributedError(
                    f"pipeline stages disagree on {pending.what}: rank {pending.src} (pp rank {pending.from_pp_rank}) "
                    f"sends shape {sent_shape} {sent_dtype}, rank {me} (pp rank {self.pp_rank}) expects shape {shape} "
                    f"{dtype}. Every rank must run the same config: check that all ranks got the same YAML and "
                    "overrides (tokens.micro_batch_size, tokens.sequence_length, model.model_config.hidden_size, "
                    "model.dtype, parallelism.tp and tp_mode)."
                )
            return self.comm.recv(pending.buffer, self.group, pending.src, pending.tag)
        self.comm.wait(pending.work, self.group, pending.buffer, pending.src)
        return pending.buffer

    def recv(self, shape: tuple[int, ...], dtype: torch.dtype, from_pp_rank: int, tag: int, what: str) -> torch.Tensor:
        return self.take(self.post_recv(shape, dtype, from_pp_rank, tag, what))

    def wait_sends(self) -> None:
        """Sends run in the background; their buffers must live until they are done."""
        for work, tensor, dst in self.pending:
            self.comm.wait(work, self.group, tensor, dst)
        self.pending.clear()
