"""Checkpoints: bit-exact resume, resharding on a changed mesh, atomic commit, bad input (C1-C3)."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
from checkpoint_runs import (
    assert_one_process_continues,
    assert_the_resume_is_bit_exact,
    make,
    merged,
    ranks_train,
    train,
    whole_then_halves,
)
from distributed import RankFailed, run_ranks
from helpers import (
    make_read_only,
    precision_path,
    small_disk,
    tiny_config_maker,
    write_patterned_tokens,
    write_yaml,
)

from femtotron.cli import main
from femtotron.errors import ConfigError
from femtotron.optim.lr_schedule import lr_at
from femtotron.parallel.context import ParallelContext
from femtotron.serialize import checkpoint
from femtotron.serialize.files import MANIFEST, MANIFEST_CHECKSUM, CheckpointError, rank_file
from femtotron.serialize.offline import reshard
from femtotron.trainer import Trainer


@pytest.mark.parametrize("dtype, native", [("float32", None), ("bfloat16", True), ("bfloat16", False)])
def test_C3_resume_on_one_rank_is_bit_exact(tiny_config, dtype, native):
    with precision_path(native):
        whole = train(make(tiny_config, f"whole-{dtype}", f"model.dtype={dtype}"), ParallelContext())
        first = make(
            tiny_config,
            f"first-{dtype}",
            f"model.dtype={dtype}",
            "checkpoints.checkpoint_interval=3",
            steps=3,
        )
        half = train(first, ParallelContext())
        rest = train(
            make(
                tiny_config,
                f"rest-{dtype}",
                f"model.dtype={dtype}",
                f"checkpoints.resume_checkpoint_path={first.run_dir / 'checkpoints'}",
            ),
            ParallelContext(),
        )
        assert half["losses"] + rest["losses"] == whole["losses"]  # identical, not approximately
        for name, weight in whole["weights"].items():
            assert torch.equal(rest["weights"][name], weight), name
            assert torch.equal(rest["masters"][name], whole["masters"][name]), name


@pytest.fixture(scope="module")
def three_d(tmp_path_factory):
    """On 8 ranks at dp2 x tp2 x pp2 with ZeRO-1, `whole_then_halves`. Returns the config maker, the results
    and the checkpoint directory."""
    root = tmp_path_factory.mktemp("ckpt3d")
    tiny_config = tiny_config_maker(root / "runs", write_patterned_tokens(root / "patterned"))
    per_rank, saved = whole_then_halves(tiny_config, "", dp=2, tp=2, pp=2, zero=1)
    return tiny_config, per_rank, saved


@pytest.mark.distributed
def test_C3_resume_on_2x2x2_with_zero1_is_bit_exact(three_d):
    assert_the_resume_is_bit_exact(three_d[1])


RESHARDED = {
    "dp2-tp1-pp4-zero0": dict(dp=2, tp=1, pp=4, zero=0),
    "dp1-tp1-pp1": dict(dp=1, tp=1, pp=1, zero=0),
    "dp4-tp2-pp1-zero1": dict(dp=4, tp=2, pp=1, zero=1),
    "dp4-tp1-pp2-zero3": dict(dp=4, tp=1, pp=2, zero=3),
}


@pytest.mark.distributed
@pytest.mark.parametrize("label", list(RESHARDED))
def test_C1_resume_on_another_mesh_continues_the_run(three_d, label):
    """Saved at dp2 x tp2 x pp2 with ZeRO-1: the next 3 steps on another layout have the uninterrupted run's
    losses (up to summation order) and read exactly its samples, none skipped or repeated."""
    tiny_config, per_rank, saved = three_d
    layout = RESHARDED[label]
    config = make(tiny_config, f"resharded-{label}", f"checkpoints.resume_checkpoint_path={saved}", **layout)
    world = layout["dp"] * layout["tp"] * layout["pp"]
    results = (
        [ranks_train(0, [config])] if world == 1 else run_ranks(ranks_train, world, [config], timeout=600)
    )
    losses, weights, _, seen = merged(results, 0)
    whole_losses, whole_weights, _, whole_seen = merged(per_rank, 0)
    assert losses == pytest.approx(whole_losses[3:], rel=1e-5)
    assert seen == {step: rows for step, rows in whole_seen.items() if step >= 3}
    for name, weight in whole_weights.items():
        assert (weights[name] - weight).abs().max() <= 1e-4 * weight.abs().max(), name


@pytest.mark.distributed
def test_C3_a_zero3_checkpoint_resumes_bit_exact_and_without_zero_on_one_process(tiny_config):
    """Saved at dp2 x pp2 with ZeRO-3 (each rank writes its shards, never the whole model): resumed on the
    same layout it is bit-exact; on one process without ZeRO it continues the run."""
    per_rank, saved = whole_then_halves(tiny_config, "z3-", dp=2, pp=2, zero=3)
    assert_the_resume_is_bit_exact(per_rank)
    assert_one_process_continues(tiny_config, "z3-single", saved, per_rank)


@pytest.mark.distributed
def test_a_checkpoint_saved_at_cp2_resumes_at_cp1_and_cp4_on_the_same_samples(tiny_config):
    """Saved at cp=2 with ZeRO-1 (its optimizer state sharded over the two cp ranks): 3 more steps at cp=1
    and at cp=4 have the uninterrupted run's losses and read exactly its samples."""
    first = make(tiny_config, "cp-first", "checkpoints.checkpoint_interval=3", cp=2, zero=1, steps=3)
    whole = make(tiny_config, "cp-whole", cp=2, zero=1)
    saved = first.run_dir / "checkpoints"
    per_rank = run_ranks(ranks_train, 2, [whole, first], timeout=300)
    whole_losses, whole_weights, _, whole_seen = merged(per_rank, 0)
    for cp in (1, 4):
        config = make(tiny_config, f"cp-{cp}", f"checkpoints.resume_checkpoint_path={saved}", cp=cp)
        results = [ranks_train(0, [config])] if cp == 1 else run_ranks(ranks_train, cp, [config], timeout=300)
        losses, weights, _, seen = merged(results, 0)
        assert losses == pytest.approx(whole_losses[3:], rel=1e-5), cp
        assert seen == {step: rows for step, rows in whole_seen.items() if step >= 3}, cp
        for name, weight in whole_weights.items():
            assert (weights[name] - weight).abs().max() <= 1e-4 * weight.abs().max(), (cp, name)


MOE = ("model.model_config.moe.num_experts=4", "model.model_config.moe.intermediate_size=32")


@pytest.mark.distributed
def test_experts_saved_at_ep2_resume_at_ep1_and_ep4_on_the_same_samples(tiny_config):
    """A mixture of experts saved at dp2 x ep2 with ZeRO-1 (each expert's optimizer state on one rank): the
    checkpoint holds every expert as a global tensor, and 3 more steps on one process and at dp4 x ep4 have
    the uninterrupted run's losses and weights."""
    first = make(
        tiny_config, "ep-first", *MOE, "checkpoints.checkpoint_interval=3", dp=2, ep=2, zero=1, steps=3
    )
    whole = make(tiny_config, "ep-whole", *MOE, dp=2, ep=2, zero=1)
    saved = first.run_dir / "checkpoints"
    per_rank = run_ranks(ranks_train, 2, [whole, first], timeout=300)
    whole_losses, whole_weights, _, _ = merged(per_rank, 0)
    manifest = json.loads((saved / "step-0000003" / MANIFEST).read_text())
    assert manifest["tensors"]["model/layers.0.mlp.experts.down_proj"]["shape"] == [4, 64, 32]
    for dp, ep in ((1, 1), (4, 4)):
        resume = f"checkpoints.resume_checkpoint_path={saved}"
        config = make(tiny_config, f"ep-{ep}", *MOE, resume, dp=dp, ep=ep)
        results = [ranks_train(0, [config])] if dp == 1 else run_ranks(ranks_train, dp, [config], timeout=300)
        losses, weights, _, _ = merged(results, 0)
        assert losses == pytest.approx(whole_losses[3:], rel=1e-5), ep
        for name, weight in whole_weights.items():
            assert (weights[name] - weight).abs().max() <= 1e-4 * weight.abs().max(), (ep, name)


@pytest.mark.distributed
def test_a_resharded_resume_says_what_changed(three_d, capsys):
    tiny_config, _, saved = three_d
    trainer = Trainer(make(tiny_config, "says", steps=3), ParallelContext())
    line, _ = checkpoint.load(trainer.parts, saved)
    assert line.startswith(f"resumed from {saved / 'step-0000003'} at step 3 (48 samples")
    assert "resharded (dp 2 -> 1, tp 2 -> 1, pp 2 -> 1, zero_stage 1 -> 0)" in line
    assert "RNG states not restored" in line


@pytest.mark.distributed
def test_the_manifest_records_mesh_counters_slices_and_checksums(three_d):
    _, _, saved = three_d
    manifest = json.loads((saved / "step-0000003" / MANIFEST).read_text())
    assert manifest["mesh"] == {
        "dp": 2,
        "cp": 1,
        "tp": 2,
        "pp": 2,
        "ep": 1,
        "pp_engine": "1f1b",
        "pp_virtual_stages": 1,
        "tp_mode": "ALL_REDUCE",
        "zero_stage": 1,
    }
    assert (manifest["step"], manifest["consumed_samples"], manifest["optimizer_steps"]) == (3, 48, 3)
    assert manifest["consumed_tokens"] == 3 * 16 * 32
    assert sorted(manifest["files"]) == [rank_file(r) for r in range(8)]
    # An XXH3-128 (32 hex digits) for every rank file's header and for every tensor in it.
    for record in manifest["files"].values():
        assert len(record["parts_xxh3_128"]["__header__"]) == 32 and len(record["parts_xxh3_128"]) > 3
    assert sorted(manifest["rng"]) == [str(r) for r in range(8)]
    kinds = {name.split("/")[0] for name in manifest["tensors"]}
    assert kinds == {"model", "exp_avg", "exp_avg_sq"}  # fp32: the weights are the master weights
    # Every element of every global tensor is saved exactly once (replicas and tied copies are not).
    for name, entry in manifest["tensors"].items():
        count = torch.zeros(entry["shape"], dtype=torch.int64)
        for piece in entry["slices"]:
            count[tuple(slice(a, b) for a, b in zip(piece["start"], piece["stop"], strict=True))] += 1
        assert torch.equal(count, torch.ones_like(count)), name
    assert (saved / "latest").read_text().strip() == "step-0000003"


def _checkpointed_run(tiny_config, run, *more):
    config = make(tiny_config, run, "checkpoints.checkpoint_interval=2", *more, steps=4)
    Trainer(config, ParallelContext(), log_to_console=False).train()
    return config.run_dir / "checkpoints"


def test_keep_last_n_deletes_older_checkpoints_and_latest_points_at_the_newest(tiny_config):
    saved = _checkpointed_run(tiny_config, "keep", "checkpoints.keep_last_n=1")
    assert sorted(p.name for p in saved.iterdir()) == ["latest", "step-0000004"]
    assert (saved / "latest").read_text().strip() == "step-0000004"


def resume_error(tiny_config, path, *more):
    trainer = Trainer(make(tiny_config, "resume", *more), ParallelContext(), log_to_console=False)
    with pytest.raises(CheckpointError) as info:
        checkpoint.load(trainer.parts, path)
    return str(info.value)


def test_bad_checkpoints_are_named_with_the_fix(tiny_config):
    saved = _checkpointed_run(tiny_config, "bad")
    step = saved / "step-0000004"
    data = step / rank_file(0)
    original = data.read_bytes()
    data.write_bytes(original[: len(original) // 2])
    assert (
        f"checkpoint file {data} has {len(original) // 2:,} bytes but the manifest says {len(original):,}"
        in resume_error(tiny_config, step)
    )
    # One flipped bit in the header, in a weight's bytes, in the RNG states (the last tensor: the narrowest).
    header = int.from_bytes(original[:8], "little")
    for where, part in (
        (8 + header // 2, "header"),
        (8 + header + 5, "tensor '"),
        (-1, "tensor 'rng/torch_cpu'"),
    ):
        flipped = bytearray(original)
        flipped[where] ^= 1
        data.write_bytes(bytes(flipped))
        message = resume_error(tiny_config, step)
        assert f"checkpoint file {data} fails its checksum for its {part}" in message, message
    data.unlink()
    assert f"checkpoint file {data} is missing" in resume_error(tiny_config, step)
    data.write_bytes(original)
    manifest = json.loads((step / MANIFEST).read_text())
    (step / MANIFEST).write_text(json.dumps({**manifest, "version": 99}))
    assert "has format version 99; this femtotron reads versions 1, 2, 3" in resume_error(tiny_config, step)
    (step / MANIFEST).write_text("{ not json")
    assert f"{step / MANIFEST} is not valid JSON" in resume_error(tiny_config, step)
    (step / MANIFEST).write_text(json.dumps(manifest))
    message = resume_error(tiny_config, step, "model.model_config.hidden_size=128")
    assert (
        "was saved from a different model:\n  model.model_config.hidden_size: checkpoint 64, config 128"
        in message
    )
    assert "does not exist" in resume_error(tiny_config, saved / "nowhere")
    assert "holds no committed checkpoint" in resume_error(tiny_config, saved.parent)


def test_a_half_written_save_is_ignored_with_a_warning_and_the_previous_one_loads(tiny_config, capsys):
    saved = _checkpointed_run(tiny_config, "half")
    (saved / ".tmp-step-0000006").mkdir()
    (saved / ".tmp-step-0000006" / rank_file(0)).write_bytes(b"partial")
    trainer = Trainer(make(tiny_config, "half-resume", steps=6), ParallelContext())
    assert checkpoint.load(trainer.parts, saved)[0].startswith(
        f"resumed from {saved / 'step-0000004'} at step 4"
    )
    assert f"ignoring {saved / '.tmp-step-0000006'}: a save that did not finish" in capsys.readouterr().out


def _slow_rank(rank, config):
    ctx = ParallelContext(dp=2, collective_timeout_seconds=3)
    trainer = Trainer(config, ctx, log_to_console=False)
    if rank == 1:  # rank 1 hangs while writing its part (a stuck file system, a dying node)
        import time

        from femtotron.serialize import checkpoint as module

        real = module.write_rank_file

        def slow_write(*args, **kwargs):
            time.sleep(8)
            return real(*args, **kwargs)

        module.write_rank_file = slow_write
    try:
        checkpoint.save(trainer.parts)
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


def test_resuming_a_finished_run_trains_nothing(tiny_config):
    saved = _checkpointed_run(tiny_config, "done")
    trainer = Trainer(
        make(tiny_config, "done-resume", f"checkpoints.resume_checkpoint_path={saved}", steps=4),
        ParallelContext(),
        log_to_console=False,
    )
    assert trainer.train() == [] and trainer.state.step == 4
    assert trainer.state.consumed_tokens == 4 * 16 * 32 and trainer.state.consumed_samples == 4 * 16


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


def test_a_resume_with_another_global_batch_warns(tiny_config, capsys):
    saved = _checkpointed_run(tiny_config, "batch")
    trainer = Trainer(
        make(tiny_config, "batch-resume", "tokens.micro_batch_size=1", steps=6), ParallelContext()
    )
    checkpoint.load(trainer.parts, saved)
    assert (
        "global batch size 16 at the save, 8 now: the data continues at the same global sample"
        in capsys.readouterr().out
    )


def word_tokenizer(path, words):
    """A tokenizer.json whose vocabulary is `words`, one id each."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    Tokenizer(WordLevel({word: i for i, word in enumerate(words)}, unk_token=words[0])).save(str(path))
    return str(path)


def test_S6_S7_a_resume_on_other_data_or_another_tokenizer_is_refused_saying_what_changed(
    tiny_config, tmp_path, capsys
):
    """The same token count with other content, another data.seed, another sequence_length, another
    tokenizer: each refused with what it would do, unless checkpoints.resume_with_other_data (warned)."""
    first = word_tokenizer(tmp_path / "first.json", ["<unk>", "a", "b"])
    saved = _checkpointed_run(tiny_config, "identity", f"tokenizer.tokenizer_name_or_path={first}")
    same_size = write_patterned_tokens(saved.parent / "other", seed=9)  # 8,400 tokens like the original
    other = word_tokenizer(tmp_path / "other.json", ["<unk>", "a", "c"])
    changes = {
        f"data.dataset_folder={same_size}": "the contents of the datasets (data.dataset_folder) changed",
        "data.seed=99": "data.seed changed (1234 at the save, 99 now): the samples would come in another",
        "tokens.sequence_length=16": "tokens.sequence_length changed (32 at the save, 16 now): samples would",
        f"tokenizer.tokenizer_name_or_path={other}": "the tokenizer's vocabulary (tokenizer.tokenizer_name",
    }
    for override, phrase in changes.items():
        kept = [] if override.startswith("tokenizer.") else [f"tokenizer.tokenizer_name_or_path={first}"]
        trainer = Trainer(make(tiny_config, "identity-resume", override, *kept), ParallelContext())
        with pytest.raises(ConfigError) as refused:
            checkpoint.load(trainer.parts, saved)
        assert phrase in str(refused.value) and "checkpoints.resume_with_other_data=true" in str(
            refused.value
        )
        allowed = make(
            tiny_config, "identity-resume", override, *kept, "checkpoints.resume_with_other_data=true"
        )
        checkpoint.load(Trainer(allowed, ParallelContext()).parts, saved)
        assert f"resuming although {phrase}" in capsys.readouterr().out
    # The data copied elsewhere, the same bytes: not a change.
    moved = saved.parent / "moved"
    moved.mkdir()
    for suffix in (".bin", ".idx"):
        shutil.copyfile(tiny_config().data.dataset_folder + suffix, moved / f"patterned{suffix}")
    config = make(
        tiny_config,
        "identity-moved",
        f"data.dataset_folder={moved / 'patterned'}",
        f"tokenizer.tokenizer_name_or_path={first}",
    )
    assert checkpoint.load(Trainer(config, ParallelContext()).parts, saved)[0].startswith("resumed from")


def test_a_checkpoint_written_before_data_identities_still_resumes_and_warns_on_other_data(
    tiny_config, capsys
):
    saved = _checkpointed_run(tiny_config, "old")
    step = saved / "step-0000004"
    manifest = json.loads((step / MANIFEST).read_text())
    del manifest["data_identity"]
    del manifest[MANIFEST_CHECKSUM]  # as older versions wrote them
    (step / MANIFEST).write_text(json.dumps(manifest | {"version": 2}))
    other = write_patterned_tokens(saved.parent / "other", documents=20)
    trainer = Trainer(
        make(tiny_config, "old-resume", f"data.dataset_folder={other}", steps=6), ParallelContext()
    )
    checkpoint.load(trainer.parts, saved)
    assert (
        "the training data differs from the checkpoint's (8,400 tokens, now 14,000)"
        in capsys.readouterr().out
    )


def test_keep_last_n_after_a_rollback_keeps_the_new_checkpoint_and_leaves_later_ones(tiny_config):
    saved = _checkpointed_run(tiny_config, "rollback")  # step-2 and step-4
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

        checkpoint.write_rank_file = full_disk
    try:
        checkpoint.save(trainer.parts)
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


def _decide_apart(rank, configs):
    """Rank 1 is given a config that sees no checkpoint, as a node whose view of a shared file system lags."""
    ctx = ParallelContext(dp=2, collective_timeout_seconds=30)
    try:
        source = checkpoint.agreed_resume_source(configs[rank], ctx)

        def fail():
            raise CheckpointError("rank 0 found no such checkpoint")

        start = time.monotonic()
        try:
            checkpoint.decided_by_rank_0(ctx, "a test", fail if rank == 0 else lambda: "never run")
        except CheckpointError as e:
            return source, str(e), time.monotonic() - start
    finally:
        ctx.close()


@pytest.mark.distributed
def test_every_rank_resumes_from_what_rank_0_sees_and_gets_rank_0_s_error_at_once(tiny_config):
    saved = _checkpointed_run(tiny_config, "seen")
    configs = [
        make(tiny_config, "apart", f"checkpoints.resume_checkpoint_path={saved}"),
        make(tiny_config, "apart"),
    ]
    assert checkpoint.resume_source(configs[1])[0] is None  # on its own, rank 1 would start from step 0
    results = run_ranks(_decide_apart, 2, configs, timeout=120)
    for source, error, seconds in results:
        assert source[:2] == (saved, "checkpoints.resume_checkpoint_path")
        assert error == "rank 0 found no such checkpoint" and seconds < 20  # not the 30 s timeout


def test_reshard_refuses_to_write_over_its_source(tiny_config):
    saved = _checkpointed_run(tiny_config, "self")
    with pytest.raises(CheckpointError, match="is the directory the checkpoint step-0000004 is in"):
        reshard(saved, saved, ["parallelism.tp=2"])


def test_a_bf16_checkpoint_resumed_in_fp16_starts_from_the_configured_loss_scale(tiny_config):
    saved = _checkpointed_run(tiny_config, "to-fp16", "model.dtype=bfloat16")
    trainer = Trainer(
        make(tiny_config, "fp16", "model.dtype=float16", steps=6), ParallelContext(), log_to_console=False
    )
    checkpoint.load(trainer.parts, saved)
    assert trainer.scaler.scale == 2.0**16


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
    saved = _checkpointed_run(tiny_config, "again")
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
    other = _checkpointed_run(tiny_config, "other")
    own = _checkpointed_run(tiny_config, "own")
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


def test_another_run_s_checkpoint_taken_without_its_optimizer_or_schedule(tiny_config, capsys):
    """nanotron's load_optimizer / load_lr_scheduler false: the weights (fp32 masters) and the step and data
    position of the checkpoint, a fresh Adam and a schedule counted again from the resumed step. The run's
    own later checkpoints then resume whole, the schedule's new start included."""
    other = _checkpointed_run(tiny_config, "other")
    more = [
        f"checkpoints.resume_checkpoint_path={other}",
        "checkpoints.load_optimizer=false",
        "checkpoints.load_lr_scheduler=false",
    ]
    config = make(tiny_config, "fresh", *more, "checkpoints.checkpoint_interval=5", steps=6)
    trainer = Trainer(config, ParallelContext())
    path, what, _ = checkpoint.agreed_resume_source(config, trainer.ctx)
    summary, _ = checkpoint.load(trainer.parts, path, what)
    assert "the optimizer starts afresh" in summary and "the lr schedule starts again at step 5" in summary
    assert trainer.optimizer.steps == 0 and trainer.state.step == 4 and trainer.state.lr_schedule_start == 4
    assert all(not moment.any() for moment in trainer.optimizer.state("exp_avg"))
    with checkpoint.CheckpointReader(other / "step-0000004") as reader:  # fp32: the weights are the masters
        for name, param in trainer.model.named_parameters():
            whole = (tuple(0 for _ in param.shape), tuple(param.shape))
            assert torch.equal(param.detach(), reader.read(f"model/{name}", whole)), name
    results = Trainer(config, ParallelContext(), log_to_console=False).train()
    sched = config.optimizer.learning_rate_scheduler
    assert [r.lr for r in results] == [lr_at(0, sched, 2), lr_at(1, sched, 2)]  # warm-up again, over 2 steps
    whole = make(tiny_config, "fresh", "checkpoints.checkpoint_interval=5", steps=6)  # its own checkpoint
    trainer = Trainer(whole, ParallelContext(), log_to_console=False)
    path, what, _ = checkpoint.agreed_resume_source(whole, trainer.ctx)
    checkpoint.load(trainer.parts, path, what)
    assert trainer.optimizer.steps == 2 and trainer.state.lr_schedule_start == 4  # saved at the end, step 6


def test_C3_a_same_layout_resume_restores_the_torch_numpy_and_python_rng_states(tiny_config):
    """Dropout-free training does not draw random numbers, so the bit-exact resume tests cannot see the RNG
    states: here they are set, saved, scrambled, and must come back exactly."""
    config = make(tiny_config, "rng", "checkpoints.checkpoint_interval=2", steps=4)
    trainer = Trainer(config, ParallelContext(), log_to_console=False)
    trainer.train_step()
    random.seed(11)
    np.random.seed(12)
    torch.manual_seed(13)
    saved = (random.getstate(), np.random.get_state(), torch.get_rng_state())
    path = checkpoint.save(trainer.parts)
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
    checkpoint.load(Trainer(config, ParallelContext(), log_to_console=False).parts, path)
    python_state = random.getstate()
    numpy_state = np.random.get_state()
    torch_state = torch.get_rng_state()
    assert python_state == saved[0]
    assert numpy_state[0] == saved[1][0] and np.array_equal(numpy_state[1], saved[1][1])
    assert numpy_state[2:] == saved[1][2:]
    assert torch.equal(torch_state, saved[2])


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


def test_a_step_link_in_a_checkpoints_directory_is_ignored_with_a_warning(tiny_config):
    saved = _checkpointed_run(tiny_config, "links")
    elsewhere = saved.parent / "elsewhere"
    shutil.copytree(saved / "step-0000004", elsewhere)
    (saved / "step-0000009").symlink_to(elsewhere)
    (saved / "latest").write_text("step-0000009\n")
    chosen, warnings = checkpoint.resolve(saved)
    assert chosen == saved / "step-0000004"
    assert f"ignoring {saved / 'step-0000009'}: a link (to {elsewhere})" in warnings[0]


def crashing_train(config, tmp_path, point):
    """`femtotron train` in a process of its own, SIGKILLed at crash point `point`."""
    env = {**os.environ, "FEMTOTRON_CRASH_AT": point, "OMP_NUM_THREADS": "1"}
    died = subprocess.run(
        [sys.executable, "-m", "femtotron", "train", write_yaml(config, tmp_path / f"{point}.yaml")],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert died.returncode == -signal.SIGKILL, died.stdout + died.stderr


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
    saved = _checkpointed_run(tiny_config, f"recommit-{point}")
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
    summary, directory = checkpoint.load(resumed.parts, saved)
    assert resumed.state.step == 4 and "at step 4" in summary
    assert (committed_at(directory) == old) == (kept == "old")


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
    chosen, warnings = checkpoint.resolve(saved)
    assert chosen == saved / "step-0000004"
    assert warnings == [
        f"{saved / 'latest'} names step-0000002, but step-0000004 was committed after it (the run was killed "
        "before it updated latest); taking step-0000004"
    ]


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


def test_with_latest_missing_the_newest_committed_checkpoint_is_resumed(tiny_config):
    """Steps 2 and 4 committed and `latest` lost: the run resumes at step 4, the one the warning names."""
    saved = _checkpointed_run(tiny_config, "no-latest")
    (saved / "latest").unlink()
    chosen, warnings = checkpoint.resolve(saved)
    assert chosen == saved / "step-0000004"
    assert warnings == [
        f"{saved / 'latest'} is missing; taking the newest committed checkpoint, step-0000004"
    ]
    resumed = Trainer(make(tiny_config, "no-latest", steps=6), ParallelContext(), log_to_console=False)
    checkpoint.load(resumed.parts, saved)
    assert resumed.state.step == 4


def test_a_run_that_died_before_its_final_weights_is_not_done_and_writes_them(tiny_config, tmp_path, capsys):
    """The last checkpoint is committed before the final weights are written: killed between the two, the
    run is not finished, and starting it again writes the weights."""
    config = make(tiny_config, "no-weights", "checkpoints.checkpoint_interval=2", steps=4)
    path = write_yaml(config, tmp_path / "c.yaml")
    assert main(["train", path]) == 0
    weights = config.run_dir / "model.safetensors"
    weights.unlink()
    assert checkpoint.already_done(config) is None
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
