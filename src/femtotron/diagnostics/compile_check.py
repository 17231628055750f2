"""model.compile: what it needs (a C++ compiler on CPUs, checked before any work) and what it cost."""

from __future__ import annotations

from femtotron.errors import ConfigError


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
