"""profiling.profile_steps: a torch.profiler Chrome trace of those steps, per rank, in <run dir>/profile/."""

import json

import pytest

from femtotron.errors import ConfigError
from femtotron.parallel.context import ParallelContext
from femtotron.trainer import Trainer


def steps_in(trace):
    """The training steps a Chrome trace covers, from the `step N` ranges the profiler marks."""
    return sorted(
        int(e["name"].split()[1]) for e in trace["traceEvents"] if e.get("name", "").startswith("step ")
    )


def test_profile_steps_write_a_chrome_trace_of_just_those_steps(tiny_config):
    config = tiny_config("tokens.train_steps=4", "profiling.profile_steps=[2,3]")
    Trainer(config, ParallelContext(), log_to_console=False).train()
    trace = json.loads((config.run_dir / "profile" / "rank-0.json").read_text())
    assert steps_in(trace) == [2, 3]
    assert any(e.get("name", "").startswith("aten::mm") for e in trace["traceEvents"])


def test_a_range_past_the_last_step_ends_with_the_run_and_none_profiles_nothing(tiny_config):
    config = tiny_config("tokens.train_steps=3", "profiling.profile_steps=[3,10]")
    Trainer(config, ParallelContext(), log_to_console=False).train()
    assert steps_in(json.loads((config.run_dir / "profile" / "rank-0.json").read_text())) == [3]
    config = tiny_config("tokens.train_steps=2", "general.run=plain")
    Trainer(config, ParallelContext(), log_to_console=False).train()
    assert not (config.run_dir / "profile").exists()


@pytest.mark.parametrize("steps", ["[3,2]", "[0,2]", "[2]"])
def test_profile_steps_must_be_an_ordered_pair_of_steps(tiny_config, steps):
    with pytest.raises(ConfigError) as info:
        tiny_config(f"profiling.profile_steps={steps}")
    assert "profiling.profile_steps" in str(info.value)
