"""One rank's parameters and gradients as tensors, whole or sharded as its ZeRO stage says, laid out by
parallel/flat_layout.py. Where a new way of holding them lands (HSDP, offload, fp8 all-gathers): the dp
reduction (parallel/data_parallel.py) and the gathering of ZeRO-3's units (parallel/fully_sharded.py) only ask
this room for a bucket's tensors.

The parameters become views into flat tensors of the model's dtype; their gradients accumulate at the same
offsets of flat gradients (fp32 unless optimizer.accumulate_grad_in_fp32 is off). Padding stays zero in both,
so it adds nothing to reductions or norms.

- Without ZeRO-2 (`shards_gradients` off) the gradients are one flat tensor, reduced in place.
- ZeRO-2 keeps only the owned shard of the summed gradients: a bucket's whole gradients exist from its first
  gradient of the step until its reduction has finished, then are freed.
- ZeRO-3 (`shards_parameters`) keeps only the owned shard of the parameters too: each bucket's whole
  parameters exist only while parallel/fully_sharded.py has them gathered (a unit's forward or backward).
  Its parameters may come on the meta device, to be drawn here a bucket at a time, never whole.
"""

from __future__ import annotations

import torch
from torch import nn

from femtotron.config.zero_stages import ZeroStage
from femtotron.parallel.comm import Comm
from femtotron.parallel.flat_layout import FlatLayout
from femtotron.parallel.sharding import initial_values


class ModelState:
    """The tensors of one rank's parameters and gradients, and the collectives that make shards whole."""

    def __init__(
        self,
        layout: FlatLayout,
        params: list[nn.Parameter],
        comm: Comm,
        *,
        zero: ZeroStage,
        grad_dtype: torch.dtype,
        device: torch.device | None = None,
    ) -> None:
        """`params` are made views into this state's tensors, their values kept (or, on the meta device,
        drawn on `device`; default: theirs)."""
        self.layout = layout
        self.comm = comm
        self.zero = zero
        self.device = device or params[0].device
        self.param_dtype = params[0].dtype
        self.grad_dtype = grad_dtype
        if zero.shards_parameters:
            self._shard_params(params)
        else:
            self.flat_params = torch.zeros(layout.size, dtype=self.param_dtype, device=self.device)
            self._place(params, self.flat_params, 0, range(len(params)))
        # ZeRO-2: per bucket, its whole gradients while they accumulate, and the owned shard
        if zero.shards_gradients:
            self.bucket_grads: list[torch.Tensor | None] = [None] * len(layout.buckets)
            self.shard_grads = [
                torch.zeros(high - low, dtype=grad_dtype, device=self.device)
                for low, high in map(layout.owned, range(len(layout.buckets)))
            ]
        else:
            self.flat_grads = torch.zeros(layout.size, dtype=grad_dtype, device=self.device)

    def _place(self, params: list[nn.Parameter], whole: torch.Tensor, start: int, indices) -> None:
        """Make parameters `indices` views into `whole` (flat elements from `start` on), values kept; one on
        the meta device (ZeRO-3's deferred initialisation) gets its initial values drawn into it."""
        with torch.no_grad():
            for index in indices:
                param = params[index]
                offset = self.layout.offsets[index] - start
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
        for index, bucket in enumerate(self.layout.buckets):
            whole = torch.zeros(bucket.end - bucket.start, dtype=self.param_dtype, device=self.device)
            self._place(params, whole, bucket.start, bucket.params)
            low, high = self.layout.owned(index)
            self.param_shards.append(whole[low - bucket.start : high - bucket.start].clone())
            self.bucket_params.append(whole)
            _free(whole)

    def start_gather(self, index: int):
        """ZeRO-3: start making bucket `index`'s parameters whole from every replica's shard."""
        whole = self.bucket_params[index]
        whole.untyped_storage().resize_(whole.numel() * whole.element_size())
        replicas = self.layout.replicas[index]
        if replicas.size == 1:
            whole.copy_(self.param_shards[index])
            return None
        return self.comm.start_all_gather(whole, self.param_shards[index], replicas.group)

    def wait_gather(self, index: int, work) -> None:
        self.comm.wait(work, self.layout.replicas[index].group, self.bucket_params[index])

    def free_params(self, index: int) -> None:
        _free(self.bucket_params[index])

    def whole_grads(self, index: int) -> torch.Tensor:
        """Bucket `index`'s whole gradients (ZeRO-2: made, zero, at its first gradient of the step)."""
        bucket = self.layout.buckets[index]
        if not self.zero.shards_gradients:
            return self.flat_grads[bucket.start : bucket.end]
        if self.bucket_grads[index] is None:
            size = bucket.end - bucket.start
            self.bucket_grads[index] = torch.zeros(size, dtype=self.grad_dtype, device=self.device)
        return self.bucket_grads[index]

    def grad_of(self, param: int) -> torch.Tensor:
        """Parameter `param`'s gradient in its bucket's whole gradients, shaped like it."""
        layout = self.layout
        bucket = layout.bucket_of[param]
        offset = layout.offsets[param] - layout.buckets[bucket].start
        shape = layout.shapes[param]
        return self.whole_grads(bucket)[offset : offset + shape.numel()].view(shape)

    def zero_grads(self) -> None:
        if self.zero.shards_gradients:
            self.bucket_grads = [None] * len(self.layout.buckets)
            for shard in self.shard_grads:
                shard.zero_()
        else:
            self.flat_grads.zero_()

    def model_state_bytes(self) -> dict[str, int]:
        """Bytes this rank holds for the model state between steps: parameters and gradients (the flat
        buffers, padding included; ZeRO-2: the owned shards of the gradients; ZeRO-3: of the parameters too),
        and for the elements it owns fp32 master weights (none when the parameters are fp32: they are their
        own masters), Adam's two moments and Muon's momentum (optim/zero.py, optim/muon.py)."""
        layout = self.layout
        owned = layout.owned_elements()
        muon = sum(piece.end - piece.start for piece in layout.pieces if layout.orthogonalised[piece.param])
        if self.zero.shards_gradients:
            grads = sum(shard.nbytes for shard in self.shard_grads)
        else:
            grads = self.flat_grads.nbytes
        if self.zero.shards_parameters:
            params = sum(shard.nbytes for shard in self.param_shards)
        else:
            params = self.flat_params.nbytes
        held = {
            "params": params,
            "grads": grads,
            "master_weights": 0 if self.param_dtype == torch.float32 else 4 * owned,
            "adam_moments": 8 * (owned - muon),
        }
        if any(layout.orthogonalised):
            held["muon_momentum"] = 4 * muon
        return held

    def checkpoint_bytes(self) -> int:
        """The most bytes of this rank's part of a checkpoint: its owned elements' parameters, master weights
        and optimizer moments (what checkpoints.async_save stages in host memory); less where a copy of a
        parameter is saved by another rank (tp's replicated norms, a tied embedding)."""
        state = self.model_state_bytes()
        optimizer = state["master_weights"] + state["adam_moments"] + state.get("muon_momentum", 0)
        return self.layout.owned_elements() * self.param_dtype.itemsize + optimizer

    def _owned_views(self, shards: list[torch.Tensor]) -> list[torch.Tensor]:
        """This rank's pieces, as 1-D views into per-bucket owned shards (ZeRO-2's gradients, ZeRO-3's
        parameters)."""
        views = []
        for piece in self.layout.pieces:
            bucket = self.layout.bucket_of[piece.param]
            low, _ = self.layout.owned(bucket)
            views.append(shards[bucket][piece.start - low : piece.end - low])
        return views

    def owned_grads(self) -> list[torch.Tensor]:
        """This rank's pieces of the gradients (summed over dp after the reduction), as 1-D views."""
        if self.zero.shards_gradients:
            return self._owned_views(self.shard_grads)
        return [self.flat_grads[piece.start : piece.end] for piece in self.layout.pieces]

    def owned_params(self) -> list[torch.Tensor]:
        """This rank's pieces of the model's parameters, as 1-D views (what the optimizer writes back)."""
        if self.zero.shards_parameters:
            return self._owned_views(self.param_shards)
        return [self.flat_params[piece.start : piece.end] for piece in self.layout.pieces]

    def gather_params(self) -> None:
        """ZeRO-1 and 2, after the step: every rank's updated shard of the parameters to every rank (ZeRO-3
        gathers each unit's when it runs)."""
        if not self.zero.shards_optimizer or self.zero.shards_parameters:
            return
        wholes = [self.flat_params[bucket.start : bucket.end] for bucket in self.layout.buckets]
        works = [self.start_bucket_gather(index, whole) for index, whole in enumerate(wholes)]
        for index, (whole, work) in enumerate(zip(wholes, works, strict=True)):
            self.wait_bucket_gather(index, work, whole)

    def start_bucket_gather(self, index: int, whole: torch.Tensor):
        """Start filling `whole`, a tensor as long as bucket `index` holding this rank's owned shard of it,
        with every replica's shard (nothing to do without ZeRO: every rank owns all of it)."""
        if not self.zero.shards_optimizer:
            return None
        bucket = self.layout.buckets[index]
        low, high = self.layout.owned(index)
        mine = whole[low - bucket.start : high - bucket.start]
        return self.comm.start_all_gather(whole, mine, self.layout.replicas[index].group)

    def start_bucket_sum(self, index: int, whole: torch.Tensor):
        """Start summing `whole`, a tensor as long as bucket `index`, over its replicas into this rank's owned
        shard of it (all of it without ZeRO); `wait_bucket_gather` waits for it."""
        group = self.layout.replicas[index].group
        if not self.zero.shards_optimizer:
            return self.comm.start_all_reduce(whole, group)
        bucket = self.layout.buckets[index]
        low, high = self.layout.owned(index)
        return self.comm.start_reduce_scatter(whole[low - bucket.start : high - bucket.start], whole, group)

    def wait_bucket_gather(self, index: int, work, whole: torch.Tensor) -> None:
        self.comm.wait(work, self.layout.replicas[index].group, whole)

    def full(self, owned: list[torch.Tensor]) -> list[torch.Tensor]:
        """Per parameter, the whole tensor from every rank's owned pieces (e.g. fp32 master weights):
        each element is owned by exactly one rank, so a sum over the replicas assembles them."""
        layout = self.layout
        dtype = owned[0].dtype if owned else torch.float32
        flat = torch.zeros(layout.size, dtype=dtype, device=self.device)
        for piece, values in zip(layout.pieces, owned, strict=True):
            flat[piece.start : piece.end] = values
        if self.zero.shards_optimizer and len(set(layout.replicas)) == 1:
            self.comm.all_reduce(flat, layout.replicas[0].group)
        elif self.zero.shards_optimizer:  # the experts' buckets over their own replicas
            for bucket, replicas in zip(layout.buckets, layout.replicas, strict=True):
                self.comm.all_reduce(flat[bucket.start : bucket.end], replicas.group)
        pairs = zip(layout.offsets, layout.shapes, strict=True)
        return [flat[offset : offset + shape.numel()].view(shape) for offset, shape in pairs]


def _free(whole: torch.Tensor) -> None:
    """Release a tensor's memory, keeping it (and its views) to be filled again: autograd's saved
    references to the parameters stay valid for when they are gathered back."""
    whole.untyped_storage().resize_(0)
