"""The pipeline engines (`parallelism.pp_engine`) as records: the facts the rules, the memory estimate and
the advice read (whether an engine interleaves model chunks, whether it splits backward, its bubble), kept
with the name. The schedules themselves are in parallel/pipeline/schedules.py, keyed by the same name."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


def _fill_and_drain(pp: int, micro_batches: int, virtual_stages: int) -> float:
    """Fill and drain take pp - 1 stage-steps, which interleaving shortens by its number of virtual stages
    (AFAB and 1F1B idle alike; 1F1B holds fewer activations)."""
    idle = (pp - 1) / virtual_stages
    return idle / (micro_batches + idle)


def _zero_bubble_h1(pp: int, micro_batches: int, virtual_stages: int) -> float:
    """Forward, B and W taking a third of a stage-step each: a step spans 3m + pp - 1 thirds, and at least
    2m + 2pp - 1 (the first micro-batch's forward and B through every stage, then the rest's F and B on the
    first stage, then its last W)."""
    thirds = max(3 * micro_batches + pp - 1, 2 * micro_batches + 2 * pp - 1)
    return 1 - 3 * micro_batches / thirds


@dataclass(frozen=True, kw_only=True)
class Engine:
    name: str  # parallelism.pp_engine
    interleaves: bool  # several model chunks per pp rank (parallelism.pp_virtual_stages >= 2)
    splits_backward: bool  # each backward split into B and W (parallel/split_backward.py)
    # The share of a step a pipeline stage idles in theory (P2), from pp, micro-batches and virtual stages.
    bubble: Callable[[int, int, int], float]


ENGINES = {
    engine.name: engine
    for engine in (
        Engine(name="1f1b", interleaves=False, splits_backward=False, bubble=_fill_and_drain),
        Engine(name="afab", interleaves=False, splits_backward=False, bubble=_fill_and_drain),
        Engine(name="interleaved-1f1b", interleaves=True, splits_backward=False, bubble=_fill_and_drain),
        Engine(name="zb-h1", interleaves=False, splits_backward=True, bubble=_zero_bubble_h1),
    )
}
