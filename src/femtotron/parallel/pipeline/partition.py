"""Which decoder layers each pipeline stage holds, balanced by estimated compute.

The embedding always sits on the first stage (it turns token ids into the activations every later
stage receives) and the final norm + LM head + loss on the last (it needs the targets). Layers are
split into contiguous runs, at least one per stage, so that the most expensive stage, which sets the
pace of the whole pipeline, is as cheap as possible. The LM head of a large vocabulary costs about
as much as a layer, so the last stage often gets fewer layers: `num_hidden_layers % pp` need not be 0.

With interleaving there are pp * v virtual stages; virtual stage s runs on pp rank s % pp, as model
chunk s // pp of that rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# A stage this much above the mean cost is reported: the others wait for it every micro-batch.
IMBALANCE_WARNING = 0.2


@dataclass(frozen=True)
class Stage:
    index: int  # virtual stage, 0 .. pp * v - 1
    layers: range
    embedding: bool
    head: bool
    cost: float  # forward FLOPs per token
    parameters: int = 0  # how many parameters it holds (memory, M3); a tied head's copy counts

    def describe(self) -> str:
        parts = (["embedding"] if self.embedding else []) + [
            f"layer {self.layers.start}" if len(self.layers) == 1 else f"layers {self.layers.start}-{self.layers.stop - 1}"
        ] + (["final norm + LM head"] if self.head else [])
        return " + ".join(parts)


def layer_flops(cfg: Any, sequence_length: int) -> float:
    """Forward FLOPs per token of one decoder layer: its matmuls and the causal attention."""
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    attention_weights = cfg.hidden_size * head_dim * (2 * cfg.num_attention_heads + 2 * cfg.num_key_value_heads)
    mlp_weights = 3 * cfg.hidden_size * cfg.intermediate_size
    return 2 * (attention_weights + mlp_weights) + 2 * sequence_length * cfg.hidden_size


def layer_parameters(cfg: Any) -> int:
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    attention = cfg.hidden_size * head_dim * (2 * cfg.num_attention_heads + 2 * cfg.num_key_value_heads)
    return attention + 3 * cfg.hidden_size * cfg.intermediate_size + 2 * cfg.hidden_size


def head_flops(cfg: Any) -> float:
    return 2 * cfg.hidden_size * cfg.vocab_size


def partition(cfg: Any, sequence_length: int, stages: int) -> list[Stage]:
    """Split the layers over `stages` contiguous stages minimising the largest stage cost.

    Exact dynamic programme over (stages, layers): cheap for any real model (a few hundred layers).
    """
    n = cfg.num_hidden_layers
    if stages > n:
        raise ValueError(f"{stages} pipeline stages for {n} layers: every stage needs a layer")
    layer, head = layer_flops(cfg, sequence_length), head_flops(cfg)

    def cost(start: int, stop: int) -> float:
        return (stop - start) * layer + (head if stop == n else 0.0)

    # best[k][i]: the smallest possible maximum cost when the first i layers form k stages.
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for k in range(1, stages + 1):
        for i in range(k, n - (stages - k) + 1):
            for j in range(k - 1, i):
                candidate = max(best[k - 1][j], cost(j, i))
                if candidate < best[k][i]:
                    best[k][i], cut[k][i] = candidate, j
    bounds, i = [], n
    for k in range(stages, 0, -1):
        bounds.append((cut[k][i], i))
        i = cut[k][i]
    bounds.reverse()
    embedding = cfg.vocab_size * cfg.hidden_size

    def parameters(start: int, stop: int) -> int:
        first, last = start == 0, stop == n
        return ((stop - start) * layer_parameters(cfg) + (embedding if first else 0)
                + (cfg.hidden_size + embedding if last else 0))  # final norm + LM head (or the tied copy)

    return [Stage(s, range(a, b), s == 0, s == stages - 1, cost(a, b), parameters(a, b))
            for s, (a, b) in enumerate(bounds)]


def stage_map(stages: list[Stage], pp: int) -> tuple[str, str | None]:
    """The layer-to-stage map for the log, and a warning when one stage is much slower (M3)."""
    total = sum(s.cost for s in stages)
    lines = [f"  stage {s.index} (pp rank {s.index % pp}{f', chunk {s.index // pp}' if len(stages) > pp else ''}): "
             f"{s.describe()}, {s.cost / total:.0%} of the compute, {s.parameters / 1e6:.2f}M parameters"
             for s in stages]
    mean = total / len(stages)
    slowest = max(stages, key=lambda s: s.cost)
    warning = None
    if slowest.cost > (1 + IMBALANCE_WARNING) * mean:
        finer = (f"a larger parallelism.pp_virtual_stages (now {len(stages) // pp})" if len(stages) > pp else
                 "parallelism.pp_engine=interleaved-1f1b with pp_virtual_stages=2")
        warning = (f"pipeline stage {slowest.index} ({slowest.describe()}) costs {slowest.cost / mean:.2f}x the mean "
                   f"stage, and every other stage waits for it on each micro-batch (M3). Finer stages balance better: "
                   f"{finer}, or a num_hidden_layers that leaves room for the LM head on the last stage.")
    return "pipeline stages:\n" + "\n".join(lines), warning
