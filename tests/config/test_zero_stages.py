"""ZeRO's stages as records: indexed by their number, each sharding everything the one before does, and a
stage ZeRO does not have refused by the rules before anything asks for its record."""

from __future__ import annotations

import dataclasses

import pytest

from femtotron.config import load_config_dict
from femtotron.config.rules import rule_problems, with_changes
from femtotron.config.zero_stages import ZERO_STAGES, ZeroStage

SHARDS = [field.name for field in dataclasses.fields(ZeroStage) if field.name.startswith("shards_")]


def tiny(**optimizer):
    raw = {
        "tokens": {"train_steps": 1},
        "data": {"dataset_folder": "unused"},
        "optimizer": optimizer,
    }
    return load_config_dict(raw)


def test_the_stages_are_indexed_by_their_number():
    assert [stage.number for stage in ZERO_STAGES] == list(range(len(ZERO_STAGES)))
    for stage in ZERO_STAGES:
        assert tiny(zero_stage=stage.number).optimizer.zero is stage


def test_each_stage_shards_everything_the_one_before_does_and_more():
    assert not any(getattr(ZERO_STAGES[0], fact) for fact in SHARDS)
    for before, stage in zip(ZERO_STAGES, ZERO_STAGES[1:], strict=False):
        sharded_before = {fact for fact in SHARDS if getattr(before, fact)}
        sharded = {fact for fact in SHARDS if getattr(stage, fact)}
        assert sharded_before < sharded, stage.name
        assert stage.adds not in before.sharded


def test_a_stage_shards_parameters_only_with_gradients_and_gradients_only_with_the_optimizer():
    for stage in ZERO_STAGES:
        assert stage.shards_gradients or not stage.shards_parameters, stage.name
        assert stage.shards_optimizer or not stage.shards_gradients, stage.name


def test_names():
    assert [stage.name for stage in ZERO_STAGES] == ["no ZeRO", "ZeRO-1", "ZeRO-2", "ZeRO-3"]


@pytest.mark.parametrize("reshard_after_forward", [True, False])
def test_a_stage_past_the_last_is_one_problem_of_the_rules_not_an_index_error(reshard_after_forward):
    """Every rule runs on a config the rules refuse: the one that reads `optimizer.zero` (reshard after
    forward) must not index past the records; it takes the unknown stage as sharding no parameters."""
    changes = {"optimizer.zero_stage": 4, "optimizer.reshard_after_forward": reshard_after_forward}
    problems = rule_problems(with_changes(tiny(), changes))
    messages = {problem.path: problem.message for problem in problems}
    assert messages["optimizer.zero_stage"] == (
        "zero_stage=4 does not exist: ZeRO has stages 1 (master weights and Adam moments sharded over dp), "
        "2 (the gradients too) and 3 (the parameters too). Fix: zero_stage=3 to shard everything."
    )
    assert ("optimizer.reshard_after_forward" in messages) == (not reshard_after_forward)
    if not reshard_after_forward:
        assert "zero_stage=4 does not shard the parameters" in messages["optimizer.reshard_after_forward"]
