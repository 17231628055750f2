"""Global gradient-norm clipping over every parallel rank that holds a piece of the model."""

from __future__ import annotations

import torch

from femtotron.parallel.comm import Group
from femtotron.parallel.context import ParallelContext


def global_grad_norm(
    grads: list[torch.Tensor],
    ctx: ParallelContext,
    counted: list[bool] | None = None,
    groups: list[Group] | None = None,
) -> torch.Tensor:
    """L2 norm of the model's gradients (fp32), squares summed over `groups` (default: the tp and pp ranks of
    one replica; ZeRO-1 adds dp). `counted[i]` False: another rank counts it (tp-replicated: tp rank 0)."""
    mine = grads if counted is None else [g for g, c in zip(grads, counted, strict=True) if c]
    # Every rank joins the all-reduce, even one holding no gradients, or the others would wait forever.
    if mine:
        norms = torch._foreach_norm(mine, dtype=torch.float32)
    else:
        norms = [torch.zeros((), device=ctx.device)]
    local_sq = torch.stack(norms).pow(2).sum()
    for group in groups or [ctx.mp_group]:
        ctx.comm.all_reduce(local_sq, group)
    return local_sq.sqrt()


def clip_grads_(
    grads: list[torch.Tensor],
    max_norm: float | None,
    ctx: ParallelContext,
    counted: list[bool] | None = None,
    groups: list[Group] | None = None,
) -> torch.Tensor:
    """Scale gradients in place so their global norm is at most `max_norm`; return the norm before."""
    norm = global_grad_norm(grads, ctx, counted=counted, groups=groups)
    if max_norm is not None and grads:
        # The same epsilon as torch.nn.utils.clip_grad_norm_; clamp keeps small norms untouched.
        scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        torch._foreach_mul_(grads, scale)
    return norm
