"""The pipeline engines' records: `parallelism.pp_engine` takes exactly their names, each names a schedule,
and their facts (interleaving, a split backward, the bubble) say what the schedules do. The bubble against
the simulated schedules: tests/parallel/pipeline/test_schedules.py."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from femtotron.config.pipeline_engines import ENGINES
from femtotron.config.sections import ParallelismArgs
from femtotron.parallel.pipeline.schedules import SCHEDULES, schedule


def test_pp_engine_accepts_exactly_the_engines_names():
    for name, engine in ENGINES.items():
        assert engine.name == name
        assert ParallelismArgs(pp_engine=name).engine is engine
    with pytest.raises(ValidationError, match="zero-bubble"):
        ParallelismArgs(pp_engine="zero-bubble")


def test_every_engine_has_a_schedule_and_every_schedule_an_engine():
    assert sorted(SCHEDULES) == sorted(ENGINES)


@pytest.mark.parametrize("name", list(ENGINES))
def test_an_engine_splits_backward_exactly_when_its_schedule_has_weight_passes(name):
    for pp in (1, 2, 4):
        for rank in range(pp):
            kinds = {action.kind for action in schedule(name, pp, rank, micro_batches=2 * pp, chunks=2)}
            assert ("W" in kinds) == ENGINES[name].splits_backward, (name, pp, rank)


@pytest.mark.parametrize("name", list(ENGINES))
def test_an_engine_interleaves_exactly_when_its_schedule_runs_several_chunks(name):
    actions = schedule(name, pp=2, rank=0, micro_batches=4, chunks=2)
    assert ({action.chunk for action in actions} == {0, 1}) == ENGINES[name].interleaves


@pytest.mark.parametrize("name", list(ENGINES))
def test_one_stage_never_idles_and_more_micro_batches_idle_less(name):
    virtual_stages = 2 if ENGINES[name].interleaves else 1
    bubble = ENGINES[name].bubble
    for micro_batches in range(1, 17):
        assert bubble(1, micro_batches, virtual_stages) == 0
    for pp in (2, 3, 4, 8):
        shares = [bubble(pp, micro_batches, virtual_stages) for micro_batches in range(1, 33)]
        assert all(0 < share < 1 for share in shares), (name, pp)
        assert shares == sorted(shares, reverse=True), (name, pp)


def idle_stage_steps(bubble: float, micro_batches: int) -> float:
    """The stage-steps a stage idles per step, from its idle share of a step of `micro_batches` of work."""
    return bubble / (1 - bubble) * micro_batches


@pytest.mark.parametrize("pp", [2, 3, 4, 8])
def test_zb_h1_idles_a_third_of_1f1b_and_interleaving_shrinks_it_by_its_virtual_stages(pp):
    """1F1B and AFAB idle pp - 1 stage-steps; v virtual stages make that (pp - 1) / v; zb-h1, forward, B and
    W a third of a stage-step each, (pp - 1) / 3 once there are pp micro-batches, and less than 1F1B with
    fewer."""
    for micro_batches in range(1, 4 * pp + 1):
        plain = ENGINES["1f1b"].bubble(pp, micro_batches, 1)
        zero_bubble = ENGINES["zb-h1"].bubble(pp, micro_batches, 1)
        assert ENGINES["afab"].bubble(pp, micro_batches, 1) == plain
        assert idle_stage_steps(plain, micro_batches) == pytest.approx(pp - 1)
        assert zero_bubble < plain, (pp, micro_batches)
        if micro_batches >= pp:
            assert idle_stage_steps(zero_bubble, micro_batches) == pytest.approx((pp - 1) / 3)
        for virtual_stages in (2, 3, 4):
            interleaved = ENGINES["interleaved-1f1b"].bubble(pp, micro_batches, virtual_stages)
            assert idle_stage_steps(interleaved, micro_batches) == pytest.approx((pp - 1) / virtual_stages)
