"""model.compile: each decoder layer through torch.compile (TorchInductor: C++ kernels on CPUs, Triton on
GPUs), so that its elementwise work (RMSNorm, rotary, SiLU, residual adds, casts) runs as fused kernels.

A layer's tp collectives cut it into compiled regions (tensor_parallel._conjugates), because a collective
inside a graph would have to be traced and ordered by the compiler on every rank alike. At tp = 1 the last
stage's norm, LM head and loss are compiled too; at tp > 1 they are collectives around little compute.

Everything else stays eager: the embedding, the pipeline, the dp buckets, ZeRO, recomputation, MoE routing
(data-dependent shapes) and checkpoints. They see the same modules and parameter names as without compiling,
so a checkpoint, a resume or a layout change does not care whether the run was compiled.

Shapes are static (every micro-batch of a run has the same), so a layer compiles once at its first call
with gradients (step 1), once more at its first without (validation), and never again. The compilers it
needs are checked before the model is built, since without them the first step would fail deep inside
torch after minutes of start-up.
"""

from __future__ import annotations

import importlib.util
import os
import shutil

import torch
from torch import nn

from femtotron.errors import ConfigError


def compile_layers(chunks: list[nn.Module], device: torch.device) -> None:
    """Mark each decoder layer of this rank's model chunks for compiling at its first call."""
    if device.type == "cpu":
        require_cpp_compiler()
    elif device.type == "cuda":
        require_gpu_compilers()
    for chunk in chunks:
        for layer in chunk.layers.values():
            layer.compile(dynamic=False)
        if chunk.stage.head and chunk.tp.size == 1:  # at tp > 1 the loss is collectives around little compute
            chunk.head_loss = torch.compile(chunk.head_loss, dynamic=False)


def c_compiler_for_triton() -> str | None:
    """The C compiler Triton builds its kernel launchers with at the first compiled step, found as Triton
    finds it: $CC, else gcc, else clang (None: none)."""
    return os.environ.get("CC") or shutil.which("gcc") or shutil.which("clang")


def require_gpu_compilers() -> None:
    """Inductor writes Triton kernels for GPUs, and Triton compiles a small C launcher for them: without
    either, the first step would fail deep inside torch, after the model was built."""
    if importlib.util.find_spec("triton") is None:
        raise ConfigError(
            "model.compile=true on a GPU needs Triton (TorchInductor writes the layers as Triton kernels), "
            "and it is not installed for this Python: install the version your torch build pins (torch's "
            "CUDA wheels bring it: `pip install torch` from PyTorch's CUDA index), or set model.compile=false"
        )
    if c_compiler_for_triton() is None:
        raise ConfigError(
            "model.compile=true on a GPU needs a C compiler (Triton builds each kernel's launcher with it), "
            "and none is here ($CC is unset and neither gcc nor clang is on PATH). Install one (e.g. `apt "
            "install gcc`) or point CC at it, or set model.compile=false"
        )


def require_cpp_compiler() -> None:
    """Inductor writes C++ for CPUs: without a compiler the first step would fail deep inside torch."""
    from torch._inductor import config, cpp_builder, exc

    try:
        cpp_builder.get_cpp_compiler()
    except exc.InvalidCxxCompiler:
        tried = ", ".join(c for c in config.cpp.cxx if c)
        raise ConfigError(
            f"model.compile=true needs a C++ compiler on the CPU (TorchInductor compiles the layers to C++), "
            f"and none runs here (tried: {tried}; set CXX to choose one). Install one (e.g. `apt install "
            "g++`), or set model.compile=false"
        ) from None
