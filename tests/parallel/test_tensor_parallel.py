"""Tensor parallelism equals one device: logits, loss, full-shape gradients, and weights after steps."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest
import torch

from femtotron.models.llama import IGNORE_INDEX, Llama
from femtotron.parallel.context import ParallelContext
from femtotron.parallel.sharding import split_dim
from femtotron.parallel.tensor_parallel import TensorParallel, full_tensor, shard_size
from tests.distributed import run_ranks

BF16_EPS = 2.0**-7  # bf16 keeps 8 significant bits


def model_config(kv_heads: int, tied: bool, vocab: int = 251) -> SimpleNamespace:
    # vocab 251 is divisible by neither 2 nor 4: every case runs with a padded vocabulary.
    return SimpleNamespace(vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                           num_attention_heads=8, num_key_value_heads=kv_heads, max_position_embeddings=32,
                           rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=tied)


def batch(vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, vocab, (3, 17), generator=torch.Generator().manual_seed(11))
    targets = ids[:, 1:].clone()
    targets[0, :5] = IGNORE_INDEX
    targets[2, -1] = vocab - 1  # the last real row, next to the padding
    return ids[:, :-1], targets


def loss_and_grads(model: Llama, ids: torch.Tensor, targets: torch.Tensor, tp: TensorParallel):
    loss_sum, count = model(ids, targets)
    (loss_sum / count).backward()
    grads = {}
    for name, p in model.named_parameters():
        grad = p.grad
        if tp.sequence_parallel and split_dim(p.shard) is None:
            # Under sequence parallelism each rank saw only its part of the sequence (the trainer
            # sums these over tp in reduce_gradients).
            grad = tp.comm.all_reduce(grad.clone(), tp.group)
        grads[name] = full_tensor(grad, p.shard, tp).float()
    return (loss_sum / count).item(), model.logits(ids).detach().float(), grads


def close(ours: torch.Tensor, reference: torch.Tensor, dtype: torch.dtype) -> bool:
    """fp32: equal up to reduction order; bf16: within a few bf16 epsilons of the tensor's scale."""
    scale = reference.abs().max().item() + 1e-12
    bound = 1e-5 if dtype == torch.float32 else 4 * BF16_EPS
    return (ours - reference).abs().max().item() <= bound * scale


def _compare_models(rank: int, tp_size: int, kv_heads: int):
    ctx = ParallelContext(tp=tp_size, collective_timeout_seconds=60)
    failures = []
    for mode, tied, dtype in itertools.product(["ALL_REDUCE", "REDUCE_SCATTER"], [False, True],
                                               [torch.float32, torch.bfloat16]):
        cfg = model_config(kv_heads, tied)
        tp = TensorParallel(ctx.comm, ctx.tp_group, ctx.tp_rank, sequence_parallel=mode == "REDUCE_SCATTER")
        kwargs = dict(std=0.02, seed=5, dtype=dtype, device=torch.device("cpu"))
        ids, targets = batch(cfg.vocab_size)
        ref_loss, ref_logits, ref_grads = loss_and_grads(Llama(cfg, **kwargs), ids, targets, TensorParallel.single())
        model = Llama(cfg, tp=tp, **kwargs)
        assert model.padded_vocab_size == shard_size(cfg.vocab_size, tp_size) * tp_size
        loss, logits, grads = loss_and_grads(model, ids, targets, tp)
        case = f"{mode} tied={tied} {dtype}"
        if abs(loss - ref_loss) > (1e-6 if dtype == torch.float32 else 4 * BF16_EPS) * ref_loss:
            failures.append(f"{case}: loss {loss} vs {ref_loss}")
        if not close(logits, ref_logits, dtype):
            failures.append(f"{case}: logits differ by {(logits - ref_logits).abs().max():.3g}")
        for name, ref in ref_grads.items():
            if grads[name].shape != ref.shape or not close(grads[name], ref, dtype):
                failures.append(f"{case}: grad of {name} differs")
    ctx.close()
    return failures


@pytest.mark.parametrize("tp_size, kv_heads", [(2, 2), (4, 4)])
def test_tensor_parallel_model_equals_one_device(tp_size, kv_heads):
    """8 query heads with 2 or 4 kv heads (GQA), both tp_modes, tied and untied, fp32 and bf16."""
    for failures in run_ranks(_compare_models, tp_size, tp_size, kv_heads, timeout=240):
        assert failures == []
