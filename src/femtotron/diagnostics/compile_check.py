"""model.compile: what it needs (a C++ compiler on CPUs, Triton and a C compiler on GPUs, checked before
any work) and what it cost."""

from __future__ import annotations

import importlib.util
import os
import shutil

from femtotron.errors import ConfigError


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


def compile_report() -> str:
    """What compiling has cost this process so far: Dynamo and Inductor for the forward graphs, and for the
    backward graphs, which are compiled at their first backward."""
    from torch._dynamo.utils import compilation_time_metrics, counters

    phases = ("_compile.compile_inner", "backward._backward_impl")
    seconds = sum(sum(compilation_time_metrics.get(phase, [])) for phase in phases)
    return f"model.compile: {counters['stats']['unique_graphs']} graphs compiled in {seconds:.1f} s"
