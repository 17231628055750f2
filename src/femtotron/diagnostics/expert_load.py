"""A mixture of experts' step as metrics (tokens per expert and layer, router losses, dropped tokens), and
router collapse: a layer's router sending most tokens to one expert step after step (the other experts then
stop learning, and the layer is a dense MLP of one expert's size)."""

from __future__ import annotations

import torch

from femtotron.config import LlamaConfig
from femtotron.models.moe import AUX, DROPPED, RouterStats, Z
from femtotron.parallel.comm import Comm, Group

COLLAPSE_STEPS = 20  # consecutive steps before the warning


def step_metrics(
    stats: RouterStats, comm: Comm, groups: list[Group], sp_group: Group | None, micro_batches: int
) -> tuple[dict[str, float], torch.Tensor]:
    """The step's records summed over `groups` (the dp x cp and pp ranks: every micro-batch and layer), the
    losses' shares also over `sp_group` (tp under sequence parallelism): metrics.jsonl's `moe/` keys, and the
    tokens per expert of each layer with experts (layers, experts)."""
    values = stats.values.clone()
    for group in groups:
        comm.all_reduce(values, group)
    if sp_group is not None:
        values[:, stats.experts + AUX :] = comm.all_reduce(
            values[:, stats.experts + AUX :].contiguous(), sp_group
        )
    values = values[stats.moe_layers].cpu()  # the layers with experts: one copy, then plain arithmetic
    loads = values[:, : stats.experts]
    extra = values[:, stats.experts :].sum(0)
    per_micro_batch = len(values) * micro_batches  # the losses are means over layers and micro-batches
    metrics = {
        "moe/aux_loss": extra[AUX] / per_micro_batch,
        "moe/z_loss": extra[Z] / per_micro_batch,
        "moe/dropped_tokens": extra[DROPPED],
    }
    cv = loads.std(dim=1, correction=0) / loads.mean(dim=1).clamp(min=1)
    for layer, low, high, spread in zip(
        stats.moe_layers, loads.min(1).values, loads.max(1).values, cv, strict=True
    ):
        metrics |= {
            f"moe/layer{layer}/load_min": low,
            f"moe/layer{layer}/load_max": high,
            f"moe/layer{layer}/load_cv": spread,
        }
    return {key: float(value) for key, value in metrics.items()}, loads


class RouterCollapse:
    def __init__(self, cfg: LlamaConfig) -> None:
        self.moe = cfg.moe
        self.layers = cfg.moe_layers
        self.balanced = self.moe.num_experts_per_tok / self.moe.num_experts  # each expert's share of tokens
        # "Most tokens", and far more than a balanced share (4 experts, top-2: a half is balanced).
        self.threshold = min(0.9, max(0.5, 3 * self.balanced)) if self.balanced < 1 else float("inf")
        self.runs: dict[int, int] = {}

    def observe(self, loads: torch.Tensor) -> list[str]:
        """`loads`: a step's tokens per expert, (layers with experts, experts); a warning per layer that has
        just collapsed for COLLAPSE_STEPS steps in a row."""
        tokens = loads.sum(dim=1) / self.moe.num_experts_per_tok
        busiest, expert = loads.max(dim=1)
        warnings = []
        shares = (busiest / tokens.clamp(min=1)).tolist()
        for layer, share, chosen in zip(self.layers, shares, expert.tolist(), strict=True):
            self.runs[layer] = self.runs.get(layer, 0) + 1 if share > self.threshold else 0
            if self.runs[layer] == COLLAPSE_STEPS:
                warnings.append(
                    f"router collapse in layer {layer}: expert {chosen} took {share:.0%} of the tokens "
                    f"in each of the last {COLLAPSE_STEPS} steps (balanced: {self.balanced:.0%}), so the "
                    "other experts of that layer barely learn. Fix: raise "
                    f"model.model_config.moe.aux_loss_coef (now {self.moe.aux_loss_coef:g}; 0.01 is usual, 0 "
                    "disables balancing) or lower the learning rate; moe/layerN/load_* in metrics.jsonl show "
                    "the loads per step."
                )
        return warnings
