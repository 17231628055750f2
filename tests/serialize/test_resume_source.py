"""Which checkpoint a run resumes from: `latest`, half-written saves and links ignored, the run's own
checkpoints (auto-resume) or the one a person named, rank 0's view for every rank, a finished run."""

from __future__ import annotations

import json
import shutil
import time

import pytest
import torch
from checkpoint_runs import checkpointed_run, crashing_train, make, train
from distributed import run_ranks
from helpers import write_yaml

from femtotron.cli import main
from femtotron.parallel.context import ParallelContext
from femtotron.serialize.files import CheckpointError, rank_file
from femtotron.serialize.restore import load
from femtotron.serialize.resume_source import (
    agreed_resume_source,
    already_done,
    decided_by_rank_0,
    resolve,
    resume_source,
)
from femtotron.trainer import Trainer


def test_a_half_written_save_is_ignored_with_a_warning_and_the_previous_one_loads(tiny_config, capsys):
    saved = checkpointed_run(tiny_config, "half")
    (saved / ".tmp-step-0000006").mkdir()
    (saved / ".tmp-step-0000006" / rank_file(0)).write_bytes(b"partial")
    trainer = Trainer(make(tiny_config, "half-resume", steps=6), ParallelContext())
    assert load(trainer.parts, saved)[0].startswith(f"resumed from {saved / 'step-0000004'} at step 4")
    assert f"ignoring {saved / '.tmp-step-0000006'}: a save that did not finish" in capsys.readouterr().out


def _decide_apart(rank, configs):
    """Rank 1 is given a config that sees no checkpoint, as a node whose view of a shared file system lags."""
    ctx = ParallelContext(dp=2, collective_timeout_seconds=30)
    try:
        source = agreed_resume_source(configs[rank], ctx)

        def fail():
            raise CheckpointError("rank 0 found no such checkpoint")

        start = time.monotonic()
        try:
            decided_by_rank_0(ctx, "a test", fail if rank == 0 else lambda: "never run")
        except CheckpointError as e:
            return source, str(e), time.monotonic() - start
    finally:
        ctx.close()


@pytest.mark.distributed
def test_every_rank_resumes_from_what_rank_0_sees_and_gets_rank_0_s_error_at_once(tiny_config):
    saved = checkpointed_run(tiny_config, "seen")
    configs = [
        make(tiny_config, "apart", f"checkpoints.resume_checkpoint_path={saved}"),
        make(tiny_config, "apart"),
    ]
    assert resume_source(configs[1])[0] is None  # on its own, rank 1 would start from step 0
    results = run_ranks(_decide_apart, 2, configs, timeout=120)
    for source, error, seconds in results:
        assert source[:2] == (saved, "checkpoints.resume_checkpoint_path")
        assert error == "rank 0 found no such checkpoint" and seconds < 20  # not the 30 s timeout


def die_after(config, step):
    """Train `config` until it dies right after step `step` (the process killed: no checkpoint of its own)."""
    trainer = Trainer(config, ParallelContext(), log_to_console=False)
    one_step = trainer.train_step

    def dying():
        if trainer.state.step == step:
            raise KeyboardInterrupt("killed")
        return one_step()

    trainer.train_step = dying
    with pytest.raises(KeyboardInterrupt):
        trainer.train()


def metrics_steps(config):
    """The steps of metrics.jsonl's training records (a checkpoint's record has no loss)."""
    records = [json.loads(line) for line in (config.run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["step"] for r in records if "loss" in r]


def test_a_requeued_run_resumes_from_its_own_latest_checkpoint_and_keeps_its_metrics(tiny_config, capsys):
    """A preempted job started again with the same config (no resume_checkpoint_path) continues from the
    newest checkpoint in checkpoints_path, says so, and ends as if never stopped; metrics.jsonl keeps the
    steps before the checkpoint, drops the ones the dead attempt logged after it, and has every step once, in
    order."""
    whole = train(make(tiny_config, "whole"), ParallelContext())
    config = make(tiny_config, "requeued", "checkpoints.checkpoint_interval=2")
    die_after(config, step=3)  # checkpoint at step 2, step 3 logged, then killed
    assert metrics_steps(config) == [1, 2, 3]
    capsys.readouterr()
    resumed = train(config, ParallelContext())
    assert resumed["losses"] == whole["losses"][2:]  # exactly as uninterrupted
    assert all(torch.equal(resumed["weights"][n], w) for n, w in whole["weights"].items())
    assert metrics_steps(config) == [1, 2, 3, 4, 5, 6]
    records = [json.loads(line) for line in (config.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["loss"] for r in records if "loss" in r] == pytest.approx(whole["losses"])
    # A record per save (steps 2, 4, 6), at the step it committed: how long training stopped, and the write.
    saves = [r for r in records if "checkpoint_step" in r]
    assert [(r["step"], r["checkpoint_step"]) for r in saves] == [(2, 2), (4, 4), (6, 6)]
    assert all(r["checkpoint_stall_seconds"] == r["checkpoint_write_seconds"] > 0 for r in saves)  # in line


def test_a_finished_run_started_again_exits_0_at_once_and_touches_nothing(tiny_config, tmp_path, capsys):
    config = make(tiny_config, "finished", "checkpoints.checkpoint_interval=2", steps=4)
    path = write_yaml(config, tmp_path / "c.yaml")
    assert main(["train", path]) == 0
    files_before = {p: p.stat().st_mtime_ns for p in config.run_dir.rglob("*") if p.is_file()}
    capsys.readouterr()
    assert main(["train", path]) == 0
    out = capsys.readouterr().out
    assert (
        f"already done: {config.run_dir / 'checkpoints' / 'step-0000004'} is step 4 of tokens.train_steps=4"
        in out
    )
    assert {p: p.stat().st_mtime_ns for p in config.run_dir.rglob("*") if p.is_file()} == files_before


def test_starting_over_existing_checkpoints_needs_auto_resume_off_and_says_so(tiny_config, capsys):
    saved = checkpointed_run(tiny_config, "again")
    config = make(
        tiny_config, "again", "checkpoints.checkpoint_interval=2", "checkpoints.auto_resume=false", steps=4
    )
    capsys.readouterr()
    trainer = Trainer(config, ParallelContext())
    assert len(trainer.train()) == 4  # from step 0
    out = capsys.readouterr().out
    assert (
        f"WARNING: checkpoints.auto_resume=false: starting from step 0, although {saved} holds checkpoints "
        "up to step-0000004; this run's saves replace them"
    ) in out


def test_resume_checkpoint_path_wins_over_the_run_s_own_checkpoints_with_a_warning(tiny_config, capsys):
    other = checkpointed_run(tiny_config, "other")
    own = checkpointed_run(tiny_config, "own")
    config = make(
        tiny_config,
        "own",
        "checkpoints.checkpoint_interval=2",
        f"checkpoints.resume_checkpoint_path={other}",
        steps=6,
    )
    capsys.readouterr()
    Trainer(config, ParallelContext()).train()
    out = capsys.readouterr().out
    assert f"resumed from {other / 'step-0000004'} at step 4" in out
    assert (
        f"WARNING: checkpoints.resume_checkpoint_path={other} is given, so the checkpoints of this run in "
        f"{own} (up to step-0000004) are not resumed"
    ) in out


def test_a_step_link_in_a_checkpoints_directory_is_ignored_with_a_warning(tiny_config):
    saved = checkpointed_run(tiny_config, "links")
    elsewhere = saved.parent / "elsewhere"
    shutil.copytree(saved / "step-0000004", elsewhere)
    (saved / "step-0000009").symlink_to(elsewhere)
    (saved / "latest").write_text("step-0000009\n")
    chosen, warnings = resolve(saved)
    assert chosen == saved / "step-0000004"
    assert f"ignoring {saved / 'step-0000009'}: a link (to {elsewhere})" in warnings[0]


@pytest.mark.distributed
def test_S4_a_kill_before_latest_is_updated_resumes_the_newer_commit_with_a_warning(
    tiny_config, tmp_path, capsys
):
    first = make(tiny_config, "stale", "checkpoints.checkpoint_interval=2", steps=2)
    Trainer(first, ParallelContext(), log_to_console=False).train()
    config = make(tiny_config, "stale", "checkpoints.checkpoint_interval=2", steps=4)
    crashing_train(config, tmp_path, "checkpoint.renamed")  # step-4 renamed into place, latest says step 2
    saved = config.run_dir / "checkpoints"
    assert (saved / "latest").read_text().strip() == "step-0000002"
    chosen, warnings = resolve(saved)
    assert chosen == saved / "step-0000004"
    assert warnings == [
        f"{saved / 'latest'} names step-0000002, but step-0000004 was committed after it (the run was killed "
        "before it updated latest); taking step-0000004"
    ]


def test_with_latest_missing_the_newest_committed_checkpoint_is_resumed(tiny_config):
    """Steps 2 and 4 committed and `latest` lost: the run resumes at step 4, the one the warning names."""
    saved = checkpointed_run(tiny_config, "no-latest")
    (saved / "latest").unlink()
    chosen, warnings = resolve(saved)
    assert chosen == saved / "step-0000004"
    assert warnings == [
        f"{saved / 'latest'} is missing; taking the newest committed checkpoint, step-0000004"
    ]
    resumed = Trainer(make(tiny_config, "no-latest", steps=6), ParallelContext(), log_to_console=False)
    load(resumed.parts, saved)
    assert resumed.state.step == 4


def test_a_run_that_died_before_its_final_weights_is_not_done_and_writes_them(tiny_config, tmp_path, capsys):
    """The last checkpoint is committed before the final weights are written: killed between the two, the
    run is not finished, and starting it again writes the weights."""
    config = make(tiny_config, "no-weights", "checkpoints.checkpoint_interval=2", steps=4)
    path = write_yaml(config, tmp_path / "c.yaml")
    assert main(["train", path]) == 0
    weights = config.run_dir / "model.safetensors"
    weights.unlink()
    assert already_done(config) is None
    capsys.readouterr()
    assert main(["train", path]) == 0
    assert "already done" not in capsys.readouterr().out
    assert weights.is_file()


def test_auto_resume_refuses_another_run_s_checkpoint_in_a_shared_checkpoints_path(
    tiny_config, tmp_path, capsys
):
    """nanotron's configs all say `checkpoints_path: checkpoints`: run B, sharing run A's path, used to
    auto-resume A's step 2 silently. Now it stops naming both runs and the fixes; A itself still resumes."""
    shared = f"checkpoints.checkpoints_path={tmp_path / 'checkpoints'}"
    first = make(tiny_config, "run-a", shared, "checkpoints.checkpoint_interval=2", steps=2)
    assert main(["train", write_yaml(first, tmp_path / "a.yaml")]) == 0
    second = make(tiny_config, "run-b", shared, "checkpoints.checkpoint_interval=2", steps=4)
    capsys.readouterr()
    assert main(["train", write_yaml(second, tmp_path / "b.yaml")]) == 6
    step = tmp_path / "checkpoints" / "step-0000002"
    assert (
        f"{step} is a checkpoint of run femtotron/run-a, not of this run (femtotron/run-b): both save into "
        f"{tmp_path / 'checkpoints'}" in capsys.readouterr().err
    )
    assert not (second.run_dir / "metrics.jsonl").exists()
    again = make(tiny_config, "run-a", shared, "checkpoints.checkpoint_interval=2", steps=4)
    assert main(["train", write_yaml(again, tmp_path / "a4.yaml")]) == 0
    assert "resumed from" in capsys.readouterr().out
