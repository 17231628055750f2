"""Tensor parallelism equals one device: logits, loss, full-shape gradients, and weights after steps."""

from __future__ import annotations

import itertools

import pytest
import torch
from distributed import run_ranks
from helpers import (
    SMOOTH_ADAM,
    assert_close_to_reference,
    assert_steps_match,
    build_llama,
    llama_config,
    loss_and_grads,
    precision_path,
    random_batch,
    record_cases,
    record_steps,
)

from femtotron.diagnostics import start_report
from femtotron.parallel.context import ParallelContext
from femtotron.parallel.tensor_parallel import TensorParallel, shard_size
from femtotron.trainer import Trainer


def _tp_and_reference(cfg, tp: TensorParallel, dtype: torch.dtype):
    """(loss, logits, gradients) of the tp model and of the whole model, from the same weights and batch."""
    ids, targets = random_batch(cfg.vocab_size)
    reference = loss_and_grads(build_llama(cfg, dtype), ids, targets)
    model = build_llama(cfg, dtype, tp=tp)
    assert model.padded_vocab_size == shard_size(cfg.vocab_size, tp.size) * tp.size
    return loss_and_grads(model, ids, targets, tp), reference


def _assert_same(ours, reference, exact, case: str) -> None:
    loss, logits, grads = ours
    ref_loss, ref_logits, ref_grads = reference
    assert_close_to_reference(loss, ref_loss, exact and exact[0], label=f"{case}: loss")
    assert_close_to_reference(logits, ref_logits, exact and exact[1], label=f"{case}: logits")
    for name, ref in ref_grads.items():
        assert grads[name].shape == ref.shape, (case, name)
        assert_close_to_reference(grads[name], ref, exact and exact[2][name], label=f"{case}: grad of {name}")


def _compare_models(rank: int, tp_size: int, kv_heads: int):
    ctx = ParallelContext(tp=tp_size, collective_timeout_seconds=60)
    for mode, tied in itertools.product(["ALL_REDUCE", "REDUCE_SCATTER"], [False, True]):
        # the tied cases with the logits' z-loss too: its term and gradient from logits split over tp
        z_loss = 1e-2 if tied else 0.0
        cfg = llama_config(num_key_value_heads=kv_heads, tie_word_embeddings=tied, logits_z_loss_coef=z_loss)
        tp = TensorParallel(ctx.comm, ctx.tp_group, ctx.tp_rank, sequence_parallel=mode == "REDUCE_SCATTER")
        ours, fp32_reference = _tp_and_reference(cfg, tp, torch.float32)
        _assert_same(ours, fp32_reference, None, f"{mode} tied={tied} float32")
        for native in (True, False):
            with precision_path(native):
                bf16_ours, bf16_reference = _tp_and_reference(cfg, tp, torch.bfloat16)
                # `exact`: the same computation in fp32, which bounds what bf16 rounding may change.
                _assert_same(
                    bf16_ours,
                    bf16_reference,
                    exact=fp32_reference,
                    case=f"{mode} tied={tied} bfloat16 native={native}",
                )
    ctx.close()


@pytest.mark.distributed
@pytest.mark.parametrize("tp_size, kv_heads", [(2, 2), (4, 4)])
def test_tensor_parallel_model_equals_one_device(tp_size, kv_heads):
    """8 query heads with 2 or 4 kv heads (GQA), both tp_modes, tied (with the logits' z-loss) and untied,
    fp32 and bf16 (native and upcast): loss, logits and every gradient."""
    run_ranks(_compare_models, tp_size, tp_size, kv_heads, timeout=240)


@pytest.mark.distributed
@pytest.mark.parametrize("tp_size", [2, 4])
def test_three_optimizer_steps_equal_one_device(tiny_config, tp_size):
    """Losses, grad norms and weights over 3 AdamW steps (clipping active) equal tp=1: both modes, fp32
    and bf16 (on both CPU paths), tied and untied, a padded vocabulary."""
    cases = []
    references = []
    for mode, tied, dtype, native in [
        ("ALL_REDUCE", False, "float32", None),
        ("REDUCE_SCATTER", True, "float32", None),  # with the logits' z-loss
        ("REDUCE_SCATTER", False, "bfloat16", True),
        ("REDUCE_SCATTER", False, "bfloat16", False),
    ]:
        overrides = [
            f"model.model_config.tie_word_embeddings={tied}",
            "model.model_config.num_key_value_heads=4",
            "model.model_config.vocab_size=257",
            "optimizer.clip_grad=0.5",
            f"general.run={mode}-{tied}-{dtype}-{native}",
            *([SMOOTH_ADAM] if native is not None else []),
            *(["model.model_config.logits_z_loss_coef=0.01"] if tied else []),
        ]
        with precision_path(native):
            reference = record_steps(tiny_config(*overrides, f"model.dtype={dtype}"), ParallelContext())
        exact = record_steps(tiny_config(*overrides), ParallelContext()) if native is not None else None
        references.append((reference, exact))
        config = tiny_config(
            *overrides, f"model.dtype={dtype}", f"parallelism.tp={tp_size}", f"parallelism.tp_mode={mode}"
        )
        cases.append((config, native))
    results = run_ranks(record_cases, tp_size, cases, timeout=240)
    for (config, _), (reference, exact), got in zip(cases, references, results[0], strict=True):
        assert_steps_match(got, reference, exact, label=config.general.run)
    # Every tp rank ends with the same full weights.
    for other in results[1:]:
        for mine, theirs in zip(results[0], other, strict=True):
            assert all(torch.equal(mine.updates[n], theirs.updates[n]) for n in mine.updates)


def _step_bytes(rank, config):
    ctx = ParallelContext(tp=config.parallelism.tp, collective_timeout_seconds=60)
    trainer = Trainer(config, ctx, log_to_console=False)
    trainer.train_step()
    sent = {op: n for (kind, op), n in ctx.comm.bytes_sent.items() if kind == "tp"}
    calls = {op: n for (kind, op), n in ctx.comm.calls.items() if kind == "tp"}
    ctx.close()
    return sent, calls


@pytest.mark.distributed
@pytest.mark.parametrize("mode, dtype", [("ALL_REDUCE", "float32"), ("REDUCE_SCATTER", "bfloat16")])
def test_tp_bytes_per_step_equal_the_analytic_count(tiny_config, mode, dtype):
    tp = 2
    accum = 2
    config = tiny_config(
        f"parallelism.tp={tp}",
        f"parallelism.tp_mode={mode}",
        f"model.dtype={dtype}",
        f"tokens.batch_accumulation_per_replica={accum}",
    )
    m = config.model.model_config_
    tok = config.tokens
    layers = m.num_hidden_layers
    hidden = m.hidden_size
    tokens = tok.micro_batch_size * tok.sequence_length
    activation = tokens * hidden * (4 if dtype == "float32" else 2)  # one (batch, seq, hidden) tensor
    # Per micro-batch, forward: after the embedding and after each attention and MLP block; backward:
    # before each attention and MLP block and before the LM head. So 2 + 4 layers collectives of a
    # whole activation; plus three fp32 numbers per token in the vocab-parallel cross-entropy.
    per_activation = 2 * (tp - 1) / tp if mode == "ALL_REDUCE" else (tp - 1) / tp
    activation_bytes = accum * (2 + 4 * layers) * per_activation * activation
    cross_entropy_bytes = accum * 3 * 2 * (tp - 1) / tp * tokens * 4
    sent, calls = run_ranks(_step_bytes, tp, config)[0]
    if mode == "ALL_REDUCE":
        assert calls == {"all_reduce": accum * (2 + 4 * layers + 3)}
        assert sent == {"all_reduce": activation_bytes + cross_entropy_bytes}
    else:
        # Replicated norm weights (fp32 gradients) are summed over tp once per step.
        norm_bytes = 2 * (tp - 1) / tp * (2 * layers + 1) * hidden * 4
        assert calls == {
            "reduce_scatter": accum * (2 + 4 * layers),
            "all_gather": accum * (2 + 4 * layers),
            "all_reduce": accum * 3 + 1,
        }
        assert sent == {
            "reduce_scatter": activation_bytes,
            "all_gather": activation_bytes,
            "all_reduce": cross_entropy_bytes + norm_bytes,
        }


def test_head_split_is_checked_when_the_model_is_built():
    """T2 at run time: a model built by hand (not through a validated config) is refused too."""
    from femtotron.errors import ConfigError
    from femtotron.parallel.comm import Comm, Group

    four_ranks = TensorParallel(Comm(), Group("tp", (0, 1, 2, 3)), 0)  # construction only, no collective
    with pytest.raises(ConfigError, match="num_key_value_heads=2, parallelism.tp=4"):
        build_llama(llama_config(), tp=four_ranks)


def _start_report(rank, config):
    ctx = ParallelContext(tp=2, collective_timeout_seconds=60)
    ctx.hosts = ["node-a", "node-b"]  # as if the ranks had checked in from two machines
    trainer = Trainer(config, ctx, log_to_console=False)
    out = (
        start_report.summary(trainer.parts, ""),
        start_report.start_warnings(trainer.parts, False, False),
    )
    ctx.close()
    return out


@pytest.mark.distributed
def test_T3_start_reports_padding_and_warns_when_a_tp_group_spans_hosts(tiny_config):
    summary, warnings = run_ranks(
        _start_report, 2, tiny_config("parallelism.tp=2", "model.model_config.vocab_size=257")
    )[0]
    assert "vocabulary padded from 257 to 258 rows to split evenly over tp=2" in summary
    assert any(
        "1 tensor-parallel group(s) span several hosts, e.g. ranks 0-1 on node-a, node-b" in w
        for w in warnings
    )


def _dp_tp(rank, config):
    ctx = ParallelContext(dp=2, tp=2, collective_timeout_seconds=60)
    out = record_steps(config, ctx)
    ctx.close()
    return out


@pytest.mark.distributed
def test_data_and_tensor_parallel_together_equal_one_process(tiny_config):
    """dp=2 x tp=2 on 4 ranks, sequence parallel: the same 3 steps as one process with accumulation."""
    reference = record_steps(tiny_config("tokens.batch_accumulation_per_replica=2"), ParallelContext())
    config = tiny_config("parallelism.dp=2", "parallelism.tp=2", "parallelism.tp_mode=REDUCE_SCATTER")
    for got in run_ranks(_dp_tp, 4, config, timeout=240):
        assert_steps_match(got, reference)


def _tiny_vocabulary(rank):
    ctx = ParallelContext(tp=4, collective_timeout_seconds=60)
    cfg = llama_config(num_key_value_heads=4, vocab_size=5)
    ids, targets = random_batch(cfg.vocab_size)
    tp = TensorParallel(ctx.comm, ctx.tp_group, ctx.tp_rank)
    out = (
        loss_and_grads(build_llama(cfg, tp=tp), ids, targets, tp)[0],
        loss_and_grads(build_llama(cfg), ids, targets)[0],
    )
    ctx.close()
    return out


@pytest.mark.distributed
def test_a_vocabulary_shard_of_only_padding_is_masked_whole():
    """vocab 5 over tp=4: ceil(5/4) = 2 rows per rank, so rank 3 holds only padding; the loss still equals
    tp=1."""
    for loss, reference in run_ranks(_tiny_vocabulary, 4, timeout=120):
        assert loss == pytest.approx(reference, rel=1e-6)
