"""Where a non-finite loss or gradient came from (N1, N2): the first module that produced it.

When a step's loss or gradient norm is not finite, the trainer runs the same micro-batches through
the same weights again with a hook on every module: in forward, the first module whose output holds
inf or NaN while its inputs did not is where the values broke; if forward stayed finite, backward
is watched through hooks on the module outputs, and the first output whose gradient is not finite
says where the gradients broke (inside the module that consumes that output). Every rank runs the
re-run (it is a whole pipeline step), and the earliest finding over all ranks is reported.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass

import torch
from torch import nn

from femtotron.batch import MicroBatch
from femtotron.parallel.context import ParallelContext
from femtotron.parallel.pipeline.schedules import Pipeline


@dataclass(frozen=True, kw_only=True)
class NonFinite:
    phase: str  # "forward" or "backward"
    module: str  # its name in the whole model, e.g. "layers.1.mlp.down_proj"
    micro_batch: int
    stage: int
    rank: int

    def describe(self) -> str:
        where = f"micro-batch {self.micro_batch}, pipeline stage {self.stage}, rank {self.rank}"
        if self.phase == "forward":
            return (
                f"the forward output of {self.module} is the first non-finite value (its inputs were "
                f"finite; {where})"
            )
        return (
            "forward was finite; in backward the first non-finite gradient reached the output of "
            f"{self.module} (so it arose in the module that consumes that output; {where})"
        )

    def order(self) -> tuple:
        """Earlier in the data flow first: forward before backward; forward from the first stage on,
        backward from the last stage back."""
        stage = self.stage if self.phase == "forward" else -self.stage
        return (self.phase != "forward", self.micro_batch, stage)


def _tensors(value: object) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for item in value for t in _tensors(item)]
    return []


def _finite(tensors: list[torch.Tensor]) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in tensors if t.is_floating_point())


@contextmanager
def watch(
    chunks: list[nn.Module], where: Callable[[], tuple[int, int]], rank: int
) -> Iterator[list[NonFinite]]:
    """Hooks on every module of `chunks` while the block runs; yields the findings (forward first, in
    time order). `where()` gives the (micro-batch, stage) being computed."""
    found: list[NonFinite] = []
    backward: list[NonFinite] = []

    def finding(phase: str, name: str) -> NonFinite:
        micro_batch, stage = where()
        return NonFinite(phase=phase, module=name, micro_batch=micro_batch, stage=stage, rank=rank)

    def on_gradient(name: str) -> Callable[[torch.Tensor], None]:
        def hook(grad: torch.Tensor) -> None:
            if not backward and not _finite([grad]):
                backward.append(finding("backward", name))

        return hook

    def on_forward(name: str) -> Callable[..., None]:
        def hook(module: nn.Module, inputs: object, output: object) -> None:
            outputs = _tensors(output)
            if not found and not _finite(outputs) and _finite(_tensors(inputs)):
                found.append(finding("forward", name))
            for tensor in outputs:
                if tensor.requires_grad:
                    tensor.register_hook(on_gradient(name))

        return hook

    handles = []
    for chunk in chunks:
        for name, module in chunk.named_modules():
            if name:  # the chunk itself is no finding
                handles.append(module.register_forward_hook(on_forward(name)))
    try:
        yield found
    finally:
        for handle in handles:
            handle.remove()
        found.extend(backward)


def earliest_over_ranks(ctx: ParallelContext, mine: NonFinite | None) -> NonFinite | None:
    """Every rank's finding to rank 0 through the store; rank 0 picks the earliest and every rank gets it."""
    store = ctx.store
    timeout = ctx.collective_timeout_seconds
    key = store.fresh_key("nan")
    store.post(f"{key}/rank{ctx.rank}", json.dumps(asdict(mine) if mine else None))
    if ctx.rank == 0:
        keys = [f"{key}/rank{r}" for r in range(ctx.world_size)]
        got = store.collect(keys, timeout, remove=True)
        findings = [NonFinite(**f) for f in map(json.loads, got.values()) if f]
        first = min(findings, key=NonFinite.order, default=None)
        store.post(f"{key}/verdict", json.dumps(asdict(first) if first else None))
        return first
    verdict_key = f"{key}/verdict"
    # Rank 0 waits up to `timeout` for the findings before it posts the verdict: wait longer here.
    verdict = json.loads(store.collect([verdict_key], 2 * timeout).get(verdict_key, "null"))
    return NonFinite(**verdict) if verdict else None


def locate(
    pipeline: Pipeline, inputs: tuple[list[MicroBatch], torch.Tensor], ctx: ParallelContext
) -> NonFinite | None:
    """Run a step's micro-batches (`inputs`, as `Pipeline.train_step` takes them) again, from the same
    weights, with a hook on every module (every rank does, as it is a whole pipeline step); the earliest
    module over all ranks that went non-finite. The caller clears the gradients before and after."""

    def where() -> tuple[int, int]:
        action = pipeline.current
        return action.micro_batch, pipeline.stage_of(action.chunk)

    with watch(pipeline.chunks, where, ctx.rank) as found:
        pipeline.train_step(*inputs)
    return earliest_over_ranks(ctx, found[0] if found else None)
