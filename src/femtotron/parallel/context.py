"""ParallelContext: who this rank is in the (pp, dp, tp) mesh, and the process groups it talks on.

The layout is written once, here: `rank = (pp_rank * dp + dp_rank) * tp + tp_rank`. TP is
innermost so a TP group is consecutive ranks (the same host, the fastest links); PP is outermost.
Joining the job (the rendezvous, with a timeout that names the ranks that never came) is here too.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from femtotron.errors import DistributedError
from femtotron.parallel.comm import Comm, Group
from femtotron.parallel.store import Store

if TYPE_CHECKING:
    from femtotron.config import Config


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
    """Built once per process and passed explicitly to whoever needs a rank or a group; a context manager
    that closes the process group on exit.

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
        self.store = Store()
        self.hosts = [socket.gethostname()]
        if self.world_size > 1:
            host = os.environ.get("MASTER_ADDR", "127.0.0.1")
            port = int(os.environ.get("MASTER_PORT", "29500"))
            self.hosts, tcp_store = rendezvous(
                self.rank,
                self.world_size,
                host,
                port,
                self.backend,
                init_timeout_seconds,
                collective_timeout_seconds,
            )
            self.store = Store(tcp_store, (host, port))
        coords = coordinates_of(self.rank, dp, tp)
        self.pp_rank, self.dp_rank, self.tp_rank = coords.pp_rank, coords.dp_rank, coords.tp_rank
        self._build_groups()

    @classmethod
    def from_config(cls, config: Config) -> ParallelContext:
        par = config.parallelism
        return cls(
            par.dp,
            par.tp,
            par.pp,
            init_timeout_seconds=par.init_timeout_seconds,
            collective_timeout_seconds=par.collective_timeout_seconds,
        )

    def __enter__(self) -> ParallelContext:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

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
        embedding_groups = [
            sorted({rank_of(0, d, t, dp, tp), rank_of(pp - 1, d, t, dp, tp)})
            for d in range(dp)
            for t in range(tp)
        ]
        self.tp_group = self._mine("tp", tp_groups)
        self.dp_group = self._mine("dp", dp_groups)
        self.pp_group = self._mine("pp", pp_groups)
        self.mp_group = self._mine("mp", mp_groups)
        self.embedding_group = self._mine("embedding", embedding_groups)
        self.world_group = Group("world", tuple(range(self.world_size)))  # no handle: the default group

    def _mine(self, kind: str, all_groups: list[list[int]]) -> Group:
        """Create every group of this kind (all ranks must, in the same order: torch.distributed's rule) and
        keep the one holding this rank; a rank in none of them (a middle pipeline stage has no embedding to
        share) gets a group of itself. Subgroups do not inherit init_process_group's timeout: it is passed."""
        mine = Group(kind, (self.rank,))
        timeout = timedelta(seconds=self.collective_timeout_seconds)
        for ranks in all_groups:
            handle = dist.new_group(ranks, timeout=timeout) if self.world_size > 1 else None
            if self.rank in ranks:
                mine = Group(kind, tuple(ranks), handle)
        return mine

    @property
    def log_prefix(self) -> str:
        return f"[rank {self.rank} dp{self.dp_rank} tp{self.tp_rank} pp{self.pp_rank}]"

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def rendezvous(
    rank: int,
    world_size: int,
    host: str,
    port: int,
    backend: str,
    init_timeout: float,
    collective_timeout: float,
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
        store = dist.TCPStore(
            host,
            port,
            world_size,
            is_master=is_server,
            timeout=timedelta(seconds=init_timeout),
            wait_for_workers=False,
        )
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
            f"Process-group init timed out after {init_timeout:g} s at {where}: ranks {_ranges(joined)} "
            f"joined, ranks {_ranges(missing)} never did.\nCheck that those ranks were launched, that "
            f"WORLD_SIZE={world_size} matches the launcher, and that they can reach {host}:{port}. "
            f"{_NETWORK_ADVICE}\nRaise parallelism.init_timeout_seconds if nodes start slowly."
        ) from None
    hosts = [store.get(k).decode() for k in keys]
    dist.init_process_group(
        backend,
        store=dist.PrefixStore(f"{attempt}/pg", store),
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=collective_timeout),
    )
    return hosts, store


_NETWORK_ADVICE = (
    "On several nodes, the usual cause is the wrong network interface: set NCCL_SOCKET_IFNAME and "
    "GLOO_SOCKET_IFNAME (e.g. =eth0; `ip -br addr` lists them) on every node, and check "
    "MASTER_ADDR/MASTER_PORT."
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
