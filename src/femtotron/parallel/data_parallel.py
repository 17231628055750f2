"""Data parallelism: flat parameter and gradient buffers, cut into buckets that are reduced over the dp
group while backward is still running.

Every parameter of this rank (over all its pipeline chunks) becomes a view into one flat tensor of
the model's dtype, and its gradient accumulates into the view at the same offset of a flat gradient
buffer (fp32 unless optimizer.accumulate_grad_in_fp32 is off): a hook adds each micro-batch's
gradient there as soon as autograd has produced it, and frees the low-precision one.

The buffers are cut into buckets of about `parallelism.dp_bucket_size_mb`, in the order backward
produces gradients (a chunk's last layer first). When every parameter of a bucket has received its
gradient for the step's last micro-batch, the bucket's reduction starts asynchronously and overlaps
the rest of backward; during the other micro-batches nothing is sent (what DDP calls no_sync).

Each bucket is padded to a multiple of dp * 64 elements and split into dp equal, aligned shards; rank
r owns shard r of every bucket under ZeRO-1 (optim/zero.py: reduce-scatter, step, all-gather). Without
ZeRO the gradients are all-reduced and every rank owns every element.

ZeRO-2 (`shard_gradients`) keeps only the owned shard of the summed gradients: a bucket's whole gradients
exist from its first gradient of the step until its reduce-scatter has finished, then are freed, and at most
IN_FLIGHT buckets' reductions run at once (a further one waits for the oldest), so with one micro-batch per
step whole gradients exist for a few buckets at a time. Under gradient accumulation a bucket's whole
gradients stay through the step's micro-batches (one reduce-scatter per step, as ZeRO-1's, rather than one
per micro-batch), and are freed as the last micro-batch's backward reduces them.

ZeRO-3 (`shard_params`) keeps only the owned shard of the parameters too: each bucket's whole parameters
exist only while parallel/fully_sharded.py has them gathered (a unit's forward or backward). The buckets are
planned so that none spans two of its units, and a unit's buckets are reduce-scattered as its backward ends,
in every micro-batch (`reduce_micro_batch`), not once per step.

Under expert parallelism the experts' buckets are reduced over their own replicas instead (`Replicas`:
the dp x cp / ep ranks holding the same experts, parallel/expert_parallel.py), and sharded over them.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch import nn

from femtotron.errors import FemtotronError
from femtotron.parallel.comm import Comm, Group
from femtotron.parallel.sharding import initial_values

# Every parameter, and every bucket's shard, starts at a multiple of 64 elements (128 bytes in bf16),
# so kernels and collectives get aligned pointers.
ALIGNMENT = 64
# ZeRO-2: the buckets whose reduce-scatter may run at once (each holds its whole gradients until it ends).
IN_FLIGHT = 2


@dataclass(frozen=True)
class Replicas:
    """The ranks holding the same parameters (gradients summed, ZeRO-1 state sharded over them); this rank's
    place among them."""

    group: Group
    rank: int

    @property
    def size(self) -> int:
        return self.group.size


@dataclass(frozen=True)
class Bucket:
    start: int  # element range [start, end) in the flat buffers; (end - start) is a multiple of dp
    end: int
    params: tuple[int, ...]  # indices of the parameters inside it

    def shard(self, dp: int, dp_rank: int) -> tuple[int, int]:
        """The element range [low, high) of shard `dp_rank` of `dp` equal ones."""
        size = (self.end - self.start) // dp
        low = self.start + dp_rank * size
        return low, low + size

    def owned(self, replicas: Replicas) -> tuple[int, int]:
        return self.shard(replicas.size, replicas.rank)


@dataclass(frozen=True)
class Piece:
    """The elements [start, end) of the flat buffers that belong to parameter `param` and to this rank."""

    param: int
    start: int
    end: int


def plan_buckets(
    numels: list[int], groups: list[list[int]], bucket_elements: int, dp: int
) -> tuple[list[int], list[Bucket]]:
    """Offsets of the parameters in the flat buffers, and the buckets.

    `groups` lists parameter indices in the order their gradients are expected; a bucket never spans
    two groups. A bucket closes once it holds `bucket_elements` or more, so a larger parameter gets
    a bucket of its own. Its size is a multiple of dp * ALIGNMENT, so its dp shards stay aligned (and those of
    any divisor of dp: the experts' replicas).
    """
    offsets = [0] * len(numels)
    buckets: list[Bucket] = []
    position = 0
    for group in groups:
        members: list[int] = []
        start = position
        for index, param in enumerate(group):
            offsets[param] = position
            position = _round_up(position + numels[param], ALIGNMENT)
            members.append(param)
            if position - start >= bucket_elements or index == len(group) - 1:
                position = start + _round_up(position - start, dp * ALIGNMENT)
                buckets.append(Bucket(start=start, end=position, params=tuple(members)))
                members = []
                start = position
    return offsets, buckets


class DataParallel:
    """Owns the flat buffers of one rank's parameters and gradients, and their reduction over dp."""

    def __init__(
        self,
        named_params: list[tuple[str, nn.Parameter]],
        groups: list[list[int]],
        comm: Comm,
        dp_group: Group,
        dp_rank: int,
        *,
        micro_batches: int,
        bucket_mb: float,
        grad_dtype: torch.dtype,
        sharded: bool,
        shard_gradients: bool = False,
        shard_params: bool = False,
        expert_replicas: Replicas | None = None,
        device: torch.device | None = None,
        orthogonalised: list[bool] | None = None,
    ) -> None:
        """`groups`: parameter indices in backward order (plan_buckets); an expert parameter's group holds
        expert parameters only, reduced over `expert_replicas` (default: the dp group, like the others).
        `sharded`: ZeRO-1 (optimizer state of the owned shards only); with `shard_gradients` ZeRO-2, with
        `shard_params` too ZeRO-3 (the caller installs a ParameterGathering as `gathering`); its parameters
        may come on the meta device, to be drawn here a bucket at a time on `device` (default: theirs).
        `orthogonalised`: per parameter, whether Muon steps it (one fp32 momentum instead of Adam's two
        moments, optim/muon.py); for the memory counts."""
        self.names = [name for name, _ in named_params]
        params = [param for _, param in named_params]
        self.comm = comm
        self.group = dp_group
        self.dp = dp_group.size
        self.dp_rank = dp_rank
        self.micro_batches = micro_batches
        self.sharded = sharded
        self.shard_gradients = shard_gradients or shard_params
        self.shard_params = shard_params
        self.gathering = None  # ZeRO-3: parallel/fully_sharded.py's, once installed
        numels = [p.numel() for p in params]
        bucket_elements = max(1, int(bucket_mb * 2**20) // grad_dtype.itemsize)
        self.offsets, self.buckets = plan_buckets(numels, groups, bucket_elements, self.dp)
        dense = Replicas(dp_group, dp_rank)
        experts = [getattr(p, "shard", None) is not None and p.shard.experts for p in params]
        self.replicas: list[Replicas] = []  # per bucket
        for bucket in self.buckets:
            # A bucket holds expert parameters only or none: its first one tells which.
            of_experts = expert_replicas and experts[bucket.params[0]]
            self.replicas.append(expert_replicas if of_experts else dense)
        self.size = self.buckets[-1].end if self.buckets else 0
        self.padding = self.size - sum(numels)
        self.device = device or params[0].device
        self.grad_dtype = grad_dtype
        self.param_dtype = params[0].dtype
        self.shapes = [p.shape for p in params]
        self.orthogonalised = orthogonalised or [False] * len(params)
        # Padding stays zero in both buffers, so it adds nothing to reductions or norms.
        if shard_params:
            self._shard_params(params)
        else:
            self.flat_params = torch.zeros(self.size, dtype=params[0].dtype, device=self.device)
            self._place(params, self.flat_params, 0, range(len(params)))
        if self.shard_gradients:  # per bucket: its whole gradients while they accumulate, and the owned shard
            self.bucket_grads: list[torch.Tensor | None] = [None] * len(self.buckets)
            owned = [
                bucket.owned(replicas) for bucket, replicas in zip(self.buckets, self.replicas, strict=True)
            ]
            self.shard_grads = [
                torch.zeros(high - low, dtype=grad_dtype, device=self.device) for low, high in owned
            ]
        else:
            self.flat_grads = torch.zeros(self.size, dtype=grad_dtype, device=self.device)
        self.bucket_of = {p: b for b, bucket in enumerate(self.buckets) for p in bucket.params}
        self.arrivals = [0] * len(params)  # gradients received this step, per parameter
        self.complete = [0] * len(self.buckets)  # parameters of the bucket with all their gradients in
        self.pending: dict[int, object] = {}  # bucket -> its reduction in flight
        # ZeRO-2/3: bucket -> the whole gradients and the received shard of its reduction in flight
        self.in_transit: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.launched = [False] * len(self.buckets)  # buckets whose reduction started this step
        for index, param in enumerate(params):
            param.register_post_accumulate_grad_hook(self._accumulate(index))
        self.pieces = self._pieces(numels, self.sharded)  # the elements this rank's optimizer steps
        # This rank's 1/dp of every bucket, even without ZeRO-1: the part it writes to a checkpoint.
        self.shard_pieces = self._pieces(numels, sharded=True)

    def _place(self, params: list[nn.Parameter], whole: torch.Tensor, start: int, indices) -> None:
        """Make parameters `indices` views into `whole` (flat elements from `start` on), values kept; one on
        the meta device (ZeRO-3's deferred initialisation) gets its initial values drawn into it."""
        with torch.no_grad():
            for index in indices:
                param = params[index]
                offset = self.offsets[index] - start
                view = whole[offset : offset + param.numel()].view_as(param)
                if param.is_meta:
                    view.copy_(initial_values(param.shard, param.shape, param.dtype, self.device))
                    shard = param.shard
                    # .data cannot move a tensor off the meta device: an empty one on the device swaps in,
                    # keeping the Python object that modules and hooks refer to
                    torch.utils.swap_tensors(
                        param, nn.Parameter(torch.empty(0, dtype=view.dtype, device=view.device))
                    )
                    param.shard = shard
                else:
                    view.copy_(param)
                # .data (unlike a new Parameter of the view) keeps the parameter's own version counter, so
                # ZeRO-3 writing the bucket's whole tensor does not look to autograd like a change in place
                param.data = view

    def _shard_params(self, params: list[nn.Parameter]) -> None:
        """ZeRO-3: per bucket, the owned shard of its parameters, and its whole tensor (freed until gathered)
        that the parameters are views into. Built a bucket at a time, so at most one is whole here."""
        self.param_shards = []
        self.bucket_params = []
        for bucket, replicas in zip(self.buckets, self.replicas, strict=True):
            whole = torch.zeros(bucket.end - bucket.start, dtype=params[0].dtype, device=self.device)
            self._place(params, whole, bucket.start, bucket.params)
            low, high = bucket.owned(replicas)
            self.param_shards.append(whole[low - bucket.start : high - bucket.start].clone())
            self.bucket_params.append(whole)
            _free(whole)

    def start_gather(self, index: int):
        """ZeRO-3: start making bucket `index`'s parameters whole from every replica's shard."""
        whole = self.bucket_params[index]
        whole.untyped_storage().resize_(whole.numel() * whole.element_size())
        replicas = self.replicas[index]
        if replicas.size == 1:
            whole.copy_(self.param_shards[index])
            return None
        return self.comm.start_all_gather(whole, self.param_shards[index], replicas.group)

    def wait_gather(self, index: int, work) -> None:
        self.comm.wait(work, self.replicas[index].group, self.bucket_params[index])

    def free_params(self, index: int) -> None:
        _free(self.bucket_params[index])

    def whole_parameters(self, params: list[int]):
        """A context in which parameters `params` are whole (ZeRO-3 gathers their buckets; else they are)."""
        if self.gathering is None:
            return contextlib.nullcontext()
        return self.gathering.whole_parameters(params)

    def _pieces(self, numels: list[int], sharded: bool) -> list[Piece]:
        pieces = []
        for bucket, replicas in zip(self.buckets, self.replicas, strict=True):
            if sharded:
                low, high = bucket.owned(replicas)
            else:
                low = bucket.start
                high = bucket.end
            for param in sorted(bucket.params, key=lambda p: self.offsets[p]):
                # The part of the parameter's elements inside [low, high), if any.
                start = max(low, self.offsets[param])
                end = min(high, self.offsets[param] + numels[param])
                if start < end:
                    pieces.append(Piece(param=param, start=start, end=end))
        return pieces

    def _bucket_grads(self, index: int) -> torch.Tensor:
        """Bucket `index`'s whole gradients (ZeRO-2: made, zero, at its first gradient of the step)."""
        bucket = self.buckets[index]
        if not self.shard_gradients:
            return self.flat_grads[bucket.start : bucket.end]
        if self.bucket_grads[index] is None:
            size = bucket.end - bucket.start
            self.bucket_grads[index] = torch.zeros(size, dtype=self.grad_dtype, device=self.device)
        return self.bucket_grads[index]

    def _grad_of(self, param: int) -> torch.Tensor:
        """Parameter `param`'s gradient in its bucket's whole gradients, shaped like it."""
        bucket = self.bucket_of[param]
        offset = self.offsets[param] - self.buckets[bucket].start
        numel = self.shapes[param].numel()
        return self._bucket_grads(bucket)[offset : offset + numel].view(self.shapes[param])

    def _accumulate(self, index: int):
        def hook(param: torch.Tensor) -> None:
            self._grad_of(index).add_(param.grad)
            param.grad = None
            self.arrivals[index] += 1
            if self.arrivals[index] > self.micro_batches:
                raise FemtotronError(
                    f"{self.names[index]} received {self.arrivals[index]} gradients in one step, but a "
                    f"step has {self.micro_batches} micro-batches: its bucket was already reduced over dp. "
                    "Call zero_grad() after each optimizer step."
                )
            if self.arrivals[index] == self.micro_batches and not self.shard_params:
                bucket = self.bucket_of[index]
                self.complete[bucket] += 1
                if self.complete[bucket] == len(self.buckets[bucket].params):
                    self._launch(bucket)

        return hook

    def reduce_micro_batch(self, buckets: tuple[int, ...]) -> None:
        """ZeRO-3, as a unit's backward ends (parallel/fully_sharded.py): reduce-scatter its buckets'
        gradients of this micro-batch and add them to the owned shards, so whole gradients never outlive a
        unit's backward. Every replica runs every unit's backward in every micro-batch, so all issue the same
        reductions, whichever of their parameters (experts) got a gradient."""
        for index in buckets:
            self._launch(index)

    def _launch(self, index: int) -> None:
        bucket = self.buckets[index]
        replicas = self.replicas[index]
        grads = self._bucket_grads(index)
        self.launched[index] = True
        if self.shard_gradients:
            self.bucket_grads[index] = None  # a later micro-batch's gradients start whole ones anew
        if replicas.size == 1:  # its own replica: the sum is the bucket itself
            if self.shard_gradients:
                self.shard_grads[index].add_(grads)
            return
        if self.shard_gradients:
            if index in self.pending:  # its previous micro-batch's reduction
                self._finish(index)
            while len(self.pending) >= IN_FLIGHT:
                self._finish(next(iter(self.pending)))  # the oldest: its whole gradients are freed
            received = torch.empty_like(self.shard_grads[index])
            self.in_transit[index] = (grads, received)
            self.pending[index] = self.comm.start_reduce_scatter(received, grads, replicas.group)
        elif self.sharded:
            low, high = bucket.owned(replicas)
            owned = self.flat_grads[low:high]
            self.pending[index] = self.comm.start_reduce_scatter(owned, grads, replicas.group)
        else:
            self.pending[index] = self.comm.start_all_reduce(grads, replicas.group)

    def _finish(self, index: int) -> None:
        """Wait for bucket `index`'s reduction; ZeRO-2 and 3 then add it to the owned shard and free the whole
        gradients it was made of."""
        if not self.shard_gradients:
            whole = self.flat_grads[self.buckets[index].start : self.buckets[index].end]
            self.comm.wait(self.pending.pop(index), self.replicas[index].group, whole)
            return
        whole, received = self.in_transit.pop(index)
        self.comm.wait(self.pending.pop(index), self.replicas[index].group, whole)
        self.shard_grads[index].add_(received)

    def finish_reduction(self) -> None:
        """After the step's backward: reduce the buckets whose gradients did not all arrive (a parameter
        unused this step; under ZeRO-3 the embedding's, reduced once per step as no unit's backward ends after
        it), then wait for every reduction. Each owned gradient is then summed over dp."""
        for index in range(len(self.buckets)):
            # ZeRO-3: gradients that came after their unit's last reduction (a tied embedding's at pp = 1)
            leftover = self.shard_params and self.bucket_grads[index] is not None
            if not self.launched[index] or leftover:
                self._launch(index)
        for index in list(self.pending):
            self._finish(index)
        if self.gathering is not None:
            self.gathering.settle()

    def zero_grad(self) -> None:
        if self.shard_gradients:
            self.bucket_grads = [None] * len(self.buckets)
            for shard in self.shard_grads:
                shard.zero_()
        else:
            self.flat_grads.zero_()
        self.arrivals = [0] * len(self.arrivals)
        self.complete = [0] * len(self.complete)
        self.launched = [False] * len(self.launched)
        self.pending.clear()
        self.in_transit.clear()

    def model_state_bytes(self) -> dict[str, int]:
        """Bytes this rank holds for the model state between steps: parameters and gradients (the flat
        buffers, padding included; ZeRO-2: the owned shards of the gradients; ZeRO-3: of the parameters too),
        and for the elements it owns fp32 master weights (none when the parameters are fp32: they are their
        own masters), Adam's two moments and Muon's momentum (optim/zero.py, optim/muon.py)."""
        owned = sum(piece.end - piece.start for piece in self.pieces)
        muon = sum(piece.end - piece.start for piece in self.pieces if self.orthogonalised[piece.param])
        grads = sum(s.nbytes for s in self.shard_grads) if self.shard_gradients else self.flat_grads.nbytes
        params = sum(s.nbytes for s in self.param_shards) if self.shard_params else self.flat_params.nbytes
        held = {
            "params": params,
            "grads": grads,
            "master_weights": 0 if self.param_dtype == torch.float32 else 4 * owned,
            "adam_moments": 8 * (owned - muon),
        }
        if any(self.orthogonalised):
            held["muon_momentum"] = 4 * muon
        return held

    def checkpoint_bytes(self) -> int:
        """The most bytes of this rank's part of a checkpoint: its owned elements' parameters, master weights
        and optimizer moments (what checkpoints.async_save stages in host memory); less where a copy of a
        parameter is saved by another rank (tp's replicated norms, a tied embedding)."""
        owned = sum(piece.end - piece.start for piece in self.pieces)
        state = self.model_state_bytes()
        optimizer = state["master_weights"] + state["adam_moments"] + state.get("muon_momentum", 0)
        return owned * self.param_dtype.itemsize + optimizer

    def _owned_views(self, shards: list[torch.Tensor]) -> list[torch.Tensor]:
        """This rank's pieces, as 1-D views into per-bucket owned shards (ZeRO-2's gradients, ZeRO-3's
        parameters)."""
        views = []
        for piece in self.pieces:
            bucket = self.bucket_of[piece.param]
            low, _ = self.buckets[bucket].owned(self.replicas[bucket])
            views.append(shards[bucket][piece.start - low : piece.end - low])
        return views

    def owned_grads(self) -> list[torch.Tensor]:
        """This rank's pieces of the gradients (summed over dp after `finish_reduction`), as 1-D views."""
        if self.shard_gradients:
            return self._owned_views(self.shard_grads)
        return [self.flat_grads[piece.start : piece.end] for piece in self.pieces]

    def owned_params(self) -> list[torch.Tensor]:
        """This rank's pieces of the model's parameters, as 1-D views (what the optimizer writes back)."""
        if self.shard_params:
            return self._owned_views(self.param_shards)
        return [self.flat_params[piece.start : piece.end] for piece in self.pieces]

    def counted_once(self) -> list[bool]:
        """Per owned piece: whether this rank counts it in a sum over all its replicas (a norm): always under
        ZeRO-1, where the replicas own different pieces; else on the first replica only."""
        pairs = zip(self.buckets, self.replicas, strict=True)
        first = {param: replicas.rank == 0 for bucket, replicas in pairs for param in bucket.params}
        return [self.sharded or first[piece.param] for piece in self.pieces]

    def gather_params(self) -> None:
        """ZeRO-1 and 2, after the step: every rank's updated shard of the parameters to every rank (ZeRO-3
        gathers each unit's when it runs)."""
        if not self.sharded or self.shard_params:
            return
        wholes = [self.flat_params[bucket.start : bucket.end] for bucket in self.buckets]
        works = [self.start_bucket_gather(index, whole) for index, whole in enumerate(wholes)]
        for index, (whole, work) in enumerate(zip(wholes, works, strict=True)):
            self.wait_bucket_gather(index, work, whole)

    def start_bucket_gather(self, index: int, whole: torch.Tensor):
        """Start filling `whole`, a tensor as long as bucket `index` holding this rank's owned shard of it,
        with every replica's shard (nothing to do without ZeRO: every rank owns all of it)."""
        if not self.sharded:
            return None
        bucket = self.buckets[index]
        replicas = self.replicas[index]
        low, high = bucket.owned(replicas)
        mine = whole[low - bucket.start : high - bucket.start]
        return self.comm.start_all_gather(whole, mine, replicas.group)

    def wait_bucket_gather(self, index: int, work, whole: torch.Tensor) -> None:
        self.comm.wait(work, self.replicas[index].group, whole)

    def full(self, owned: list[torch.Tensor]) -> list[torch.Tensor]:
        """Per parameter, the whole tensor from every rank's owned pieces (e.g. fp32 master weights):
        each element is owned by exactly one rank, so a sum over dp assembles them."""
        dtype = owned[0].dtype if owned else torch.float32
        flat = torch.zeros(self.size, dtype=dtype, device=self.device)
        for piece, values in zip(self.pieces, owned, strict=True):
            flat[piece.start : piece.end] = values
        if self.sharded and len(set(self.replicas)) == 1:
            self.comm.all_reduce(flat, self.group)
        elif self.sharded:  # the experts' buckets over their own replicas
            for bucket, replicas in zip(self.buckets, self.replicas, strict=True):
                self.comm.all_reduce(flat[bucket.start : bucket.end], replicas.group)
        pairs = zip(self.offsets, self.shapes, strict=True)
        return [flat[offset : offset + shape.numel()].view(shape) for offset, shape in pairs]


def _free(whole: torch.Tensor) -> None:
    """Release a tensor's memory, keeping it (and its views) to be filled again: autograd's saved
    references to the parameters stay valid for when they are gathered back."""
    whole.untyped_storage().resize_(0)


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple
