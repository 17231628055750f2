import os

import pytest
import torch
from distributed import run_ranks

from femtotron.errors import DistributedError
from femtotron.parallel.context import ParallelContext, coordinates_of, rank_of


def test_T3_rank_layout_is_tp_innermost_pp_outermost():
    dp, tp, pp = 2, 2, 2
    assert [rank_of(0, 0, t, dp, tp) for t in range(tp)] == [0, 1]
    assert [rank_of(0, d, 0, dp, tp) for d in range(dp)] == [0, 2]
    assert [rank_of(p, 0, 0, dp, tp) for p in range(pp)] == [0, 4]
    for rank in range(dp * tp * pp):
        c = coordinates_of(rank, dp, tp)
        assert rank_of(c.pp_rank, c.dp_rank, c.tp_rank, dp, tp) == rank


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
        op = ("send", torch.tensor([42.0]), 1, 0) if rank == 0 else ("recv", buffer, 0, 0)
        (work,) = ctx.comm.batch_p2p([op], g)
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
        ctx.comm.in_flight,
        dict(ctx.comm.calls),
    )
    ctx.close()
    return out


@pytest.mark.distributed
def test_collectives_and_byte_accounting():
    results = run_ranks(_collectives, 4)
    for rank, (summed, gathered, scattered, _received, sent, in_flight, calls) in enumerate(results):
        assert calls["dp", "all_reduce"] == calls["dp", "all_gather"] == calls["dp", "reduce_scatter"] == 1
        assert calls["dp", "barrier"] == 1 and calls.get(("dp", "wait"), 0) == (1 if rank < 2 else 0)
        assert summed == 1 + 2 + 3 + 4
        assert gathered == [0.0, 1.0, 2.0, 3.0]
        assert scattered == [4 * (2 * rank), 4 * (2 * rank + 1)]
        assert in_flight is None
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
    with pytest.raises(DistributedError, match=r"dp\*tp\*pp = 1\*2\*1 = 2 but WORLD_SIZE = 4"):
        ParallelContext(tp=2)
    assert os.environ["WORLD_SIZE"] == "4"


def _rank_one_skips_the_collective(rank):
    ctx = ParallelContext(dp=2, init_timeout_seconds=30, collective_timeout_seconds=3)
    if rank == 1:
        return None  # never joins the all-reduce below: the classic "one rank took another branch"
    with pytest.raises(DistributedError) as info:
        ctx.comm.all_reduce(torch.ones(4, 8), ctx.dp_group)
    return str(info.value), ctx.comm.in_flight


@pytest.mark.distributed
def test_a_collective_that_times_out_names_the_op_group_and_shape():
    message, in_flight = run_ranks(_rank_one_skips_the_collective, 2, timeout=90)[0]
    assert "rank 0: all_reduce on dp[0,1] for a (4, 8) torch.float32 tensor failed after" in message
    assert "collective_timeout_seconds" in message and "same collective" in message
    assert in_flight is not None and in_flight.kind == "all_reduce"
