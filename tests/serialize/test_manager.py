"""The checkpoint policy of a training run: the saves at the start, every interval, at the end and on a
stop signal, and a resume at the last step."""

from __future__ import annotations

import json
import signal
import subprocess
import sys

import pytest
from checkpoint_runs import checkpointed_run, make
from helpers import write_yaml

from femtotron.parallel.context import ParallelContext
from femtotron.trainer import Trainer


def test_resuming_a_finished_run_trains_nothing(tiny_config):
    saved = checkpointed_run(tiny_config, "done")
    trainer = Trainer(
        make(tiny_config, "done-resume", f"checkpoints.resume_checkpoint_path={saved}", steps=4),
        ParallelContext(),
        log_to_console=False,
    )
    assert trainer.train() == [] and trainer.state.step == 4
    assert trainer.state.consumed_tokens == 4 * 16 * 32 and trainer.state.consumed_samples == 4 * 16


@pytest.mark.distributed
@pytest.mark.parametrize("async_save", [False, True])
def test_sigterm_saves_a_checkpoint_and_stops_then_the_run_resumes(tiny_config, tmp_path, async_save):
    """With checkpoints.async_save the stop waits for the background write: exit 7 once it is committed."""
    config = make(
        tiny_config,
        "term",
        "logging.iteration_step_info_interval=1",
        "checkpoints.checkpoint_interval=3",
        f"checkpoints.async_save={async_save}",
        steps=10**6,
    )
    run = subprocess.Popen(
        [sys.executable, "-m", "femtotron", "train", write_yaml(config, tmp_path / "c.yaml")],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    for line in run.stdout:
        if "step 2/" in line:  # training is under way
            run.send_signal(signal.SIGTERM)
            break
    output = run.stdout.read()
    assert run.wait(timeout=120) == 7, output
    saved = config.run_dir / "checkpoints"
    step = int((saved / "latest").read_text().strip().removeprefix("step-"))
    assert step >= 2 and "SIGTERM received: stopped after step" in output
    assert "Run the same command again to resume from it (checkpoints.auto_resume)" in output
    assert f"another run resumes it with checkpoints.resume_checkpoint_path={saved}" in output
    trainer = Trainer(
        make(tiny_config, "term-resume", f"checkpoints.resume_checkpoint_path={saved}", steps=step + 1),
        ParallelContext(),
        log_to_console=False,
    )
    assert len(trainer.train()) == 1 and trainer.state.step == step + 1


@pytest.mark.parametrize("async_save", [False, True])
def test_the_initial_state_every_interval_and_the_last_step_are_saved_and_recorded(tiny_config, async_save):
    """checkpoints.save_initial_state saves step 0 before the first step, checkpoint_interval every 3rd step,
    and the last step, off the interval, is saved at the end; each committed save has its metrics.jsonl
    record, also those written in the background."""
    config = make(
        tiny_config,
        f"policy-{async_save}",
        "checkpoints.save_initial_state=true",
        "checkpoints.checkpoint_interval=3",
        f"checkpoints.async_save={async_save}",
        steps=4,
    )
    Trainer(config, ParallelContext(), log_to_console=False).train()
    saved = config.run_dir / "checkpoints"
    steps = ["step-0000000", "step-0000003", "step-0000004"]
    assert sorted(p.name for p in saved.iterdir()) == ["latest", *steps]
    records = [json.loads(line) for line in (config.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert sorted(r["checkpoint_step"] for r in records if "checkpoint_step" in r) == [0, 3, 4]
