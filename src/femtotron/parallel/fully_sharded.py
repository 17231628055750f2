"""ZeRO-3 (`optimizer.zero_stage: 3`): parameters sharded over the dp replicas too, gathered only while used.

Each rank keeps 1/dp of every bucket's parameters (parallel/model_state.py holds them, with the owned
shards of the gradients). A model chunk is cut into units, each gathered whole just
before its forward and freed after it: the embedding, each decoder layer, and the head (final norm and LM
head). The buckets never span two units, so a unit is a set of buckets, and an all-gather of each makes the
unit's parameters whole again, in place: the parameters are views into the buckets' whole tensors, whose
storage is freed (resized to nothing) while they are not needed, and autograd's saved references to them
see the data again once it is gathered back.

- Forward: a unit's gather is waited for (started early as the previous unit began: prefetch), the next
  unit's is started, the unit runs, and its parameters are freed (`reshard_after_forward`; with it off they
  stay until the unit's backward, as FSDP's knob: less communication, more memory).
- Backward: an identity on the unit's output gathers the unit again when its gradient arrives (before any
  of the unit's backward runs) and starts the previous unit's gather; an identity on its input frees it
  when the gradient leaves (after all of it ran). The gradients are reduce-scattered bucket by bucket as
  they complete, as under ZeRO-2.
- A recomputed layer (parallel.recompute_layer) runs its forward again inside its own backward, where it
  is gathered already: the hooks leave it alone then.
- The embedding's backward needs only the token ids, so it is not gathered for backward. A tied embedding
  also serves as the LM head: both units hold its bucket, counted by users.

The hooks are `torch.compiler.disable`d, so under model.compile a unit's gathers run eagerly at the edges
of its compiled graphs, as tp's collectives do.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from femtotron.errors import FemtotronError
from femtotron.parallel.data_parallel import DataParallel
from femtotron.parallel.split_backward import DeferredWeightGradients


@dataclass(frozen=True)
class Unit:
    """Parameters gathered together, by their buckets."""

    name: str
    buckets: tuple[int, ...]
    needed_in_backward: bool  # the embedding's backward reads the token ids only


@dataclass(frozen=True)
class ChunkUnit:
    """A unit of a model chunk, before its buckets exist: the module whose calls gather it (None: the head,
    gathered around `head_logits`, as the final norm and LM head are no module of their own)."""

    name: str
    params: list[nn.Parameter]
    needed_in_backward: bool
    module: nn.Module | None


def chunk_units(chunk: nn.Module) -> list[ChunkUnit]:
    """A model chunk's units in forward order. Every parameter of the chunk is in a unit (a tied embedding
    in both the embedding's and the head's)."""
    units = []
    if chunk.stage.embedding:
        embedding = chunk.embed_tokens
        units.append(ChunkUnit("embedding", list(embedding.parameters()), False, embedding))
    for index, layer in chunk.layers.items():
        units.append(ChunkUnit(f"layer {index}", list(layer.parameters()), True, layer))
    if chunk.stage.head:
        output = chunk.embed_tokens if chunk.cfg.tie_word_embeddings else chunk.lm_head
        units.append(ChunkUnit("head", list(chunk.norm.parameters()) + list(output.parameters()), True, None))
    return units


def parameter_indices(chunks: list[nn.Module]) -> dict[int, int]:
    """id(parameter) -> its index among this rank's parameters (its chunks' in order: the flat layout's)."""
    return {id(p): i for i, p in enumerate(p for chunk in chunks for p in chunk.parameters())}


class ParameterGathering:
    """Which buckets' parameters are whole on this rank, who uses them, and the hooks that gather them."""

    def __init__(
        self,
        data_parallel: DataParallel,
        chunks: list[nn.Module],
        *,
        deferred: DeferredWeightGradients | None,
        reshard_after_forward: bool,
    ) -> None:
        """Hooks every unit of every chunk of `chunks`: the layers and the embedding by module hooks, the head
        around `head_logits`. `data_parallel`'s state holds the buckets' parameters, and it reduces a unit's
        gradients as the unit's backward ends; under zb-h1 (parallel/split_backward.py) `deferred` holds the
        weight gradients that reduction then waits for (W)."""
        self.data_parallel = data_parallel
        self.state = data_parallel.state
        self.reshard_after_forward = reshard_after_forward
        self.deferred = deferred
        buckets = len(self.state.layout.buckets)
        self.users = [0] * buckets  # units (and tools) using each bucket's whole parameters now
        self.whole = [False] * buckets  # gathered (or being gathered) and not freed since
        self.in_flight: dict[int, object] = {}  # bucket -> its all-gather not yet waited for
        self.in_backward: set[Unit] = set()  # units between their output's and their input's gradient
        self.whole_elements = 0  # of the buckets whole now, padding included
        self.peak_whole_elements = 0  # the most at once: the working set (doctor counts it, tests bound it)
        self.units: list[list[Unit]] = []  # per model chunk, in forward order
        index_of = parameter_indices(chunks)
        bucket_of = self.state.layout.bucket_of
        for chunk in chunks:
            parts = chunk_units(chunk)
            units = []
            for part in parts:
                buckets = sorted({bucket_of[index_of[id(p)]] for p in part.params})
                units.append(
                    Unit(name=part.name, buckets=tuple(buckets), needed_in_backward=part.needed_in_backward)
                )
            self.units.append(units)
            for position, part in enumerate(parts):
                if part.module is not None:
                    self._hook(part.module, units, position)
                else:
                    chunk.head_logits = self._around(chunk.head_logits, units, position)

    def _hook(self, module: nn.Module, units: list[Unit], position: int) -> None:
        def before(_: nn.Module, args: tuple) -> tuple:
            return (self.before_forward(units, position, args[0]), *args[1:])

        def after(_: nn.Module, __: tuple, output: torch.Tensor) -> torch.Tensor:
            return self.after_forward(units, position, output)

        module.register_forward_pre_hook(before)
        module.register_forward_hook(after)

    def _around(self, function, units: list[Unit], position: int):
        def call(x: torch.Tensor) -> torch.Tensor:
            return self.after_forward(units, position, function(self.before_forward(units, position, x)))

        return call

    @torch.compiler.disable
    def before_forward(self, units: list[Unit], position: int, x: torch.Tensor) -> torch.Tensor:
        unit = units[position]
        if unit in self.in_backward:  # a recomputed forward, inside the unit's backward: whole already
            return x
        self.acquire(unit)
        if position + 1 < len(units):
            self.prefetch(units[position + 1])
        if not (torch.is_grad_enabled() and unit.needed_in_backward):
            return x
        if not x.requires_grad:
            raise FemtotronError(
                f"ZeRO-3: the input of {unit.name} needs no gradient, so nothing would free its parameters "
                "after its backward. Every unit after the embedding must take a tensor that requires grad."
            )
        return _AfterBackward.apply(x, self, unit)

    @torch.compiler.disable
    def after_forward(self, units: list[Unit], position: int, output: torch.Tensor) -> torch.Tensor:
        unit = units[position]
        if unit in self.in_backward:
            return output
        if not (torch.is_grad_enabled() and unit.needed_in_backward):  # no backward will need it
            self.release(unit)
            return output
        if self.reshard_after_forward:
            self.release(unit)
        previous = units[position - 1] if position > 0 else None
        return _BeforeBackward.apply(output, self, unit, previous)

    def working_set(self) -> int:
        """The most elements of parameters whole at once in a step (`peak_whole_elements` measures it).
        Resharding after forward: two neighbouring units of a chunk (the one running, the one prefetched).
        Keeping them for backward: every unit that backward reads stays whole from its forward to its
        backward, so at the end of a chunk's forward all of them are (or, if more, the embedding with the
        first layer, before the embedding is freed); with several chunks, their sum bounds it."""
        if self.reshard_after_forward:
            pairs = [a.buckets + b.buckets for units in self.units for a, b in itertools.pairwise(units)]
            return max(self.elements(buckets) for buckets in pairs or [u.buckets for u in self.units[0]])
        total = 0
        for units in self.units:
            kept = self.elements(b for unit in units if unit.needed_in_backward for b in unit.buckets)
            first = self.elements(units[0].buckets + units[1].buckets) if len(units) > 1 else 0
            total += max(kept, first)
        return total

    def elements(self, buckets) -> int:
        """How many elements the buckets `buckets` hold whole, padding included (a bucket counted once)."""
        spans = self.state.layout.buckets
        return sum(spans[b].end - spans[b].start for b in set(buckets))

    def prefetch(self, unit: Unit) -> None:
        """Start gathering a unit that runs next, while the current one computes."""
        self._start(unit)

    def _start(self, unit: Unit) -> None:
        """Start gathering the unit's buckets that are not whole."""
        for bucket in unit.buckets:
            if not self.whole[bucket]:
                self.in_flight[bucket] = self.state.start_gather(bucket)
                self._mark(bucket, whole=True)
        self.peak_whole_elements = max(self.peak_whole_elements, self.whole_elements)

    def _mark(self, bucket: int, whole: bool) -> None:
        self.whole[bucket] = whole
        size = self.elements([bucket])
        self.whole_elements += size if whole else -size

    def _free(self, bucket: int) -> None:
        self.state.free_params(bucket)
        self._mark(bucket, whole=False)

    def acquire(self, unit: Unit) -> None:
        """The unit's parameters are whole once this returns, until its `release`."""
        self._start(unit)
        for bucket in unit.buckets:
            if bucket in self.in_flight:
                self.state.wait_gather(bucket, self.in_flight.pop(bucket))
            self.users[bucket] += 1

    def release(self, unit: Unit) -> None:
        for bucket in unit.buckets:
            self.users[bucket] -= 1
            if self.users[bucket] == 0:
                self._free(bucket)

    def settle(self) -> None:
        """After a step's backward: every unit was released; free what a prefetch left whole."""
        for bucket, work in list(self.in_flight.items()):
            self.state.wait_gather(bucket, work)
        self.in_flight.clear()
        for bucket, users in enumerate(self.users):
            if users:
                raise FemtotronError(
                    f"ZeRO-3: bucket {bucket}'s parameters are still in use after the step's backward "
                    f"({users} users): a unit's backward did not run. This is a bug in femtotron."
                )
            if self.whole[bucket]:
                self._free(bucket)
        self.in_backward.clear()

    @contextlib.contextmanager
    def whole_parameters(self, params: list[int]) -> Iterator[None]:
        """The parameters `params` whole for a tool outside training steps (saving final weights, tests)."""
        unit = Unit("tool", tuple(sorted({self.state.layout.bucket_of[p] for p in params})), False)
        self.acquire(unit)
        try:
            yield
        finally:
            self.release(unit)

    def enter_backward(self, unit: Unit, previous: Unit | None) -> None:
        self.in_backward.add(unit)
        if self.reshard_after_forward:
            self.acquire(unit)
        if previous is not None and previous.needed_in_backward:
            self.prefetch(previous)

    def leave_backward(self, unit: Unit) -> None:
        """All of the unit's backward ran (autograd runs a weight's gradient accumulation as soon as it is
        ready, before any other node): free its parameters, reduce its gradients of this micro-batch. Under
        zb-h1 the reduction waits for the unit's weight gradients, in W (which needs no parameters)."""
        self.in_backward.discard(unit)
        self.release(unit)
        reduce = functools.partial(self.data_parallel.reduce_micro_batch, unit.buckets)
        if self.deferred is None:
            reduce()
        else:
            self.deferred.after(reduce)


class _BeforeBackward(torch.autograd.Function):
    """Identity on a unit's output; its backward (the first of the unit's) gathers the unit's parameters."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, gathering: ParameterGathering, unit: Unit, previous: Unit | None):
        ctx.gathering = gathering
        ctx.unit = unit
        ctx.previous = previous
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        ctx.gathering.enter_backward(ctx.unit, ctx.previous)
        return grad, None, None, None


class _AfterBackward(torch.autograd.Function):
    """Identity on a unit's input; its backward (after all of the unit's) frees the unit's parameters."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, gathering: ParameterGathering, unit: Unit):
        ctx.gathering = gathering
        ctx.unit = unit
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        ctx.gathering.leave_backward(ctx.unit)
        return grad, None, None
