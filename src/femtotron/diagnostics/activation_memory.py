"""Measure the activation memory autograd keeps for backward (used to check recomputation's saving)."""

from __future__ import annotations

import itertools

import torch
from torch import nn


def saved_activation_bytes(
    model: nn.Module, ids: torch.Tensor, targets: torch.Tensor, backward: bool = False
) -> int:
    """Bytes of activation storage autograd holds for backward after one forward pass of `model(ids,
    targets)`.

    A pack hook sees every tensor saved for backward (under recomputation: each checkpointed layer's
    input, nothing from inside the layer). Each storage is counted once (a tensor and its views, or one
    tensor saved by two ops, occupy memory once), parameters and buffers not at all: they are held
    anyway. With `backward` the graph is then run (recomputation must work under the counting);
    otherwise it is dropped unused, so no gradient hook fires.
    """
    kept_anyway = itertools.chain(model.parameters(), model.buffers())
    held = {t.untyped_storage().data_ptr() for t in kept_anyway}
    seen: set[int] = set()
    total = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        storage = t.untyped_storage()
        if storage.data_ptr() not in held and storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss_sum, _ = model(ids, targets)
    if backward:
        loss_sum.backward()
    return total
