"""ParallelContext: who this rank is in the (pp, dp, tp) mesh, and the process groups it talks on.

The layout is written once, here: `rank = (pp_rank * dp + dp_rank) * tp + tp_rank`. TP is
innermost so a TP group is consecutive ranks (the same host, the fastest links); PP is outermost.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

import torch

from femtotron.errors import DistributedError
from femtotron.parallel import comm
from femtotron.parallel.comm import Comm, Group


@dataclass(frozen=True)
class MeshCoordinates:
    pp_rank: int
    dp_rank: int
    tp_rank: int


def rank_of(pp_rank: int, dp_rank: int, tp_rank: int, dp: int, tp: int) -> int:
    return (pp_rank * dp + dp_rank) * tp + tp_rank


def coordinates_of(rank: int, dp: int, tp: int) -> MeshCoordinates:
    return MeshCoordinates(pp_rank=rank // (dp * tp), dp_rank=(rank // tp) % dp, tp_rank=rank % tp)


class ParallelContext:
    """Built once per process and passed explicitly to whoever needs a rank or a group.

    With a world of one process it needs no launcher and creates no process group: every group
    has one member and every collective in `Comm` returns at once.
    """

    def __init__(
        self,
        dp: int = 1,
        tp: int = 1,
        pp: int = 1,
        *,
        init_timeout_seconds: float = 300.0,
        collective_timeout_seconds: float = 600.0,
    ) -> None:
        self.dp, self.tp, self.pp = dp, tp, pp
        self.world_size = int(os.environ.get("WORLD_SIZE", "1"))
        self.rank = int(os.environ.get("RANK", "0"))
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        if dp * tp * pp != self.world_size:
            # The config check (check_world_size) normally catches this first, with suggestions.
            raise DistributedError(
                f"dp*tp*pp = {dp}*{tp}*{pp} = {dp * tp * pp} but WORLD_SIZE = {self.world_size}: "
                "set parallelism.dp/tp/pp so their product equals the number of processes launched."
            )
        self.collective_timeout_seconds = collective_timeout_seconds
        self.device = self._pick_device()
        self.backend = "nccl" if self.device.type == "cuda" else "gloo"
        self.comm = Comm()
        self.hosts = [socket.gethostname()]
        if self.world_size > 1:
            host = os.environ.get("MASTER_ADDR", "127.0.0.1")
            port = int(os.environ.get("MASTER_PORT", "29500"))
            self.hosts, self.comm.store = comm.rendezvous(self.rank, self.world_size, host, port, self.backend,
                                                          init_timeout_seconds, collective_timeout_seconds)
            self.comm.store_address = (host, port)
        coords = coordinates_of(self.rank, dp, tp)
        self.pp_rank, self.dp_rank, self.tp_rank = coords.pp_rank, coords.dp_rank, coords.tp_rank
        self._build_groups()

    def _pick_device(self) -> torch.device:
        if torch.cuda.is_available():
            torch.cuda.set_device(self.local_rank)
            return torch.device("cuda", self.local_rank)
        return torch.device("cpu")

    def _build_groups(self) -> None:
        dp, tp, pp = self.dp, self.tp, self.pp
        tp_groups = [[rank_of(p, d, t, dp, tp) for t in range(tp)] for p in range(pp) for d in range(dp)]
        dp_groups = [[rank_of(p, d, t, dp, tp) for d in range(dp)] for p in range(pp) for t in range(tp)]
        pp_groups = [[rank_of(p, d, t, dp, tp) for p in range(pp)] for d in range(dp) for t in range(tp)]
        # Model-parallel group: every rank holding a piece of one model replica (for grad norms).
        mp_groups = [[rank_of(p, d, t, dp, tp) for p in range(pp) for t in range(tp)] for d in range(dp)]
        # First and last pipeline stage of each (dp, tp) position: they share tied embeddings.
        embedding_groups = [sorted({rank_of(0, d, t, dp, tp), rank_of(pp - 1, d, t, dp, tp)})
                            for d in range(dp) for t in range(tp)]
        self.tp_group = self._mine("tp", tp_groups)
        self.dp_group = self._mine("dp", dp_groups)
        self.pp_group = self._mine("pp", pp_groups)
        self.mp_group = self._mine("mp", mp_groups)
        self.embedding_group = self._mine("embedding", embedding_groups)
        self.world_group = Group("world", tuple(range(self.world_size)))  # no handle: the default group

    def _mine(self, kind: str, all_groups: list[list[int]]) -> Group:
        """Create every group of this kind (all ranks must) and keep the one holding this rank; a rank in
        none of them (a middle pipeline stage has no embedding to share) gets a group of itself."""
        mine = Group(kind, (self.rank,))
        for ranks in all_groups:
            if self.world_size > 1:
                group = comm.new_group(kind, ranks, self.collective_timeout_seconds)
            else:
                group = Group(kind, tuple(ranks))
            if self.rank in ranks:
                mine = group
        return mine

    @property
    def log_prefix(self) -> str:
        return f"[rank {self.rank} dp{self.dp_rank} tp{self.tp_rank} pp{self.pp_rank}]"

    def close(self) -> None:
        comm.shutdown()
