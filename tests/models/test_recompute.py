"""Activation recomputation (`parallelism.recompute_layer`): the same loss and gradients, bit for bit,
with far fewer bytes held for backward.

Bit-identical (torch.equal), not merely close: non-reentrant checkpointing backpropagates through the
same autograd graph, and the recomputed forward runs the same kernels on the same inputs (no dropout,
no randomness), so every saved tensor it restores is bitwise the one it dropped.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from distributed import run_ranks
from helpers import build_llama, llama_config, loss_and_grads, precision_path, random_batch

from femtotron.diagnostics.activation_memory import saved_activation_bytes
from femtotron.models.llama import Llama
from femtotron.parallel.context import ParallelContext
from femtotron.parallel.tensor_parallel import TensorParallel
from femtotron.trainer import Trainer


def model_config(layers: int = 2, tied: bool = False):
    return llama_config(num_hidden_layers=layers, tie_word_embeddings=tied)


def build(cfg, recompute: bool, dtype=torch.float32, tp: TensorParallel | None = None) -> Llama:
    return build_llama(cfg, dtype, tp=tp, recompute_layer=recompute)


def losses_and_grads(
    model: Llama, ids: torch.Tensor, targets: torch.Tensor, tp: TensorParallel | None = None
):
    loss, _, grads = loss_and_grads(model, ids, targets, tp)
    return loss, grads


@pytest.mark.parametrize(
    "tied, dtype, native",
    [
        (False, torch.float32, None),
        (True, torch.float32, None),
        (False, torch.bfloat16, True),
        (False, torch.bfloat16, False),
    ],
)
def test_recompute_gives_identical_loss_and_gradients(tied, dtype, native):
    cfg = model_config(layers=3, tied=tied)
    ids, targets = random_batch(cfg.vocab_size)
    with precision_path(native):
        loss_off, grads_off = losses_and_grads(build(cfg, False, dtype), ids, targets)
        loss_on, grads_on = losses_and_grads(build(cfg, True, dtype), ids, targets)
    assert loss_on == loss_off
    assert grads_on.keys() == grads_off.keys()
    for name, grad in grads_off.items():
        assert torch.equal(grads_on[name], grad), name


def test_recompute_is_off_without_gradients():
    """Evaluation (no_grad) runs the layers plainly: same logits, nothing to recompute."""
    cfg = model_config()
    ids, _ = random_batch(cfg.vocab_size)
    with torch.no_grad():
        assert torch.equal(build(cfg, True).logits(ids), build(cfg, False).logits(ids))


def test_recompute_cuts_saved_activation_bytes():
    cfg = model_config(layers=4)
    ids, targets = random_batch(cfg.vocab_size, size=4)
    off = saved_activation_bytes(build(cfg, False), ids, targets, backward=True)
    on = saved_activation_bytes(build(cfg, True), ids, targets, backward=True)
    # On, each layer keeps exactly its fp32 input: (batch, sequence, hidden).
    layer_inputs = cfg.num_hidden_layers * ids.numel() * cfg.hidden_size * 4
    assert on >= layer_inputs
    assert on < off / 3, (on, off)


def _compare_on_ranks(rank: int, layers: int):
    ctx = ParallelContext(tp=2, collective_timeout_seconds=60)
    failures, extra_calls = [], {}
    for mode in ["ALL_REDUCE", "REDUCE_SCATTER"]:
        tp = TensorParallel(ctx.comm, ctx.tp_group, ctx.tp_rank, sequence_parallel=mode == "REDUCE_SCATTER")
        cfg = model_config(layers=layers)
        ids, targets = random_batch(cfg.vocab_size, size=4)
        calls = []
        results = []
        for recompute in (False, True):
            before = Counter(ctx.comm.calls)
            results.append(losses_and_grads(build(cfg, recompute, tp=tp), ids, targets, tp))
            calls.append(
                {
                    op: n - before[kind, op]
                    for (kind, op), n in ctx.comm.calls.items()
                    if kind == "tp" and n != before[kind, op]
                }
            )
        (loss_off, grads_off), (loss_on, grads_on) = results
        if loss_on != loss_off:
            failures.append(f"{mode}: loss {loss_on} vs {loss_off}")
        failures += [
            f"{mode}: grad of {name} differs"
            for name, g in grads_off.items()
            if not torch.equal(grads_on[name], g)
        ]
        extra = {op: calls[1].get(op, 0) - calls[0].get(op, 0) for op in calls[0].keys() | calls[1].keys()}
        extra_calls[mode] = {op: n for op, n in extra.items() if n}
    ctx.close()
    return failures, extra_calls


@pytest.mark.distributed
def test_recompute_under_tensor_parallelism_replays_the_collectives():
    """tp=2, both tp_modes: every rank replays the layer's forward collectives during backward, in the same
    order, and the gradients (each rank's shards) are bit-identical to those without recomputation."""
    layers = 2
    results = run_ranks(_compare_on_ranks, 2, layers, timeout=240)
    for failures, _ in results:
        assert failures == []
    extra = results[0][1]
    assert extra == results[1][1]
    # The recomputation stops once the last tensor backward needs is back (torch's early stop), so a
    # layer's final collective, after its last saved tensor, is not replayed: ALL_REDUCE replays the
    # attention block's all-reduce; REDUCE_SCATTER both all-gathers and the attention's reduce-scatter.
    assert extra["ALL_REDUCE"] == {"all_reduce": layers}
    assert extra["REDUCE_SCATTER"] == {"all_gather": 2 * layers, "reduce_scatter": layers}


def test_trainer_passes_the_switch_and_trains_identically(tiny_config):
    assert tiny_config().parallelism.recompute_layer is False
    runs = []
    for recompute in (False, True):
        config = tiny_config(f"parallelism.recompute_layer={recompute}", f"general.run=recompute-{recompute}")
        trainer = Trainer(config, ParallelContext(), log_to_console=False)
        assert all(chunk.recompute_layer is recompute for chunk in trainer.model.chunks)
        runs.append([(r.loss, r.grad_norm) for r in (trainer.train_step() for _ in range(2))])
    assert runs[0] == runs[1]


def _train_two_steps(rank: int, configs):
    ctx = ParallelContext(pp=configs[0].parallelism.pp, collective_timeout_seconds=60)
    out = []
    for config in configs:
        trainer = Trainer(config, ctx, log_to_console=False)
        out.append([(r.loss, r.grad_norm) for r in (trainer.train_step() for _ in range(2))])
    ctx.close()
    return out


@pytest.mark.distributed
def test_recompute_under_pipeline_parallelism(tiny_config):
    """pp=2 (1F1B, 2 micro-batches): a stage's backward starts from its output with the gradient received
    from the next stage; the recomputed layers give the same losses and grad norms bit for bit."""
    configs = [
        tiny_config(
            "parallelism.pp=2",
            "tokens.batch_accumulation_per_replica=2",
            f"parallelism.recompute_layer={on}",
            f"general.run=pp-recompute-{on}",
        )
        for on in (False, True)
    ]
    for off, on in run_ranks(_train_two_steps, 2, configs, timeout=240):
        assert on == off
