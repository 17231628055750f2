"""Where the elements a rank holds sit in the global tensors a checkpoint stores.

A checkpoint keeps every tensor as slices ("boxes": a start and stop per dimension) of its global,
unsharded tensor, so any layout can find what it needs. A rank's parameter is a box of the global
tensor (`ShardInfo.local_slice`), possibly followed by zero padding along its split dimension; the
part of it whose optimizer state a rank owns under ZeRO-1 is a flat range of that local tensor,
which splits into a few boxes, each contiguous in flat order.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from femtotron.parallel.sharding import ShardInfo

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (start, stop) per dimension


def flat_range_boxes(shape: tuple[int, ...], start: int, stop: int) -> list[tuple[int, int, Box]]:
    """Elements [start, stop) of a row-major tensor of `shape` as boxes, in flat order: a partial first
    row, a block of whole rows, a partial last row (each partial row split the same way one dimension
    down). Returns (flat start, flat stop, box) for each."""
    if start >= stop:
        return []
    if len(shape) == 1:
        return [(start, stop, ((start,), (stop,)))]
    inner = math.prod(shape[1:])
    row = start // inner
    if row == (stop - 1) // inner:  # inside one row: split that row one dimension down
        base = row * inner
        return [
            (base + a, base + b, ((row, *s), (row + 1, *e)))
            for a, b, (s, e) in flat_range_boxes(shape[1:], start - base, stop - base)
        ]
    head_end = min(stop, -(-start // inner) * inner)  # end of the partial first row (= start if none)
    body_end = max(head_end, stop // inner * inner)  # end of the whole rows
    boxes = flat_range_boxes(shape, start, head_end)
    if body_end > head_end:
        rest = tuple(shape[1:])
        whole_rows = ((head_end // inner, *(0,) * len(rest)), (body_end // inner, *rest))
        boxes.append((head_end, body_end, whole_rows))
    return boxes + flat_range_boxes(shape, body_end, stop)


@dataclass(frozen=True, kw_only=True)
class Placement:
    """Elements [flat_start, flat_stop) of a local tensor: a box of it (`local`, contiguous in flat order),
    of which the part `valid` (relative to the box; padding cut off) is the global box `target`."""

    flat_start: int
    flat_stop: int
    local_shape: tuple[int, ...]  # the box's shape
    valid: tuple[slice, ...]
    target: Box


def placements(shard: ShardInfo, local_shape: tuple[int, ...], start: int, stop: int) -> list[Placement]:
    """Where elements [start, stop) of a local tensor with `shard` go in its global tensor. Boxes lying
    wholly in the padding are dropped: padding is never saved."""
    out = []
    extent = [piece.stop - piece.start for piece in shard.local_slice]  # the real (unpadded) local extent
    offsets = [piece.start for piece in shard.local_slice]
    for flat_start, flat_stop, (low, high) in flat_range_boxes(local_shape, start, stop):
        clipped_high = [min(h, n) for h, n in zip(high, extent, strict=True)]
        if any(h <= lo for lo, h in zip(low, clipped_high, strict=True)):
            continue
        target = (
            tuple(lo + o for lo, o in zip(low, offsets, strict=True)),
            tuple(h + o for h, o in zip(clipped_high, offsets, strict=True)),
        )
        shape = tuple(h - lo for lo, h in zip(low, high, strict=True))
        valid = tuple(slice(0, h - lo) for lo, h in zip(low, clipped_high, strict=True))
        placement = Placement(
            flat_start=flat_start, flat_stop=flat_stop, local_shape=shape, valid=valid, target=target
        )
        out.append(placement)
    return out


def intersect(a: Box, b: Box) -> Box | None:
    low = tuple(max(x, y) for x, y in zip(a[0], b[0], strict=True))
    high = tuple(min(x, y) for x, y in zip(a[1], b[1], strict=True))
    return None if any(h <= lo for lo, h in zip(low, high, strict=True)) else (low, high)


def volume(box: Box) -> int:
    return math.prod(h - lo for lo, h in zip(*box, strict=True))


def relative(box: Box, origin: tuple[int, ...]) -> tuple[slice, ...]:
    """`box` as slices of a tensor whose element 0 is at global position `origin`."""
    return tuple(slice(lo - o, h - o) for lo, h, o in zip(box[0], box[1], origin, strict=True))


def first_overlap(boxes: list[Box]) -> tuple[Box, Box] | None:
    """Two of `boxes` that share an element, or None: a sweep along dimension 0 in order of start, so each
    box is compared only with those still open where it starts."""
    open_boxes: list[Box] = []
    for box in sorted(boxes):
        open_boxes = [other for other in open_boxes if other[1][0] > box[0][0]]
        for other in open_boxes:
            if intersect(other, box) is not None:
                return other, box
        open_boxes.append(box)
    return None
