"""ZeRO's stages as records: what each shards over the dp x cp replicas. Code asks the record
(`config.optimizer.zero.shards_gradients`), never compares stage numbers, so a new variant (HSDP, offload)
is one record here and the branches that read its new fact."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class ZeroStage:
    number: int  # optimizer.zero_stage
    shards_optimizer: bool  # fp32 master weights and optimizer moments: each replica keeps its own shard
    shards_gradients: bool  # the summed gradients: only the owned shard outlives the reduction
    shards_parameters: bool  # the parameters: gathered while a unit runs (parallel/fully_sharded.py)
    sharded: str  # what it shards, for messages
    adds: str  # what it shards beyond the stage before, for messages that list the stages

    @property
    def name(self) -> str:
        return f"ZeRO-{self.number}" if self.number else "no ZeRO"


# Indexed by number (`OptimizerArgs.zero` reads ZERO_STAGES[zero_stage]), each stage sharding all the one
# before it does.
ZERO_STAGES = (
    ZeroStage(
        number=0,
        shards_optimizer=False,
        shards_gradients=False,
        shards_parameters=False,
        sharded="nothing",
        adds="nothing",
    ),
    ZeroStage(
        number=1,
        shards_optimizer=True,
        shards_gradients=False,
        shards_parameters=False,
        sharded="master weights and Adam moments",
        adds="master weights and Adam moments sharded over dp",
    ),
    ZeroStage(
        number=2,
        shards_optimizer=True,
        shards_gradients=True,
        shards_parameters=False,
        sharded="gradients, master weights and Adam moments",
        adds="the gradients too",
    ),
    ZeroStage(
        number=3,
        shards_optimizer=True,
        shards_gradients=True,
        shards_parameters=True,
        sharded="parameters, gradients, master weights and Adam moments",
        adds="the parameters too",
    ),
)
