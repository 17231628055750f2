"""Pipeline schedules, checked by simulating every rank's action list with the executor's rules."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import pytest

from femtotron.config.pipeline_engines import ENGINES as RECORDS
from femtotron.parallel.pipeline.schedules import Action, forward_only, schedule

ENGINES = list(RECORDS)  # every engine the config accepts
F_COST = 1
B_COST = 2  # a backward costs about twice a forward
W_COST = 1  # split (zb-h1): B is the input's gradient, B_COST - W_COST, and W the weights', W_COST


@dataclass(frozen=True)
class Message:
    kind: str  # "act" (forward activation) or "grad" (gradient)
    micro_batch: int
    src_stage: int
    dst_stage: int

    def __repr__(self) -> str:
        return f"{self.kind}(mb{self.micro_batch}, {self.src_stage}->{self.dst_stage})"


@dataclass
class SimResult:
    status: str  # "ok", "deadlock" or "error" (out-of-order channel head, backward before forward, ...)
    detail: str = ""
    # rank (with several pipelines: (pipeline, rank)) -> (action, awaited message; None: in the all-to-all)
    blocked: dict = field(default_factory=dict)
    finish: list[int] = field(default_factory=list)  # per-rank tick at which its last action ended

    @property
    def makespan(self) -> int:
        return max(self.finish)


def simulate(
    lists: list[list[Action]], pp: int, chunks: int, others: tuple[list[list[Action]], ...] = ()
) -> SimResult:
    """Run every pp rank's action list as the executor would and report how it ends.

    Rules: the virtual stage of (rank, chunk) is chunk * pp + rank, of S = pp * chunks. A forward
    F(mb) of stage s first receives act(mb, s-1->s) from the rank of stage s-1 (blocking, if s > 0),
    computes, then sends act(mb, s->s+1) to the rank of stage s+1 (if s < S-1, never blocking). A
    backward B(mb) of stage s needs its forward to have run earlier on this rank, receives
    grad(mb, s+1->s) (if s < S-1), computes, then sends grad(mb, s->s-1) (if s > 0). A weight-gradient pass
    W(mb) needs its B earlier on this rank and nothing else: it neither receives nor sends. Messages travel
    on one FIFO channel per ordered (src rank, dst rank) pair, activations and gradients alike, and a
    receive takes the channel's head, which must be exactly the awaited message (NCCL matches
    point-to-point operations in order), otherwise that is an error.

    `others`: the action lists of more pipelines (data-parallel replicas, each with channels of its own)
    whose ranks at a stage share a mixture of experts' all-to-all with that stage's rank of `lists`
    (expert parallelism over dp). In every action but W (forward, and backward: recomputation reruns the
    forward) the host then blocks at the all-to-all's split read (parallel/expert_parallel.py) until every
    pipeline's rank at that stage has begun the same action; the action ends at the latest begin among them
    plus its cost.

    Ranks are stepped round-robin, each for as long as it can progress. Since every rank's list and
    every channel's order are fixed, the outcome does not depend on that order. If no rank can
    progress while some have actions left, the result is a deadlock naming each rank's blocked action.

    Timing: a forward costs F_COST ticks, a backward B_COST (split in two when the rank's list has a W for
    it: B_COST - W_COST, then W_COST); an action starts once its rank is free and its input has arrived
    (sent at the sender's finish tick, no latency). `finish` is each rank's end.
    """
    S = pp * chunks
    pipelines = [lists, *others]
    ranks = [(d, rank) for d in range(len(pipelines)) for rank in range(pp)]
    channels: dict[tuple[int, int, int], deque[tuple[Message, int]]] = {}  # (pipeline, src, dst)
    pc = dict.fromkeys(ranks, 0)
    clock = dict.fromkeys(ranks, 0)
    begun: set[tuple[int, int]] = set()  # ranks whose current action has its input: in its all-to-all
    meetings: dict[tuple[int, int], dict[int, int]] = {}  # (rank, action index) -> pipeline -> begin tick
    forwarded: dict[tuple[int, int], set[tuple[int, int]]] = {key: set() for key in ranks}
    backwarded: dict[tuple[int, int], set[tuple[int, int]]] = {key: set() for key in ranks}
    split = {
        (d, rank): {(a.micro_batch, a.chunk) for a in pipelines[d][rank] if a.kind == "W"}
        for d, rank in ranks
    }

    def cost(d: int, rank: int, a: Action) -> int:
        if a.kind == "F":
            return F_COST
        if a.kind == "W":
            return W_COST
        return B_COST - W_COST if (a.micro_batch, a.chunk) in split[d, rank] else B_COST

    def awaited(rank: int, a: Action) -> tuple[Message, int] | None:
        s = a.chunk * pp + rank
        if a.kind == "F" and s > 0:
            return Message("act", a.micro_batch, s - 1, s), (s - 1) % pp
        if a.kind == "B" and s < S - 1:
            return Message("grad", a.micro_batch, s + 1, s), (s + 1) % pp
        return None

    def name(d: int, rank: int) -> str:
        return f"rank {rank}" if len(pipelines) == 1 else f"pipeline {d} rank {rank}"

    progress = True
    while progress:
        progress = False
        for d, rank in ranks:
            actions = pipelines[d][rank]
            while pc[d, rank] < len(actions):
                a = actions[pc[d, rank]]
                s = a.chunk * pp + rank
                if (d, rank) not in begun:
                    if a.kind not in ("F", "B", "W") or not 0 <= a.chunk < chunks:
                        return SimResult("error", f"{name(d, rank)}: bad action {a!r}")
                    if a.kind == "B" and (a.micro_batch, a.chunk) not in forwarded[d, rank]:
                        return SimResult("error", f"{name(d, rank)}: {a!r} runs before its forward")
                    if a.kind == "W" and (a.micro_batch, a.chunk) not in backwarded[d, rank]:
                        return SimResult("error", f"{name(d, rank)}: {a!r} runs before its backward")
                    start = clock[d, rank]
                    need = awaited(rank, a)
                    if need is not None:
                        msg, src = need
                        queue = channels.get((d, src, rank))
                        if not queue:
                            break  # blocked: try the other ranks
                        head, sent_at = queue[0]
                        if head != msg:
                            return SimResult(
                                "error",
                                f"{name(d, rank)}: {a!r} awaits {msg!r} from rank {src} "
                                f"but the channel's head is {head!r}",
                            )
                        queue.popleft()
                        start = max(start, sent_at)
                    begun.add((d, rank))
                    meetings.setdefault((rank, pc[d, rank]), {})[d] = start
                meeting = meetings[rank, pc[d, rank]]
                if a.kind == "W":  # the weights' gradients only: no all-to-all, no peer to wait for
                    meeting = {d: meeting[d]}
                elif len(meeting) < len(pipelines):
                    break  # in the all-to-all: another pipeline's rank at this stage has not begun it
                begun.discard((d, rank))
                clock[d, rank] = max(meeting.values()) + cost(d, rank, a)
                out = None
                if a.kind == "F":
                    forwarded[d, rank].add((a.micro_batch, a.chunk))
                    out = Message("act", a.micro_batch, s, s + 1) if s < S - 1 else None
                elif a.kind == "B":
                    backwarded[d, rank].add((a.micro_batch, a.chunk))
                    out = Message("grad", a.micro_batch, s, s - 1) if s > 0 else None
                if out is not None:
                    channel = (d, rank, out.dst_stage % pp)
                    channels.setdefault(channel, deque()).append((out, clock[d, rank]))
                pc[d, rank] += 1
                progress = True

    finish = [clock[key] for key in ranks]
    stuck = [(d, rank) for d, rank in ranks if pc[d, rank] < len(pipelines[d][rank])]
    if stuck:
        blocked = {}
        for d, rank in stuck:
            a = pipelines[d][rank][pc[d, rank]]
            need = None if (d, rank) in begun else awaited(rank, a)[0]
            blocked[rank if len(pipelines) == 1 else (d, rank)] = (a, need)
        parts = []
        for key, (a, m) in blocked.items():
            who = name(*key) if isinstance(key, tuple) else f"rank {key}"
            waiting = f"awaiting {m!r}" if m is not None else "in the all-to-all"
            parts.append(f"{who} blocked at {a!r} {waiting}")
        return SimResult(status="deadlock", detail="; ".join(parts), blocked=blocked, finish=finish)
    leftover = {k: [m for m, _ in q] for k, q in channels.items() if q}
    if leftover:
        return SimResult(status="error", detail=f"messages never received: {leftover}", finish=finish)
    return SimResult(status="ok", finish=finish)


def lists_for(engine: str, pp: int, m: int, v: int) -> list[list[Action]]:
    return [schedule(engine, pp, r, m, v) for r in range(pp)]


def cases(engine: str, pp: int, m_max: int = 16):
    """(m, v) pairs: interleaved needs m divisible by pp and has v in 2..4; the others have v = 1."""
    if RECORDS[engine].interleaves:
        return [(m, v) for v in (2, 3, 4) for m in range(pp, m_max + 1, pp)]
    return [(m, 1) for m in range(1, m_max + 1)]


def leading_forwards(actions: list[Action]) -> int:
    return next((i for i, a in enumerate(actions) if a.kind == "B"), len(actions))


def max_in_flight(actions: list[Action], kind: str = "F") -> int:
    """The most micro-batches at once past their `kind` pass ("F": forward, "B": B) and before the next."""
    passes = "FBW"
    following = passes[passes.index(kind) + 1]
    held = 0
    most = 0
    for a in actions:
        held += (a.kind == kind) - (a.kind == following)
        most = max(most, held)
    return most


# 1. Completeness and per-rank order.


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("pp", [1, 2, 3, 4, 8])
def test_every_forward_has_one_backward_after_it(engine, pp):
    for m, v in cases(engine, pp):
        expected = {(mb, c) for mb in range(m) for c in range(v)}
        for rank, actions in enumerate(lists_for(engine, pp, m, v)):
            forwards = [(a.micro_batch, a.chunk) for a in actions if a.kind == "F"]
            backwards = [(a.micro_batch, a.chunk) for a in actions if a.kind == "B"]
            weights = [(a.micro_batch, a.chunk) for a in actions if a.kind == "W"]
            assert sorted(forwards) == sorted(expected), (engine, pp, m, v, rank)
            assert sorted(backwards) == sorted(expected), (engine, pp, m, v, rank)
            assert sorted(weights) == (sorted(expected) if engine == "zb-h1" else []), (
                engine,
                pp,
                m,
                v,
                rank,
            )
            position = {(a.kind, a.micro_batch, a.chunk): i for i, a in enumerate(actions)}
            for mb, c in expected:
                assert position[("F", mb, c)] < position[("B", mb, c)], (engine, pp, m, v, rank, mb, c)
                assert position[("B", mb, c)] < position.get(("W", mb, c), len(actions)), (
                    engine,
                    pp,
                    m,
                    rank,
                )


# 2. Warm-up: the forwards a rank runs before its first backward. The list holds the warm-up
# forwards, then the steady phase opens with one more forward before the first backward.


@pytest.mark.parametrize("pp", [1, 2, 3, 4, 8])
def test_warmup_counts(pp):
    for m in range(1, 17):
        for rank in range(pp):
            assert leading_forwards(schedule("afab", pp, rank, m)) == m
            warmup = min(pp - rank - 1, m)
            assert leading_forwards(schedule("1f1b", pp, rank, m)) == min(warmup + 1, m), (pp, m, rank)
            assert leading_forwards(schedule("zb-h1", pp, rank, m)) == min(warmup + 1, m), (pp, m, rank)
    for m, v in cases("interleaved-1f1b", pp):
        for rank in range(pp):
            warmup = min((pp - rank - 1) * 2 + (v - 1) * pp, m * v)
            # All forwards first when the warm-up covers every (micro-batch, chunk).
            assert leading_forwards(schedule("interleaved-1f1b", pp, rank, m, v)) == min(warmup + 1, m * v)


def test_warmup_examples():
    assert [repr(a) for a in schedule("1f1b", 4, 0, 4)] == ["F0", "F1", "F2", "F3", "B0", "B1", "B2", "B3"]
    assert [repr(a) for a in schedule("1f1b", 4, 3, 4)] == ["F0", "B0", "F1", "B1", "F2", "B2", "F3", "B3"]
    assert [repr(a) for a in schedule("1f1b", 4, 1, 4)] == ["F0", "F1", "F2", "B0", "F3", "B1", "B2", "B3"]
    # pp=2, v=2, m=2: rank 1 warms up with (v - 1) * pp = 2 forwards, rank 0 with 2 more.
    assert [repr(a) for a in schedule("interleaved-1f1b", 2, 1, 2, 2)] == [
        "F0",
        "F1",
        "F0.1",
        "B0.1",
        "F1.1",
        "B1.1",
        "B0",
        "B1",
    ]
    assert [repr(a) for a in schedule("interleaved-1f1b", 2, 0, 2, 2)] == [
        "F0",
        "F1",
        "F0.1",
        "F1.1",
        "B0.1",
        "B1.1",
        "B0",
        "B1",
    ]


# 3. Activations held: forwards whose backward has not run yet.


@pytest.mark.parametrize("pp", [1, 2, 3, 4, 8])
def test_in_flight_bound(pp):
    for m in range(1, 17):
        for rank in range(pp):
            assert max_in_flight(schedule("afab", pp, rank, m)) == m
            assert max_in_flight(schedule("1f1b", pp, rank, m)) == min(pp - rank, m), (pp, m, rank)
            # zb-h1: 1F1B's forwards and B's; W's keep at most rank + 1 micro-batches' weight-gradient inputs
            zero_bubble = schedule("zb-h1", pp, rank, m)
            assert max_in_flight(zero_bubble) == min(pp - rank, m), (pp, m, rank)
            assert max_in_flight(zero_bubble, "B") == min(rank + 1, m), (pp, m, rank)
    for m, v in cases("interleaved-1f1b", pp):
        for rank in range(pp):
            warmup = min((pp - rank - 1) * 2 + (v - 1) * pp, m * v)
            assert max_in_flight(schedule("interleaved-1f1b", pp, rank, m, v)) == min(warmup + 1, m * v)


# 4. Every schedule completes: no deadlock, every receive finds its message at its channel's head.


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("pp", range(1, 9))
def test_schedule_runs_to_completion(engine, pp):
    failures = []
    for m, v in cases(engine, pp):
        result = simulate(lists_for(engine, pp, m, v), pp, v)
        if result.status != "ok":
            failures.append(f"pp={pp} m={m} v={v}: {result.status}: {result.detail}")
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("engine", ["afab", "1f1b"])
@pytest.mark.parametrize("pp", [2, 4])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 8])
def test_small_pipelines_complete(engine, pp, m):
    assert simulate(lists_for(engine, pp, m, 1), pp, 1).status == "ok"


@pytest.mark.parametrize("pp,v", [(2, 2), (2, 3), (2, 4), (4, 2), (4, 4), (1, 3)])
@pytest.mark.parametrize("groups", [1, 2, 4])
def test_small_interleaved_pipelines_complete(pp, v, groups):
    # pp = 2 is where one channel carries activations and gradients both; pp = 1 sends to itself.
    m = pp * groups
    result = simulate(lists_for("interleaved-1f1b", pp, m, v), pp, v)
    assert result.status == "ok", result.detail


# Bubble: idle share of the simulated step against each engine's `bubble` (config/pipeline_engines.py).
# With uniform costs and free communication every schedule's makespan is exactly (m * v + pp - 1) * (F + B)
# in chunk units: fill and drain cost pp - 1 chunk-steps, i.e. (pp - 1) / v stage-steps. So the simulation
# matches `bubble` exactly for AFAB, 1F1B and interleaved-1F1B (e.g. pp=4, v=2, m=4: 9/33 = 0.2727).


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("pp", [1, 2, 3, 4, 8])
def test_bubble_matches_the_engine_s_bubble(engine, pp):
    for m, v in cases(engine, pp):
        result = simulate(lists_for(engine, pp, m, v), pp, v)
        if engine != "zb-h1":
            assert result.makespan == (m * v + pp - 1) * (F_COST + B_COST), (engine, pp, m, v)
        bubble = 1 - m * v * (F_COST + B_COST) / result.makespan
        assert bubble == pytest.approx(RECORDS[engine].bubble(pp, m, v)), (engine, pp, m, v)


@pytest.mark.parametrize("pp", range(2, 9))
def test_zb_h1_idles_a_third_of_1f1b(pp):
    """With F = B = W (a third of a stage-step each): 1F1B idles (pp - 1)(F + B + W) per rank, ZB-H1
    (pp - 1)(F + B - W) once m >= pp (every rank alike); with fewer micro-batches still less than 1F1B."""
    for m in range(1, 4 * pp + 1):
        plain = simulate(lists_for("1f1b", pp, m, 1), pp, 1)
        zero_bubble = simulate(lists_for("zb-h1", pp, m, 1), pp, 1)
        busy = m * (F_COST + B_COST)
        assert zero_bubble.makespan - busy < plain.makespan - busy, (pp, m)
        if m >= pp:
            assert plain.makespan - busy == (pp - 1) * (F_COST + B_COST)
            assert zero_bubble.makespan - busy == (pp - 1) * (F_COST + B_COST - 2 * W_COST), (pp, m)


def test_zb_h1_examples():
    """Rank r's W's trail its B's by r: the last stage sends gradients back first, its W's at the end."""
    assert [repr(a) for a in schedule("zb-h1", 4, 0, 4)] == [
        *("F0", "F1", "F2", "F3"),
        *("B0", "W0", "B1", "W1", "B2", "W2", "B3", "W3"),
    ]
    assert [repr(a) for a in schedule("zb-h1", 4, 3, 4)] == [
        *("F0", "B0", "F1", "B1", "F2", "B2", "F3", "B3", "W0"),
        *("W1", "W2", "W3"),
    ]
    assert [repr(a) for a in schedule("zb-h1", 4, 1, 4)] == [
        *("F0", "F1", "F2", "B0", "F3", "B1", "W0"),
        *("B2", "W1", "B3", "W2", "W3"),
    ]


@pytest.mark.parametrize("pp", [2, 4, 8])
def test_interleaving_shrinks_the_bubble(pp):
    for m in (pp, 2 * pp, 4 * pp):
        plain = simulate(lists_for("1f1b", pp, m, 1), pp, 1).makespan
        for v in (2, 3, 4):
            # Each chunk is 1/v of a stage, so in plain 1F1B units the step takes makespan / v.
            assert simulate(lists_for("interleaved-1f1b", pp, m, v), pp, v).makespan / v < plain, (pp, m, v)


# 4b. Expert parallelism over dp: a MoE layer's host blocks in every action until the ep peers (the other
# replicas' ranks at the same stage) reach the same all-to-all. Every engine still completes, in the same
# time: the replicas run the same schedule, so they meet at each all-to-all as they arrive.


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("pp", [1, 2, 3, 4, 8])
def test_a_host_blocked_in_every_moe_layer_completes_every_schedule(engine, pp):
    failures = []
    for m, v in cases(engine, pp, m_max=8):
        lists = lists_for(engine, pp, m, v)
        alone = simulate(lists, pp, v)
        result = simulate(lists, pp, v, others=(lists_for(engine, pp, m, v),) * 3)  # ep = 4 replicas
        if result.status != "ok" or result.makespan != alone.makespan:
            failures.append(f"pp={pp} m={m} v={v}: {result.status}: {result.detail}")
    assert not failures, "\n".join(failures)


def test_the_all_to_all_model_can_deadlock():
    """A replica built from another config (4 micro-batches per step against 2) runs twice the all-to-alls:
    its ranks wait in their fifth for peers that have none, as hosts would on GPUs. Reported as a deadlock,
    naming the all-to-all."""
    result = simulate(lists_for("1f1b", 2, 4, 1), 2, 1, others=(lists_for("1f1b", 2, 2, 1),))
    assert result.status == "deadlock", result
    assert "pipeline 0 rank 0 blocked at" in result.detail and "in the all-to-all" in result.detail
    assert result.blocked[0, 0][1] is None and (1, 0) not in result.blocked  # the other replica finished


# 5. Interleaving needs whole groups of pp micro-batches.


@pytest.mark.parametrize("pp,m", [(2, 1), (2, 3), (4, 2), (4, 6), (3, 4)])
def test_interleaved_needs_micro_batches_divisible_by_pp(pp, m):
    with pytest.raises(ValueError, match="divisible by pp"):
        schedule("interleaved-1f1b", pp, 0, m, 2)


def test_unknown_engine():
    with pytest.raises(KeyError, match="zero-bubble"):  # the config's Literal stops it first
        schedule("zero-bubble", 2, 0, 4)


# 6. The simulator can fail.


def test_simulator_reports_a_deadlock():
    lists = lists_for("1f1b", 2, 2, 1)
    assert [repr(a) for a in lists[1]] == ["F0", "B0", "F1", "B1"]
    # Rank 1 runs both forwards before its first backward, but rank 0's B0 (which waits for rank 1's
    # B0) comes before the F1 that rank 1's F1 waits for.
    lists[0] = [Action("F", 0, 0), Action("B", 0, 0), Action("F", 1, 0), Action("B", 1, 0)]
    lists[1] = [Action("F", 0, 0), Action("F", 1, 0), Action("B", 0, 0), Action("B", 1, 0)]
    result = simulate(lists, 2, 1)
    assert result.status == "deadlock"
    assert result.blocked == {
        0: (Action("B", 0, 0), Message("grad", 0, 1, 0)),
        1: (Action("F", 1, 0), Message("act", 1, 0, 1)),
    }
    assert "rank 0 blocked at B0" in result.detail and "rank 1 blocked at F1" in result.detail


def test_simulator_reports_an_out_of_order_receive():
    lists = lists_for("1f1b", 2, 2, 1)
    lists[1] = [Action("F", 1, 0), Action("B", 1, 0), Action("F", 0, 0), Action("B", 0, 0)]
    result = simulate(lists, 2, 1)
    assert result.status == "error"
    assert "awaits act(mb1, 0->1)" in result.detail and "head is act(mb0, 0->1)" in result.detail


def test_simulator_reports_backward_before_forward():
    lists = lists_for("1f1b", 2, 2, 1)
    lists[0] = [Action("B", 0, 0), Action("F", 0, 0), Action("F", 1, 0), Action("B", 1, 0)]
    result = simulate(lists, 2, 1)
    assert result.status == "error" and "before its forward" in result.detail


def test_simulator_reports_weight_gradients_before_their_backward():
    lists = lists_for("zb-h1", 2, 2, 1)
    assert [repr(a) for a in lists[1]] == ["F0", "B0", "F1", "B1", "W0", "W1"]
    lists[1] = [Action("F", 0, 0), Action("W", 0, 0), Action("B", 0, 0), *lists[1][2:]]
    result = simulate(lists, 2, 1)
    assert result.status == "error" and "W0 runs before its backward" in result.detail


def test_single_stage_needs_no_communication():
    result = simulate(lists_for("1f1b", 1, 3, 1), 1, 1)
    assert result.status == "ok" and result.finish == [3 * (F_COST + B_COST)]


# 7. NCCL's rules are the simulator's. The executor gives each direction between two ranks a process group
# of its own (parallel/pipeline/p2p.py): on NCCL one stream per group, a rank's sends to one peer in issue
# order on one, its receives from that peer on another. The k-th send meets the k-th receive (NCCL ignores
# tags: the channel's head must be the awaited message, as `simulate` checks); a send waits for its
# receive, but on a stream of sends only, so it holds up later sends the same way and nothing the rank
# computes. That is `simulate`'s model. (Batching each send with the next receive on one shared group, as
# the executor did before, deadlocks interleaved 1F1B from 2 * pp micro-batches on: the pipeline tests run
# under NCCL's semantics on gloo too, tests/conftest.py, and caught it.)


@pytest.mark.parametrize("pp", range(1, 9))
def test_evaluation_runs_to_completion(pp):
    failures = []
    for v in (1, 2, 3):
        for m in range(1, 17):
            result = simulate([forward_only(m, v)] * pp, pp, v)
            if result.status != "ok":
                failures.append(f"pp={pp} m={m} v={v}: {result.status}: {result.detail}")
    assert not failures, "\n".join(failures)
