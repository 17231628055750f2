"""AdamW over fp32 master weights, with gradients accumulated in fp32.

The model may hold bf16 (or fp16) parameters for speed and memory; the optimizer keeps an fp32
copy of each (the "master" weight) and updates that, so small updates are not rounded away. As each
parameter's gradient is produced during backward, a hook adds it to the master's fp32 `.grad` and
frees the low-precision one, so accumulation over micro-batches happens in fp32.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


class MixedPrecisionAdamW:
    def __init__(self, params: list[nn.Parameter], cfg: Any) -> None:
        """`cfg` is the `optimizer` config section."""
        self.params = params
        self.accumulate_in_fp32 = cfg.accumulate_grad_in_fp32
        self.masters = [p if p.dtype == torch.float32 else nn.Parameter(p.detach().float().clone()) for p in params]
        if self.accumulate_in_fp32:
            for param, master in zip(params, self.masters, strict=True):
                if master is not param:
                    param.register_post_accumulate_grad_hook(self._accumulator(master))
        factory = cfg.optimizer_factory
        decayed = [m for m in self.masters if m.dim() >= 2]  # norms are not decayed
        undecayed = [m for m in self.masters if m.dim() < 2]
        self.adam = torch.optim.AdamW(
            [{"params": decayed, "weight_decay": cfg.weight_decay}, {"params": undecayed, "weight_decay": 0.0}],
            lr=cfg.learning_rate_scheduler.learning_rate,
            betas=(factory.adam_beta1, factory.adam_beta2),
            eps=factory.adam_eps,
            fused=factory.torch_adam_is_fused or None,
            foreach=None if factory.torch_adam_is_fused else True,
        )

    @staticmethod
    def _accumulator(master: nn.Parameter):
        def hook(param: torch.Tensor) -> None:
            if master.grad is None:
                master.grad = param.grad.float()
            else:
                master.grad.add_(param.grad)
            param.grad = None

        return hook

    def grads(self) -> list[torch.Tensor]:
        """The fp32 gradients the step will use (call after the last backward of the step)."""
        if not self.accumulate_in_fp32:
            for param, master in zip(self.params, self.masters, strict=True):
                if master is not param and param.grad is not None:
                    master.grad, param.grad = param.grad.float(), None
        for master in self.masters:
            if master.grad is None:  # unused this step: a zero keeps every rank's list the same shape
                master.grad = torch.zeros_like(master)
        return [m.grad for m in self.masters]

    def step(self, lr: float) -> None:
        for group in self.adam.param_groups:
            group["lr"] = lr
        self.adam.step()
        with torch.no_grad():
            for param, master in zip(self.params, self.masters, strict=True):
                if master is not param:
                    param.copy_(master)

    def zero_grad(self) -> None:
        for param, master in zip(self.params, self.masters, strict=True):
            param.grad = None
            master.grad = None
