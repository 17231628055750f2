"""femtotron's tensor parallelism agrees with PyTorch's own: an independent reference.

The reference is Hugging Face's `LlamaForCausalLM` (its own attention, MLP, norms and rotary code),
loaded with our weights via `to_hf` and parallelised by `torch.distributed.tensor.parallel` (DTensor)
over the same two gloo ranks: column-wise q/k/v/gate/up, row-wise o/down, a row-wise vocabulary-split
embedding and a column-wise vocabulary-split head with `loss_parallel` cross-entropy. For
REDUCE_SCATTER the reference uses DTensor's `SequenceParallel` norms and Shard(1) residual stream.

At tp=2, GQA (8 query heads, 2 kv heads: one whole group per rank), tied and untied embeddings, a
vocabulary (251) that does not divide by tp, and ignored targets, the test proves that femtotron's
TP model gives the same loss, the same full logits and the same full-shape gradient of every
parameter (fused qkv / gate_up gradients split back to HF names) as the DTensor model, in fp32.
Neither side is compared against a one-device run here (tests/parallel/test_tensor_parallel.py does
that): this checks femtotron's hand-written collectives against PyTorch's.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from distributed import run_ranks
from helpers import build_llama, hf_llama, llama_config, random_batch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)
from transformers import LlamaForCausalLM

from femtotron.batch import IGNORE_INDEX
from femtotron.diagnostics.check_tp import full_gradients
from femtotron.models.hf_conversion import to_hf
from femtotron.models.llama import Llama
from femtotron.parallel.context import ParallelContext
from femtotron.parallel.tensor_parallel import TensorParallel

TP = 2


def parallelize_hf(hf: LlamaForCausalLM, sequence_parallel: bool) -> None:
    """The Megatron plan in DTensor terms, as torchtitan writes it for LLaMA (sequence parallel optional)."""
    mesh = init_device_mesh("cpu", (TP,))
    # Between blocks the residual stream is replicated, or (sequence parallel) split along the sequence.
    stream = Shard(1) if sequence_parallel else Replicate()
    top = {
        "model.embed_tokens": RowwiseParallel(
            input_layouts=Replicate(), output_layouts=stream, use_local_output=not sequence_parallel
        ),
        # Logits stay split over the vocabulary for loss_parallel.
        "lm_head": ColwiseParallel(input_layouts=stream, output_layouts=Shard(-1), use_local_output=False),
    }
    if sequence_parallel:
        top["model.norm"] = SequenceParallel()
    parallelize_module(hf, mesh, top)
    if hf.config.tie_word_embeddings:
        # parallelize_module gave each module its own new DTensor parameter, untying them: tie them
        # again (both are vocabulary rows split Shard(0), so one parameter serves both).
        hf.lm_head.weight = hf.model.embed_tokens.weight
    for layer in hf.model.layers:
        plan = {
            "self_attn.q_proj": ColwiseParallel(),
            "self_attn.k_proj": ColwiseParallel(),
            "self_attn.v_proj": ColwiseParallel(),
            "self_attn.o_proj": RowwiseParallel(
                output_layouts=stream, use_local_output=not sequence_parallel
            ),
            "mlp.gate_proj": ColwiseParallel(),
            "mlp.up_proj": ColwiseParallel(),
            "mlp.down_proj": RowwiseParallel(output_layouts=stream, use_local_output=not sequence_parallel),
        }
        if sequence_parallel:
            plan.update(
                {
                    "input_layernorm": SequenceParallel(),
                    "post_attention_layernorm": SequenceParallel(),
                    "self_attn": PrepareModuleInput(
                        input_kwarg_layouts={"hidden_states": Shard(1)},
                        desired_input_kwarg_layouts={"hidden_states": Replicate()},
                    ),
                    "mlp": PrepareModuleInput(
                        input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
                    ),
                }
            )
        parallelize_module(layer, mesh, plan)
    # HF's attention infers the head count from the local q/k/v width (view with -1 heads); its
    # repeat_kv factor (query heads per kv head) must still match the local shards: 4 q heads, 1 kv head.
    attn = hf.model.layers[0].self_attn
    local_q = attn.q_proj.weight.to_local().shape[0]
    local_k = attn.k_proj.weight.to_local().shape[0]
    assert local_q == local_k * attn.num_key_value_groups == hf.config.hidden_size // TP


def dtensor_loss_and_grads(hf: LlamaForCausalLM, ids: torch.Tensor, targets: torch.Tensor):
    logits = hf(input_ids=ids).logits  # a DTensor split over the vocabulary
    count = (targets != IGNORE_INDEX).sum()
    with loss_parallel():
        loss_sum = torch.nn.functional.cross_entropy(
            logits.flatten(0, 1), targets.flatten(), reduction="sum", ignore_index=IGNORE_INDEX
        )
        loss = loss_sum / count
        loss.backward()
    # Norm weights outside the plan (ALL_REDUCE) stay plain tensors with whole, identical gradients;
    # under SequenceParallel their DTensor gradients are Partial, and full_tensor() sums them.
    grads = {
        name: p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        for name, p in hf.named_parameters()
    }
    return loss.full_tensor().item(), logits.full_tensor().detach(), grads


def femtotron_loss_and_grads(model: Llama, ids: torch.Tensor, targets: torch.Tensor, tp: TensorParallel):
    loss_sum, count = model(ids, targets)
    (loss_sum / count).backward()
    grads = full_gradients(model, tp)
    return (loss_sum / count).item(), model.logits(ids).detach(), to_hf(grads, model.cfg)


def _compare(rank: int) -> list[str]:
    ctx = ParallelContext(tp=TP, collective_timeout_seconds=60)
    failures = []
    for mode, tied in itertools.product(["ALL_REDUCE", "REDUCE_SCATTER"], [False, True]):
        cfg = llama_config(tie_word_embeddings=tied)
        case = f"{mode} tied={tied}"
        sp = mode == "REDUCE_SCATTER"
        ids, targets = random_batch(cfg.vocab_size)

        tp = TensorParallel(ctx.comm, ctx.tp_group, ctx.tp_rank, sequence_parallel=sp)
        loss, logits, grads = femtotron_loss_and_grads(build_llama(cfg, tp=tp), ids, targets, tp)

        # The reference starts from the full weights of a one-device model (init depends on seed and name
        # only).
        full = {name: p.detach() for name, p in build_llama(cfg).named_parameters()}
        hf = hf_llama(cfg, full, attn_implementation="eager")
        parallelize_hf(hf, sp)
        ref_loss, ref_logits, ref_grads = dtensor_loss_and_grads(hf, ids, targets)

        if abs(loss - ref_loss) > 1e-5 * ref_loss:
            failures.append(f"{case}: loss {loss} vs DTensor {ref_loss}")
        if not torch.allclose(logits, ref_logits, rtol=1e-5, atol=1e-5):
            failures.append(f"{case}: logits differ by {(logits - ref_logits).abs().max():.3g}")
        if grads.keys() != ref_grads.keys():
            failures.append(f"{case}: gradient names {sorted(grads)} vs {sorted(ref_grads)}")
            continue
        for name, ref in ref_grads.items():
            scale = ref.abs().max().item()
            if grads[name].shape != ref.shape or (grads[name] - ref).abs().max().item() > 1e-5 * scale:
                failures.append(f"{case}: grad of {name} differs from DTensor's")
    ctx.close()
    return failures


@pytest.mark.distributed
def test_tensor_parallel_matches_torch_dtensor():
    """Both tp_modes, tied and untied: loss, logits and every full gradient equal DTensor's at tp=2."""
    for failures in run_ranks(_compare, TP, timeout=120):
        assert failures == []
