"""The messages a failed step stops with: divergence (N2), fp16 overflow at the smallest loss scale (N1),
and running out of memory (M1/M2). Each says where, what the numbers were, and the knobs to turn."""

from __future__ import annotations

import math
from collections.abc import Iterable

from femtotron.config import Config
from femtotron.diagnostics.memory import human
from femtotron.errors import OutOfMemory, TrainingDiverged
from femtotron.metrics import describe_memory, memory_gib
from femtotron.optim.loss_scale import DynamicLossScaler
from femtotron.parallel.context import ParallelContext


def number(value: float) -> str:
    return f"{value:.4f}" if math.isfinite(value) else str(value)


def diverged(
    config: Config,
    step: int,
    loss: float,
    grad_norm: float,
    where: str,
    recent: Iterable[tuple[int, float, float]],
) -> TrainingDiverged:
    if not math.isfinite(loss):
        what = f"loss {number(loss)} is not finite (grad norm {number(grad_norm)})"
    else:
        what = f"grad norm {number(grad_norm)} is not finite (loss {number(loss)})"
    history = ", ".join(f"step {s}: lr {lr:.2e} grad_norm {g:.3g}" for s, lr, g in recent) or "none"
    dtype = {
        "bfloat16": "keep model.dtype=bfloat16 (float16 overflows far sooner); ",
        "float16": "use model.dtype=bfloat16 (float32's range, no overflow at 65504); ",
        "float32": "",
    }
    return TrainingDiverged(
        f"step {step}: {what}; the optimizer step was skipped and training stopped.\nWhere: "
        f"{where}.\nRecent steps: {history}\nFixes: lower optimizer.learning_rate_scheduler.learning_rate "
        "(e.g. by 3x), keep optimizer.clip_grad at 1.0, "
        f"{dtype[config.model.dtype]}model.init_method.std=0.02; if it starts at the embedding or the "
        "first layer, look at the data (`femtotron inspect-data CONFIG`). optimizer.on_non_finite=skip "
        "drops such steps instead of stopping."
    )


def non_finite_skipped(step: int, loss: float, grad_norm: float, where: str, skipped: int) -> str:
    return (
        f"step {step}: loss {number(loss)} / grad norm {number(grad_norm)} is not finite: {where}; step "
        f"skipped (optimizer.on_non_finite=skip; {skipped} skipped so far)"
    )


def fp16_overflow_at_minimum(step: int, scaler: DynamicLossScaler, loss: float) -> TrainingDiverged:
    return TrainingDiverged(
        f"step {step}: fp16 gradients overflowed at loss scale {scaler.scale:g}, which is "
        f"optimizer.loss_scale.min_scale={scaler.min_scale:g} ({scaler.skipped_steps} steps skipped so "
        f"far): the loss ({loss:.4f}) is finite, but the gradients do not fit fp16 even at the smallest "
        "allowed scale, so training stopped.\nFixes: use model.dtype=bfloat16 (fp32's range), or float32; "
        "lower optimizer.learning_rate_scheduler.learning_rate; keep optimizer.clip_grad at 1.0."
    )


def out_of_memory(
    error: BaseException,
    config: Config,
    ctx: ParallelContext,
    step: int,
    where: str,
    model_state: dict[str, int],
) -> OutOfMemory:
    """`where`: the pass, micro-batch and stage it ran out in; `model_state`: this rank's bytes by kind."""
    tokens = config.tokens
    par = config.parallelism
    dp = ctx.dp * par.cp  # the ranks holding the same parameters
    device = ctx.device
    state = ", ".join(f"{key.replace('_', ' ')} {human(value)}" for key, value in model_state.items())
    if tokens.micro_batch_size > 1:
        smaller = (
            f"tokens.micro_batch_size={max(tokens.micro_batch_size // 2, 1)} (activations scale with it; "
            "raise batch_accumulation_per_replica to keep the batch)"
        )
    else:
        smaller = f"tokens.sequence_length={tokens.sequence_length // 2} (activations scale with it)"
    fixes = [smaller]
    if not par.recompute_layer:
        fixes.append("parallelism.recompute_layer=true (76-90% fewer saved activations, ~25% more compute)")
    zero = config.optimizer.zero
    if not zero.shards_parameters and dp > 1:
        over = f"dp={dp}" if par.cp == 1 else f"dp x cp = {dp}"
        if not zero.shards_gradients:
            fixes.append(f"optimizer.zero_stage=2 (gradients, master weights and Adam moments / {over})")
        fixes.append(
            f"optimizer.zero_stage=3 (the parameters too / {over}; each layer gathered while it runs)"
        )
    # Long sequences: their activations are what context parallelism splits.
    if tokens.sequence_length >= 4096:
        fixes.append(f"parallelism.cp={par.cp * 2} (each rank holds 1/cp of every sequence's activations)")
    moe = config.model.model_config_.moe
    if moe is not None and moe.num_experts % (par.ep * 2) == 0 and dp % (par.ep * 2) == 0:
        fixes.append(f"parallelism.ep={par.ep * 2} (each rank holds half as many experts; no more processes)")
    fixes.append(f"parallelism.tp={par.tp * 2} or parallelism.pp={par.pp * 2} (fewer parameters per rank)")
    gap = ""
    if device.type == "cuda":
        gap = (
            " The peaks are since the last logged step; a large gap between peak reserved and peak allocated "
            "is fragmentation: keep general.cuda_expandable_segments on "
            "(PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True)."
        )
    first_line = (str(error).splitlines() or [type(error).__name__])[0][:200]
    return OutOfMemory(
        f"step {step}: out of memory on rank {ctx.rank} in {where} ({first_line}).\nThis rank's model state: "
        f"{state}; memory: {describe_memory(memory_gib(device))}.{gap}\nFixes, in the usual order: "
        f"{'; '.join(fixes)}."
    )
