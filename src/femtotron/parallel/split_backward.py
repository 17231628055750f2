"""Zero-bubble pipelines' split backward (`parallelism.pp_engine: zb-h1`): a linear layer's backward computes
the gradient of its input at once (B: the previous pipeline stage waits for it) and leaves the gradient of
its weight for later (W: only the optimizer step needs it), so that the schedule can run W in time the
stage would otherwise spend waiting (parallel/pipeline/schedules.py).

Deferred are the matmuls that hold nearly all of a layer's weight-gradient work: the column- and
row-parallel linears (attention's projections, the MLPs, an untied LM head) and the experts' grouped
weights. The norms, the embedding (a tied LM head too: it is the embedding's weight), the router and biases
keep their cheap gradients in B.

W hands each gradient to autograd as the gradient of the parameter itself (`_AdoptGradient`), so it
accumulates and fires the parameter's hooks as a gradient from B would: data parallelism adds it to its
bucket, and launches the bucket's reduction once the step's last micro-batch has completed it, as the
backward of 1F1B does. Under ZeRO-3, whose reductions run per layer as the layer's backward ends, that
reduction is queued behind the layer's weight gradients (`after`), so W reduces each layer once complete.
Until its W runs, each deferred layer keeps its input (saved for backward anyway) and its output's gradient.

model.compile: the deferring matmuls are `torch.compiler.disable`d (their backward leaves work for later,
a side effect a compiled graph cannot hold), so a compiled layer is cut at its linears as it is at its tp
collectives; the elementwise work between them is still compiled.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import nn

from femtotron.precision import grouped_linear, grouped_linear_weight_gradient, linear, linear_weight_gradient

DeferredWork = Callable[[], None]  # one piece of a W action's work


class DeferredWeightGradients:
    """The work a backward left for W, in the order the backward ran: weight gradients (so the buckets fill
    as under 1F1B), and what must follow some of them."""

    def __init__(self) -> None:
        self.collected: list[DeferredWork] = []

    def defer(self, param: nn.Parameter, gradient: Callable[[], torch.Tensor]) -> None:
        self.collected.append(functools.partial(_accumulate, param, gradient))

    def after(self, work: DeferredWork) -> None:
        """Run `work` in W once the weight gradients deferred so far are in (ZeRO-3: a layer's reduction)."""
        self.collected.append(work)

    def take(self) -> list[DeferredWork]:
        """What the backward just run left."""
        taken = self.collected
        self.collected = []
        return taken


def _accumulate(param: nn.Parameter, gradient: Callable[[], torch.Tensor]) -> None:
    """A weight's gradient, accumulated into the parameter through autograd (its hooks fire). Computed
    inside autograd's engine, by `_AdoptGradient`'s backward: the engine then holds the only reference, and
    the parameter takes the tensor as its gradient (passed from here, to `torch.autograd.backward(param,
    grad)`, it would be copied first)."""
    torch.autograd.backward(_AdoptGradient.apply(param, gradient))


class _AdoptGradient(torch.autograd.Function):
    """A number depending on `param`, whose backward gives `param` the gradient `gradient()`."""

    @staticmethod
    def forward(ctx, param: nn.Parameter, gradient: Callable[[], torch.Tensor]) -> torch.Tensor:
        ctx.gradient = gradient
        ctx.shape = param.shape
        return param.new_zeros(())

    @staticmethod
    def backward(ctx, _: torch.Tensor):
        return ctx.gradient().view(ctx.shape), None


def compute_weight_gradients(deferred: list[DeferredWork]) -> None:
    """W: the work a backward left, in its order."""
    for work in deferred:
        work()


def kept_tensors(deferred: list[DeferredWork]) -> list[torch.Tensor]:
    """The tensors `deferred` keeps alive until its W runs (the split layers' inputs and output gradients,
    inside its partials; parameters aside): for memory estimates."""
    found = []
    pending = list(deferred)
    while pending:
        item = pending.pop()
        if isinstance(item, functools.partial):
            pending += item.args
        elif isinstance(item, torch.Tensor) and not isinstance(item, nn.Parameter):
            found.append(item)
    return found


def defer_weight_gradients(chunks: list[nn.Module]) -> DeferredWeightGradients:
    """Make every deferrable layer of `chunks` (those with a `deferred` attribute) leave its weight's
    gradient to one store, which the pipeline empties after each backward."""
    store = DeferredWeightGradients()
    for chunk in chunks:
        for module in chunk.modules():
            if hasattr(module, "deferred"):
                module.deferred = store
    return store


def _defers(x: torch.Tensor, deferred: DeferredWeightGradients | None) -> bool:
    # An input without gradient (none flows back through it) would leave the weight's gradient uncomputed.
    return deferred is not None and torch.is_grad_enabled() and x.requires_grad


def split_linear(
    x: torch.Tensor,
    *,
    param: nn.Parameter,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    deferred: DeferredWeightGradients | None,
) -> torch.Tensor:
    """`linear(x, weight, bias)`, `weight` being `param` or a view of it; with `deferred`, its weight's
    gradient is left there for W."""
    if not _defers(x, deferred):
        return linear(x, weight, bias)
    return _split_linear(x, weight.detach(), bias, functools.partial(deferred.defer, param))


def split_grouped_linear(
    x: torch.Tensor,
    *,
    param: nn.Parameter,
    weight: torch.Tensor,
    ends: torch.Tensor,
    deferred: DeferredWeightGradients | None,
) -> torch.Tensor:
    """`grouped_linear(x, weight, ends)` (experts), its weight's gradient left to W as `split_linear`'s."""
    if not _defers(x, deferred):
        return grouped_linear(x, weight, ends)
    return _split_grouped_linear(x, weight.detach(), ends, functools.partial(deferred.defer, param))


# The weight goes in detached, and the parameter only inside `defer_weight` (the store's `defer` for it):
# autograd sees no path to the parameter, so B neither accumulates into it nor fires its hooks (it would,
# with an empty gradient, were the parameter an input that gets None back).
class _SplitLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, defer_weight):
        ctx.save_for_backward(x, weight)
        ctx.defer_weight = defer_weight
        ctx.has_bias = bias is not None
        return linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight = ctx.saved_tensors
        ctx.defer_weight(functools.partial(linear_weight_gradient, x, grad))
        grad_bias = grad.reshape(-1, grad.shape[-1]).sum(0) if ctx.has_bias else None
        return linear(grad, weight.t()), None, grad_bias, None


class _SplitGroupedLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, ends, defer_weight):
        ctx.save_for_backward(x, weight, ends)
        ctx.defer_weight = defer_weight
        return grouped_linear(x, weight, ends)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight, ends = ctx.saved_tensors
        grad = grad.contiguous()  # the grouped GEMM takes only a contiguous one
        ctx.defer_weight(functools.partial(grouped_linear_weight_gradient, x, grad, ends))
        return grouped_linear(grad, weight.transpose(-2, -1), ends), None, None, None


@torch.compiler.disable
def _split_linear(x, weight, bias, defer_weight) -> torch.Tensor:
    return _SplitLinear.apply(x, weight, bias, defer_weight)


@torch.compiler.disable
def _split_grouped_linear(x, weight, ends, defer_weight) -> torch.Tensor:
    return _SplitGroupedLinear.apply(x, weight, ends, defer_weight)
