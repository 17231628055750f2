"""Tensor parallelism: Megatron-style column/row-parallel layers and the collectives between them.

A column-parallel linear splits its output features over the tp ranks, a row-parallel one its input
features; back to back (attention: qkv -> o, MLP: gate/up -> down) they need one collective each way per
block, which depends on `tp_mode`:
- ALL_REDUCE: activations whole on every rank. Entering a column-parallel layer: identity forward,
  all-reduce backward; leaving a row-parallel layer: all-reduce forward, identity backward.
- REDUCE_SCATTER (sequence parallel): between blocks each rank holds 1/tp of the sequence (norms and
  residual adds do 1/tp of the work and memory). Entering: all-gather forward, reduce-scatter backward;
  leaving: the reverse. The same bytes as ALL_REDUCE (an all-reduce is a reduce-scatter, then an all-gather).
The vocabulary is split like a column-parallel layer (padded to a multiple of tp); the cross-entropy is
computed on the vocab shards, never gathering the logits. At tp = 1 every op returns its input.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from femtotron.errors import ConfigError
from femtotron.parallel.comm import Group, GroupMember
from femtotron.parallel.sharding import ShardInfo, split_dim
from femtotron.parallel.split_backward import DeferredWeightGradients, split_linear

SEQUENCE_DIM = 1  # activations are (batch, sequence, hidden)


@dataclass(frozen=True)
class TensorParallel(GroupMember):
    """What a tensor-parallel layer needs to know: the tp group, this rank in it, and the mode."""

    KIND = "tp"
    sequence_parallel: bool = False


def shard_size(full: int, tp: int) -> int:
    """Rows per rank along a split dimension, rounding up (the vocabulary is padded, not required even)."""
    return -(-full // tp)


def _same(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    return x


def _sum(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    return tp.comm.all_reduce(x, tp.group)


def _gather(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    return tp.comm.all_gather(x, tp.group, dim=SEQUENCE_DIM)


def _scatter(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    return tp.comm.reduce_scatter(x, tp.group, dim=SEQUENCE_DIM)


class _Conjugates(torch.autograd.Function):
    """`ahead` on the input, `back` on its gradient: the pairs of collectives in the module docstring."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, tp: TensorParallel, ahead: Callable, back: Callable) -> torch.Tensor:
        ctx.tp = tp
        ctx.back = back
        if ahead is _sum:
            ctx.mark_dirty(x)  # summed in place: the partial sums are not needed afterwards
        return ahead(x, tp)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        if ctx.back is _sum:
            # A gradient can be shared with other branches of the graph: it is summed in a copy.
            grad = grad.contiguous().clone()
        # One gradient per input of forward: tp, ahead and back have none.
        return ctx.back(grad, ctx.tp), None, None, None


def enter_column_parallel(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """Make the input a column-parallel layer needs: the whole sequence, gradient summed over tp."""
    if tp.size == 1:
        return x
    if tp.sequence_parallel:
        return _conjugates(x, tp, ahead=_gather, back=_scatter)
    return _conjugates(x, tp, ahead=_same, back=_sum)


def sum_gradient_over_tp(weight: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """A weight every tp rank holds whole but applies to its own heads only (the q/k norms): its gradient
    summed over tp. Under REDUCE_SCATTER the trainer sums every replicated weight's gradient over tp already
    (each rank saw part of the sequence), so there it is the weight as it is."""
    if tp.size == 1 or tp.sequence_parallel:
        return weight
    return _conjugates(weight, tp, ahead=_same, back=_sum)


def sum_over_tp(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """A sum of which each tp rank holds a part and needs the whole (over all heads, each rank holding some):
    summed forward, and its gradient summed backward, each rank's loss depending on it through its heads."""
    if tp.size == 1:
        return x
    return _conjugates(x, tp, ahead=_sum, back=_sum)


def leave_row_parallel(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """Sum a row-parallel layer's partial outputs: whole (ALL_REDUCE) or this rank's sequence shard."""
    if tp.size == 1:
        return x
    if tp.sequence_parallel:
        return _conjugates(x, tp, ahead=_scatter, back=_gather)
    return _conjugates(x, tp, ahead=_sum, back=_same)


# model.compile: a layer's collectives are where its compiled graphs end; Dynamo runs them as they are,
# forward and backward, between those graphs (and at tp = 1 there is nothing to cut).
@torch.compiler.disable
def _conjugates(x: torch.Tensor, tp: TensorParallel, ahead: Callable, back: Callable) -> torch.Tensor:
    return _Conjugates.apply(x, tp, ahead, back)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Summed cross-entropy from logits split over the vocabulary: three all-reduces of one number
    per token (max, sum of exponentials, target logit) instead of gathering (tokens x vocab) logits.
    With `z_loss_coef` each valid token adds coef * log(Z)^2, Z the softmax's normaliser (PaLM's z-loss)."""

    @staticmethod
    def forward(
        ctx,
        logits: torch.Tensor,
        targets: torch.Tensor,
        vocab_start: int,
        ignore_index: int,
        tp: TensorParallel,
        z_loss_coef: float,
    ) -> torch.Tensor:
        ctx.logits_dtype = logits.dtype
        ctx.z_loss_coef = z_loss_coef
        logits = logits.float()
        row_max = logits.max(dim=-1).values
        tp.comm.all_reduce(row_max, tp.group, op="max")
        shifted = logits - row_max.unsqueeze(-1)
        exp = shifted.exp()
        sum_exp = exp.sum(dim=-1)
        tp.comm.all_reduce(sum_exp, tp.group)
        local_targets = targets - vocab_start
        valid = targets != ignore_index
        # The targets in this rank's shard of the vocabulary; the other ranks hold the rest.
        mine = valid & (local_targets >= 0) & (local_targets < logits.shape[-1])
        local_targets = local_targets.masked_fill(~mine, 0)
        target_logit = shifted.gather(-1, local_targets.unsqueeze(-1)).squeeze(-1)
        target_logit = target_logit.masked_fill(~mine, 0.0)
        tp.comm.all_reduce(target_logit, tp.group)
        log_z = row_max + sum_exp.log()
        losses = sum_exp.log() - target_logit + z_loss_coef * log_z.square()
        ctx.save_for_backward(exp, sum_exp, local_targets, mine, valid, log_z)
        return losses.masked_fill(~valid, 0.0).sum()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        exp, sum_exp, local_targets, mine, valid, log_z = ctx.saved_tensors
        # d(loss)/d(logit) = softmax * (1 + 2 coef log Z) - one_hot(target), zero for ignored tokens.
        grad_logits = exp.div_(sum_exp.unsqueeze(-1))
        if ctx.z_loss_coef:
            grad_logits.mul_((1.0 + 2.0 * ctx.z_loss_coef * log_z).unsqueeze(-1))
        one_hot = mine.unsqueeze(-1).to(grad_logits.dtype)
        grad_logits.scatter_add_(-1, local_targets.unsqueeze(-1), -one_hot)
        scale = valid.to(grad_logits.dtype) * grad
        grad_logits.mul_(scale.unsqueeze(-1))
        return grad_logits.to(ctx.logits_dtype), None, None, None, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor,
    targets: torch.Tensor,
    vocab_start: int,
    vocab_size: int,
    ignore_index: int,
    tp: TensorParallel,
    z_loss_coef: float = 0.0,
) -> torch.Tensor:
    """Sum of cross-entropy (plus z-loss with `z_loss_coef`) over valid targets, from this rank's logits for
    [vocab_start, ...). Columns past `vocab_size` (padding the vocabulary to a multiple of tp) get -inf:
    probability 0, no gradient."""
    if vocab_start + logits.shape[-1] > vocab_size:  # a tiny vocabulary can leave a shard all padding
        ids = torch.arange(vocab_start, vocab_start + logits.shape[-1], device=logits.device)
        logits = logits.masked_fill(ids >= vocab_size, float("-inf"))
    if tp.size == 1 and not z_loss_coef:  # torch's fused kernel
        return torch.nn.functional.cross_entropy(
            logits.flatten(0, -2).float(), targets.flatten(), reduction="sum", ignore_index=ignore_index
        )
    return _VocabParallelCrossEntropy.apply(logits, targets, vocab_start, ignore_index, tp, z_loss_coef)


def gather_full(tensor: torch.Tensor, dim: int | None, tp: TensorParallel, parts: int = 1) -> torch.Tensor:
    """This rank's piece of a tensor split along `dim` over tp, gathered back (no gradient). With `parts` > 1
    the piece is [part 0 | part 1 | ...] along `dim` (see ColumnParallelLinear): each part gathered alone."""
    if dim is None or tp.size == 1:
        return tensor
    pieces = tensor.detach().chunk(parts, dim=dim)
    gathered = [tp.comm.all_gather(piece.contiguous(), tp.group, dim=dim) for piece in pieces]
    return torch.cat(gathered, dim=dim)


def _split(name: str, what: str, n: int, tp: TensorParallel) -> None:
    # The config rules (T2) catch this first; a model built by hand must not pad weights silently.
    if n % tp.size:
        raise ConfigError(
            f"{name}: {what}={n} is not divisible by tp={tp.size}, so it cannot be split over "
            f"parallelism.tp ranks. Choose parallelism.tp dividing {n}."
        )


class ColumnParallelLinear(nn.Module):
    """y = x W^T (+ b), W's rows (output features) split over tp, the output and `bias` too. `parts` > 1:
    (parts, d_out, d_in), split along d_out (MLP gate, up): one matmul, output [part 0 | part 1 | ...] of this
    rank's features."""

    def __init__(
        self,
        make: Callable[..., nn.Parameter],
        name: str,
        d_in: int,
        d_out: int,
        std: float | None,
        tp: TensorParallel,
        pad: bool = False,
        parts: int = 1,
        bias: bool = False,
        fused_rows: tuple[int, ...] | None = None,
    ) -> None:
        """Args:
        make: draws the parameters with their shard metadata (sharding.ParamFactory).
        name: the module's name in the whole model.
        d_in: input features (whole on every tp rank).
        d_out: output features, split over tp.
        std: the weight's init std (None: the factory's).
        tp: the tensor-parallel group.
        pad: d_out need not divide by tp (padded up, as the LM head's vocabulary); else it must.
        parts: several matrices of the same shape in one weight (the experts), split alike.
        bias: with a bias, split with the weight's rows.
        fused_rows: the weight's rows interleave several matrices (ShardInfo.fused_rows).
        """
        super().__init__()
        if not pad:
            _split(f"{name}.weight", "output features", d_out, tp)
        self.tp = tp
        if parts == 1:
            shape = (d_out, d_in)
            dim = 0
        else:
            shape = (parts, d_out, d_in)
            dim = 1
        self.weight = make(
            f"{name}.weight", shape, std, shard_dim=dim, rank=tp.rank, world=tp.size, fused_rows=fused_rows
        )
        self.bias = None
        if bias:  # zeros at init, split with the weight's rows
            self.bias = make(f"{name}.bias", shape[:-1], 0.0, shard_dim=dim, rank=tp.rank, world=tp.size)
        self.output_split_dim = -1
        self.output_parts = parts
        self.deferred: DeferredWeightGradients | None = None  # zero-bubble pipelines: where W's work goes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.flatten()
        x = enter_column_parallel(x, self.tp)
        weight = self.weight.flatten(0, -2)
        return split_linear(x, param=self.weight, weight=weight, bias=bias, deferred=self.deferred)


class RowParallelLinear(nn.Module):
    """y = x W^T with W's columns (input features) split over tp; partial outputs are summed."""

    def __init__(
        self,
        make: Callable[..., nn.Parameter],
        name: str,
        d_in: int,
        d_out: int,
        std: float | None,
        tp: TensorParallel,
    ) -> None:
        super().__init__()
        _split(f"{name}.weight", "input features", d_in, tp)
        self.tp = tp
        self.weight = make(f"{name}.weight", (d_out, d_in), std, shard_dim=1, rank=tp.rank, world=tp.size)
        self.output_split_dim = SEQUENCE_DIM if tp.sequence_parallel else None
        self.deferred: DeferredWeightGradients | None = None  # zero-bubble pipelines: where W's work goes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = split_linear(x, param=self.weight, weight=self.weight, bias=None, deferred=self.deferred)
        return leave_row_parallel(out, self.tp)


class VocabParallelEmbedding(nn.Module):
    """Embedding rows split over tp, the vocabulary padded up to a multiple of tp."""

    def __init__(
        self,
        make: Callable[..., nn.Parameter],
        name: str,
        vocab: int,
        dim: int,
        std: float,
        tp: TensorParallel,
        tie_group: str | None,
    ) -> None:
        """Args:
        make: draws the weight with its shard metadata (sharding.ParamFactory).
        name: the module's name in the whole model.
        vocab: the vocabulary size (rows), padded up to a multiple of tp.
        dim: the hidden size (columns).
        std: the weight's init std.
        tp: the tensor-parallel group its rows are split over.
        tie_group: the name shared with a tied LM head's copy (None: not tied).
        """
        super().__init__()
        self.tp = tp
        self.vocab_start = tp.rank * shard_size(vocab, tp.size)
        self.weight = make(
            f"{name}.weight", (vocab, dim), std, shard_dim=0, rank=tp.rank, world=tp.size, tie_group=tie_group
        )
        self.output_split_dim = SEQUENCE_DIM if tp.sequence_parallel else None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Look up ids in this rank's rows [vocab_start, vocab_start + rows) and sum over tp."""
        if self.tp.size == 1:
            return nn.functional.embedding(ids, self.weight)
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = nn.functional.embedding(local.masked_fill(outside, 0), self.weight)
        return leave_row_parallel(out.masked_fill(outside.unsqueeze(-1), 0.0), self.tp)


def full_tensor(
    tensor: torch.Tensor, shard: ShardInfo, tp: TensorParallel, ep: Group | None = None
) -> torch.Tensor:
    """A parameter's (or its gradient's) global tensor, gathered over tp (experts: over `ep`), unpadded."""
    full = gather_full(tensor.detach(), split_dim(shard), tp)
    if shard.experts and ep is not None:
        full = tp.comm.all_gather(full.contiguous(), ep, dim=0)
    return full[tuple(slice(0, n) for n in shard.global_shape)]
