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


def on_this_cpu(x: torch.Tensor) -> bool:
    return x.device.type == "cpu" or (x.is_meta and ESTIMATING_FOR_THIS_CPU.get())


def emulated_low_precision(x: torch.Tensor) -> bool:
    """True for bf16/fp16 tensors on a CPU without bf16 matrix units. PyTorch emulates their matmuls there
    (~70x fp32's time for a linear layer, 2-4x for attention, on an AVX2 CPU); fp32 gives what a GPU tensor
    core computes anyway (low-precision inputs, fp32 accumulation, output rounded back) at fp32 speed."""
    return x.dtype != torch.float32 and on_this_cpu(x) and not native_on_cpu


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    if emulated_low_precision(x):
        fp32_bias = None if bias is None else bias.float()
        return F.linear(x.float(), weight.float(), fp32_bias).to(x.dtype)
    return F.linear(x, weight, bias)


def linear_weight_gradient(x: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """The gradient of `linear`'s weight from its input and its output's gradient: grad^T x over every token
    (parallel/split_backward.py computes it apart from the input's gradient)."""
    if emulated_low_precision(x):
        return linear_weight_gradient(x.float(), grad.float()).to(x.dtype)
    return grad.reshape(-1, grad.shape[-1]).t() @ x.reshape(-1, x.shape[-1])


# torch._grouped_mm exists from torch 2.8 (CUDA only), with a CPU kernel from 2.9.
GROUPED_MM = tuple(int(part) for part in torch.__version__.split(".")[:2]) >= (2, 9)


def grouped_mm_on_gpu(dtype: torch.dtype, capability: tuple[int, int]) -> bool:
    """Whether torch's grouped GEMM is right and sync-free on this GPU: bf16 on sm90 only. Its CUTLASS kernel
    (aten/src/ATen/native/cuda/GroupedBlas.cpp) runs on sm90 and sm100, but on sm100 gives experts without
    rows gradients (pytorch#172439); elsewhere (sm80 too) torch loops over matmuls after reading the offsets
    to the host, in forward and both backward products: three syncs where grouped_linear's loop makes one."""
    return dtype == torch.bfloat16 and capability == (9, 0)


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """Rows [ends[g - 1], ends[g]) of `x` times weight[g]^T for each group g (a layer's experts) in one
    grouped GEMM: on CPUs in any dtype, on the GPUs of `grouped_mm_on_gpu` (and the meta device) in bf16;
    elsewhere (and for rows not a multiple of 16 bytes) a loop over the groups."""
    if emulated_low_precision(x):
        return grouped_linear(x.float(), weight.float(), ends).to(x.dtype)
    if _grouped_mm_runs(x, weight.shape[-2:]):
        out = torch._grouped_mm(x, weight.transpose(-2, -1), offs=_offsets(ends, x))
        if out.requires_grad:  # its backward takes only a contiguous gradient
            out.register_hook(torch.Tensor.contiguous)
        return out
    return torch.cat([F.linear(part, w) for part, w in zip(x.split(_rows(ends)), weight, strict=True)])


def grouped_linear_weight_gradient(x: torch.Tensor, grad: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """The gradient of `grouped_linear`'s weight: weight[g]'s is grad^T x over group g's rows (zero for a
    group without rows), through the same kernels."""
    if emulated_low_precision(x):
        return grouped_linear_weight_gradient(x.float(), grad.float(), ends).to(x.dtype)
    if _grouped_mm_runs(x, (grad.shape[-1], x.shape[-1])):
        return torch._grouped_mm(grad.t(), x, offs=_offsets(ends, x))
    rows = _rows(ends)
    parts = zip(grad.split(rows), x.split(rows), strict=True)
    return torch.stack([part_grad.t() @ part for part_grad, part in parts])


def _grouped_mm_runs(x: torch.Tensor, weight_dims: tuple[int, ...]) -> bool:
    """Whether torch's grouped GEMM takes `x` and a (groups, *weight_dims) weight: see grouped_linear."""
    aligned = all(n * x.element_size() % 16 == 0 for n in weight_dims)  # the kernel's rule
    on_gpu = x.is_cuda and grouped_mm_on_gpu(x.dtype, torch.cuda.get_device_capability(x.device))
    as_on_gpu = x.is_meta and x.dtype == torch.bfloat16  # memory estimates
    return GROUPED_MM and aligned and (x.device.type == "cpu" or as_on_gpu or on_gpu)


def _offsets(ends: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return ends.to(device=x.device, dtype=torch.int32)


def _rows(ends: torch.Tensor) -> list[int]:
    """Each group's rows, for the loop: it slices on the host (one device-to-host read of the ends)."""
    return torch.diff(ends.cpu(), prepend=torch.zeros(1, dtype=ends.dtype)).tolist()


def attention_dtype(q: torch.Tensor) -> torch.dtype:
    """What attention computes in: bf16/fp16 on GPUs and on CPUs whose attention kernel runs them fast."""
    if q.dtype != torch.float32 and on_this_cpu(q) and not (native_on_cpu and CPU_ATTENDS_IN_BF16):
        return torch.float32
    return q.dtype


def tf32_for_fp32(device: torch.device, dtype: torch.dtype) -> None:
    """fp32 runs on CUDA multiply in TF32 (fp32's range, 10-bit mantissa inputs, 7-8x plain fp32's rate on
    A100/H100), unless NVIDIA_TF32_OVERRIDE=0, which NVIDIA's libraries read too."""
    if device.type == "cuda" and dtype == torch.float32 and os.environ.get("NVIDIA_TF32_OVERRIDE") != "0":
        # The setting torch's own code still reads (torch.get_float32_matmul_precision); CUDA only, unlike
        # torch.set_float32_matmul_precision, which also changes CPU (oneDNN) matmuls.
        torch.backends.cuda.matmul.allow_tf32 = True
