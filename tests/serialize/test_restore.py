"""Resuming from a checkpoint: bit-exact on the same layout, resharded on a changed mesh (C1, C3); a
checkpoint that does not fit the run (another model, optimizer or data, damaged files) is refused, saying
why."""

from __future__ import annotations

import json
import random
import shutil

import numpy as np
import pytest
import torch
from checkpoint_runs import (
    assert_one_process_continues,
    assert_the_resume_is_bit_exact,
    checkpointed_run,
    make,
    merged,
    ranks_train,
    train,
    whole_then_halves,
)
from distributed import run_ranks
from helpers import precision_path, tiny_config_maker, write_patterned_tokens

from femtotron.config import LlamaConfig
from femtotron.config.sections import MoEConfig
from femtotron.errors import ConfigError
from femtotron.models.families import FEATURES
from femtotron.optim.lr_schedule import lr_at
from femtotron.parallel.context import ParallelContext
from femtotron.serialize.files import (
    MANIFEST,
    MANIFEST_CHECKSUM,
    CheckpointError,
    CheckpointReader,
    rank_file,
)
from femtotron.serialize.restore import MODEL_FIELDS, NOT_CHECKED, load, model_differences
from femtotron.serialize.resume_source import agreed_resume_source
from femtotron.serialize.saving import save
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
    line, _ = load(trainer.parts, saved)
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


def resume_error(tiny_config, path, *more):
    trainer = Trainer(make(tiny_config, "resume", *more), ParallelContext(), log_to_console=False)
    with pytest.raises(CheckpointError) as info:
        load(trainer.parts, path)
    return str(info.value)


def test_bad_checkpoints_are_named_with_the_fix(tiny_config):
    saved = checkpointed_run(tiny_config, "bad")
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


def test_every_model_config_field_is_checked_on_resume_or_declared_not_to_change_the_tensors():
    """A field added to LlamaConfig (or MoEConfig, as moe.KEY) is checked when a checkpoint loads unless
    NOT_CHECKED declares it; a declared name that is no field is stale; every feature a model family turns on
    (models/families.py) changes the tensors or what they mean, so none is declared."""
    moe = {f"moe.{key}" for key in MoEConfig.model_fields}
    fields = {name for name in LlamaConfig.model_fields if name != "moe"} | moe
    assert set(MODEL_FIELDS) | NOT_CHECKED == fields
    assert not set(MODEL_FIELDS) & NOT_CHECKED
    assert set(FEATURES) - {"moe"} <= set(MODEL_FIELDS)


def test_the_dense_mlp_size_is_checked_where_a_layer_of_a_mixture_of_experts_is_dense(tiny_config):
    """A mixture of experts sizes its experts by moe.intermediate_size; intermediate_size sizes only the
    dense layers (moe.dense_layers), so it matters where there are some, and is named there."""
    moe = ("model.model_config.moe.num_experts=4", "model.model_config.moe.num_experts_per_tok=2")
    dense = "model.model_config.moe.dense_layers=[0]"
    saved = tiny_config(*moe, dense).model.model_config_.model_dump(mode="json")
    other = "model.model_config.intermediate_size=96"
    assert [
        line.split(":")[0] for line in model_differences(saved, tiny_config(*moe, dense, other), "x")
    ] == ["model.model_config.intermediate_size"]
    all_experts = tiny_config(*moe).model.model_config_.model_dump(mode="json")
    assert model_differences(all_experts, tiny_config(*moe, other), "x") == []


def test_a_checkpoint_of_other_norms_is_refused_naming_the_field_and_one_from_before_the_field_resumes(
    tiny_config,
):
    """norm_placement and qk_norm_span change what the norms' weights do (OLMo2's): a checkpoint saved with
    other values is refused naming the field, not read into another model. A manifest written before such
    a field existed lacks it and counts as its default: it resumes into a model of the default, and is
    refused by another."""
    step = checkpointed_run(tiny_config, "norms") / "step-0000004"
    placement = "model.model_config.norm_placement: checkpoint 'before', config 'after'"
    assert placement in resume_error(tiny_config, step, "model.model_config.norm_placement=after")
    span = "model.model_config.qk_norm_span: checkpoint 'head', config 'all_heads'"
    qk_norms = ("model.model_config.qk_norm=true", "model.model_config.qk_norm_span=all_heads")
    assert span in resume_error(tiny_config, step, *qk_norms)
    manifest = json.loads((step / MANIFEST).read_text())
    model_config = manifest["config"]["model"]["model_config"]
    del model_config["norm_placement"]
    del model_config["qk_norm_span"]
    del manifest[MANIFEST_CHECKSUM]  # as older versions wrote them
    (step / MANIFEST).write_text(json.dumps(manifest | {"version": 2}))
    trainer = Trainer(make(tiny_config, "norms-old", steps=6), ParallelContext(), log_to_console=False)
    assert load(trainer.parts, step)[0].startswith(f"resumed from {step} at step 4")
    assert placement in resume_error(tiny_config, step, "model.model_config.norm_placement=after")


def test_a_resume_with_another_global_batch_warns(tiny_config, capsys):
    saved = checkpointed_run(tiny_config, "batch")
    trainer = Trainer(
        make(tiny_config, "batch-resume", "tokens.micro_batch_size=1", steps=6), ParallelContext()
    )
    load(trainer.parts, saved)
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
    saved = checkpointed_run(tiny_config, "identity", f"tokenizer.tokenizer_name_or_path={first}")
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
            load(trainer.parts, saved)
        assert phrase in str(refused.value) and "checkpoints.resume_with_other_data=true" in str(
            refused.value
        )
        allowed = make(
            tiny_config, "identity-resume", override, *kept, "checkpoints.resume_with_other_data=true"
        )
        load(Trainer(allowed, ParallelContext()).parts, saved)
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
    assert load(Trainer(config, ParallelContext()).parts, saved)[0].startswith("resumed from")


def test_a_checkpoint_written_before_data_identities_still_resumes_and_warns_on_other_data(
    tiny_config, capsys
):
    saved = checkpointed_run(tiny_config, "old")
    step = saved / "step-0000004"
    manifest = json.loads((step / MANIFEST).read_text())
    del manifest["data_identity"]
    del manifest[MANIFEST_CHECKSUM]  # as older versions wrote them
    (step / MANIFEST).write_text(json.dumps(manifest | {"version": 2}))
    other = write_patterned_tokens(saved.parent / "other", documents=20)
    trainer = Trainer(
        make(tiny_config, "old-resume", f"data.dataset_folder={other}", steps=6), ParallelContext()
    )
    load(trainer.parts, saved)
    assert (
        "the training data differs from the checkpoint's (8,400 tokens, now 14,000)"
        in capsys.readouterr().out
    )


def test_a_bf16_checkpoint_resumed_in_fp16_starts_from_the_configured_loss_scale(tiny_config):
    saved = checkpointed_run(tiny_config, "to-fp16", "model.dtype=bfloat16")
    trainer = Trainer(
        make(tiny_config, "fp16", "model.dtype=float16", steps=6), ParallelContext(), log_to_console=False
    )
    load(trainer.parts, saved)
    assert trainer.scaler.scale == 2.0**16


def test_another_run_s_checkpoint_taken_without_its_optimizer_or_schedule(tiny_config, capsys):
    """nanotron's load_optimizer / load_lr_scheduler false: the weights (fp32 masters) and the step and data
    position of the checkpoint, a fresh Adam and a schedule counted again from the resumed step. The run's
    own later checkpoints then resume whole, the schedule's new start included."""
    other = checkpointed_run(tiny_config, "other")
    more = [
        f"checkpoints.resume_checkpoint_path={other}",
        "checkpoints.load_optimizer=false",
        "checkpoints.load_lr_scheduler=false",
    ]
    config = make(tiny_config, "fresh", *more, "checkpoints.checkpoint_interval=5", steps=6)
    trainer = Trainer(config, ParallelContext())
    path, what, _ = agreed_resume_source(config, trainer.ctx)
    summary, _ = load(trainer.parts, path, what)
    assert "the optimizer starts afresh" in summary and "the lr schedule starts again at step 5" in summary
    assert trainer.optimizer.steps == 0 and trainer.state.step == 4 and trainer.state.lr_schedule_start == 4
    assert all(not moment.any() for moment in trainer.optimizer.state("exp_avg"))
    with CheckpointReader(other / "step-0000004") as reader:  # fp32: the weights are the masters
        for name, param in trainer.model.named_parameters():
            whole = (tuple(0 for _ in param.shape), tuple(param.shape))
            assert torch.equal(param.detach(), reader.read(f"model/{name}", whole)), name
    results = Trainer(config, ParallelContext(), log_to_console=False).train()
    sched = config.optimizer.learning_rate_scheduler
    assert [r.lr for r in results] == [lr_at(0, sched, 2), lr_at(1, sched, 2)]  # warm-up again, over 2 steps
    whole = make(tiny_config, "fresh", "checkpoints.checkpoint_interval=5", steps=6)  # its own checkpoint
    trainer = Trainer(whole, ParallelContext(), log_to_console=False)
    path, what, _ = agreed_resume_source(whole, trainer.ctx)
    load(trainer.parts, path, what)
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
    path = save(trainer.parts)
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
    load(Trainer(config, ParallelContext(), log_to_console=False).parts, path)
    python_state = random.getstate()
    numpy_state = np.random.get_state()
    torch_state = torch.get_rng_state()
    assert python_state == saved[0]
    assert numpy_state[0] == saved[1][0] and np.array_equal(numpy_state[1], saved[1][1])
    assert numpy_state[2:] == saved[1][2:]
    assert torch.equal(torch_state, saved[2])
