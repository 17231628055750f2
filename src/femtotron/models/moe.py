"""Mixture of experts: each layer's MLP replaced by `num_experts` gated MLPs ("experts"), of which a router
picks k = `num_experts_per_tok` per token, plus optional shared experts every token takes. Parameter names
are transformers' (the router is its `mlp.gate`); experts are split over tp along their intermediate size
and over ep along the experts (parallel/expert_parallel.py).

The router runs on this rank's tokens before they enter tensor parallelism (so tp ranks do not each add its
gradient); assignments are sorted by expert and each expert runs on its rows in one grouped GEMM per matrix.
The router losses (load balancing: E * sum_e f_e * P_e, 1 when balanced; z-loss: mean squared log-sum-exp)
are averaged over the layers with experts and the global batch's micro-batches, so every layout gets the
same gradients; they are left out of the logged loss and added in backward (`_AddRouterLoss`).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

from femtotron.config import LlamaConfig
from femtotron.errors import ConfigError
from femtotron.parallel.members import Parallel
from femtotron.parallel.split_backward import DeferredWeightGradients, split_grouped_linear
from femtotron.parallel.tensor_parallel import (
    SEQUENCE_DIM,
    enter_column_parallel,
    gather_full,
    leave_row_parallel,
)
from femtotron.precision import linear

# RouterStats columns after the per-expert token counts.
DROPPED, AUX, Z = range(3)


class RouterStats:
    """Per layer, what one rank's routers did in a step: tokens per expert (every tp rank routes all the
    micro-batch's tokens), dropped assignments, this rank's share of the two losses; and the weight of the
    losses' gradients, set by the trainer (loss scale / micro-batches per global batch)."""

    def __init__(self, cfg: LlamaConfig, device: torch.device) -> None:
        self.experts = cfg.moe.num_experts
        self.moe_layers = cfg.moe_layers
        self.values = torch.zeros(cfg.num_hidden_layers, self.experts + 3, device=device)
        self.gradient_scale = 1.0
        self.replaying = False  # a recomputed forward records nothing

    @contextmanager
    def replay(self) -> Iterator[None]:
        self.replaying = True
        try:
            yield
        finally:
            self.replaying = False

    def record(
        self, layer: int, counts: torch.Tensor, dropped: torch.Tensor, aux: torch.Tensor, z: torch.Tensor
    ) -> None:
        if not self.replaying:  # columns: per expert, then DROPPED, AUX, Z
            self.values[layer, : self.experts] += counts
            self.values[layer, self.experts :] += torch.stack([dropped.to(aux.dtype), aux, z]).detach()

    def reset(self, gradient_scale: float) -> None:
        self.values.zero_()
        self.gradient_scale = gradient_scale


class _AddRouterLoss(torch.autograd.Function):
    """Returns `x`; in backward gives `loss` the gradient `scale`, as if it were added to the total loss."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, loss: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, grad.new_full((), ctx.scale, dtype=torch.float32), None


class RouterLogits(torch.autograd.Function):
    """fp32 logits x @ weight^T, keeping `x` for backward in its own dtype (autograd of F.linear on fp32
    copies would keep an fp32 copy of the layer's hidden states)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        return F.linear(x.float(), weight.float())

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight = ctx.saved_tensors
        return (grad @ weight.float()).to(x.dtype), (grad.T @ x.float()).to(weight.dtype)


class Router(nn.Module):
    """A (rows, hidden) weight replicated over tp: the router's, or the shared experts' gate."""

    def __init__(self, make, name: str, rows: int, hidden: int) -> None:
        super().__init__()
        self.weight = make(f"{name}.weight", (rows, hidden), make.std)


class Experts(nn.Module):
    """Every expert's gated MLP as two grouped weights; `forward` runs rows sorted by expert."""

    def __init__(self, make, name: str, cfg: LlamaConfig, out_std: float, parallel: Parallel):
        super().__init__()
        experts = cfg.moe.num_experts
        inner = cfg.moe.intermediate_size
        hidden = cfg.hidden_size
        tp = parallel.tp
        ep = parallel.ep
        split = dict(shard_dim=2, rank=tp.rank, world=tp.size, experts=(ep.rank, ep.size))
        self.gate_up_proj = make(f"{name}.gate_up_proj", (experts, 2, inner, hidden), make.std, **split)
        self.down_proj = make(f"{name}.down_proj", (experts, hidden, inner), out_std, **split)
        self.deferred: DeferredWeightGradients | None = None  # zero-bubble pipelines: where W's work goes

    def forward(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """`rows` sorted by expert, counts[e] of them for this rank's expert e."""
        ends = counts.cumsum(0)
        gate_up = split_grouped_linear(
            rows,
            param=self.gate_up_proj,
            weight=self.gate_up_proj.flatten(1, 2),
            ends=ends,
            deferred=self.deferred,
        )
        gate, up = gate_up.chunk(2, dim=-1)
        hidden = F.silu(gate) * up
        return split_grouped_linear(
            hidden, param=self.down_proj, weight=self.down_proj, ends=ends, deferred=self.deferred
        )


class MoE(nn.Module):
    def __init__(
        self,
        make,
        name: str,
        layer: int,
        cfg: LlamaConfig,
        out_std: float,
        parallel: Parallel,
        stats: RouterStats,
        shared: nn.Module | None,
    ) -> None:
        """Args:
        make: draws each parameter with its shard metadata (sharding.ParamFactory).
        name: the module's name in the whole model, e.g. `layers.0.mlp`.
        layer: the decoder layer's index (where its routing is recorded in `stats`).
        cfg: the model config (its `moe` section).
        out_std: the init std of the experts' output projections.
        parallel: the tp, cp and ep the experts are split and routed over.
        stats: what this rank's MoE layers routed in a step.
        shared: the shared expert every token also passes through (None: none).
        """
        super().__init__()
        self.tp = parallel.tp
        self.cp = parallel.cp
        self.ep = parallel.ep
        self.moe = moe = cfg.moe
        self.layer = layer
        self.layers = cfg.moe_layer_count
        self.stats = stats
        # The config rules catch these first; a model built by hand must not split experts unevenly.
        splits = {
            "intermediate_size": (moe.intermediate_size, self.tp),
            "num_experts": (moe.num_experts, self.ep),
        }
        for what, (n, split) in splits.items():
            if n % split.size:
                raise ConfigError(
                    f"model.model_config.moe.{what}={n} is not divisible by parallelism.{split.group.kind}="
                    f"{split.size}: experts are split over those ranks. Choose a divisor of {n}."
                )
        self.router = Router(make, f"{name}.router", moe.num_experts, cfg.hidden_size)
        self.experts = Experts(make, f"{name}.experts", cfg, out_std, parallel)
        self.shared_expert = shared
        if moe.shared_expert_gate:
            self.shared_expert_gate = Router(make, f"{name}.shared_expert_gate", 1, cfg.hidden_size)
        self.output_split_dim = SEQUENCE_DIM if self.tp.sequence_parallel else None

    # model.compile: routing has data-dependent shapes and talks over tp, cp and ep: the block runs eagerly
    # between the layer's compiled graphs (the attention's).
    @torch.compiler.disable
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (batch, sequence, hidden), this rank's part of the sequence under sequence parallelism."""
        b, s, h = x.shape
        k = self.moe.num_experts_per_tok
        tp = self.tp
        logits = RouterLogits.apply(x.reshape(-1, h), self.router.weight)
        if self.moe.router_norm == "topk_then_softmax":
            top, chosen = logits.topk(k, dim=-1)
            weights = top.softmax(dim=-1)
        else:
            weights, chosen = logits.softmax(dim=-1).topk(k, dim=-1)
        # Every tp rank runs its part of every expert on all the micro-batch's tokens of this cp rank.
        tokens = enter_column_parallel(x, tp)
        weights = enter_column_parallel(weights.view(b, s, k), tp).reshape(-1, k)
        if tp.sequence_parallel:
            chosen = gather_full(chosen.view(b, s, k), SEQUENCE_DIM, tp).reshape(-1, k)
        out, counts, dropped = self.routed(tokens.reshape(-1, h), chosen, weights)
        out = leave_row_parallel(out.view(tokens.shape), tp)
        if self.shared_expert is not None:
            shared = self.shared_expert(x)
            if self.moe.shared_expert_gate:
                shared = torch.sigmoid(linear(x, self.shared_expert_gate.weight)) * shared
            out = out + shared
        if not torch.is_grad_enabled() or x.is_meta:
            return out
        aux, z = self.router_losses(logits, counts)
        self.stats.record(self.layer, counts, dropped, aux, z)
        loss = (self.moe.aux_loss_coef * aux + self.moe.z_loss_coef * z) / self.layers
        return _AddRouterLoss.apply(out, loss, self.stats.gradient_scale) if loss.requires_grad else out

    def routed(
        self, tokens: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Each token's weighted sum of its experts' outputs (this tp rank's partial sum), the assignments per
        expert (before any are dropped) and how many were dropped (device tensors: the host reads neither)."""
        n, k = chosen.shape
        experts = self.moe.num_experts
        # The meta device (memory estimates) has shapes but no routing: taken as perfectly balanced.
        flat = torch.arange(n * k) % experts if chosen.is_meta else chosen.flatten()
        # Not torch.bincount: on CUDA it reads the largest index back to the host to size its output.
        counts = kept = flat.new_zeros(experts).index_add_(0, flat, torch.ones_like(flat))
        order = flat.argsort(stable=True)
        if self.moe.capacity_factor is not None:  # an assignment's place among its expert's, in token order
            capacity = math.ceil(self.moe.capacity_factor * n * k / experts)
            first = (counts.cumsum(0) - counts).repeat_interleave(counts, output_size=n * k)
            place = torch.arange(n * k, device=flat.device) - first
            # How many are kept is the data's: the mask reads it back to the host (dropless routing does not).
            order = order[place < capacity]
            kept = counts.clamp(max=capacity)
        order = order.to(tokens.device)
        token = order // k
        out = self.ep.run(tokens[token], kept, self.experts)
        out = out * weights.flatten()[order].unsqueeze(-1).to(out.dtype)
        combined = tokens.new_zeros(n, tokens.shape[-1]).index_add(0, token, out)
        return combined, counts, (counts - kept).sum()

    def router_losses(self, logits: torch.Tensor, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's shares of the micro-batch's load-balancing and z losses (fp32 scalars; the shares of
        the cp ranks, and of the tp ranks under sequence parallelism, add up to the whole)."""
        aux = z = logits.new_zeros(())
        tokens = len(logits) * self.cp.size * (self.tp.size if self.tp.sequence_parallel else 1)
        if self.moe.aux_loss_coef:
            assigned = self.cp.comm.all_reduce(counts.float(), self.cp.group)  # the whole micro-batch's
            share = assigned / (tokens * self.moe.num_experts_per_tok)
            aux = self.moe.num_experts * (share * logits.softmax(dim=-1).sum(0)).sum() / tokens
        if self.moe.z_loss_coef:
            z = logits.logsumexp(dim=-1).square().sum() / tokens
        return aux, z
