import os
import socket

import pytest
import torch
import torch.distributed as dist
from distributed import run_ranks

from femtotron.errors import DistributedError
from femtotron.parallel.context import (
    ParallelContext,
    device_index,
    refuse_serialized_streams,
    rendezvous,
    shared_gpus,
)


def test_D2_world_of_one_needs_no_launcher(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    ctx = ParallelContext()
    assert (ctx.rank, ctx.world_size, ctx.device.type, ctx.backend) == (0, 1, "cpu", "gloo")
    assert ctx.log_prefix == "[rank 0 dp0 tp0 pp0]"
    t = torch.ones(3)
    assert ctx.comm.all_reduce(t, ctx.dp_group) is t and ctx.comm.bytes_sent == {}
    ctx.close()


def _mesh(rank):
    ctx = ParallelContext(dp=2, tp=2, pp=2, init_timeout_seconds=30, collective_timeout_seconds=30)
    out = {
        "coords": (ctx.pp_rank, ctx.dp_rank, ctx.tp_rank),
        "groups": {g.kind: g.ranks for g in (ctx.tp_group, ctx.dp_group, ctx.pp_group, ctx.mp_group)},
        "prefix": ctx.log_prefix,
    }
    # Each group really connects its members: summing the global ranks gives the group's sum.
    out["sums"] = {
        g.kind: int(ctx.comm.all_reduce(torch.tensor([float(rank)]), g).item())
        for g in (ctx.tp_group, ctx.dp_group, ctx.pp_group)
    }
    ctx.close()
    return out


@pytest.mark.distributed
def test_mesh_and_groups_on_eight_ranks():
    results = run_ranks(_mesh, 8)
    r5 = results[5]  # rank 5 = pp 1, dp 0, tp 1
    assert r5["coords"] == (1, 0, 1)
    assert r5["prefix"] == "[rank 5 dp0 tp1 pp1]"
    assert r5["groups"] == {"tp": (4, 5), "dp": (5, 7), "pp": (1, 5), "mp": (0, 1, 4, 5)}
    for res in results:
        for kind, ranks in res["groups"].items():
            if kind in res["sums"]:
                assert res["sums"][kind] == sum(ranks)


def _collectives(rank):
    ctx = ParallelContext(dp=4, init_timeout_seconds=30, collective_timeout_seconds=30)
    g = ctx.dp_group
    x = torch.full((4, 2), float(rank + 1))
    summed = ctx.comm.all_reduce(x.clone(), g)
    gathered = ctx.comm.all_gather(torch.tensor([float(rank)]), g)
    scattered = ctx.comm.reduce_scatter(torch.arange(8.0), g)
    received = None
    if rank in (0, 1):  # a point-to-point pair, as the pipeline sends (parallel/pipeline/p2p.py)
        buffer = torch.zeros(1)
        kind, tensor = ("send", torch.tensor([42.0])) if rank == 0 else ("recv", buffer)
        work = ctx.comm.start_p2p(kind, tensor, 1 - rank, g, tag=0)
        ctx.comm.wait(work, g, buffer, peer=1 - rank)
        received = buffer.item() if rank == 1 else None
    ctx.comm.barrier(g)
    seconds = ctx.comm.take_seconds()
    assert seconds.keys() == {"dp"} and seconds["dp"] > 0 and ctx.comm.take_seconds() == {}
    out = (
        summed[0, 0].item(),
        gathered.tolist(),
        scattered.tolist(),
        received,
        dict(ctx.comm.bytes_sent),
        ctx.comm.unfinished(),
        dict(ctx.comm.calls),
    )
    ctx.close()
    return out


@pytest.mark.distributed
def test_collectives_and_byte_accounting():
    results = run_ranks(_collectives, 4)
    for rank, (summed, gathered, scattered, _received, sent, unfinished, calls) in enumerate(results):
        assert calls["dp", "all_reduce"] == calls["dp", "all_gather"] == calls["dp", "reduce_scatter"] == 1
        assert calls["dp", "barrier"] == 1 and calls.get(("dp", "wait"), 0) == (1 if rank < 2 else 0)
        assert summed == 1 + 2 + 3 + 4
        assert gathered == [0.0, 1.0, 2.0, 3.0]
        assert scattered == [4 * (2 * rank), 4 * (2 * rank + 1)]
        assert unfinished == []
        assert sent["dp", "all_reduce"] == 2 * 3 / 4 * 8 * 4  # ring: 2(n-1)/n of 8 fp32 values
        assert sent["dp", "all_gather"] == 3 * 4
        assert sent["dp", "reduce_scatter"] == 3 / 4 * 8 * 4
    assert results[0][4]["dp", "send"] == 4 and results[1][3] == 42.0


def _only_rank_zero_arrives(rank):
    if rank != 0:
        return None
    with pytest.raises(DistributedError) as info:
        ParallelContext(dp=2, init_timeout_seconds=2)
    return str(info.value)


@pytest.mark.distributed
def test_L4_init_timeout_names_missing_ranks_and_interfaces():
    message = run_ranks(_only_rank_zero_arrives, 2, timeout=60)[0]
    assert "ranks 0 joined" in message and "ranks 1 never did" in message
    assert "NCCL_SOCKET_IFNAME" in message and "GLOO_SOCKET_IFNAME" in message
    assert "127.0.0.1:" in message and "gloo" in message


def test_L1_mismatched_world_size_is_refused_before_init(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(DistributedError, match=r"dp\*cp\*tp\*pp = 1\*1\*2\*1 = 2 but WORLD_SIZE = 4"):
        ParallelContext(tp=2)
    assert os.environ["WORLD_SIZE"] == "4"


def _rank_one_skips_the_collective(rank):
    ctx = ParallelContext(dp=2, init_timeout_seconds=30, collective_timeout_seconds=3)
    if rank == 1:
        return None  # never joins the all-reduce below: the classic "one rank took another branch"
    with pytest.raises(DistributedError) as info:
        ctx.comm.all_reduce(torch.ones(4, 8), ctx.dp_group)
    return str(info.value), ctx.comm.unfinished()


@pytest.mark.distributed
def test_a_collective_that_times_out_names_the_op_group_and_shape():
    message, unfinished = run_ranks(_rank_one_skips_the_collective, 2, timeout=90)[0]
    assert "rank 0: all_reduce on dp[0,1] for a (4, 8) torch.float32 tensor failed after" in message
    assert "collective_timeout_seconds" in message and "same collective" in message
    assert [op.kind for op in unfinished] == ["all_reduce"]  # a failed op stays, for the reports


def test_L1_a_process_that_sees_one_gpu_takes_it_whatever_its_local_rank():
    assert [device_index(r, 8) for r in range(8)] == list(range(8))  # torchrun: each sees every GPU
    assert [device_index(r, 1) for r in range(4)] == [0, 0, 0, 0]  # srun --gpus-per-task=1, --gpu-bind
    assert device_index(5, 4) == 1


def test_L1_ranks_on_one_gpu_are_found_by_host_and_uuid():
    gpus = [("a", "GPU-1"), ("a", "GPU-2"), ("a", "GPU-1"), ("b", "GPU-1"), ("a", ""), ("a", "")]
    assert shared_gpus(gpus) == {("a", "GPU-1"): [0, 2]}  # CPU ranks (no UUID) share nothing
    assert shared_gpus([("a", "GPU-1"), ("a", "GPU-2")]) == {}


def _check_in_with(rank, uuids):
    gpu = (uuids[rank], f"cuda:0 of 1 visible, LOCAL_RANK={rank}, CUDA_VISIBLE_DEVICES=unset")
    port = int(os.environ["MASTER_PORT"])
    try:
        hosts, _store = rendezvous(
            rank=rank,
            world_size=len(uuids),
            host="127.0.0.1",
            port=port,
            device=torch.device("cpu"),
            init_timeout=30,
            collective_timeout=30,
            gpu=gpu,
        )
    except DistributedError as e:
        return str(e)
    dist.destroy_process_group()
    return hosts


@pytest.mark.distributed
def test_L1_two_ranks_on_one_gpu_are_refused_at_the_rendezvous_on_every_rank():
    messages = run_ranks(_check_in_with, 2, ["GPU-7f3a", "GPU-7f3a"], timeout=60)
    assert messages[0] == messages[1]
    message = messages[0]
    assert "Ranks 0, 1 share GPU GPU-7f3a on host " in message
    assert (
        "rank 0: cuda:0 of 1 visible, LOCAL_RANK=0" in message
        and "rank 1: cuda:0 of 1 visible, LOCAL_RANK=1" in message
    )
    for fix in ("CUDA_VISIBLE_DEVICES", "--nproc-per-node", "--gpus-per-task=1", "--gpu-bind"):
        assert fix in message
    assert run_ranks(_check_in_with, 2, ["GPU-7f3a", "GPU-00b1"], timeout=60)[0] == [socket.gethostname()] * 2


def _shared_handles(rank):
    created = []
    new_group = dist.new_group
    dist.new_group = lambda ranks, **kwargs: created.append(ranks) or new_group(ranks, **kwargs)
    ctx = ParallelContext(dp=1, tp=2, pp=2, init_timeout_seconds=30, collective_timeout_seconds=30)
    groups = (ctx.tp_group, ctx.pp_group, ctx.mp_group, ctx.embedding_group, ctx.world_group)
    out = {
        "created": created,
        "embedding is pp": ctx.embedding_group.handle is ctx.pp_group.handle is not None,
        "default": [g.kind for g in groups if g.handle is None],
        "sums": {g.kind: int(ctx.comm.all_reduce(torch.tensor([float(rank)]), g).item()) for g in groups},
    }
    ctx.close()
    return out


@pytest.mark.distributed
def test_groups_with_equal_ranks_share_one_process_group_and_still_work():
    """tp=2 pp=2: mp is the world (the default group), embedding = pp; 4 subgroups instead of 11, then the
    pipeline's one-way links (parallel/pipeline/p2p.py), one each way between the two stages."""
    results = run_ranks(_shared_handles, 4)
    for rank, out in enumerate(results):
        assert out["created"] == [[0, 1], [2, 3], [0, 2], [1, 3]] + [[0, 2], [0, 2], [1, 3], [1, 3]]
        assert out["embedding is pp"] and out["default"] == ["mp", "world"]
        tp_sum, pp_sum = (1 if rank < 2 else 5), (2 if rank % 2 == 0 else 4)
        assert out["sums"] == {"tp": tp_sum, "pp": pp_sum, "mp": 6, "embedding": pp_sum, "world": 6}


@pytest.mark.cuda
def test_L1_a_local_rank_beyond_the_visible_gpus_wraps_around(monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", str(torch.cuda.device_count()))
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    ctx = ParallelContext()
    assert ctx.device == torch.device("cuda", 0) and ctx.backend == "nccl"
    ctx.close()


def test_cuda_device_max_connections_1_is_refused_with_pp_or_cp(monkeypatch):
    """One hardware queue starts kernels in issue order: the pipeline's and the ring's receive-then-send on
    two NCCL streams can deadlock there. Refused on GPUs with pp or cp > 1, naming the variable and fix."""
    cuda = torch.device("cuda", 0)
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    for pp, cp in ((2, 1), (1, 2)):
        with pytest.raises(DistributedError, match="unset CUDA_DEVICE_MAX_CONNECTIONS") as info:
            refuse_serialized_streams(cuda, pp, cp)
        assert f"CUDA_DEVICE_MAX_CONNECTIONS=1 with parallelism.pp={pp}, cp={cp}" in str(info.value)
    refuse_serialized_streams(cuda, 1, 1)  # tp and dp only: no transfer waits on another stream
    refuse_serialized_streams(torch.device("cpu"), 2, 2)
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "8")
    refuse_serialized_streams(cuda, 2, 2)
