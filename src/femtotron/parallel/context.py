"""ParallelContext: joining the job, this rank's place in the mesh, and its process groups and links.

The mesh's arithmetic (which ranks form which group, in which order) is mesh.py's; this module
turns it into process groups, which every rank must create in one order (torch.distributed's rule), and
connects the one-way links of the pipeline and of the cp ring at start-up, before any schedule uses them.
Joining the job goes through our own check-in on the store first, so a rank that never arrives is named
instead of hanging, and two ranks on one GPU stop before NCCL would.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
from collections import defaultdict
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from femtotron.errors import DistributedError
from femtotron.mesh import ADDED_LATER, NAMED, Mesh
from femtotron.parallel.comm import Comm, Group
from femtotron.store import Store

if TYPE_CHECKING:
    from femtotron.config import Config


BACKENDS = {"cuda": "nccl", "cpu": "gloo"}


@dataclass(frozen=True)
class PipeLink:
    """A neighbouring pipeline stage's rank, and a process group for each direction to it (p2p.py: why)."""

    rank: int
    outgoing: Group
    incoming: Group


def refuse_serialized_streams(device: torch.device, pp: int, cp: int) -> None:
    """CUDA_DEVICE_MAX_CONNECTIONS=1 (which Megatron recipes export for their tensor-parallel overlap) gives
    the GPU one hardware queue: kernels of different streams then start in issue order. The pipeline and the
    cp ring each have a receive on one NCCL stream waiting for a peer's send on another; issued in that
    order on every rank, the sends can never start."""
    if device.type == "cuda" and max(pp, cp) > 1 and os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS") == "1":
        raise DistributedError(
            f"CUDA_DEVICE_MAX_CONNECTIONS=1 with parallelism.pp={pp}, cp={cp}: with one hardware queue the "
            "GPU starts kernels of different streams in issue order, and the pipeline's (or the cp ring's) "
            "transfers, each waiting for a peer on its own NCCL stream, can deadlock. femtotron does not "
            "need it: unset CUDA_DEVICE_MAX_CONNECTIONS (or set it to 8 or more) in the job's environment."
        )


def device_index(local_rank: int, visible: int) -> int:
    """GPU LOCAL_RANK where each process sees all of the node's GPUs (torchrun); its only one where it sees
    one (`srun --gpus-per-task=1`, `--gpu-bind`, one GPU per container)."""
    return local_rank % visible


def shared_gpus(gpus: list[tuple[str, str]]) -> dict[tuple[str, str], list[int]]:
    """(host, GPU UUID) by rank -> the GPUs more than one rank took, with those ranks (UUID "": no GPU)."""
    ranks_on: defaultdict[tuple[str, str], list[int]] = defaultdict(list)
    for rank, gpu in enumerate(gpus):
        ranks_on[gpu].append(rank)
    return {gpu: ranks for gpu, ranks in ranks_on.items() if gpu[1] and len(ranks) > 1}


class ParallelContext:
    """Built once per process and passed explicitly to whoever needs a rank or a group; a context manager
    that closes the process group on exit. A world of one process needs no launcher and creates no process
    group: every group has one member and every collective in `Comm` returns at once."""

    def __init__(
        self,
        dp: int = 1,
        tp: int = 1,
        pp: int = 1,
        cp: int = 1,
        ep: int = 1,
        *,
        init_timeout_seconds: float = 300.0,
        collective_timeout_seconds: float = 600.0,
    ) -> None:
        """Args:
        dp: data-parallel size.
        tp: tensor-parallel size.
        pp: pipeline-parallel size.
        cp: context-parallel size.
        ep: expert-parallel size (a divisor of dp * cp; not a dimension of the world).
        init_timeout_seconds: how long the rendezvous waits for every rank before it fails with a message.
        collective_timeout_seconds: how long one collective may wait before the process group gives up.
        """
        self.mesh = Mesh(pp=pp, dp=dp, cp=cp, tp=tp, ep=ep)
        self.dp = dp
        self.tp = tp
        self.pp = pp
        self.cp = cp
        self.ep = ep
        self.world_size = int(os.environ.get("WORLD_SIZE", "1"))
        self.rank = int(os.environ.get("RANK", "0"))
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        if self.mesh.world_size != self.world_size:
            # The config check (check_world_size) normally catches this first, with suggestions.
            raise DistributedError(
                f"dp*cp*tp*pp = {dp}*{cp}*{tp}*{pp} = {self.mesh.world_size} but WORLD_SIZE = "
                f"{self.world_size}: "
                "set parallelism.dp/cp/tp/pp so their product equals the number of processes launched."
            )
        if (dp * cp) % ep:
            raise DistributedError(
                f"ep={ep} does not divide dp*cp = {dp * cp}: the experts are split over ep of the ranks "
                "holding the same dense parameters. Set parallelism.ep to a divisor of dp * cp."
            )
        self.collective_timeout_seconds = collective_timeout_seconds
        self.device, gpu = self._pick_device()
        self.backend = BACKENDS[self.device.type]
        refuse_serialized_streams(self.device, pp, cp)
        self.store = Store()
        self.hosts = [socket.gethostname()]
        if self.world_size > 1:
            host = os.environ.get("MASTER_ADDR", "127.0.0.1")
            port = int(os.environ.get("MASTER_PORT", "29500"))
            self.hosts, tcp = rendezvous(
                rank=self.rank,
                world_size=self.world_size,
                host=host,
                port=port,
                device=self.device,
                init_timeout=init_timeout_seconds,
                collective_timeout=collective_timeout_seconds,
                gpu=gpu,
            )
            self.store = Store(tcp, (host, port))
        self.comm = Comm(store=self.store, connect_timeout=collective_timeout_seconds)
        place = self.mesh.coordinates_of(self.rank)
        self.pp_rank = place.pp_rank
        self.dp_rank = place.dp_rank
        self.cp_rank = place.cp_rank
        self.tp_rank = place.tp_rank
        self._build_groups()

    @classmethod
    def from_config(cls, config: Config) -> ParallelContext:
        par = config.parallelism
        timeouts = par.model_dump(include={"init_timeout_seconds", "collective_timeout_seconds"})
        return cls(dp=par.dp, tp=par.tp, pp=par.pp, cp=par.cp, ep=par.ep, **timeouts)

    def __enter__(self) -> ParallelContext:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _pick_device(self) -> tuple[torch.device, tuple[str, str]]:
        """This process's device, and its GPU's UUID with how it was chosen (empty without a GPU)."""
        if not torch.cuda.is_available():
            return torch.device("cpu"), ("", "")
        visible = torch.cuda.device_count()
        device = torch.device("cuda", device_index(self.local_rank, visible))
        torch.cuda.set_device(device)
        mask = os.environ.get("CUDA_VISIBLE_DEVICES", "unset")
        how = f"{device} of {visible} visible, LOCAL_RANK={self.local_rank}, CUDA_VISIBLE_DEVICES={mask}"
        return device, (str(torch.cuda.get_device_properties(device).uuid), how)

    def _build_groups(self) -> None:
        """Every rank creates every subgroup, in one order (torch.distributed's rule), and takes the one of
        each kind holding it (or itself alone: a middle pipeline stage has no embedding to share); kinds with
        equal ranks share a process group. Subgroups do not inherit init_process_group's timeout: passed."""
        timeout = timedelta(seconds=self.collective_timeout_seconds)
        handles = {}
        for kind, sets in self.mesh.subgroups_by_kind().items():
            handles |= self._new_groups(kind, sets, timeout)
        groups = self.mesh.groups()

        def mine(kind: str) -> Group:
            ranks = next((ranks for ranks in groups.get(kind, []) if self.rank in ranks), (self.rank,))
            return Group(kind, ranks, handles.get(ranks))

        self.tp_group = mine("tp")
        self.dp_group = mine("dp")
        self.pp_group = mine("pp")
        self.cp_group = mine("cp")
        self.mp_group = mine("mp")
        self.embedding_group = mine("embedding")
        # Every rank holding the same parameters: dp's, or with cp > 1 those of dp x cp.
        self.dp_cp_group = mine("dp_cp") if self.cp > 1 else self.dp_group
        self.dp_cp_rank = self.dp_rank * self.cp + self.cp_rank
        # Expert parallelism splits the dp x cp ranks: ep groups share out the experts, edp groups hold alike.
        self.ep_group = mine("ep")
        self.edp_group = mine("edp") if self.ep > 1 else self.dp_cp_group
        self.ep_rank = self.dp_cp_rank % self.ep
        self.edp_rank = self.dp_cp_rank // self.ep
        self.world_group = Group("world", tuple(range(self.world_size)))
        kinds = {pair: "pp" for pair in self.mesh.pipe_links()} | {
            pair: "cp" for pair in self.mesh.ring_links()
        }
        # One new_group each: split_group names a group by its ranks, and a link's reverse has the same ones.
        links = {
            pair: Group(
                kind, pair, dist.new_group(sorted(pair), timeout=timeout, group_desc=kind), one_way=True
            )
            for pair, kind in kinds.items()
        }
        self.pp_links = {  # by the neighbour's pp rank
            p: PipeLink(peer, links[self.rank, peer], links[peer, self.rank])
            for p, peer in enumerate(self.pp_group.ranks)
            if (self.rank, peer) in links
        }
        # The cp ring: a one-way group to the following rank and one from the preceding (p2p.py: why).
        self.cp_links = None
        if self.cp > 1:
            ring = self.cp_group.ranks
            following = ring[(self.cp_rank + 1) % self.cp]
            preceding = ring[(self.cp_rank - 1) % self.cp]
            self.cp_links = (links[self.rank, following], links[preceding, self.rank])
        # Connected now, in creation order: the first transfers the schedules make would form a cycle (every
        # stage sends first, every ring rank receives first), and NCCL's lazy connection set-up hangs on one.
        self.comm.connect(list(links.values()), self.device)

    def _new_groups(
        self, kind: str, sets: list[tuple[int, ...]], timeout: timedelta
    ) -> dict[tuple[int, ...], dist.ProcessGroup]:
        """Process groups for disjoint rank sets, by rank set (this rank's at least). Each `new_group` is a
        world-wide ncclCommSplit when NCCL was initialised eagerly (rendezvous passes device_id), so on NCCL
        one `split_group` makes them all, as torch's DeviceMesh does (hundreds of calls fewer at scale)."""
        if self.backend != "nccl":
            return {ranks: dist.new_group(list(ranks), timeout=timeout, group_desc=kind) for ranks in sets}
        handle = dist.split_group(
            split_ranks=[list(ranks) for ranks in sets], timeout=timeout, group_desc=kind
        )
        return {ranks: handle for ranks in sets if self.rank in ranks}

    def norm_groups(self, *, replicas_differ: bool) -> list[Group]:
        """The ranks whose squared gradient norms add up to the whole model's: every rank holding a piece of
        one replica (pp x tp), and the replicas too (dp x cp) where they hold different pieces of it: ZeRO-1
        shards, or experts split over ep."""
        return [self.mp_group, self.dp_cp_group] if replicas_differ else [self.mp_group]

    def routing_groups(self) -> list[Group]:
        """The ranks whose MoE routing adds up to the step's: other samples and sequence parts (dp x cp) and
        other layers (pp). tp ranks route the same tokens, except under sequence parallelism."""
        return [self.dp_cp_group, self.pp_group]

    @property
    def log_prefix(self) -> str:
        """`[rank 5 dp0 tp1 pp1]`: each dimension's place, by name; cp and ep only where they are used."""
        places = [
            f"{name}{getattr(self, f'{name}_rank')}"
            for name in NAMED
            if name not in ADDED_LATER or self.mesh.size(name) > 1
        ]
        return f"[rank {self.rank} {' '.join(places)}]"

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def rendezvous(
    *,
    rank: int,
    world_size: int,
    host: str,
    port: int,
    device: torch.device,
    init_timeout: float,
    collective_timeout: float,
    gpu: tuple[str, str] = ("", ""),
) -> tuple[list[str], dist.Store]:
    """Join the job and create the default process group; return each rank's hostname, and the store (it
    stays reachable when collectives are stuck, so it carries what must get through regardless). Every rank
    first checks in under its own key with its GPU (`gpu`: UUID, "" for none, and how it was chosen), so a
    timeout names exactly the ranks that never arrived instead of hanging, and ranks sharing a GPU stop."""
    backend = BACKENDS[device.type]
    # Under torchrun the agent already serves the store on MASTER_PORT; every worker is a client.
    server = rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"
    where = f"{host}:{port} (backend {backend}, rank {rank} of {world_size})"
    limit = timedelta(seconds=init_timeout)
    try:
        store = dist.TCPStore(host, port, world_size, is_master=server, timeout=limit, wait_for_workers=False)
    except (RuntimeError, OSError) as e:
        raise DistributedError(
            f"Could not reach the rendezvous store at {where} within {init_timeout:g} s: {e}.\n"
            f"{_NETWORK_ADVICE}"
        ) from None
    attempt = f"femtotron/attempt{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"  # torchrun restarts
    keys = [f"{attempt}/joined/{r}" for r in range(world_size)]
    store.set(keys[rank], json.dumps([socket.gethostname(), *gpu]))
    try:
        store.wait(keys, limit)
    except (RuntimeError, OSError):
        joined = [r for r in range(world_size) if store.check([keys[r]])]
        missing = sorted(set(range(world_size)) - set(joined))
        raise DistributedError(
            f"Process-group init timed out after {init_timeout:g} s at {where}: ranks {_ranges(joined)} "
            f"joined, ranks {_ranges(missing)} never did.\nCheck that those ranks were launched, that "
            f"WORLD_SIZE={world_size} matches the launcher, and that they can reach {host}:{port}. "
            f"{_NETWORK_ADVICE}\nRaise parallelism.init_timeout_seconds if nodes start slowly."
        ) from None
    checked_in = [json.loads(store.get(k)) for k in keys]
    shared = shared_gpus([(name, uuid) for name, uuid, _ in checked_in])
    if shared:
        store.set(f"{attempt}/read/{rank}", "")
        if server:  # the store's server stays until every rank has read it
            with contextlib.suppress(RuntimeError, OSError):
                store.wait([f"{attempt}/read/{r}" for r in range(world_size)], limit)
        raise DistributedError(_shared_gpu_message(shared, checked_in))
    dist.init_process_group(
        backend,
        store=dist.PrefixStore(f"{attempt}/pg", store),
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=collective_timeout),
        # NCCL then creates the default communicator now, and splits every subgroup's from it.
        device_id=device if device.type == "cuda" else None,
    )
    return [name for name, _, _ in checked_in], store


def _shared_gpu_message(shared: dict[tuple[str, str], list[int]], checked_in: list[list[str]]) -> str:
    (host, uuid), ranks = next(iter(shared.items()))
    how = "; ".join(f"rank {r}: {checked_in[r][2]}" for r in ranks)
    return (
        f"Ranks {', '.join(map(str, ranks))} share GPU {uuid} on host {host} ({how}), but each "
        "process needs a GPU of its own (NCCL cannot run two ranks on one GPU). Fix: one process per GPU: "
        "with torchrun, --nproc-per-node = the GPUs per node; with srun, --ntasks-per-node = the GPUs per "
        "node and --gpus-per-task=1 (or --gpu-bind=single:1); and check that CUDA_VISIBLE_DEVICES does not "
        "hide GPUs from the processes."
    )


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
