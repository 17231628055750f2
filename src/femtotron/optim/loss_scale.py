"""Dynamic loss scaling for fp16 training (N1).

fp16 has 5 exponent bits: gradients below ~6e-8 flush to zero and values above 65504 overflow to
inf. Multiplying the loss by a large scale S before backward lifts the small gradients into fp16's
range; the fp32 gradients are divided by S again before clipping and the optimizer step. When a
gradient overflows anyway, that step is skipped and S halved; after `growth_interval` clean steps S
doubles, so it settles just below the largest scale that fits. bf16 and fp32 have fp32's exponent
range and need none of this: there the scaler is disabled (scale 1, no checks).
"""

from __future__ import annotations

import torch

from femtotron.parallel.context import ParallelContext


class DynamicLossScaler:
    def __init__(
        self,
        initial_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 1000,
        min_scale: float = 1.0,
        enabled: bool = True,
    ) -> None:
        self.enabled = enabled
        self.scale = float(initial_scale) if enabled else 1.0
        self.growth_factor, self.backoff_factor = growth_factor, backoff_factor
        self.growth_interval, self.min_scale = growth_interval, min_scale
        self.clean_steps = 0  # consecutive steps without overflow since the scale last changed
        self.skipped_steps = 0  # over the whole run

    def unscale_(self, grads: list[torch.Tensor], ctx: ParallelContext) -> bool:
        """Divide the (fp32) gradients by the scale in place; return True when any gradient on any rank is
        not finite.

        Every rank must take the same decision (skip or step), or the replicas drift apart and the next
        collective pairs different calls: the flag is agreed by an all-reduce (max) over the
        model-parallel group and the dp x cp group, which together span every rank.
        """
        if not self.enabled:
            return False
        found_inf = torch.zeros((), device=ctx.device)
        if grads:
            inv_scale = torch.full((), 1.0 / self.scale, device=ctx.device)
            torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale)
        ctx.comm.all_reduce(found_inf, ctx.mp_group, op="max")
        ctx.comm.all_reduce(found_inf, ctx.dp_cp_group, op="max")
        return bool(ctx.comm.read(found_inf, "fp16 overflow flag"))

    def state_dict(self) -> dict[str, float | int]:
        return {"scale": self.scale, "clean_steps": self.clean_steps, "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict[str, float | int]) -> None:
        self.scale = float(state["scale"])
        self.clean_steps, self.skipped_steps = int(state["clean_steps"]), int(state["skipped_steps"])

    @property
    def at_minimum(self) -> bool:
        """True when an overflow can no longer be answered by lowering the scale."""
        return self.scale <= self.min_scale

    def update(self, overflow: bool) -> None:
        """After a step: back off on overflow (the step was skipped), grow after enough clean steps."""
        if not self.enabled:
            return
        if overflow:
            self.scale = max(self.scale * self.backoff_factor, self.min_scale)
            self.clean_steps = 0
            self.skipped_steps += 1
            return
        self.clean_steps += 1
        if self.clean_steps >= self.growth_interval:
            self.scale *= self.growth_factor
            self.clean_steps = 0
