"""Activations and gradients between neighbouring pipeline stages, through parallel/comm.py.

The first time a pair of ranks exchanges a tensor of a given shape and dtype, the sender first sends
a small description of it and the receiver checks it against what it expects (P1). A mismatch (ranks
started with different configs, a stage returning the wrong shape) is then an error naming both
ranks and both shapes, instead of a receive that hangs or fills a buffer with the wrong numbers.
"""

from __future__ import annotations

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

    def recv(self, shape: tuple[int, ...], dtype: torch.dtype, from_pp_rank: int, tag: int, what: str) -> torch.Tensor:
        src = self.group.ranks[from_pp_rank]
        key = ("recv", src, shape, dtype)
        if key not in self.described:
            description = self.comm.recv(torch.empty(_MAX_DIMS + 2, dtype=torch.int64, device=self.device),
                                         self.group, src, _DESCRIPTION_TAG)
            sent_shape, sent_dtype = _read(description)
            if (sent_shape, sent_dtype) != (shape, dtype):
                me = self.group.ranks[self.pp_rank]
                raise DistributedError(
                    f"pipeline stages disagree on {what}: rank {src} (pp rank {from_pp_rank}) sends shape "
                    f"{sent_shape} {sent_dtype}, rank {me} (pp rank {self.pp_rank}) expects shape {shape} {dtype}. "
                    "Every rank must run the same config: check that all ranks got the same YAML and overrides "
                    "(tokens.micro_batch_size, tokens.sequence_length, model.model_config.hidden_size, model.dtype, "
                    "parallelism.tp and tp_mode)."
                )
            self.described.add(key)
        return self.comm.recv(torch.empty(shape, dtype=dtype, device=self.device), self.group, src, tag)

    def wait_sends(self) -> None:
        """Sends run in the background; their buffers must live until they are done."""
        for work, tensor, dst in self.pending:
            self.comm.wait(work, self.group, tensor, dst)
        self.pending.clear()
