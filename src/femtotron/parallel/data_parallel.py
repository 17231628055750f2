"""Data parallelism's reduction: each bucket's gradients summed over its replicas while backward still runs.

A hook adds each micro-batch's gradient of a parameter into the model state's gradients
(parallel/model_state.py) as soon as autograd has produced it, and frees the low-precision one. When every
parameter of a bucket (parallel/flat_layout.py) has received its gradient for the step's last micro-batch,
the bucket's reduction starts asynchronously and overlaps the rest of backward; during the other
micro-batches nothing is sent (what DDP calls no_sync). Without ZeRO the gradients are all-reduced; under
ZeRO-1 reduce-scattered into the owned shard (optim/zero.py then steps it and all-gathers the parameters).

ZeRO-2 reduce-scatters each bucket's whole gradients into a buffer of its own, added to the owned shard, and
at most IN_FLIGHT buckets' reductions run at once (a further one waits for the oldest), so with one
micro-batch per step whole gradients exist for a few buckets at a time. Under gradient accumulation a
bucket's whole gradients stay through the step's micro-batches (one reduce-scatter per step, as ZeRO-1's,
rather than one per micro-batch), and are freed as the last micro-batch's backward reduces them.

ZeRO-3's buckets are planned so that none spans two of its units, and a unit's buckets are reduce-scattered
as its backward ends (`reduce_micro_batch`, called by parallel/fully_sharded.py): in every micro-batch, so
whole gradients never outlive a unit's backward, or (optimizer.reduce_every_micro_batch false) only in the
step's last, one reduction per step as ZeRO-2's, every unit's whole gradients kept until then.
"""

from __future__ import annotations

import torch
from torch import nn

from femtotron.config.zero_stages import ZeroStage
from femtotron.errors import FemtotronError
from femtotron.parallel.comm import Comm
from femtotron.parallel.flat_layout import FlatLayout, Replicas
from femtotron.parallel.model_state import ModelState

# ZeRO-2: the buckets whose reduce-scatter may run at once (each holds its whole gradients until it ends).
IN_FLIGHT = 2


class DataParallel:
    """The reduction over dp of one rank's gradients; the layout and state it reduces are its `layout` and
    `state`."""

    def __init__(
        self,
        layout: FlatLayout,
        state: ModelState,
        params: list[nn.Parameter],
        comm: Comm,
        *,
        micro_batches: int,
        reduce_every_micro_batch: bool = True,
    ) -> None:
        """Hooks every parameter of `params` (laid out by `layout`, held by `state`): a step has
        `micro_batches` backward passes, and a bucket is reduced after its last (ZeRO-3: after each, unless
        `reduce_every_micro_batch` is off)."""
        self.layout = layout
        self.state = state
        self.comm = comm
        self.zero = state.zero
        self.micro_batches = micro_batches
        self.reduce_every_micro_batch = reduce_every_micro_batch
        # ZeRO-3: the backward passes each bucket's unit has finished this step. Every replica runs every
        # unit's backward in every micro-batch, so all count alike, whichever parameters got a gradient.
        self.unit_backwards = [0] * len(layout.buckets)
        self.arrivals = [0] * len(params)  # gradients received this step, per parameter
        self.complete = [0] * len(layout.buckets)  # parameters of the bucket with all their gradients in
        self.pending: dict[int, object] = {}  # bucket -> its reduction in flight
        # ZeRO-2/3: bucket -> the whole gradients and the received shard of its reduction in flight
        self.in_transit: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.launched = [False] * len(layout.buckets)  # buckets whose reduction started this step
        for index, param in enumerate(params):
            param.register_post_accumulate_grad_hook(self._accumulate(index))

    @classmethod
    def build(
        cls,
        named_params: list[tuple[str, nn.Parameter]],
        groups: list[list[int]],
        comm: Comm,
        dense: Replicas,
        *,
        micro_batches: int,
        bucket_mb: float,
        grad_dtype: torch.dtype,
        zero: ZeroStage,
        experts: Replicas | None = None,
        device: torch.device | None = None,
        orthogonalised: list[bool] | None = None,
        reduce_every_micro_batch: bool = True,
    ) -> DataParallel:
        """The three rooms of one rank's model state, built in order: the layout, the state, its reduction.

        Args:
            named_params: this rank's parameters by name (under ZeRO-3 they may be on the meta device, drawn
                a bucket at a time on `device`).
            groups: parameter indices in backward order (flat_layout.plan_buckets).
            comm: the collectives.
            dense: the ranks summing the dense parameters' gradients and this rank's place among them.
            micro_batches: backward passes per step.
            bucket_mb: buckets of about this many MiB of gradients (parallelism.dp_bucket_size_mb).
            grad_dtype: the gradients' dtype (fp32 unless optimizer.accumulate_grad_in_fp32 is off).
            zero: the ZeRO stage (config.optimizer.zero).
            experts: the replicas of the expert parameters (None: the dense ones).
            device: where the state lives (default: the parameters' device).
            orthogonalised: per parameter, whether Muon steps it (for the memory counts).
            reduce_every_micro_batch: ZeRO-3 reduces a unit's gradients after each micro-batch's backward,
                or (False) after the last one's only (optimizer.reduce_every_micro_batch).
        """
        layout = FlatLayout(
            named_params,
            groups,
            bucket_elements=max(1, int(bucket_mb * 2**20) // grad_dtype.itemsize),
            zero=zero,
            dense=dense,
            experts=experts,
            orthogonalised=orthogonalised,
        )
        params = [param for _, param in named_params]
        state = ModelState(layout, params, comm, zero=zero, grad_dtype=grad_dtype, device=device)
        return cls(
            layout,
            state,
            params,
            comm,
            micro_batches=micro_batches,
            reduce_every_micro_batch=reduce_every_micro_batch,
        )

    def _accumulate(self, index: int):
        def hook(param: torch.Tensor) -> None:
            self.state.grad_of(index).add_(param.grad)
            param.grad = None
            self.arrivals[index] += 1
            if self.arrivals[index] > self.micro_batches:
                raise FemtotronError(
                    f"{self.layout.names[index]} received {self.arrivals[index]} gradients in one step, but "
                    f"a step has {self.micro_batches} micro-batches: its bucket was already reduced over dp. "
                    "Call zero_grad() after each optimizer step."
                )
            if self.arrivals[index] == self.micro_batches and not self.zero.shards_parameters:
                bucket = self.layout.bucket_of[index]
                self.complete[bucket] += 1
                if self.complete[bucket] == len(self.layout.buckets[bucket].params):
                    self._launch(bucket)

        return hook

    def reduce_micro_batch(self, buckets: tuple[int, ...]) -> None:
        """ZeRO-3, as a unit's backward ends (parallel/fully_sharded.py): reduce-scatter its buckets'
        gradients of this micro-batch and add them to the owned shards, so whole gradients never outlive a
        unit's backward. Every replica runs every unit's backward in every micro-batch, so all issue the same
        reductions, whichever of their parameters (experts) got a gradient. Without
        `reduce_every_micro_batch` only the step's last micro-batch reduces: the others' gradients add up in
        the whole ones."""
        for index in buckets:
            self.unit_backwards[index] += 1
            if self.reduce_every_micro_batch or self.unit_backwards[index] == self.micro_batches:
                self._launch(index)

    def _launch(self, index: int) -> None:
        state = self.state
        replicas = self.layout.replicas[index]
        grads = state.whole_grads(index)
        self.launched[index] = True
        if self.zero.shards_gradients:
            state.bucket_grads[index] = None  # a later micro-batch's gradients start whole ones anew
        if replicas.size == 1:  # its own replica: the sum is the bucket itself
            if self.zero.shards_gradients:
                state.shard_grads[index].add_(grads)
            return
        if self.zero.shards_gradients:
            if index in self.pending:  # its previous micro-batch's reduction
                self._finish(index)
            while len(self.pending) >= IN_FLIGHT:
                self._finish(next(iter(self.pending)))  # the oldest: its whole gradients are freed
            received = torch.empty_like(state.shard_grads[index])
            self.in_transit[index] = (grads, received)
            self.pending[index] = self.comm.start_reduce_scatter(received, grads, replicas.group)
        elif self.zero.shards_optimizer:
            low, high = self.layout.owned(index)
            owned = state.flat_grads[low:high]
            self.pending[index] = self.comm.start_reduce_scatter(owned, grads, replicas.group)
        else:
            self.pending[index] = self.comm.start_all_reduce(grads, replicas.group)

    def _finish(self, index: int) -> None:
        """Wait for bucket `index`'s reduction; ZeRO-2 and 3 then add it to the owned shard and free the whole
        gradients it was made of."""
        group = self.layout.replicas[index].group
        if not self.zero.shards_gradients:
            bucket = self.layout.buckets[index]
            self.comm.wait(self.pending.pop(index), group, self.state.flat_grads[bucket.start : bucket.end])
            return
        whole, received = self.in_transit.pop(index)
        self.comm.wait(self.pending.pop(index), group, whole)
        self.state.shard_grads[index].add_(received)

    def finish_reduction(self) -> None:
        """After the step's backward: reduce the buckets whose gradients did not all arrive (a parameter
        unused this step; under ZeRO-3 the embedding's, reduced once per step as no unit's backward ends after
        it), then wait for every reduction. Each owned gradient is then summed over dp."""
        for index in range(len(self.layout.buckets)):
            # ZeRO-3: gradients that came after their unit's last reduction (a tied embedding's at pp = 1)
            leftover = self.zero.shards_parameters and self.state.bucket_grads[index] is not None
            if not self.launched[index] or leftover:
                self._launch(index)
        for index in list(self.pending):
            self._finish(index)

    def zero_grad(self) -> None:
        self.state.zero_grads()
        self.arrivals = [0] * len(self.arrivals)
        self.complete = [0] * len(self.complete)
        self.launched = [False] * len(self.launched)
        self.unit_backwards = [0] * len(self.unit_backwards)
        self.pending.clear()
        self.in_transit.clear()
