"""parallel/comm.py: collectives along any dimension, the ops a rank waits for, NCCL's semantics on gloo."""

from __future__ import annotations

import time
import weakref

import pytest
import torch
import torch.distributed as dist
from distributed import run_ranks

from femtotron.errors import DistributedError
from femtotron.parallel.comm import Comm, Group
from femtotron.parallel.context import ParallelContext


def _along_dimensions(rank):
    ctx = ParallelContext(dp=2, collective_timeout_seconds=30)
    g = ctx.dp_group
    comm = ctx.comm
    x = torch.arange(24.0).view(2, 3, 4) + 100 * rank  # (batch, sequence, hidden), as sequence parallelism
    out = {dim: comm.all_gather(x, g, dim=dim) for dim in (0, 1, -1)}
    scattered = {}
    for dim in (0, 1, -1):
        doubled = torch.cat([x, x + 1], dim=dim)
        scattered[dim] = comm.reduce_scatter(doubled, g, dim=dim)
    ctx.close()
    return x, out, scattered


@pytest.mark.distributed
def test_all_gather_and_reduce_scatter_along_any_dimension():
    """One collective into one buffer: gathered parts in rank order along `dim`, and this rank's equal part
    of the sum along `dim`, as torch.cat and torch.chunk would give."""
    results = run_ranks(_along_dimensions, 2)
    parts = [x for x, _, _ in results]
    for rank, (_, gathered, scattered) in enumerate(results):
        for dim, got in gathered.items():
            assert torch.equal(got, torch.cat(parts, dim=dim)), dim
        for dim, got in scattered.items():
            total = sum(torch.cat([p, p + 1], dim=dim) for p in parts)
            assert torch.equal(got, total.chunk(2, dim=dim)[rank]), dim


def _started_ops_land_at_their_wait(rank):
    ctx = ParallelContext(dp=2, collective_timeout_seconds=30)
    comm = Comm(emulate_nccl=True)
    g = ctx.dp_group
    seen = {}
    summed = torch.full((4,), rank + 1.0)
    work = comm.start_all_reduce(summed, g)
    seen["all_reduce"] = (summed.isnan().all().item(), work, summed)
    flat = torch.arange(4.0) + rank
    own = flat[2 * rank : 2 * rank + 2]  # this rank's part of the sum
    work = comm.start_reduce_scatter(own, flat, g)
    seen["reduce_scatter"] = (flat.isnan().all().item(), work, own)
    gathered = torch.zeros(4)
    shard = gathered[2 * rank : 2 * rank + 2]
    shard.fill_(rank + 1.0)
    work = comm.start_all_gather(gathered, shard, g)
    seen["all_gather"] = (gathered.isnan().all().item(), work, gathered)
    received = torch.zeros(3)
    send = comm.start_p2p("send", torch.full((3,), 7.0 + rank), 1 - rank, g, tag=5)
    work = comm.start_p2p("recv", received, 1 - rank, g, tag=5)
    seen["recv"] = (received.isnan().all().item(), work, received)
    out = {}
    for name, (nan_before, work, tensor) in seen.items():
        comm.wait(work, g, tensor)
        out[name] = (nan_before, tensor.tolist())
    comm.wait(send, g, received)
    out["unfinished"] = comm.unfinished()
    ctx.close()
    return out


@pytest.mark.distributed
def test_with_nccl_semantics_a_started_op_s_result_arrives_only_at_its_wait():
    """Before its wait a started op's tensor holds NaN (on GPUs it would hold whatever was there), so code
    that reads it early fails on a CPU; after the wait it holds the result."""
    for rank, out in enumerate(run_ranks(_started_ops_land_at_their_wait, 2)):
        assert out["all_reduce"] == (True, [3.0] * 4)
        assert out["reduce_scatter"] == (True, [2 * (2 * rank) + 1, 2 * (2 * rank + 1) + 1])
        assert out["all_gather"] == (True, [1.0, 1.0, 2.0, 2.0])
        assert out["recv"] == (True, [7.0 + 1 - rank] * 3)
        assert out["unfinished"] == []


def _late_peer(rank):
    ctx = ParallelContext(dp=2, collective_timeout_seconds=30)
    comm = ctx.comm
    g = ctx.dp_group
    if rank == 1:
        time.sleep(2)  # rank 0's op cannot complete before rank 1 joins it
    work = comm.start_all_reduce(torch.ones(4), g)
    waiting = [(op.kind, op.group) for op in comm.unfinished()]
    comm.wait(work, g, torch.ones(4))
    comm.read(torch.ones(()), "loss")
    out = {
        "waiting": waiting,
        "unfinished": comm.unfinished(),
        "last_kind": comm.last_op.kind,
        "last_group": comm.last_op.group,
    }
    ctx.close()
    return out


@pytest.mark.distributed
def test_unfinished_lists_the_ops_a_rank_waits_for_until_they_complete():
    """What the hang report reads on NCCL, where a call returns once its op is queued: the op, until its work
    says it is complete; then nothing. A read of a result on the host is recorded as a wait for the device."""
    out = run_ranks(_late_peer, 2)[0]
    waiting = out["waiting"]
    unfinished = out["unfinished"]
    last_kind = out["last_kind"]
    last_group = out["last_group"]
    assert waiting == [("all_reduce", "dp[0,1]")]
    assert unfinished == [] and (last_kind, last_group) == ("wait for the device (loss)", None)


def _finished_ops_let_go(rank):
    ctx = ParallelContext(dp=2, collective_timeout_seconds=30)
    comm = ctx.comm
    g = ctx.dp_group
    received = torch.zeros(1)
    # NCCL blocks a pair's first transfer on a group until the peer posts one (parallel/comm.py): connected
    # first, so that rank 0's receive below is posted at once while rank 1 is in the all-reduces.
    comm.connect([ctx.world_group], ctx.device)
    if rank == 0:  # an op on another group that stays unfinished meanwhile
        pending = comm.start_p2p("recv", received, 1, ctx.world_group, tag=9)
    held = []
    for _ in range(3):
        tensor = torch.ones(1024)
        comm.all_reduce(tensor, g)
        held.append(weakref.ref(tensor))
        del tensor
    comm.all_reduce(torch.ones(1), g)  # the group's next op drops the finished ones before it
    # gloo's own threads may let go of a finished op's tensors a moment later: allow them that moment.
    deadline = time.monotonic() + 2
    while any(ref() is not None for ref in held) and time.monotonic() < deadline:
        time.sleep(0.01)
    alive = [ref() is not None for ref in held]
    if rank == 1:
        send = comm.start_p2p("send", torch.ones(1), 0, ctx.world_group, tag=9)
        comm.wait(send, ctx.world_group, received)
    else:
        comm.wait(pending, ctx.world_group, received)
    ctx.close()
    return alive


@pytest.mark.distributed
def test_finished_ops_are_let_go_with_their_tensors():
    """Ops are kept until complete, for the hang report; a finished op's work (on GPUs holding its tensors,
    activations under sequence parallelism) must not stay alive with it, even behind an op of another group
    that has not finished."""
    assert run_ranks(_finished_ops_let_go, 2) == [[False] * 3] * 2


@pytest.mark.distributed  # so that it runs under both semantics (tests/conftest.py); it starts no process
def test_the_nccl_semantics_cases_really_emulate_nccl(comm_semantics):
    """Every distributed test of tests/parallel/ runs twice; the second time the ranks must really behave as
    NCCL does (the fixture once only parametrized the id, and every "nccl-semantics" case ran as gloo)."""
    assert comm_semantics in ("gloo", "nccl-semantics")
    assert Comm().emulate_nccl == (comm_semantics == "nccl-semantics")


def _emulates_nccl(rank):
    ctx = ParallelContext(dp=2, collective_timeout_seconds=30)
    try:
        return ctx.comm.emulate_nccl
    finally:
        ctx.close()


@pytest.mark.distributed
def test_forked_ranks_run_under_the_semantics_the_case_names(comm_semantics):
    """The ranks, not only the test's own process: were the choice lost on the way to the children, every
    "nccl-semantics" case would be a second gloo run, and turning the emulation off removes failures only."""
    assert run_ranks(_emulates_nccl, 2) == [comm_semantics == "nccl-semantics"] * 2


def _unfinished_behind_a_pending_receive(rank):
    ctx = ParallelContext(dp=2, collective_timeout_seconds=30)
    comm = ctx.comm
    group = ctx.world_group
    received = torch.zeros(1)
    comm.connect([group], ctx.device)
    if rank == 0:
        pending = comm.start_p2p("recv", received, 1, group, tag=7)
    comm.all_reduce(torch.ones(1), group)  # complete, queued on the same group behind the receive
    listed = [(op.kind, op.peer) for op in comm.unfinished()]
    comm.barrier(group)
    if rank == 1:
        send = comm.start_p2p("send", torch.ones(1), 0, group, tag=7)
        comm.wait(send, group, received)
    else:
        comm.wait(pending, group, received)
    ctx.close()
    return listed


@pytest.mark.distributed
def test_unfinished_skips_completed_ops_queued_behind_a_pending_one():
    """A hang report must not name an op that finished: gloo completes a group's ops out of order, so a
    completed all-reduce can sit behind a receive still waiting for its peer."""
    listed = run_ranks(_unfinished_behind_a_pending_receive, 2)
    assert listed == [[("recv", 1)], []]


def _first_transfers(rank, connect_first):
    ctx = ParallelContext(dp=2, collective_timeout_seconds=30)
    comm = Comm(emulate_nccl=True, store=ctx.store, connect_timeout=3)
    # Two one-way groups, as the pipeline's links: rank 0 sends on the first, rank 1 on the second.
    links = [Group("pp", (0, 1), dist.new_group([0, 1]), one_way=True)]
    links.append(Group("pp", (1, 0), dist.new_group([0, 1]), one_way=True))
    if connect_first:
        comm.connect(links, ctx.device)
    outgoing = links[rank]
    incoming = links[1 - rank]
    received = torch.zeros(2)
    try:  # both send first, as the pipeline's shape handshake does
        send = comm.start_p2p("send", torch.full((2,), rank + 1.0), 1 - rank, outgoing, tag=1)
        receive = comm.start_p2p("recv", received, 1 - rank, incoming, tag=1)
        comm.wait(receive, incoming, received)
        comm.wait(send, outgoing, received)
        return received.tolist()
    except DistributedError as e:
        return str(e)
    finally:
        ctx.close()


@pytest.mark.distributed
def test_with_nccl_semantics_first_transfers_in_a_cycle_fail_and_connecting_first_fixes_them():
    """NCCL connects a pair on its first transfer on a communicator, the host blocking until the peer posts
    one too: two ranks each sending first on its own one-way group wait for each other forever. Emulated,
    that fails after the connect timeout, naming the rank, group and peer; `Comm.connect` at start-up (as
    ParallelContext does with the pipeline's and ring's links) makes the same transfers go through."""
    for rank, message in enumerate(run_ranks(_first_transfers, 2, False)):
        link = "pp[0->1]" if rank == 0 else "pp[1->0]"
        assert message.startswith(f"rank {rank}: its first send on {link} waited 3 s for rank {1 - rank}")
        assert "On NCCL this hangs forever" in message
    assert run_ranks(_first_transfers, 2, True) == [[2.0, 2.0], [1.0, 1.0]]
