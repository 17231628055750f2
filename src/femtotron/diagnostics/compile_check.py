"""model.compile: what compiling has cost this process, for the start report and the run log."""

from __future__ import annotations


def compile_report() -> str:
    """What compiling has cost this process so far: Dynamo and Inductor for the forward graphs, and for the
    backward graphs, which are compiled at their first backward."""
    from torch._dynamo.utils import compilation_time_metrics, counters

    phases = ("_compile.compile_inner", "backward._backward_impl")
    seconds = sum(sum(compilation_time_metrics.get(phase, [])) for phase in phases)
    return f"model.compile: {counters['stats']['unique_graphs']} graphs compiled in {seconds:.1f} s"
