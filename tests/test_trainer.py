import json
import math
from pathlib import Path

import pytest
import torch
from distributed import run_ranks
from helpers import BF16_PATHS, assert_steps_match, full_masters, mask_unevenly, precision_path, record_steps

from femtotron.batch import IGNORE_INDEX, MicroBatch
from femtotron.errors import ConfigError, DataError, TrainingDiverged
from femtotron.parallel.context import ParallelContext
from femtotron.trainer import Trainer


def train(config):
    trainer = Trainer(config, ParallelContext(), log_to_console=False)
    return trainer, trainer.train()


def test_D4_loss_decreases_and_metrics_are_written(tiny_config):
    trainer, results = train(tiny_config("tokens.train_steps=40", "logging.iteration_step_info_interval=5"))
    losses = [r.loss for r in results]
    assert losses[0] == pytest.approx(math.log(256), rel=0.05)  # an untrained model is uniform over the vocab
    assert sum(losses[-5:]) / 5 < losses[0] - 1.0
    records = [json.loads(line) for line in (trainer.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [
        1,
        2,
        3,
        4,
        5,
        10,
        15,
        20,
        25,
        30,
        35,
        40,
    ]  # the first 5, then every 5
    for key in (
        "loss",
        "lr",
        "grad_norm",
        "tokens_per_sec",
        "tokens_per_sec_per_device",
        "mfu",
        "mem_rss_gib",
    ):
        assert key in records[0]
    assert records[0]["loss"] == pytest.approx(losses[0]) and records[-1]["loss"] == pytest.approx(losses[-1])
    assert (trainer.run_dir / "model.safetensors").is_file() and (trainer.run_dir / "config.yaml").is_file()
    # At pp = 1 too model-parts.json lists the weights (it replaces an earlier pp run's list): as README says.
    assert json.loads((trainer.run_dir / "model-parts.json").read_text()) == {"parts": ["model.safetensors"]}
    readme = " ".join((Path(__file__).parents[1] / "README.md").read_text().split())
    assert "at any pp `RUN_DIR/model-parts.json` lists the files" in readme


def loss_and_grads(config, ctx=None):
    """One step's loss and fp32 gradients, by parameter name (after the dp reduction)."""
    trainer = Trainer(config, ctx or ParallelContext(), log_to_console=False)
    loss, _, pieces = trainer.compute_gradients()
    grads = trainer.data_parallel.state.full(pieces)  # per parameter, whole (assembled over dp under ZeRO-1)
    names = [n for n, _ in trainer.model.named_parameters()]
    return loss, dict(zip(names, [g.clone() for g in grads], strict=True)), trainer


def test_micro_batch_split_gives_the_same_loss_and_gradients(tiny_config):
    whole_loss, whole, _ = loss_and_grads(tiny_config("tokens.micro_batch_size=8"))
    split_loss, split, _ = loss_and_grads(
        tiny_config("tokens.micro_batch_size=2", "tokens.batch_accumulation_per_replica=4")
    )
    assert split_loss == pytest.approx(whole_loss, rel=1e-6)
    for name, grad in whole.items():
        torch.testing.assert_close(split[name], grad, rtol=1e-5, atol=1e-7, msg=name)


def _dp_run(rank, config):
    ctx = ParallelContext(dp=2, init_timeout_seconds=30, collective_timeout_seconds=60)
    loss, grads, trainer = loss_and_grads(config, ctx)
    trainer.optimizer.zero_grad()
    later_losses = [trainer.train_step().loss for _ in range(3)]
    ctx.close()
    return loss, grads, later_losses


@pytest.mark.distributed
def test_data_parallel_matches_single_process(tiny_config):
    single_loss, single_grads, single = loss_and_grads(tiny_config("tokens.micro_batch_size=4"))
    single.optimizer.zero_grad()
    single_later = [single.train_step().loss for _ in range(3)]
    results = run_ranks(_dp_run, 2, tiny_config("tokens.micro_batch_size=2", "parallelism.dp=2"))
    for loss, grads, later in results:
        assert loss == pytest.approx(single_loss, rel=1e-6)
        for name, grad in single_grads.items():
            torch.testing.assert_close(grads[name], grad, rtol=1e-5, atol=1e-7, msg=name)
        assert later == pytest.approx(single_later, rel=1e-4)


@BF16_PATHS
def test_bf16_parameters_train_with_fp32_master_weights(tiny_config, native):
    with precision_path(native):
        trainer, results = train(tiny_config("model.dtype=bfloat16", "tokens.train_steps=4"))
    assert all(p.dtype == torch.bfloat16 for p in trainer.model.chunks[0].parameters())
    assert all(m.dtype == torch.float32 for m in full_masters(trainer.optimizer))
    for p, m in zip(trainer.model.chunks[0].parameters(), full_masters(trainer.optimizer), strict=True):
        assert torch.equal(p, m.to(torch.bfloat16))
    assert results[-1].loss < results[0].loss


def test_N2_non_finite_loss_stops_with_history_and_advice(tiny_config):
    trainer = Trainer(tiny_config("tokens.train_steps=5"), ParallelContext(), log_to_console=False)
    trainer.train_step()
    with torch.no_grad():
        trainer.model.chunks[0].norm.weight.fill_(float("nan"))
    with pytest.raises(TrainingDiverged) as info:
        trainer.train_step()
    message = str(info.value)
    assert "step 2:" in message and "not finite" in message and "step 1: lr" in message
    assert "learning_rate" in message and "clip_grad" in message


def test_missing_dataset_is_reported_before_the_model_is_built_and_leaves_the_metrics_alone(
    tiny_config, tmp_path
):
    trainer, _ = train(tiny_config("tokens.train_steps=2"))
    metrics = (trainer.run_dir / "metrics.jsonl").read_text()
    config = tiny_config(f"data.dataset_folder={tmp_path / 'nowhere'}")
    with pytest.raises(DataError, match="nowhere") as info:
        Trainer(config, ParallelContext(), log_to_console=False).train()
    assert "femtotron preprocess" in str(info.value)
    assert (
        trainer.run_dir / "metrics.jsonl"
    ).read_text() == metrics  # the run never started: nothing changed


def test_validation_loss_is_logged(tiny_config, tiny_dataset):
    trainer, _ = train(
        tiny_config(
            "tokens.train_steps=4",
            "tokens.val_check_interval=2",
            "tokens.limit_val_batches=2",
            f"data.validation_folder={tiny_dataset}",
        )
    )
    records = [json.loads(line) for line in (trainer.run_dir / "metrics.jsonl").read_text().splitlines()]
    val = [r for r in records if "val_loss" in r]
    assert [r["step"] for r in val] == [2, 4] and all(math.isfinite(r["val_loss"]) for r in val)


def test_validation_counts_targets_on_the_host_as_training_does(tiny_config, tiny_dataset, monkeypatch):
    """Counting a micro-batch already on a GPU reads the device (a host sync per micro-batch): batches
    moved by `MicroBatch.to` are marked, and no count may read one."""
    config = tiny_config("tokens.limit_val_batches=2", f"data.validation_folder={tiny_dataset}")
    trainer = Trainer(config, ParallelContext(), log_to_console=False)
    counted_on_device = []
    move = MicroBatch.to
    count = MicroBatch.counted_targets.fget

    def marked_move(batch, device):
        on_device = move(batch, device)
        on_device.moved = True
        return on_device

    def probed_count(batch):
        counted_on_device.append(getattr(batch, "moved", False))
        return count(batch)

    monkeypatch.setattr(MicroBatch, "to", marked_move)
    monkeypatch.setattr(MicroBatch, "counted_targets", property(probed_count))
    trainer.validate()
    assert counted_on_device == [False, False]


@pytest.mark.parametrize("stage", [4, 5])
def test_zero_stages_past_3_are_refused_not_treated_as_3(tiny_config, stage):
    with pytest.raises(
        ConfigError, match=f"optimizer.zero_stage.*zero_stage={stage} does not exist.*Fix: zero_stage=3"
    ):
        tiny_config(f"optimizer.zero_stage={stage}")


def test_N3_token_ids_beyond_the_vocabulary_name_the_dataset_file_before_the_model_is_built(
    tiny_config, tiny_dataset
):
    config = tiny_config("model.model_config.vocab_size=128")  # the data uses ids up to 255
    with pytest.raises(DataError) as info:
        Trainer(config, ParallelContext(), log_to_console=False)
    message = str(info.value)
    assert message.startswith(f"{tiny_dataset}.bin (data.dataset_folder) holds token id 2")
    assert (
        "model.model_config.vocab_size=128 allows ids 0..127" in message and "femtotron preprocess" in message
    )


def test_N3_a_batch_with_an_empty_loss_mask_is_an_error(tiny_config):
    trainer = Trainer(tiny_config(), ParallelContext(), log_to_console=False)
    trainer.batches.step_at = lambda consumed: [
        MicroBatch(torch.zeros(4, 32, dtype=torch.int64), torch.full((4, 32), IGNORE_INDEX))
    ]
    with pytest.raises(DataError, match="step 1: no target token of the whole batch counts in the loss"):
        trainer.train_step()


def test_N3_a_first_loss_far_from_ln_vocab_is_a_warning(tiny_config, capsys):
    Trainer(tiny_config("tokens.train_steps=2", "model.init_method.std=2.0"), ParallelContext()).train()
    out = capsys.readouterr().out
    assert "step 1: loss" in out and "should start near ln(vocab_size) = ln(256) = 5.545" in out
    assert "far above: the initialisation is too large" in out
    Trainer(tiny_config("tokens.train_steps=2", "general.run=ok"), ParallelContext()).train()
    assert "should start near ln(vocab_size)" not in capsys.readouterr().out


def test_a_mixture_of_experts_logs_its_loads_and_warns_of_a_collapsed_router(
    tiny_config, capsys, monkeypatch
):
    """Every step's record has each layer's tokens per expert and the router losses; a router whose busiest
    expert stays over the threshold (here: any share, for 3 steps) is warned about once."""
    import femtotron.diagnostics.expert_load as expert_load

    monkeypatch.setattr(expert_load, "COLLAPSE_STEPS", 3)
    moe = ("model.model_config.moe.num_experts=4", "model.model_config.moe.z_loss_coef=0.001")
    config = tiny_config("tokens.train_steps=4", *moe)
    trainer = Trainer(config, ParallelContext())
    trainer.router_collapse.threshold = 0.0
    trainer.train()
    records = [json.loads(line) for line in (config.run_dir / "metrics.jsonl").read_text().splitlines()]
    tokens = config.tokens.micro_batch_size * config.tokens.sequence_length * 2  # top-2
    assert all(sum(r[f"moe/layer0/load_{k}"] for k in ("min", "max")) <= tokens for r in records)
    assert all(
        r["moe/aux_loss"] >= 1 - 1e-6 and r["moe/z_loss"] > 0 and r["moe/dropped_tokens"] == 0
        for r in records
    )
    out = capsys.readouterr().out
    assert out.count("step 3: router collapse in layer 0") == 1 and "moe aux 1." in out


def weights(trainer):
    return [p.detach().clone() for _, p in trainer.model.named_parameters()] + [
        m.detach().clone() for m in full_masters(trainer.optimizer)
    ]


def test_N1_fp16_overflow_skips_the_step_and_lowers_the_loss_scale(tiny_config, capsys):
    config = tiny_config("model.dtype=float16", "tokens.train_steps=20")
    trainer = Trainer(config, ParallelContext())
    assert trainer.scaler.enabled and trainer.scaler.scale == 2.0**16
    # One fp16 parameter gradient overflows during backward (as a too-large loss scale makes it do).
    _, param = trainer.model.named_parameters()[3]
    assert param.dtype == torch.float16
    hook = param.register_hook(lambda grad: torch.full_like(grad, math.inf))
    before = weights(trainer)
    skipped = trainer.train_step()
    hook.remove()
    assert skipped.skipped and math.isfinite(skipped.loss) and skipped.loss_scale == 2.0**15
    assert trainer.scaler.scale == 2.0**15 and trainer.scaler.skipped_steps == 1
    assert all(torch.equal(a, b) for a, b in zip(before, weights(trainer), strict=True))  # weights unchanged
    assert not trainer.data_parallel.state.flat_grads.any()  # the bad gradients are dropped
    assert (
        "step 1: fp16 gradients overflowed at loss scale 65536; step skipped, scale lowered to 32768"
        in capsys.readouterr().out
    )
    trainer.log_step(skipped)
    results = trainer.train()  # steps 2..20: no more overflows, and fp16 learns
    losses = [skipped.loss] + [r.loss for r in results]
    assert not any(r.skipped for r in results) and all(math.isfinite(x) for x in losses)
    assert all(r.loss_scale == 2.0**15 for r in results)
    assert sum(losses[-5:]) / 5 < losses[0] - 0.5
    records = [json.loads(line) for line in (trainer.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert records[0]["grad_norm"] is None and records[0]["skipped_steps"] == 1
    assert records[-1]["loss_scale"] == 2.0**15 and records[-1]["grad_norm"] > 0


def test_fp16_loss_scale_too_large_for_fp16_backs_off_then_stops_at_min_scale(tiny_config):
    config = tiny_config(
        "model.dtype=float16",
        "optimizer.loss_scale.initial_scale=1099511627776",  # 2**40
        "optimizer.loss_scale.min_scale=549755813888",
    )  # 2**39
    trainer = Trainer(config, ParallelContext(), log_to_console=False)
    before = weights(trainer)
    result = trainer.train_step()  # scaled by 2**40 the gradients really overflow fp16
    assert result.skipped and trainer.scaler.scale == 2.0**39
    assert all(torch.equal(a, b) for a, b in zip(before, weights(trainer), strict=True))
    with pytest.raises(TrainingDiverged) as info:
        trainer.train_step()
    message = str(info.value)
    assert "step 2: fp16 gradients overflowed" in message and "min_scale" in message and "bfloat16" in message


def test_bf16_and_fp32_have_no_loss_scale(tiny_config):
    trainer, results = train(tiny_config("model.dtype=bfloat16", "tokens.train_steps=2"))
    assert not trainer.scaler.enabled and trainer.scaler.scale == 1.0
    assert all(r.loss_scale is None and not r.skipped for r in results)
    assert "loss_scale" not in (trainer.run_dir / "metrics.jsonl").read_text()


def _fp16_dp_overflow_on_one_rank(rank, config):
    ctx = ParallelContext(dp=2, init_timeout_seconds=30, collective_timeout_seconds=60)
    trainer = Trainer(config, ctx, log_to_console=False)
    reduce, poison = trainer.reduce_gradients, [rank == 1]

    def reduce_then_poison():
        grads = reduce()
        if poison[0]:  # after the dp sum: only rank 1's gradients overflow, rank 0's are finite
            grads[0].view(-1)[0] = math.inf
            poison[0] = False
        return grads

    trainer.reduce_gradients = reduce_then_poison
    before = weights(trainer)
    first = trainer.train_step()
    unchanged = all(torch.equal(a, b) for a, b in zip(before, weights(trainer), strict=True))
    second = trainer.train_step()
    ctx.close()
    return first.skipped, unchanged, trainer.scaler.scale, second.skipped, second.loss, weights(trainer)


@pytest.mark.distributed
def test_fp16_overflow_on_one_dp_rank_skips_the_step_on_both(tiny_config):
    config = tiny_config("model.dtype=float16", "tokens.micro_batch_size=2", "parallelism.dp=2")
    results = run_ranks(_fp16_dp_overflow_on_one_rank, 2, config)
    for skipped, unchanged, scale, second_skipped, second_loss, _ in results:
        assert skipped and unchanged and scale == 2.0**15
        assert not second_skipped and math.isfinite(second_loss)
    assert all(
        torch.equal(a, b) for a, b in zip(results[0][-1], results[1][-1], strict=True)
    )  # still in step


def _masked_dp_run(rank, config):
    with ParallelContext.from_config(config) as ctx:
        return record_steps(config, ctx, prepare=mask_unevenly)


@pytest.mark.distributed
def test_the_loss_is_token_weighted_when_micro_batches_and_dp_ranks_count_different_targets(tiny_config):
    """Masks that differ between micro-batches and dp ranks: one big micro-batch, four small ones and dp=2
    give the same loss, gradients and steps. A mean of per-micro-batch means would weight the targets of a
    sparse micro-batch more and fail here."""
    whole = record_steps(tiny_config("tokens.micro_batch_size=8"), ParallelContext(), prepare=mask_unevenly)
    split = record_steps(
        tiny_config("tokens.micro_batch_size=2", "tokens.batch_accumulation_per_replica=4"),
        ParallelContext(),
        prepare=mask_unevenly,
    )
    assert_steps_match(split, whole)
    config = tiny_config(
        "tokens.micro_batch_size=2",
        "tokens.batch_accumulation_per_replica=2",
        "parallelism.dp=2",
        "parallelism.collective_timeout_seconds=60",
    )
    for got in run_ranks(_masked_dp_run, 2, config):
        assert_steps_match(got, whole)


def test_router_losses_are_a_mean_over_micro_batches(tiny_config):
    """One micro-batch, and the same micro-batch four times over (every layout test uses four, so its
    one-process reference shares any error in the count): the token-weighted LM loss is the same, and so
    must be the router losses and every gradient, the routers' included."""
    moe = ("model.model_config.moe.num_experts=4", "model.model_config.moe.z_loss_coef=0.1")
    moe += ("model.model_config.moe.aux_loss_coef=0.1",)
    once = Trainer(tiny_config("tokens.micro_batch_size=2", *moe), ParallelContext(), log_to_console=False)
    repeated = Trainer(
        tiny_config("tokens.micro_batch_size=2", "tokens.batch_accumulation_per_replica=4", *moe),
        ParallelContext(),
        log_to_console=False,
    )
    micro_batch = once.batches.step_at(0)[0]
    repeated.batches.step_at = lambda consumed_samples: [micro_batch] * 4
    results = []
    for trainer in (once, repeated):
        loss, _, pieces = trainer.compute_gradients()
        grads = trainer.data_parallel.state.full(pieces)
        names = [name for name, _ in trainer.model.named_parameters()]
        results.append((loss, dict(zip(names, grads, strict=True))))
    assert results[1][0] == pytest.approx(results[0][0], rel=1e-6)
    routers = [name for name in results[0][1] if "router" in name]
    assert routers
    for name, grad in results[0][1].items():
        torch.testing.assert_close(results[1][1][name], grad, rtol=1e-5, atol=1e-7, msg=name)
