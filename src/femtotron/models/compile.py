"""model.compile: each decoder layer through torch.compile (TorchInductor: C++ kernels on CPUs, Triton on
GPUs), so its elementwise work (RMSNorm, rotary, SiLU, residual adds, casts) runs as fused kernels.

A layer's tp collectives cut it into compiled regions (tensor_parallel._between_compiled_regions); the
embedding, the LM head and the loss stay eager, and so do the pipeline, dp buckets, ZeRO, recomputation and
checkpoints, which see the same modules and parameter names as without compiling. Shapes are static (every
micro-batch of a run has the same), so a layer compiles once at its first call with gradients (step 1),
once more at its first without (validation), and never again.
"""

from __future__ import annotations

import torch
from torch import nn

from femtotron.errors import ConfigError


def compile_layers(chunks: list[nn.Module], device: torch.device) -> None:
    """Mark each decoder layer of this rank's model chunks for compiling at its first call."""
    if device.type == "cpu":
        require_cpp_compiler()
    for chunk in chunks:
        for layer in chunk.layers.values():
            layer.compile(dynamic=False)


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


def compile_report() -> str:
    """What compiling has cost this process so far: Dynamo and Inductor for the forward graphs, and for the
    backward graphs, which are compiled at their first backward."""
    from torch._dynamo.utils import compilation_time_metrics, counters

    phases = ("_compile.compile_inner", "backward._backward_impl")
    seconds = sum(sum(compilation_time_metrics.get(phase, [])) for phase in phases)
    return f"model.compile: {counters['stats']['unique_graphs']} graphs compiled in {seconds:.1f} s"
