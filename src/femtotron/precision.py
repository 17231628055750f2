"""Where low-precision matmuls really run in low precision, and where they are upcast."""

from __future__ import annotations

import os
from contextvars import ContextVar
from pathlib import Path

import torch
import torch.nn.functional as F


def cpu_flags() -> str:
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""  # not Linux: no way to tell


def cpu_has_bf16_matmul(flags: str | None = None) -> bool:
    """Whether this CPU multiplies bf16 in hardware (AVX512-BF16 or AMX); without it bf16 is emulated."""
    flags = cpu_flags() if flags is None else flags
    return not flags or "avx512_bf16" in flags or "amx_bf16" in flags


# Whether bf16/fp16 matmuls run natively on this CPU: read once from /proc/cpuinfo, and forced either way
# by the tests (tests/helpers.py `cpu_low_precision_path`: both paths on every machine). A module attribute,
# not a ContextVar, so that torch.compile reads it while tracing (and guards on it) instead of breaking the
# graph there.
CPU_FLAGS = cpu_flags()
CPU_MULTIPLIES_BF16 = cpu_has_bf16_matmul(CPU_FLAGS)
# Without AMX, the CPU flash-attention kernel's bf16 backward takes 2.6-6x its fp32 time (AVX512-BF16 EPYC,
# torch 2.13, bench/throughput.py's shapes; the forward is as fast): attention is upcast there too.
CPU_ATTENDS_IN_BF16 = not CPU_FLAGS or "amx_bf16" in CPU_FLAGS
native_on_cpu = CPU_MULTIPLIES_BF16

# Memory estimates run the model on the meta device; set while estimating for this CPU, so that they
# make the same fp32 copies the CPU run makes (diagnostics/memory.py).
ESTIMATING_FOR_THIS_CPU: ContextVar[bool] = ContextVar("estimating_for_cpu", default=False)


# The CPU's flash-attention kernels, which also return (and take) the log-sum-exp.
_CPU_FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_CPU_FLASH_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def on_this_cpu(x: torch.Tensor) -> bool:
    return x.device.type == "cpu" or (x.is_meta and ESTIMATING_FOR_THIS_CPU.get())


def emulated_low_precision(x: torch.Tensor) -> bool:
    """True for bf16/fp16 tensors on a CPU without bf16 matrix units. PyTorch emulates their matmuls there
    (~70x fp32's time for a linear layer, 2-4x for attention, on an AVX2 CPU); fp32 gives what a GPU tensor
    core computes anyway (low-precision inputs, fp32 accumulation, output rounded back) at fp32 speed."""
    return x.dtype != torch.float32 and on_this_cpu(x) and not native_on_cpu


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    if emulated_low_precision(x):
        return F.linear(x.float(), weight.float()).to(x.dtype)
    return F.linear(x, weight)


# torch._grouped_mm exists from torch 2.8 (CUDA only), with a CPU kernel from 2.9.
GROUPED_MM = tuple(int(part) for part in torch.__version__.split(".")[:2]) >= (2, 9)


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """Rows [ends[g - 1], ends[g]) of `x` times weight[g]^T for each group g (a layer's experts) in one
    grouped GEMM: on CPUs in any dtype, on Hopper and later GPUs (and the meta device) in bf16, which is what
    torch's kernel takes there; elsewhere (and for rows not a multiple of 16 bytes) a loop over the groups."""
    if emulated_low_precision(x):
        return grouped_linear(x.float(), weight.float(), ends).to(x.dtype)
    aligned = all(n * x.element_size() % 16 == 0 for n in weight.shape[-2:])  # the kernel's rule
    hopper = x.is_meta or x.is_cuda and torch.cuda.get_device_capability(x.device) >= (9, 0)
    if GROUPED_MM and aligned and (x.device.type == "cpu" or x.dtype == torch.bfloat16 and hopper):
        out = torch._grouped_mm(x, weight.transpose(-2, -1), offs=ends.to(device=x.device, dtype=torch.int32))
        if out.requires_grad:  # its backward takes only a contiguous gradient
            out.register_hook(torch.Tensor.contiguous)
        return out
    rows = torch.diff(ends.cpu(), prepend=ends.new_zeros(1).cpu()).tolist()
    return torch.cat([F.linear(part, w) for part, w in zip(x.split(rows), weight, strict=True)])


def attention_dtype(q: torch.Tensor) -> torch.dtype:
    """What attention computes in: bf16/fp16 on GPUs and on CPUs whose attention kernel runs them fast."""
    if q.dtype != torch.float32 and on_this_cpu(q) and not (native_on_cpu and CPU_ATTENDS_IN_BF16):
        return torch.float32
    return q.dtype


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True) -> torch.Tensor:
    """`causal` False: every query sees every key (one new position against a generation's cache)."""
    dtype = attention_dtype(q)
    return _causal_attention(q.to(dtype), k.to(dtype), v.to(dtype), causal).to(q.dtype)


def _causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
    # Memory estimates: keep what a fused kernel keeps (output, log-sum-exp), as on GPUs and CPUs.
    if q.is_meta:
        return _CPU_FLASH(q, k, v, 0.0, True)[0]
    groups = q.shape[1] // k.shape[1]
    capability = torch.cuda.get_device_capability(q.device) if q.is_cuda else None
    if groups > 1 and not fused_kernel_takes_kv_groups(q.device.type, q.dtype, capability):
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=k.shape[1] != q.shape[1])


def attention_with_lse(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, allowed: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """One block of attention (k, v with the KV heads) and its fp32 log-sum-exp per query (-inf: sees no key);
    `allowed`: which query sees which key, (batch, 1, queries, keys). On CPUs the flash kernel (its backward
    takes the output and lse of all blocks merged: ring attention), elsewhere `math_attention_with_lse`."""
    if on_this_cpu(q):
        mask = None if allowed is None else _additive(allowed, q.dtype)
        out, lse = _CPU_FLASH(q, k, v, 0.0, causal, attn_mask=mask)
        if allowed is not None:  # the kernel gives a query that sees nothing a log-sum-exp of 0
            seen = _visible(allowed, causal, slice(0, q.shape[-2]), k.shape[-2], q.device).any(-1)
            lse = lse.masked_fill(~seen, float("-inf"))
        return out, lse
    return math_attention_with_lse(q, k, v, causal, allowed)


def attention_with_lse_backward(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    causal: bool,
    allowed: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients of one block's q, k, v, given the output and log-sum-exp of every block together."""
    if on_this_cpu(q):
        mask = None if allowed is None else _additive(allowed, q.dtype)
        return _CPU_FLASH_BACKWARD(grad_out, q, k, v, out, lse, 0.0, causal, attn_mask=mask)
    return math_attention_with_lse_backward(grad_out, q, k, v, out, lse, causal, allowed)


def math_attention_with_lse(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, allowed: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """`attention_with_lse` written out, SCORES_PER_CHUNK query rows' scores at a time."""
    outs, lses = [], []
    for rows in _row_chunks(q, k):
        probabilities, lse = _probabilities(q[:, :, rows], k, causal, allowed, rows)
        outs.append((probabilities @ _grouped(v, q).float()).to(q.dtype))
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
    allowed: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Flash attention's backward by autograd, a chunk of query rows at a time: with the softmax normalised by
    the merged `lse` (held fixed), the scores' gradient P * (dP - rowsum(dO * O)) is that of
    dO . (P V) - rowsum(dO * O) . rowsum(P)."""
    keys = [t.detach().float().requires_grad_() for t in (k, v)]  # their gradients add up over the chunks
    grad_q = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    for rows in _row_chunks(q, k):
        grad = grad_out[:, :, rows].float()
        delta = (grad * out[:, :, rows].float()).sum(-1, keepdim=True)
        with torch.enable_grad():
            queries = q[:, :, rows].detach().float().requires_grad_()
            probabilities, _ = _probabilities(queries, keys[0], causal, allowed, rows, lse[:, :, rows])
            weighted = probabilities @ _grouped(keys[1], q)
            ((grad * weighted).sum() - (delta * probabilities).sum()).backward()
        grad_q[:, :, rows] = queries.grad
    return grad_q.to(q.dtype), keys[0].grad.to(k.dtype), keys[1].grad.to(v.dtype)


# The written-out blocks hold (batch, heads, rows, keys) fp32 scores: at most this many at once (256 MiB).
SCORES_PER_CHUNK = 2**26


def _row_chunks(q: torch.Tensor, k: torch.Tensor) -> list[slice]:
    rows = max(1, SCORES_PER_CHUNK // (q.shape[0] * q.shape[1] * k.shape[-2]))
    return [slice(first, min(first + rows, q.shape[-2])) for first in range(0, q.shape[-2], rows)]


def _additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.zeros((), dtype=dtype, device=allowed.device).masked_fill(~allowed, float("-inf"))


def _visible(
    allowed: torch.Tensor | None, causal: bool, rows: slice, keys: int, device: torch.device
) -> torch.Tensor | None:
    """Which query of `rows` sees which key: `allowed` (None: all), causally up to its own position."""
    allowed = None if allowed is None else allowed[..., rows, :]
    if not causal:
        return allowed
    tril = torch.ones(rows.stop - rows.start, keys, dtype=torch.bool, device=device).tril(rows.start)
    return tril if allowed is None else allowed & tril


def _grouped(kv: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    return kv.repeat_interleave(q.shape[1] // kv.shape[1], dim=1)


def _probabilities(
    queries: torch.Tensor,
    k: torch.Tensor,
    causal: bool,
    allowed: torch.Tensor | None,
    rows: slice,
    lse: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 softmax of `queries` (the block's `rows`), normalised by `lse` (else their own), and that lse."""
    scores = queries.float() @ _grouped(k, queries).float().transpose(-1, -2) * queries.shape[-1] ** -0.5
    allowed = _visible(allowed, causal, rows, k.shape[-2], queries.device)
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


def tf32_for_fp32(device: torch.device, dtype: torch.dtype) -> None:
    """fp32 runs on CUDA multiply in TF32 (fp32's range, 10-bit mantissa inputs, 7-8x plain fp32's rate on
    A100/H100), unless NVIDIA_TF32_OVERRIDE=0, which NVIDIA's libraries read too."""
    if device.type == "cuda" and dtype == torch.float32 and os.environ.get("NVIDIA_TF32_OVERRIDE") != "0":
        # The setting torch's own code still reads (torch.get_float32_matmul_precision); CUDA only, unlike
        # torch.set_float32_matmul_precision, which also changes CPU (oneDNN) matmuls.
        torch.backends.cuda.matmul.allow_tf32 = True
