"""logging.tensorboard / logging.wandb: the step records on dashboards, one point per step across a resume."""

import json

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from femtotron.dashboards import tag
from femtotron.errors import ConfigError
from femtotron.parallel.context import ParallelContext
from femtotron.trainer import Trainer


def test_record_keys_are_grouped_by_what_they_measure():
    assert [tag(k) for k in ("loss", "lr", "grad_norm", "val_loss", "mfu", "tokens_per_sec")] == [
        "train/loss",
        "train/lr",
        "train/grad_norm",
        "val/loss",
        "perf/mfu",
        "perf/tokens_per_sec",
    ]
    assert tag("mem_peak_allocated_gib") == "memory/peak_allocated_gib" and tag("dp_comm_share") == (
        "perf/dp_comm_share"
    )


def board(run_dir):
    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    return events


def test_tensorboard_gets_every_record_and_a_resumed_run_continues_the_same_curves(tiny_config, tiny_dataset):
    overrides = [
        "logging.tensorboard=true",
        "checkpoints.checkpoint_interval=2",
        "tokens.val_check_interval=2",
        "tokens.limit_val_batches=1",
        f"data.validation_folder={tiny_dataset}",
    ]
    first = Trainer(tiny_config("tokens.train_steps=4", *overrides), ParallelContext(), log_to_console=False)
    first.train()
    events = board(first.run_dir)
    scalars = events.Tags()["scalars"]
    for name in ("train/loss", "train/lr", "train/grad_norm", "perf/tokens_per_sec", "perf/mfu", "val/loss"):
        assert name in scalars, (name, scalars)
    assert "memory/rss_gib" in scalars and "config/text_summary" in events.Tags()["tensors"]
    assert [e.step for e in events.Scalars("train/loss")] == [1, 2, 3, 4]

    first_lrs = {e.step: e.value for e in events.Scalars("train/lr")}

    # The run is taken up again from its step-2 checkpoint (as after a crash that lost step 4's), now for 6
    # steps: steps 3 and 4 are trained again on a longer schedule, and each step still has one point, the new.
    step_2 = first.run_dir / "checkpoints" / "step-0000002"
    resumed = tiny_config("tokens.train_steps=6", *overrides, f"checkpoints.resume_checkpoint_path={step_2}")
    second = Trainer(resumed, ParallelContext(), log_to_console=False)
    second.train()
    records = [json.loads(line) for line in (second.run_dir / "metrics.jsonl").read_text().splitlines()]
    events = board(second.run_dir)
    for name, key in (("train/loss", "loss"), ("train/lr", "lr"), ("val/loss", "val_loss")):
        points = [(e.step, pytest.approx(e.value)) for e in events.Scalars(name)]
        assert points == [(r["step"], r[key]) for r in records if key in r], name
    assert [e.step for e in events.Scalars("val/loss")] == [2, 4, 6]
    assert events.Scalars("train/lr")[3].value != pytest.approx(first_lrs[4])  # the new step 4, not the old


def test_a_dashboard_that_is_not_installed_is_a_config_error_before_anything_is_built(
    tiny_config, monkeypatch
):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name: None if name == "wandb" else find_spec(name)
    )
    config = tiny_config("logging.wandb=true", "data.dataset_folder=/nonexistent/data")
    with pytest.raises(ConfigError) as info:  # before the data is opened: that would be a DataError
        Trainer(config, ParallelContext(), log_to_console=False)
    assert "logging.wandb=true but wandb is not installed: `pip install femtotron[wandb]`" in str(info.value)
    assert not config.run_dir.exists()
