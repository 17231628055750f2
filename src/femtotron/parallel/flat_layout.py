"""Where one rank's parameters lie in its flat buffers: the buckets, the replicas each bucket is reduced over,
and the pieces of each parameter this rank owns. Geometry only, no tensors: the model state
(parallel/model_state.py), the dp reduction (parallel/data_parallel.py), the optimizer, Muon, checkpoints and
the memory estimate all read it, so they agree on every offset.

Every parameter of this rank (over all its pipeline chunks) has an offset in one flat index space. The space
is cut into buckets of about `parallelism.dp_bucket_size_mb`, in the order backward produces gradients (a
chunk's last layer first), so a bucket's reduction can start while backward still runs. Each bucket is padded
to a multiple of dp * 64 elements and split into dp equal, aligned shards: rank r owns shard r of every bucket
under ZeRO (`pieces`: what its optimizer steps); without ZeRO every rank owns every element.

Under expert parallelism the experts' buckets are reduced over their own replicas instead (`Replicas`: the
dp x cp / ep ranks holding the same experts, parallel/expert_parallel.py), and sharded over them.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from femtotron.config.zero_stages import ZeroStage
from femtotron.parallel.comm import Group

# Every parameter, and every bucket's shard, starts at a multiple of 64 elements (128 bytes in bf16),
# so kernels and collectives get aligned pointers.
ALIGNMENT = 64


@dataclass(frozen=True)
class Replicas:
    """The ranks holding the same parameters (gradients summed, ZeRO state sharded over them); this rank's
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


class FlatLayout:
    """The buckets, offsets and owned pieces of one rank's parameters."""

    def __init__(
        self,
        named_params: list[tuple[str, nn.Parameter]],
        groups: list[list[int]],
        *,
        bucket_elements: int,
        zero: ZeroStage,
        dense: Replicas,
        experts: Replicas | None = None,
        orthogonalised: list[bool] | None = None,
    ) -> None:
        """Args:
        named_params: this rank's parameters (read for their names, shapes and shard metadata; may be on the
            meta device).
        groups: parameter indices in backward order (plan_buckets); an expert parameter's group holds expert
            parameters only.
        bucket_elements: a bucket closes once it holds this many elements.
        zero: the ZeRO stage; with `shards_optimizer` this rank owns 1/dp of every bucket, else all of it.
        dense: the ranks summing the dense parameters' gradients (dp x cp) and this rank's place among them.
        experts: the same for the expert parameters' (dp x cp / ep); None: the dense replicas.
        orthogonalised: per parameter, whether Muon steps it (one fp32 momentum instead of Adam's two
            moments, optim/muon.py); for the memory counts.
        """
        self.names = [name for name, _ in named_params]
        self.shapes = [param.shape for _, param in named_params]
        numels = [shape.numel() for shape in self.shapes]
        self.offsets, self.buckets = plan_buckets(numels, groups, bucket_elements, dense.size)
        of_experts = [getattr(p, "shard", None) is not None and p.shard.experts for _, p in named_params]
        # A bucket holds expert parameters only or none: its first one tells which.
        self.replicas = [
            experts if experts and of_experts[bucket.params[0]] else dense for bucket in self.buckets
        ]
        self.size = self.buckets[-1].end if self.buckets else 0
        self.padding = self.size - sum(numels)
        self.orthogonalised = orthogonalised or [False] * len(named_params)
        self.bucket_of = {p: b for b, bucket in enumerate(self.buckets) for p in bucket.params}
        self.sharded = zero.shards_optimizer
        self.pieces = self._pieces(numels, sharded=self.sharded)  # the elements this rank's optimizer steps
        # This rank's 1/dp of every bucket, even without ZeRO: the part it writes to a checkpoint.
        self.shard_pieces = self._pieces(numels, sharded=True)

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

    def owned(self, bucket: int) -> tuple[int, int]:
        """The element range [low, high) of bucket `bucket` that this rank owns among its replicas."""
        return self.buckets[bucket].owned(self.replicas[bucket])

    def owned_elements(self) -> int:
        return sum(piece.end - piece.start for piece in self.pieces)

    def counted_once(self) -> list[bool]:
        """Per owned piece: whether this rank counts it in a sum over all its replicas (a norm): always under
        ZeRO, where the replicas own different pieces; else on the first replica only."""
        pairs = zip(self.buckets, self.replicas, strict=True)
        first = {param: replicas.rank == 0 for bucket, replicas in pairs for param in bucket.params}
        return [self.sharded or first[piece.param] for piece in self.pieces]


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple
