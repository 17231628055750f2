"""Activations and gradients between neighbouring pipeline stages, through parallel/comm.py.

Transfers go out in batches of at most one send and one receive (`exchange`): the send of the action
just computed and the receive of the next action. NCCL pairs the transfers between two ranks in the
order they are issued, ignoring tags, on one stream per pair; a lone receive issued before a send can
then block it while the neighbour does the same. Batched together they progress together (the
pairing Megatron-LM uses), and tests/parallel/pipeline/test_schedules.py checks every schedule under
that model. Gloo matches by tag, so there the tags alone would do.

Every transfer has the same shape and dtype: (micro_batch_size, sequence [/ tp], hidden) in the
model's dtype. At start the ranks exchange that shape with their pipeline neighbours, so ranks built
from different configs stop with an error naming both ranks and both shapes (P1) before the first
step, instead of a receive that hangs or fills a buffer with the wrong numbers; a stage that returns
another shape is stopped before it sends.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from femtotron.errors import DistributedError
from femtotron.parallel.comm import Comm, Group, Work

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


class PipelineP2P:
    """Point-to-point over the pp group for tensors of one shape and dtype; peers named by pp rank."""

    def __init__(
        self,
        comm: Comm,
        group: Group,
        pp_rank: int,
        device: torch.device,
        shape: tuple[int, ...],
        dtype: torch.dtype,
    ) -> None:
        self.comm, self.group, self.pp_rank, self.device = comm, group, pp_rank, device
        self.shape, self.dtype = tuple(shape), dtype
        self.pending: list[tuple[Work, torch.Tensor, int]] = []

    def handshake(self, neighbours: list[int]) -> None:
        """Exchange the transfer shape and dtype with the neighbouring pp ranks; raise on disagreement
        (P1)."""
        neighbours = sorted(set(neighbours) - {self.pp_rank})
        if not neighbours:
            return
        mine = _describe(self.shape, self.dtype, self.device)
        theirs = {p: torch.empty_like(mine) for p in neighbours}
        ops = [("send", mine, self.group.ranks[p], _DESCRIPTION_TAG) for p in neighbours]
        ops += [("recv", theirs[p], self.group.ranks[p], _DESCRIPTION_TAG) for p in neighbours]
        for work, (_, tensor, peer, _) in zip(self.comm.batch_p2p(ops, self.group), ops, strict=True):
            self.comm.wait(work, self.group, tensor, peer)
        for p in neighbours:
            shape, dtype = _read(theirs[p].cpu())
            if (shape, dtype) != (self.shape, self.dtype):
                raise DistributedError(
                    "pipeline stages disagree on the activations they exchange: rank "
                    f"{self.group.ranks[p]} (pp rank {p}) sends and expects shape {shape} {dtype}, rank "
                    f"{self.group.ranks[self.pp_rank]} (pp rank {self.pp_rank}) shape {self.shape} "
                    f"{self.dtype}. Every rank must run the same config: check that all ranks got the same "
                    "YAML and overrides (tokens.micro_batch_size, tokens.sequence_length, "
                    "model.model_config.hidden_size, model.dtype, parallelism.tp and tp_mode)."
                )

    def exchange(
        self, send: tuple[torch.Tensor, Transfer] | None, recv: Transfer | None
    ) -> PendingRecv | None:
        """Start sending `send` and receiving `recv` as one batch; returns the receive to `take` later."""
        ops = []
        if send is not None:
            tensor, to = send
            if tuple(tensor.shape) != self.shape or tensor.dtype != self.dtype:
                raise DistributedError(
                    f"pp rank {self.pp_rank} would send {to.what} of shape {tuple(tensor.shape)} "
                    f"{tensor.dtype} to pp rank {to.pp_rank}, but every pipeline transfer is {self.shape} "
                    f"{self.dtype}: a stage returned the wrong shape (a model bug, not a config problem)."
                )
            ops.append(("send", tensor.detach().contiguous(), self.group.ranks[to.pp_rank], to.tag))
        buffer = None
        if recv is not None:
            buffer = torch.empty(self.shape, dtype=self.dtype, device=self.device)
            ops.append(("recv", buffer, self.group.ranks[recv.pp_rank], recv.tag))
        works = self.comm.batch_p2p(ops, self.group)
        if send is not None:
            self.pending.append((works[0], ops[0][1], ops[0][2]))
            self.release_finished_sends()
        return PendingRecv(works[-1], buffer, ops[-1][2]) if recv is not None else None

    def take(self, pending: PendingRecv) -> torch.Tensor:
        self.comm.wait(pending.work, self.group, pending.buffer, pending.src, kind="recv")
        return pending.buffer

    def release_finished_sends(self) -> None:
        """Let go of finished sends, so their buffers (whole activations) do not pile up until the end of
        the step: 1F1B's point is holding only about pp micro-batches at a time."""
        unfinished = []
        for work, sent, peer in self.pending:
            if work.is_completed():
                self.comm.wait(work, self.group, sent, peer)  # instant; raises if the transfer failed
            else:
                unfinished.append((work, sent, peer))
        self.pending = unfinished

    def wait_sends(self) -> None:
        for work, tensor, dst in self.pending:
            self.comm.wait(work, self.group, tensor, dst, kind="send")
        self.pending.clear()
