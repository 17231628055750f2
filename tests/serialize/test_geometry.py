"""Flat ranges of local tensors as boxes of global tensors."""

import math
import random

import torch

from femtotron.parallel.sharding import ShardInfo
from femtotron.serialize.geometry import first_overlap, flat_range_boxes, intersect, placements


def test_flat_ranges_split_into_contiguous_boxes_in_order():
    rng = random.Random(0)
    for _ in range(500):
        shape = tuple(rng.randint(1, 5) for _ in range(rng.randint(1, 4)))
        numel = math.prod(shape)
        start = rng.randint(0, numel)
        stop = rng.randint(start, numel)
        elements = torch.arange(numel).view(shape)
        position = start
        for flat_start, flat_stop, (low, high) in flat_range_boxes(shape, start, stop):
            assert flat_start == position
            box = elements[tuple(slice(lo, h) for lo, h in zip(low, high, strict=True))]
            assert torch.equal(box.flatten(), torch.arange(flat_start, flat_stop)), (shape, start, stop)
            position = flat_stop
        assert position == max(start, stop) or start == stop


def test_placements_map_a_padded_shard_into_its_global_tensor_and_drop_the_padding():
    # Rows 6..9 of a (10, 3) global tensor on a rank whose local tensor has 5 rows: the last is padding.
    shard = ShardInfo(name="w", global_shape=(10, 3), local_slice=(slice(6, 10), slice(0, 3)))
    local = torch.zeros(5, 3)
    local[:4] = torch.arange(18, 30, dtype=torch.float32).view(4, 3)  # global rows 6..9 hold 18..29
    covered = []
    for place in placements(
        shard, (5, 3), 2, 15
    ):  # from the middle of row 0 to the end, padding row included
        values = local.view(-1)[place.flat_start : place.flat_stop].view(place.local_shape)[place.valid]
        (low, high) = place.target
        expected = torch.arange(30, dtype=torch.float32).view(10, 3)[low[0] : high[0], low[1] : high[1]]
        assert torch.equal(values, expected)
        covered.append(place.target)
    assert covered == [((6, 2), (7, 3)), ((7, 0), (10, 3))]  # nothing from the padding row


def test_first_overlap_finds_a_shared_element_exactly_when_two_boxes_have_one():
    rng = random.Random(1)
    for _ in range(500):
        boxes = []
        for _ in range(rng.randint(0, 6)):
            low = tuple(rng.randint(0, 4) for _ in range(2))
            boxes.append((low, tuple(lo + rng.randint(1, 3) for lo in low)))
        found = first_overlap(boxes)
        any_pair = any(intersect(a, b) for i, a in enumerate(boxes) for b in boxes[i + 1 :])
        assert (found is not None) == any_pair, boxes
        if found is not None:
            assert intersect(*found) is not None
    # Boxes side by side along the first dimension only touch: no element is shared.
    assert first_overlap([((0, 0), (2, 4)), ((2, 0), (4, 4))]) is None
