"""Activations and gradients between neighbouring pipeline stages, through parallel/comm.py.

Each action's receive is posted before the action ahead of it computes, each output's send started once
computed (`exchange`); only a receive is waited for before computing. Each direction between two neighbours
has a process group of its own (`PipeLink`, parallel/context.py): NCCL ignores tags, pairs a group's
transfers in issue order on one stream, and completes a large send only once its receive is posted. With
one group both ways, a send waiting for its receiver would hold up the receives behind it, and the
interleaved schedule (some receives posted many actions later) would deadlock; one way per group, a send
only holds up later sends the same way, taken in the same order (test_schedules.py checks every schedule).

Every transfer is (micro_batch_size, sequence [/ tp], hidden) in the model's dtype. The ranks exchange that
with their neighbours at start, so ranks built from different configs stop before the first step with an
error naming both ranks and shapes (P1), not a hanging receive or wrong numbers; a stage that returns
another shape is stopped before it sends.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from femtotron.errors import DistributedError
from femtotron.parallel.comm import Comm, Work
from femtotron.parallel.context import PipeLink

_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
_MAX_DIMS = 8
_DESCRIPTION_TAG = 1 << 30  # apart from the data tags, which count up from 0


def _describe(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    dims = list(shape) + [-1] * (_MAX_DIMS - len(shape))
    return torch.tensor([len(shape), *dims, _DTYPES.index(dtype)], dtype=torch.int64, device=device)


def _read(description: torch.Tensor) -> tuple[tuple[int, ...], torch.dtype]:
    values = description.tolist()
    return tuple(values[1 : 1 + values[0]]), _DTYPES[values[-1]]


@dataclass
class PendingRecv:
    work: Work
    buffer: torch.Tensor
    src: int


@dataclass(frozen=True)
class Transfer:
    """One side of a transfer: the peer (by pp rank), the tag, and what it carries (for messages)."""

    pp_rank: int
    tag: int
    what: str


Send = tuple[torch.Tensor, Transfer]  # a tensor to send, and where to


class PipelineP2P:
    """Point-to-point of one shape and dtype with the neighbouring pp ranks, each through its `PipeLink`."""

    def __init__(
        self,
        comm: Comm,
        links: dict[int, PipeLink],
        pp_rank: int,
        device: torch.device,
        shape: tuple[int, ...],
        dtype: torch.dtype,
    ) -> None:
        self.comm = comm
        self.links = links
        self.pp_rank = pp_rank
        self.device = device
        self.shape = tuple(shape)
        self.dtype = dtype
        self.pending: list[tuple[Work, torch.Tensor, int]] = []

    def _start(self, kind: str, tensor: torch.Tensor, pp_rank: int, tag: int) -> Work:
        link = self.links[pp_rank]
        group = link.outgoing if kind == "send" else link.incoming
        return self.comm.start_p2p(kind, tensor, link.rank, group, tag)

    def handshake(self, neighbours: list[int]) -> None:
        """Exchange the transfer shape and dtype with the neighbouring pp ranks; raise if they differ (P1)."""
        neighbours = sorted(set(neighbours) - {self.pp_rank})
        if not neighbours:
            return
        mine = _describe(self.shape, self.dtype, self.device)
        theirs = {p: torch.empty_like(mine) for p in neighbours}
        sends = [(p, self._start("send", mine, p, _DESCRIPTION_TAG)) for p in neighbours]
        receives = [(p, self._start("recv", theirs[p], p, _DESCRIPTION_TAG)) for p in neighbours]
        for p, work in receives + sends:
            link = self.links[p]
            self.comm.wait(work, link.incoming, theirs[p], link.rank, kind="shape handshake")
        for p in neighbours:
            shape, dtype = _read(theirs[p].cpu())
            if (shape, dtype) != (self.shape, self.dtype):
                raise DistributedError(
                    "pipeline stages disagree on the activations they exchange: rank "
                    f"{self.links[p].rank} (pp rank {p}) sends and expects shape {shape} {dtype}, rank "
                    f"{self.links[p].outgoing.ranks[0]} (pp rank {self.pp_rank}) shape {self.shape} "
                    f"{self.dtype}. Every rank must run the same config: check that all ranks got the same "
                    "YAML and overrides (tokens.micro_batch_size, tokens.sequence_length, "
                    "model.model_config.hidden_size, model.dtype, parallelism.tp and tp_mode)."
                )

    def exchange(self, send: Send | None, recv: Transfer | None) -> PendingRecv | None:
        """Start sending `send` and receiving `recv`; returns the receive to `take` later."""
        if send is not None:
            tensor, to = send
            if tuple(tensor.shape) != self.shape or tensor.dtype != self.dtype:
                raise DistributedError(
                    f"pp rank {self.pp_rank} would send {to.what} of shape {tuple(tensor.shape)} "
                    f"{tensor.dtype} to pp rank {to.pp_rank}, but every pipeline transfer is {self.shape} "
                    f"{self.dtype}: a stage returned the wrong shape (a model bug, not a config problem)."
                )
            sent = tensor.detach().contiguous()
            work = self._start("send", sent, to.pp_rank, to.tag)
            self.pending.append((work, sent, to.pp_rank))
            self.release_finished_sends()
        if recv is None:
            return None
        buffer = torch.empty(self.shape, dtype=self.dtype, device=self.device)
        work = self._start("recv", buffer, recv.pp_rank, recv.tag)
        return PendingRecv(work=work, buffer=buffer, src=recv.pp_rank)

    def take(self, pending: PendingRecv) -> torch.Tensor:
        link = self.links[pending.src]
        self.comm.wait(pending.work, link.incoming, pending.buffer, link.rank, kind="recv")
        return pending.buffer

    def release_finished_sends(self) -> None:
        """Let go of finished sends, so their buffers (whole activations) do not pile up until the end of
        the step: 1F1B's point is holding only about pp micro-batches at a time."""
        waiting = self.pending
        self.pending = []
        for work, sent, pp_rank in waiting:
            if work.is_completed():
                link = self.links[pp_rank]  # the wait is instant; it raises on a failure
                self.comm.wait(work, link.outgoing, sent, link.rank, kind="send")
            else:
                self.pending.append((work, sent, pp_rank))

    def wait_sends(self) -> None:
        for work, sent, pp_rank in self.pending:
            link = self.links[pp_rank]
            self.comm.wait(work, link.outgoing, sent, link.rank, kind="send")
        self.pending.clear()
