"""Which decoder layers each pipeline stage holds, balanced by estimated compute.

The embedding sits on the first stage, the final norm + LM head + loss on the last (it needs the
targets). Layers are split into contiguous runs, at least one per stage, so that the most expensive stage
(it sets the pipeline's pace) is as cheap as possible. A large vocabulary's LM head costs about a layer, so
the last stage often gets fewer layers: `num_hidden_layers % pp` need not be 0. With interleaving, virtual
stage s of pp * v runs on pp rank s % pp, as its model chunk s // pp.
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Callable

    from femtotron.config import LlamaConfig

# A stage this much above the mean cost is reported: the others wait for it every micro-batch.
IMBALANCE_WARNING = 0.2


@dataclass(frozen=True, kw_only=True)
class Stage:
    index: int  # virtual stage, 0 .. pp * v - 1
    layers: range
    embedding: bool
    head: bool
    cost: float  # forward FLOPs per token
    parameters: int = 0  # how many parameters it holds (memory, M3); a tied head's copy counts

    def describe(self) -> str:
        first = self.layers.start
        last = self.layers.stop - 1
        parts = ["embedding"] if self.embedding else []
        parts.append(f"layer {first}" if first == last else f"layers {first}-{last}")
        if self.head:
            parts.append("final norm + LM head")
        return " + ".join(parts)


def partition(cfg: LlamaConfig, sequence_length: int, stages: int) -> list[Stage]:
    """Split the layers over `stages` contiguous stages minimising the largest stage cost, exactly, in
    O(stages * log(layers)): no table per layer (1e9 layers would need gigabytes)."""
    n = cfg.num_hidden_layers
    if stages > n:
        raise ValueError(f"{stages} pipeline stages for {n} layers: every stage needs a layer")
    layer = cfg.layer_flops(sequence_length)
    head = cfg.head_flops

    def cost(start: int, stop: int) -> float:
        return (stop - start) * layer + (head if stop == n else 0.0)

    def before(k: int, j: int) -> float:
        """The smallest possible maximum cost of the first j layers as k stages (none holds the head)."""
        return -(-j // k) * layer if k else 0.0

    def start_of(k: int, stop: int) -> int:
        """Where stage k (from 1) ending at `stop` starts: the smallest j minimising max(before(k - 1, j),
        cost(j, stop)), as a dynamic programme over every (stage, layer) pair trying j upwards finds it.
        The first term grows with j, the second shrinks: the minimum is where they cross."""
        low = k - 1  # each earlier stage needs a layer
        high = stop if k > 1 else 1  # the first stage starts at layer 0
        crossing = _first(low, high, lambda j: before(k - 1, j) >= cost(j, stop))
        near = (crossing - 1, crossing)
        slowest = {j: max(before(k - 1, j), cost(j, stop)) for j in near if low <= j < high}
        best = min(slowest.values())
        if slowest.get(crossing - 1) == best:  # below the crossing only the cost counts, which may stay flat
            return _first(low, crossing, lambda j: cost(j, stop) <= best)
        return crossing

    # Walk back from the last stage, which ends at layer n.
    bounds = []
    stop = n
    for k in range(stages, 0, -1):
        start = start_of(k, stop)
        bounds.append((start, stop))
        stop = start
    bounds.reverse()
    emb = cfg.embedding_parameters

    def parameters(start: int, stop: int) -> int:
        held = (stop - start) * cfg.layer_parameters
        if start == 0:
            held += emb
        if stop == n:  # the final norm and the LM head (or the tied copy of the embedding)
            held += cfg.hidden_size + emb
        return held

    return [
        Stage(
            index=s,
            layers=range(start, stop),
            embedding=s == 0,
            head=s == stages - 1,
            cost=cost(start, stop),
            parameters=parameters(start, stop),
        )
        for s, (start, stop) in enumerate(bounds)
    ]


def _first(low: int, high: int, test: Callable[[int], bool]) -> int:
    """The smallest j in [low, high) passing `test` (false, then true, as j grows), or `high`."""
    return low + bisect_left(range(low, high), True, key=test)


def stage_map(stages: list[Stage], pp: int) -> str:
    """The layer-to-stage map for the log."""
    total = sum(s.cost for s in stages)
    lines = ["pipeline stages:"]
    for s in stages:
        place = f"pp rank {s.index % pp}"
        if len(stages) > pp:  # interleaved: name the model chunk too
            place += f", chunk {s.index // pp}"
        share = s.cost / total
        lines.append(
            f"  stage {s.index} ({place}): {s.describe()}, {share:.0%} of the compute, "
            f"{s.parameters / 1e6:.2f}M parameters"
        )
    return "\n".join(lines)
