"""Dynamic loss scaling for fp16 training (N1).

fp16 gradients below ~6e-8 flush to zero, values above 65504 overflow. The loss is multiplied by a scale S
before backward, lifting small gradients into range; the fp32 gradients are divided by S before clipping.
On an overflow the step is skipped and S halved; after `growth_interval` clean steps S doubles, settling
just below the largest scale that fits. bf16 and fp32 need none of this: the scaler is disabled (scale 1).
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
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.growth_interval = growth_interval
        self.min_scale = min_scale
        self.clean_steps = 0  # consecutive steps without overflow since the scale last changed
        self.skipped_steps = 0  # over the whole run

    def unscale_(self, grads: list[torch.Tensor], ctx: ParallelContext) -> bool:
        """Unscale the fp32 gradients in place; return whether any on any rank is not finite. Every rank must
        decide alike (else replicas drift), so the flag is max-reduced over mp and dp x cp: every rank."""
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
        self.clean_steps = int(state["clean_steps"])
        self.skipped_steps = int(state["skipped_steps"])

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
