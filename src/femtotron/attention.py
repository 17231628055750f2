"""Attention kernels: causal attention for whole sequences, and attention over one block of keys at a time
with its log-sum-exp, which the context-parallel ring and document masking merge block by block.

Each device gets the kernel that is fastest and exact there: the CPU's flash kernel, CUDA's flash kernel
for blocks without a mask (whole sequences with a sliding window too: it applies the window itself),
CUDA's memory-efficient kernel (the mask as an additive bias) for masked ones, and written-out scores
(taken a chunk of rows at a time, to bound memory) where no fused kernel applies.
What precision attention computes in is precision.py's policy (`attention_dtype`), not decided here.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from femtotron.precision import attention_dtype, on_this_cpu

# The CPU's flash-attention kernels, which also return (and take) the log-sum-exp.
_CPU_FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_CPU_FLASH_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
# CUDA's FlashAttention-2 with its sliding window (torch 2.13), on (batch, sequence, heads, head_dim) tensors.
_FLASH_WINDOW = torch.ops.aten._flash_attention_forward


def causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True, window: int | None = None
) -> torch.Tensor:
    """`causal` False: every query sees every key (one new position against a generation's cache). The
    queries are the last of the keys' positions. `window`: a query sees only the keys fewer than `window`
    positions before it (itself included), as transformers' sliding window."""
    dtype = attention_dtype(q)
    return _causal_attention(q.to(dtype), k.to(dtype), v.to(dtype), causal, window).to(q.dtype)


def _causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, window: int | None
) -> torch.Tensor:
    keys = k.shape[-2]
    windowed = window is not None and keys > window  # the window hides some key from some query
    if windowed and _kernel_of(q, masked=False) == "flash":
        # FlashAttention-2's own window, aligned to the last key as the queries are: no mask, the blocks
        # outside every window skipped, the K/V heads as they are; autograd gives its backward the window.
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # its layout: (batch, sequence, heads, head_dim)
        out = _FLASH_WINDOW(
            query=q,
            key=k,
            value=v,
            cum_seq_q=None,  # dense inputs: no cumulative lengths
            cum_seq_k=None,
            max_q=q.shape[1],
            max_k=keys,
            dropout_p=0.0,
            is_causal=True,
            return_debug_mask=False,
            window_size_left=window - 1,
            window_size_right=0,
        )[0]
        return out.transpose(1, 2)
    mask = _window_mask(q.shape[-2], keys, window, q) if windowed else None
    causal = causal and mask is None  # the window's mask holds the causal one
    # Memory estimates: keep what a fused kernel keeps (output, log-sum-exp, the window's mask), as on CPUs.
    if q.is_meta:
        return _CPU_FLASH(q, k, v, 0.0, causal, attn_mask=mask)[0]
    groups = q.shape[1] // k.shape[1]
    capability = torch.cuda.get_device_capability(q.device) if q.is_cuda else None
    takes_groups = fused_kernel_takes_kv_groups(q.device.type, q.dtype, capability) and (
        mask is None or not q.is_cuda  # CUDA's flash kernel takes no mask
    )
    if groups > 1 and not takes_groups:
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=k.shape[1] != q.shape[1]
    )


# The window's additive masks, each while some autograd graph holds it: every layer of a forward attends
# with the one tensor, in the dtype SDPA takes as it is, so that its backward keeps it once, not per layer
# (a boolean mask is converted to a new tensor at every call).
_WINDOW_MASKS: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def _window_mask(queries: int, keys: int, window: int, q: torch.Tensor) -> torch.Tensor:
    """0 where each of the last `queries` of `keys` positions sees a key under the window, -inf elsewhere
    (queries x keys, in q's dtype and on its device)."""
    cached = (queries, keys, window, q.device, q.dtype)
    # Weak references are not traced: compiled, the graph computes the mask once for all the layers.
    compiling = torch.compiler.is_compiling()
    mask = None if compiling else _WINDOW_MASKS.get(cached)
    if mask is None:
        positions = torch.arange(keys - queries, keys, device=q.device)  # the queries': the keys' last
        distance = positions[:, None] - torch.arange(keys, device=q.device)
        visible = (distance >= 0) & (distance < window)
        mask = _additive(visible, q.dtype)
        if not compiling:
            _WINDOW_MASKS[cached] = mask
    return mask


# CUDA's fused kernels (torch 2.13), which also return the log-sum-exp, and whose backward takes it: flash
# for mask-free blocks, memory-efficient attention (the mask as an additive bias) for masked ones.
_FLASH = torch.ops.aten._scaled_dot_product_flash_attention
_FLASH_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_backward
_EFFICIENT = torch.ops.aten._scaled_dot_product_efficient_attention
_EFFICIENT_BACKWARD = torch.ops.aten._scaled_dot_product_efficient_attention_backward
# The efficient kernel's log-sum-exp has room for a multiple of 32 queries, +inf past the last, which its
# backward reads unchecked; the rows of its bias start at multiples of 8 elements (as SDPA pads them).
EFFICIENT_LSE_ALIGNMENT = 32
EFFICIENT_BIAS_ALIGNMENT = 8

# Document masking, per block: each query's document (batch, queries) and each key's (batch, keys). A query
# sees only the keys of its own document.
Documents = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class Window:
    """A sliding window, per block: each query's and each key's index in the whole sequence ((queries,),
    (keys,)); a query sees only the keys fewer than `size` indices before it (itself included)."""

    query_index: torch.Tensor
    key_index: torch.Tensor
    size: int


def block_kernel(
    device_type: str, dtype: torch.dtype, capability: tuple[int, int] | None, head_dim: int, masked: bool
) -> str:
    """Which kernel computes a block of `attention_with_lse`: "cpu flash" on CPUs; on CUDA GPUs that run
    torch's flash kernel (sm80 to sm121, fp16/bf16, head_dim a multiple of 8 up to 256) "flash" for a
    mask-free block, "efficient" (memory-efficient attention, which takes those shapes too) for a masked one;
    elsewhere (fp32 on GPUs, older GPUs, other head_dims) "written out" (`math_attention_with_lse`)."""
    if device_type == "cpu":
        return "cpu flash"
    if device_type != "cuda" or dtype not in (torch.float16, torch.bfloat16) or capability is None:
        return "written out"
    # Flash's backward lacks the shared memory for head_dim 193-224 on sm86-89 and sm120-121 (torch's check).
    small_shared_memory = (8, 6) <= capability <= (8, 9) or (12, 0) <= capability
    flash_takes = (8, 0) <= capability <= (12, 1) and head_dim % 8 == 0 and head_dim <= 256
    if not flash_takes or (small_shared_memory and 192 < head_dim <= 224):
        return "written out"
    return "efficient" if masked else "flash"


def _kernel_of(q: torch.Tensor, masked: bool) -> str:
    """`block_kernel` for a block of queries `q`."""
    if on_this_cpu(q):
        return "cpu flash"
    if q.is_meta:  # a GPU's memory estimate (diagnostics/memory.py): the kernels of any sm80+ GPU
        return block_kernel("cuda", q.dtype, (8, 0), q.shape[-1], masked)
    capability = torch.cuda.get_device_capability(q.device) if q.is_cuda else None
    return block_kernel(q.device.type, q.dtype, capability, q.shape[-1], masked)


def attention_with_lse(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    documents: Documents | None,
    window: Window | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One block of attention (k, v with the KV heads) and its fp32 log-sum-exp per query (-inf: sees no key),
    whole or `causal` (the queries' own block: key i is query i's token), under `documents` each query
    seeing only its own document's keys, under `window` only the keys in its window. The kernel is
    `block_kernel`'s; each one's backward takes the output and lse of all blocks merged (ring attention)."""
    kernel = _kernel_of(q, documents is not None or window is not None)
    if kernel == "cpu flash":
        return _cpu_flash_attention(q, k, v, causal, documents, window)
    if kernel == "flash":
        out, lse, *_ = _FLASH(q, k, v, 0.0, causal)
        return out, lse
    if kernel == "efficient":
        return _efficient_attention(q, k, v, causal, documents, window)
    return math_attention_with_lse(q, k, v, causal, documents, window)


def attention_with_lse_backward(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    causal: bool,
    documents: Documents | None,
    window: Window | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients of one block's q, k, v, given the output and log-sum-exp of every block together."""
    masked = documents is not None or window is not None
    kernel = _kernel_of(q, masked)
    if kernel == "cpu flash":
        visible = _visible(documents, window, causal, slice(0, q.shape[-2]), k.shape[-2], q.device)
        mask = _additive(visible, q.dtype) if masked else None
        return _CPU_FLASH_BACKWARD(grad_out, q, k, v, out, lse, 0.0, causal, attn_mask=mask)
    if kernel == "flash":
        # Without dropout the random state is not read; it has the shapes the forward gives it. The two
        # None: dense inputs (no cumulative sequence lengths). The lse is read as a contiguous array.
        rng_state = torch.empty(2, dtype=torch.uint64, device=q.device)
        unused = torch.empty((), dtype=torch.uint64, device=q.device)
        lengths = (q.shape[-2], k.shape[-2])
        return _FLASH_BACKWARD(
            grad_out, q, k, v, out, lse.contiguous(), None, None, *lengths, 0.0, causal, rng_state, unused
        )
    if kernel == "efficient":
        return _efficient_attention_backward(grad_out, q, k, v, out, lse, causal, documents, window)
    return math_attention_with_lse_backward(grad_out, q, k, v, out, lse, causal, documents, window)


def _cpu_flash_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    documents: Documents | None,
    window: Window | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    if documents is None and window is None:
        return _CPU_FLASH(q, k, v, 0.0, causal)
    visible = _visible(documents, window, causal, slice(0, q.shape[-2]), k.shape[-2], q.device)
    out, lse = _CPU_FLASH(q, k, v, 0.0, causal, attn_mask=_additive(visible, q.dtype))
    # The kernel gives a query that sees nothing a log-sum-exp of 0.
    return out, lse.masked_fill(~visible.any(-1), float("-inf"))


def _efficient_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    documents: Documents | None,
    window: Window | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The memory-efficient kernel with the documents, the window and the causal mask as a bias, built for a
    chunk of query rows at a time; the kernel takes as many K/V heads as query heads."""
    k = _grouped(k, q)
    v = _grouped(v, q)
    outs = []
    lses = []
    for rows in _row_chunks(q.shape[-2], q.shape[0] * k.shape[-2]):
        keys = rows.stop if causal else k.shape[-2]  # causal rows see no key past their last
        visible = _visible(documents, window, causal, rows, keys, q.device)
        out, lse, *_ = _EFFICIENT(q[:, :, rows], k[:, :, :keys], v[:, :, :keys], _bias(visible, q), True)
        unseen = ~visible.any(-1)  # queries that see no key here: the kernel may leave NaN in their output
        outs.append(out.masked_fill(unseen.unsqueeze(-1), 0))
        lses.append(lse[..., : rows.stop - rows.start].masked_fill(unseen, float("-inf")))
    return torch.cat(outs, dim=-2), torch.cat(lses, dim=-1)


def _efficient_attention_backward(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    causal: bool,
    documents: Documents | None,
    window: Window | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`_efficient_attention`'s backward, chunk by chunk as it ran: the repeated K/V heads' gradients add up
    over the chunks (fp32), then over each KV head's group."""
    keys_and_values = [_grouped(t, q) for t in (k, v)]
    grads = [torch.zeros(t.shape, dtype=torch.float32, device=q.device) for t in keys_and_values]
    grad_q = torch.empty_like(q)
    no_dropout = torch.empty((), dtype=torch.long)  # the random state, as the forward gives it: not read
    for rows in _row_chunks(q.shape[-2], q.shape[0] * k.shape[-2]):
        keys = rows.stop if causal else k.shape[-2]
        inputs = [t[:, :, rows] for t in (grad_out, q)] + [t[:, :, :keys] for t in keys_and_values]
        bias = _bias(_visible(documents, window, causal, rows, keys, q.device), q)
        # Its output's layout, (batch, rows, heads, head_dim), which the backward assumes of `out`.
        chunk_out = out[:, :, rows].transpose(1, 2).contiguous().transpose(1, 2)
        chunk_lse = _padded_lse(lse[:, :, rows])
        # The gradients of q, k, v, not the bias's; not causal (the bias has the causal mask).
        dq, dk, dv, _ = _EFFICIENT_BACKWARD(
            *inputs, bias, chunk_out, chunk_lse, no_dropout, no_dropout, 0.0, [True, True, True, False], False
        )
        grad_q[:, :, rows] = dq
        grads[0][:, :, :keys] += dk
        grads[1][:, :, :keys] += dv
    return grad_q, _summed_over_groups(grads[0], k).to(k.dtype), _summed_over_groups(grads[1], v).to(v.dtype)


def _bias(visible: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """`visible` (batch, 1, rows, keys) as the efficient kernel's additive bias for `q`'s heads: in q's dtype,
    each row starting at a multiple of EFFICIENT_BIAS_ALIGNMENT elements, one copy for all the heads."""
    keys = visible.shape[-1]
    padded = F.pad(_additive(visible, q.dtype), (0, -keys % EFFICIENT_BIAS_ALIGNMENT))
    return padded[..., :keys].expand(q.shape[0], q.shape[1], -1, -1)


def _padded_lse(lse: torch.Tensor) -> torch.Tensor:
    """`lse` as the efficient kernel's forward leaves it for its backward (EFFICIENT_LSE_ALIGNMENT)."""
    return F.pad(lse, (0, -lse.shape[-1] % EFFICIENT_LSE_ALIGNMENT), value=float("inf"))


def math_attention_with_lse(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    documents: Documents | None,
    window: Window | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`attention_with_lse` written out in fp32, SCORES_PER_CHUNK query rows' scores at a time."""
    keys = _grouped(k, q).float()  # all the query heads', once
    values = _grouped(v, q).float()
    outs = []
    lses = []
    for rows in _row_chunks(q.shape[-2], q.shape[0] * q.shape[1] * k.shape[-2]):
        probabilities, lse = _probabilities(
            q[:, :, rows], keys, _visible(documents, window, causal, rows, k.shape[-2], q.device)
        )
        outs.append((probabilities @ values).to(q.dtype))
        lses.append(lse)
    return torch.cat(outs, dim=-2), torch.cat(lses, dim=-1)


def math_attention_with_lse_backward(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    causal: bool,
    documents: Documents | None,
    window: Window | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Flash attention's backward by autograd, a chunk of query rows at a time: with the softmax normalised by
    the merged `lse` (held fixed), the scores' gradient P * (dP - rowsum(dO * O)) is that of
    dO . (P V) - rowsum(dO * O) . rowsum(P)."""
    # Keys and values of all the query heads, once: their gradients add up over the chunks, then over the
    # heads that share a KV head.
    keys = [_grouped(t, q).detach().float().requires_grad_() for t in (k, v)]
    grad_q = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    for rows in _row_chunks(q.shape[-2], q.shape[0] * q.shape[1] * k.shape[-2]):
        grad = grad_out[:, :, rows].float()
        delta = (grad * out[:, :, rows].float()).sum(-1, keepdim=True)
        with torch.enable_grad():
            queries = q[:, :, rows].detach().float().requires_grad_()
            allowed = _visible(documents, window, causal, rows, k.shape[-2], q.device)
            probabilities, _ = _probabilities(queries, keys[0], allowed, lse[:, :, rows])
            weighted = probabilities @ keys[1]
            ((grad * weighted).sum() - (delta * probabilities).sum()).backward()
        grad_q[:, :, rows] = queries.grad
    grad_k, grad_v = (_summed_over_groups(t.grad, kv) for t, kv in zip(keys, (k, v), strict=True))
    return grad_q.to(q.dtype), grad_k.to(k.dtype), grad_v.to(v.dtype)


# The written-out blocks hold (batch, heads, rows, keys) fp32 scores, the efficient kernel's a (batch, rows,
# keys) bias: at most this many elements at once (256 MiB of scores).
SCORES_PER_CHUNK = 2**26


def _row_chunks(rows: int, per_row: int) -> list[slice]:
    """`rows` in slices of SCORES_PER_CHUNK // `per_row` rows (at least one)."""
    step = max(1, SCORES_PER_CHUNK // per_row)
    return [slice(first, min(first + step, rows)) for first in range(0, rows, step)]


def _additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.zeros((), dtype=dtype, device=allowed.device).masked_fill(~allowed, float("-inf"))


def _visible(
    documents: Documents | None,
    window: Window | None,
    causal: bool,
    rows: slice,
    keys: int,
    device: torch.device,
) -> torch.Tensor | None:
    """Which query of `rows` sees which of the first `keys` keys: those of its own document, in its window,
    causally up to its own position; (batch, 1, rows, keys) under `documents`, else (rows, keys) (None: all
    see all)."""
    allowed = None
    if documents is not None:
        query_documents, key_documents = documents
        allowed = (query_documents[:, rows, None] == key_documents[:, None, :keys]).unsqueeze(1)
    if window is not None:
        near = window.query_index[rows, None] - window.key_index[None, :keys] < window.size
        allowed = near if allowed is None else allowed & near
    if not causal:
        return allowed
    tril = torch.ones(rows.stop - rows.start, keys, dtype=torch.bool, device=device).tril(rows.start)
    return tril if allowed is None else allowed & tril


def _grouped(kv: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """K or V repeated to `q`'s heads (each KV head serves q.shape[1] // kv.shape[1] consecutive ones)."""
    return kv.repeat_interleave(q.shape[1] // kv.shape[1], dim=1)


def _summed_over_groups(grad: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
    """The gradient of `_grouped(kv, q)` taken back to `kv`'s heads."""
    return grad.unflatten(1, (kv.shape[1], -1)).sum(2)


def _probabilities(
    queries: torch.Tensor, keys: torch.Tensor, allowed: torch.Tensor | None, lse: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 softmax of `queries` against `keys` (fp32, all the query heads') where `allowed` (`_visible`),
    normalised by `lse` (else their own), and that lse."""
    scores = queries.float() @ keys.transpose(-1, -2) * queries.shape[-1] ** -0.5
    if allowed is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))
    lse = scores.logsumexp(-1) if lse is None else lse
    safe = lse.masked_fill(lse == float("-inf"), 0)
    return (scores - safe.unsqueeze(-1)).exp(), lse


def fused_kernel_takes_kv_groups(device_type: str, dtype: torch.dtype, capability: tuple | None) -> bool:
    """Whether SDPA's fused kernel takes fewer K/V heads than query heads (`enable_gqa`): the CPU's flash
    kernel does; on CUDA (torch 2.13) only flash (fp16/bf16, sm80+). Elsewhere `enable_gqa` means the math
    kernel and its (batch, heads, seq, seq) scores: the K/V heads are repeated for the mem-efficient one."""
    gpu_flash = dtype in (torch.float16, torch.bfloat16) and capability is not None and capability >= (8, 0)
    return device_type != "cuda" or gpu_flash
