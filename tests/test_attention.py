"""What attention keeps for its backward: one sliding-window mask for all the layers of a forward."""

from __future__ import annotations

import gc
import weakref

import torch
from helpers import build_llama, llama_config

SEQUENCE = 256


def test_a_sliding_window_keeps_one_mask_for_all_layers_and_frees_it_with_the_graph():
    """4 windowed layers: the (sequence x sequence) tensors saved for backward, counted by storage, are the
    one mask they share (a boolean mask, converted by SDPA at every call, left one per layer: 2 GiB each at
    32k tokens in bf16); the backward frees it, nothing caches it past the graph."""
    cfg = llama_config(num_hidden_layers=4, max_position_embeddings=SEQUENCE, sliding_window=32)
    model = build_llama(cfg)
    ids = torch.randint(0, cfg.vocab_size, (1, SEQUENCE), generator=torch.Generator().manual_seed(0))
    masks: dict[int, weakref.ref] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.shape[-2:] == (SEQUENCE, SEQUENCE):
            masks[t.untyped_storage().data_ptr()] = weakref.ref(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss_sum, _ = model(ids, ids)
    assert len(masks) == 1, [(m().dtype, m().shape) for m in masks.values()]
    loss_sum.backward()
    del loss_sum
    gc.collect()
    assert all(mask() is None for mask in masks.values())
