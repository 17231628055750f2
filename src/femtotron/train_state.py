"""Where a run is (what a checkpoint records besides tensors), and the parts checkpoints and reports get."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

from tokenizers import Tokenizer

from femtotron.config import Config
from femtotron.data.stages import DataStages, StageStart
from femtotron.layout import RankModel
from femtotron.optim.loss_scale import DynamicLossScaler
from femtotron.optim.lr_schedule import lr_at
from femtotron.optim.zero import ZeroOptimizer
from femtotron.parallel.context import ParallelContext
from femtotron.run_log import RunLog


@dataclass(kw_only=True)
class TrainState:
    scaler: DynamicLossScaler  # fp16's dynamic loss scale (disabled, scale 1, for bf16 and fp32)
    step: int = 0  # optimizer steps done (skipped ones included: the schedule and the data moved on)
    consumed_samples: int = 0  # global samples read: where the data continues
    stages: list[StageStart] = field(default_factory=list)  # the data stages entered (data/stages.py)
    consumed_tokens: int = 0  # target tokens that counted in the loss
    non_finite_skips: int = 0  # steps dropped with optimizer.on_non_finite=skip
    lr_schedule_start: int = 0  # the step the lr schedule counts from (checkpoints.load_lr_scheduler=false)
    # (step, lr, grad norm) of the last applied steps: the history a divergence report shows
    recent: deque[tuple[int, float, float]] = field(default_factory=lambda: deque(maxlen=10))

    def state_dict(self) -> dict[str, Any]:
        """JSON-ready; the checkpoint manifest's keys (format version 1)."""
        return {
            "step": self.step,
            "consumed_samples": self.consumed_samples,
            "data_stages": [stage.to_dict() for stage in self.stages],
            "consumed_tokens": self.consumed_tokens,
            "non_finite_skips": self.non_finite_skips,
            "recent": [list(r) for r in self.recent],
            "lr_schedule": {
                "last_lr": self.recent[-1][1] if self.recent else None,
                "start": self.lr_schedule_start,
            },
            "loss_scale": self.scaler.state_dict(),
        }

    def lr(self, config: Config) -> float:
        """The learning rate of the next step, on the schedule counted from `lr_schedule_start`."""
        start = self.lr_schedule_start
        sched = config.optimizer.learning_rate_scheduler
        return lr_at(self.step - start, sched, config.tokens.train_steps - start)

    def load_state_dict(self, state: dict[str, Any], loss_scale: bool) -> None:
        """Restore the counters; the loss scale only with `loss_scale` (an fp16 run resuming an fp16
        checkpoint: a bf16 or fp32 run's scale is 1, which would be fp16's minimum)."""
        self.step = int(state["step"])
        self.consumed_samples = int(state["consumed_samples"])
        self.stages = [StageStart.from_dict(record) for record in state.get("data_stages", [])]
        self.consumed_tokens = int(state.get("consumed_tokens", 0))
        self.non_finite_skips = int(state.get("non_finite_skips", 0))
        self.lr_schedule_start = int(state.get("lr_schedule", {}).get("start", 0))
        self.recent = deque((tuple(r) for r in state.get("recent", [])), maxlen=self.recent.maxlen)
        if loss_scale and state.get("loss_scale"):
            self.scaler.load_state_dict(state["loss_scale"])


@dataclass(kw_only=True)
class TrainingParts:
    """What a checkpoint saves and restores and the start report describes, handed over by whoever trains."""

    config: Config
    ctx: ParallelContext
    model: RankModel
    optimizer: ZeroOptimizer
    state: TrainState
    data: DataStages  # the identity of the stage a checkpoint is in is recorded, and compared on resume
    log: RunLog
    tokenizer: Tokenizer | None = None  # saved beside the tensors: a checkpoint is self-contained
