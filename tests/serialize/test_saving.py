"""Saving a checkpoint: every rank writes its part, rank 0 commits by rename, so a failed, stuck or killed
save leaves the previous checkpoint to resume (C2); keep_last_n; a path that cannot be written."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from checkpoint_runs import checkpointed_run, crashing_train, make, train
from distributed import RankFailed, run_ranks
from helpers import make_read_only, small_disk, write_yaml

from femtotron.parallel.context import ParallelContext
from femtotron.serialize import saving
from femtotron.serialize.files import MANIFEST, CheckpointError
from femtotron.serialize.restore import load
from femtotron.trainer import Trainer


def test_keep_last_n_deletes_older_checkpoints_and_latest_points_at_the_newest(tiny_config):
    saved = checkpointed_run(tiny_config, "keep", "checkpoints.keep_last_n=1")
    assert sorted(p.name for p in saved.iterdir()) == ["latest", "step-0000004"]
    assert (saved / "latest").read_text().strip() == "step-0000004"


def _slow_rank(rank, config):
    ctx = ParallelContext(dp=2, collective_timeout_seconds=3)
    trainer = Trainer(config, ctx, log_to_console=False)
    if rank == 1:  # rank 1 hangs while writing its part (a stuck file system, a dying node)
        import time

        from femtotron.serialize import saving as module

        real = module.write_rank_file

        def slow_write(*args, **kwargs):
            time.sleep(8)
            return real(*args, **kwargs)

        module.write_rank_file = slow_write
    try:
        saving.save(trainer.parts)
    finally:
        ctx.close()


@pytest.mark.distributed
def test_C2_a_rank_that_never_finishes_its_save_is_named_and_nothing_is_committed(tiny_config):
    config = make(tiny_config, "slow", "parallelism.collective_timeout_seconds=3", dp=2, steps=2)
    with pytest.raises(RankFailed) as failed:
        run_ranks(_slow_rank, 2, config, timeout=60)
    message = str(failed.value)
    assert "was not committed: rank 1 did not finish writing its file within 3 s" in message
    root = config.run_dir / "checkpoints"
    assert not (root / "step-0000000").exists() and not (root / "latest").exists()


# Run `femtotron train` in this process, but SIGKILL it half-way through writing the checkpoint of step 4
# (with checkpoints.async_save: in the background writer, while training goes on).
KILL_DURING_SECOND_SAVE = """
import os, signal, sys
from femtotron.serialize import files
real = files.write_safetensors
def write_then_die(path, tensors, metadata):
    if "step-0000004" in str(path):
        real(path, tensors, metadata)
        with open(path, "r+b") as f:
            f.truncate(os.path.getsize(path) // 2)
        os.kill(os.getpid(), signal.SIGKILL)
    return real(path, tensors, metadata)
files.write_safetensors = write_then_die
from femtotron.cli import main
sys.exit(main(["train", sys.argv[1]]))
"""


@pytest.mark.distributed
@pytest.mark.parametrize("async_save", [False, True])
def test_C2_a_save_killed_part_way_leaves_the_previous_checkpoint_and_the_run_resumes(
    tiny_config, tmp_path, async_save
):
    whole = train(make(tiny_config, "whole"), ParallelContext())
    config = make(
        tiny_config, "killed", "checkpoints.checkpoint_interval=2", f"checkpoints.async_save={async_save}"
    )
    died = subprocess.run(
        [sys.executable, "-c", KILL_DURING_SECOND_SAVE, write_yaml(config, tmp_path / "c.yaml")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert died.returncode == -signal.SIGKILL, died.stderr
    saved = config.run_dir / "checkpoints"
    assert (saved / ".tmp-step-0000004").is_dir() and (saved / "latest").read_text().strip() == "step-0000002"
    resumed = train(
        make(tiny_config, "killed-resume", f"checkpoints.resume_checkpoint_path={saved}"), ParallelContext()
    )
    assert resumed["losses"] == whole["losses"][2:]  # from step 2's checkpoint, exactly as uninterrupted
    assert all(torch.equal(resumed["weights"][n], w) for n, w in whole["weights"].items())


def test_keep_last_n_after_a_rollback_keeps_the_new_checkpoint_and_leaves_later_ones(tiny_config):
    saved = checkpointed_run(tiny_config, "rollback")  # step-2 and step-4
    config = make(
        tiny_config,
        "rollback",
        f"checkpoints.resume_checkpoint_path={saved / 'step-0000002'}",
        "checkpoints.checkpoint_interval=1",
        "checkpoints.keep_last_n=1",
        steps=3,
    )
    Trainer(config, ParallelContext(), log_to_console=False).train()
    assert sorted(p.name for p in saved.iterdir()) == ["latest", "step-0000003", "step-0000004"]
    assert (saved / "latest").read_text().strip() == "step-0000003"


def _failing_write(rank, config):
    ctx = ParallelContext(dp=2, collective_timeout_seconds=60)
    trainer = Trainer(config, ctx, log_to_console=False)
    if rank == 1:  # as safetensors reports a full disk: not an OSError

        def full_disk(*args, **kwargs):
            raise Exception("No space left on device")

        saving.write_rank_file = full_disk
    try:
        saving.save(trainer.parts)
    finally:
        ctx.close()


@pytest.mark.distributed
def test_a_rank_that_fails_to_write_stops_every_rank_at_once_with_its_reason(tiny_config):
    config = make(tiny_config, "full", dp=2, steps=2)
    start = time.monotonic()
    with pytest.raises(RankFailed) as failed:
        run_ranks(_failing_write, 2, config, timeout=120)
    assert time.monotonic() - start < 40  # not the 60 s collective timeout
    assert "rank 1 could not write its part of checkpoint" in str(failed.value)
    assert "No space left on device" in str(failed.value)


def test_W2_a_planted_tmp_step_link_is_removed_and_the_save_lands_in_the_run(tiny_config, tmp_path):
    config = make(tiny_config, "planted", "checkpoints.checkpoint_interval=2", steps=2)
    outside = tmp_path / "outside"
    outside.mkdir()
    root = config.run_dir / "checkpoints"
    root.mkdir(parents=True)
    (root / ".tmp-step-0000002").symlink_to(outside)  # as in a downloaded run directory
    Trainer(config, ParallelContext(), log_to_console=False).train()
    assert list(outside.iterdir()) == []
    step = root / "step-0000002"
    assert not step.is_symlink() and (step / MANIFEST).is_file()


def committed_at(directory):
    return json.loads((directory / MANIFEST).read_text())["committed_at"]


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("point", "kept"),
    [
        ("checkpoint.manifest_written", "old"),
        ("checkpoint.set_aside", "old"),  # before: no step-4 at all, resumed from step 2
        ("checkpoint.renamed", "new"),
        ("checkpoint.latest_written", "new"),
    ],
)
def test_S3_re_committing_a_step_killed_at_each_boundary_keeps_a_step_to_resume(
    tiny_config, tmp_path, point, kept
):
    """A rollback to step 2 saves step 4 again over the old step 4; killed anywhere in that commit, the run
    resumes at step 4: the old one until the new one is in place, then the new one."""
    saved = checkpointed_run(tiny_config, f"recommit-{point}")
    old = committed_at(saved / "step-0000004")
    config = make(
        tiny_config,
        f"recommit-{point}",
        f"checkpoints.resume_checkpoint_path={saved / 'step-0000002'}",
        "checkpoints.checkpoint_interval=2",
        steps=4,
    )
    crashing_train(config, tmp_path, point)
    resumed = Trainer(
        make(tiny_config, f"recommit-{point}", steps=4), ParallelContext(), log_to_console=False
    )
    summary, directory = load(resumed.parts, saved)
    assert resumed.state.step == 4 and "at step 4" in summary
    assert (committed_at(directory) == old) == (kept == "old")


@pytest.mark.parametrize("fault", ["read-only", "full"])
def test_a_checkpoints_path_that_cannot_be_written_fails_before_step_1(tiny_config, tmp_path, fault):
    with small_disk(tmp_path / "disk") as where:
        if fault == "full":
            with open(where / "filler", "wb") as f, pytest.raises(OSError):
                f.write(b"\0" * (1 << 20))
                f.flush()
                os.fsync(f.fileno())
        else:
            make_read_only(where)
        config = make(
            tiny_config,
            f"unwritable-{fault}",
            "checkpoints.checkpoint_interval=2",
            f"checkpoints.checkpoints_path={where}",
        )
        trainer = Trainer(config, ParallelContext(), log_to_console=False)
        with pytest.raises(CheckpointError, match=f"checkpoints cannot be written to {where} "):
            trainer.train()
        assert trainer.state.step == 0
