"""logging.tensorboard / logging.wandb: the step records on dashboards, one point per step across a resume."""

import json
import math

import pytest

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
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    return events


def test_tensorboard_gets_every_record_and_a_resumed_run_continues_the_same_curves(tiny_config, tiny_dataset):
    pytest.importorskip(
        "tensorboard", reason="logging.tensorboard needs tensorboard: `pip install tensorboard`"
    )
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


def wandb_attempts(run_dir):
    """What each attempt logged to W&B offline, in the order written: (run record, history by step)."""
    from wandb.proto import wandb_internal_pb2
    from wandb.sdk.internal import datastore

    attempts = []
    for path in sorted(
        (run_dir / "wandb").glob("offline-run-*/run-*.wandb"), key=lambda p: p.stat().st_mtime
    ):
        store = datastore.DataStore()
        run = None
        history = {}
        store.open_for_scan(str(path))
        while (data := store.scan_data()) is not None:
            record = wandb_internal_pb2.Record()
            record.ParseFromString(data)
            if record.WhichOneof("record_type") == "run":
                run = record.run
            elif record.WhichOneof("record_type") == "history":
                items = {
                    item.key or "/".join(item.nested_key): json.loads(item.value_json)
                    for item in record.history.item
                }
                history[items.pop("_step")] = {k: v for k, v in items.items() if not k.startswith("_")}
        attempts.append((run, history))
    return attempts


@pytest.fixture
def wandb_offline(monkeypatch, tmp_path):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))  # not the user's settings
    yield
    import wandb

    wandb.teardown()  # W&B keeps its settings per process: the next test sets its own


@pytest.mark.distributed  # W&B logs through a service process of its own
def test_wandb_offline_gets_every_record_under_the_run_names_and_a_resume_continues_the_same_run(
    tiny_config, wandb_offline
):
    overrides = ["logging.wandb=true", "checkpoints.checkpoint_interval=2", "general.project=proj"]
    first = Trainer(tiny_config("tokens.train_steps=4", *overrides), ParallelContext(), log_to_console=False)
    first.train()
    step_2 = first.run_dir / "checkpoints" / "step-0000002"
    resumed = tiny_config("tokens.train_steps=6", *overrides, f"checkpoints.resume_checkpoint_path={step_2}")
    Trainer(resumed, ParallelContext(), log_to_console=False).train()

    (run, first_history), (run_again, history) = wandb_attempts(first.run_dir)
    assert (run.project, run.display_name) == ("proj", first.config.general.run)
    assert run_again.run_id == run.run_id  # one W&B run per run directory
    config = {item.key: json.loads(item.value_json) for item in run.config.update}
    assert config["model"] == first.config.to_dict()["model"]

    records = [json.loads(line) for line in (first.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert sorted(first_history) == [1, 2, 3, 4] and sorted(history) == [3, 4, 5, 6]
    by_step = {}  # W&B keeps one row per step: a checkpoint's record joins its step's training record
    for record in records:
        by_step.setdefault(record["step"], {}).update(record)
    assert any("checkpoint_step" in record for record in by_step.values())
    for record in by_step.values():
        logged = (history if record["step"] > 2 else first_history)[record["step"]]
        numbers = {tag(k): v for k, v in record.items() if k != "step" and isinstance(v, (int, float))}
        assert logged.keys() == numbers.keys() and {"train/loss", "train/lr", "perf/mfu"} <= logged.keys()
        assert all(math.isclose(logged[k], v, rel_tol=1e-12) for k, v in numbers.items()), record["step"]


@pytest.mark.distributed
def test_wandb_that_cannot_start_a_run_is_a_config_error_naming_the_ways_out(
    tiny_config, wandb_offline, monkeypatch, tmp_path
):
    monkeypatch.setenv("WANDB_MODE", "online")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))  # W&B would find a login there
    trainer = Trainer(tiny_config("logging.wandb=true"), ParallelContext(), log_to_console=False)
    with pytest.raises(ConfigError) as info:
        trainer.train()
    message = str(info.value)
    assert "logging.wandb=true but W&B could not start a run: No API key configured" in message
    assert "WANDB_MODE=offline" in message and "logging.wandb=false" in message
    assert not (trainer.run_dir / "metrics.jsonl").exists()
