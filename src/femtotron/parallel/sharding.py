"""Parameters that know their own sharding.

Each is created at its full shape on the rank's device from a seed of (global seed, name), then sliced for
this rank: any layout starts from exactly the single-device weights (on that kind of device: `full_init`),
and checkpoints, clipping and conversion read the `ShardInfo` instead of re-deriving layouts from names.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch
from torch import nn

CPU = torch.device("cpu")


@dataclass(frozen=True, kw_only=True)
class ShardInfo:
    name: str  # the parameter's name in the full model, e.g. "layers.0.self_attn.q_proj.weight"
    global_shape: tuple[int, ...]
    # The part of the global tensor this rank holds. The local tensor starts with exactly that
    # part; along a split dimension it may be longer, zero-padded (the vocabulary is padded to a
    # multiple of tp), and the padding is never part of the model.
    local_slice: tuple[slice, ...]
    tie_group: str | None = None  # parameters sharing one value (tied embeddings) share a group
    experts: bool = False  # dimension 0 indexes a layer's experts, split over the ep ranks
    # How its initial values are drawn (`initial_values`): ZeRO-3 creates a parameter on the meta device
    # and draws its values only when its bucket is laid out, so no rank ever holds its whole part at once.
    init_std: float | None = None
    init_seed: int = 0
    # Rows that interleave several matrices: blocks of these sizes repeat along dimension 0, block i of each
    # repetition belonging to matrix i (attention's fused q|k|v, one repetition per key/value head). Muon
    # orthogonalises each matrix alone (optim/muon.py).
    fused_rows: tuple[int, ...] | None = None


def param_seed(seed: int, name: str) -> int:
    """A stable 63-bit seed per (seed, name); Python's hash() is salted per process, so not that."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def full_init(
    name: str, shape: tuple[int, ...], std: float | None, seed: int, device: torch.device = CPU
) -> torch.Tensor:
    """The full fp32 tensor every layout slices from: normal(0, std), or ones when std is None. Drawn on
    `device`: the values differ on CPU and CUDA, and on GPUs with other SM counts (CUDA spreads the draws)."""
    if device.type == "meta" or std is None:  # meta (offline checkpoint tools): only shapes matter
        return torch.ones(shape, device=device)
    generator = torch.Generator(device).manual_seed(param_seed(seed, name))
    return torch.empty(shape, device=device).normal_(0.0, std, generator=generator)


def make_param(
    name: str,
    shape: tuple[int, ...],
    *,
    std: float | None,
    seed: int,
    dtype: torch.dtype,
    device: torch.device,
    shard_dim: int | None = None,
    rank: int = 0,
    world: int = 1,
    tie_group: str | None = None,
    experts: tuple[int, int] | None = None,
    fused_rows: tuple[int, ...] | None = None,
) -> nn.Parameter:
    """Initialise `name` at full shape and keep this rank's chunk of `shard_dim` (ceil(n / world) long, the
    last ones zero-padded), and with `experts` = (ep rank, ep) its 1/ep of dimension 0."""
    local_slice = [slice(0, n) for n in shape]
    local_shape = list(shape)
    if shard_dim is not None and world > 1:
        n = shape[shard_dim]
        size = -(-n // world)
        local_slice[shard_dim] = slice(min(rank * size, n), min((rank + 1) * size, n))
        local_shape[shard_dim] = size
    if experts is not None:
        ep_rank, ep = experts
        local_shape[0] = shape[0] // ep
        local_slice[0] = slice(ep_rank * local_shape[0], (ep_rank + 1) * local_shape[0])
    shard = ShardInfo(
        name=name,
        global_shape=tuple(shape),
        local_slice=tuple(local_slice),
        tie_group=tie_group,
        experts=experts is not None,
        init_std=std,
        init_seed=seed,
        fused_rows=fused_rows,
    )
    if device.type == "meta":  # shapes only, or ZeRO-3's deferred values (data_parallel.py draws them)
        param = nn.Parameter(torch.zeros(local_shape, device=device, dtype=dtype))
    else:
        param = nn.Parameter(initial_values(shard, tuple(local_shape), dtype, device))
    param.shard = shard
    return param


def initial_values(
    shard: ShardInfo, local_shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """A parameter's initial local tensor: its slice of the full initial tensor, zero-padded to its shape."""
    full = full_init(shard.name, shard.global_shape, shard.init_std, shard.init_seed, device)
    local = torch.zeros(local_shape, device=device, dtype=dtype)
    piece = full[shard.local_slice]
    local[tuple(slice(0, k) for k in piece.shape)] = piece
    return local


def split_dim(shard: ShardInfo) -> int | None:
    """The dimension this parameter is split along over tp, or None when every tp rank holds all of it."""
    for dim, (piece, n) in enumerate(zip(shard.local_slice, shard.global_shape, strict=True)):
        if piece.stop - piece.start != n and not (shard.experts and dim == 0):
            return dim
    return None
