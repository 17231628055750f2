"""Which decoder layers each pipeline stage holds, balanced by estimated compute.

The embedding sits on the first stage, the final norm + LM head + loss on the last (it needs the
targets). Layers are split into contiguous runs, at least one per stage, so that the most expensive stage
(it sets the pipeline's pace) is as cheap as possible. A large vocabulary's LM head costs about a layer, so
the last stage often gets fewer layers: `num_hidden_layers % pp` need not be 0. With interleaving, virtual
stage s of pp * v runs on pp rank s % pp, as its model chunk s // pp.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
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
    """Split the layers over `stages` contiguous stages minimising the largest stage cost: an exact dynamic
    programme over (stages, layers), cheap for any real model (a few hundred layers)."""
    n = cfg.num_hidden_layers
    if stages > n:
        raise ValueError(f"{stages} pipeline stages for {n} layers: every stage needs a layer")
    layer = cfg.layer_flops(sequence_length)
    head = cfg.head_flops

    def cost(start: int, stop: int) -> float:
        return (stop - start) * layer + (head if stop == n else 0.0)

    # best[k][i]: the smallest possible maximum cost when the first i layers form k stages.
    best = [[float("inf")] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for k in range(1, stages + 1):
        for i in range(k, n - (stages - k) + 1):
            for j in range(k - 1, i):
                candidate = max(best[k - 1][j], cost(j, i))
                if candidate < best[k][i]:
                    best[k][i] = candidate
                    cut[k][i] = j
    # Walk the cuts back from the last stage, which ends at layer n.
    bounds = []
    i = n
    for k in range(stages, 0, -1):
        bounds.append((cut[k][i], i))
        i = cut[k][i]
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
