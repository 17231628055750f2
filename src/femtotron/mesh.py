"""The mesh of ranks: which parallel dimensions there are, in which order ranks are laid out over them, and
the arithmetic between a rank and its place. Everything that knows the layout derives it from here.

Ranks are laid out over `LAYOUT`, outermost first: `rank = ((pp_rank * dp + dp_rank) * cp + cp_rank) * tp +
tp_rank`. Tensor parallelism is innermost so that a tp group is consecutive ranks: one host, the fastest
links, for the collectives inside every layer. Context parallelism comes next, because its ring sends a
block of keys and values at every attention step. Pipeline parallelism is outermost: it sends one
activation per micro-batch and tolerates the slowest links.

Expert parallelism is not a dimension of its own. It carves the dp x cp ranks that hold the same dense
parameters into groups of ep consecutive ones that share out the experts (ep groups), and the ranks at the
same place in each such group hold the same experts (edp groups). So ep must divide dp * cp, and adding ep
changes no rank's place.

A new dimension is a name in `LAYOUT` (and `NAMED`, and `ADDED_LATER` so older checkpoints load), its size
in the config, and the layers that use it; ranks, groups, links, log prefixes and layout listings follow.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import product
from typing import Protocol

# The rank layout, outermost dimension first.
LAYOUT = ("pp", "dp", "cp", "tp")
# The order people name the dimensions in, in configs (nanotron's) and in every message and log prefix.
NAMED = ("dp", "cp", "ep", "tp", "pp")
# The dimensions whose sizes multiply to the number of processes, in the order people name them.
WORLD_DIMENSIONS = tuple(name for name in NAMED if name != "ep")
# Dimensions added after the first checkpoints were written: absent from an older manifest, they were 1
# there; and a message leaves them out while they are 1, as most runs never use them.
ADDED_LATER = ("cp", "ep")


class HasMeshSizes(Protocol):
    """What a mesh is read from: the config's parallelism section, or a checkpoint manifest's mesh."""

    dp: int
    cp: int
    tp: int
    pp: int
    ep: int


@dataclass(frozen=True, kw_only=True)
class MeshCoordinates:
    """A rank's place on every dimension, in layout order."""

    pp_rank: int
    dp_rank: int
    cp_rank: int
    tp_rank: int


@dataclass(frozen=True, kw_only=True)
class Mesh:
    """The size of each dimension, and ep (see the module docstring)."""

    pp: int = 1
    dp: int = 1
    cp: int = 1
    tp: int = 1
    ep: int = 1

    @classmethod
    def of(cls, sizes: HasMeshSizes) -> Mesh:
        return cls(**{name: getattr(sizes, name) for name in NAMED})

    def size(self, dimension: str) -> int:
        return getattr(self, dimension)

    @property
    def world_size(self) -> int:
        return math.prod(self.size(dimension) for dimension in LAYOUT)

    def rank_of(self, at: MeshCoordinates) -> int:
        rank = 0
        for dimension in LAYOUT:
            rank = rank * self.size(dimension) + getattr(at, f"{dimension}_rank")
        return rank

    def coordinates_of(self, rank: int) -> MeshCoordinates:
        place = {}
        for dimension in reversed(LAYOUT):
            place[f"{dimension}_rank"] = rank % self.size(dimension)
            rank //= self.size(dimension)
        return MeshCoordinates(**place)

    def describe(self) -> str:
        """`dp=2 tp=2 pp=1`: the dimensions of the world size by name, those added later only where used."""
        shown = [name for name in WORLD_DIMENSIONS if name not in ADDED_LATER or self.size(name) > 1]
        return " ".join(f"{name}={self.size(name)}" for name in shown)

    def groups(self) -> dict[str, list[tuple[int, ...]]]:
        """Every group of each kind, as its ranks: the ranks that differ only in the kind's dimensions.

        dp_cp: the ranks holding the same parameters (gradients summed, ZeRO-1 sharded over it). mp: every
        rank holding a piece of one model replica (their squared norms add up to the replica's). embedding:
        the first and the last pipeline stage of each (dp, cp, tp) place, which share a tied embedding.
        """
        kinds = {
            "tp": ["tp"],
            "cp": ["cp"],
            "dp": ["dp"],
            "dp_cp": ["dp", "cp"],
            "pp": ["pp"],
            "mp": ["pp", "tp"],
        }
        groups = {kind: self._spans(varying) for kind, varying in kinds.items()}
        groups["embedding"] = [tuple(sorted({ranks[0], ranks[-1]})) for ranks in groups["pp"]]
        if self.ep > 1:
            groups["ep"] = [
                ranks[start : start + self.ep]
                for ranks in groups["dp_cp"]
                for start in range(0, len(ranks), self.ep)
            ]
            groups["edp"] = [
                ranks[offset :: self.ep] for ranks in groups["dp_cp"] for offset in range(self.ep)
            ]
        return groups

    def _points(self, dimensions: list[str]) -> list[dict[str, int]]:
        ranges = [range(self.size(dimension)) for dimension in dimensions]
        return [dict(zip(dimensions, at, strict=True)) for at in product(*ranges)]

    @staticmethod
    def _coordinates(place: dict[str, int]) -> MeshCoordinates:
        return MeshCoordinates(**{f"{dimension}_rank": place[dimension] for dimension in LAYOUT})

    def _spans(self, varying: list[str]) -> list[tuple[int, ...]]:
        """The groups of ranks that differ only along `varying`, each in rank order."""
        fixed = [dimension for dimension in LAYOUT if dimension not in varying]
        spans = []
        for held in self._points(fixed):
            places = [held | moving for moving in self._points(varying)]
            ranks = [self.rank_of(self._coordinates(at)) for at in places]
            spans.append(tuple(sorted(ranks)))
        return sorted(spans)

    def subgroups_by_kind(self) -> dict[str, list[tuple[int, ...]]]:
        """The rank sets needing a process group (with NCCL, a communicator and its GPU memory) of their own,
        by kind in creation order: each distinct set once, under the first kind that has it; none of one
        rank, none of the whole world (the default group). A kind's sets are disjoint, so one split creates
        them all."""
        created: set[tuple[int, ...]] = set()
        by_kind = {}
        for kind, groups in self.groups().items():
            fresh = [ranks for ranks in groups if 1 < len(ranks) < self.world_size and ranks not in created]
            created.update(fresh)
            if fresh:
                by_kind[kind] = fresh
        return by_kind

    def subgroups(self) -> list[tuple[int, ...]]:
        """`subgroups_by_kind`'s sets, in creation order."""
        return [ranks for sets in self.subgroups_by_kind().values() for ranks in sets]

    def pipe_links(self) -> list[tuple[int, int]]:
        """The one-way links between neighbouring pipeline stages, as (from, to) ranks, in creation order:
        both ways between stages p and p + 1, and between the last stage and the first (interleaved
        schedules send from the last stage's chunk to the first stage's next chunk)."""
        neighbours = {(stage, stage + 1) for stage in range(self.pp - 1)}
        if self.pp > 2:
            neighbours.add((self.pp - 1, 0))
        return [
            (pipeline[sender], pipeline[receiver])
            for pipeline in self.groups()["pp"]
            for first, second in sorted(neighbours)
            for sender, receiver in ((first, second), (second, first))
        ]

    def ring_links(self) -> list[tuple[int, int]]:
        """The one-way links of each context-parallel ring, as (from, to): cp rank c sends to c + 1 mod cp."""
        if self.cp == 1:
            return []
        return [(ring[c], ring[(c + 1) % self.cp]) for ring in self.groups()["cp"] for c in range(self.cp)]
