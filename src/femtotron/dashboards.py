"""TensorBoard and W&B views of the run's records (logging.tensorboard, logging.wandb); metrics.jsonl stays
the source of truth. Only rank 0 writes, and a resumed run continues the same curves."""

from __future__ import annotations

import hashlib
import importlib.util
from typing import Any

import yaml

from femtotron.config import Config
from femtotron.errors import ConfigError

TRAIN_KEYS = ("loss", "lr", "grad_norm", "loss_scale", "skipped_steps")


def tag(key: str) -> str:
    """A record key's name on the dashboards: train/loss, val/loss, memory/peak_allocated_gib, perf/mfu..."""
    for prefix, group in (("mem_", "memory/"), ("val_", "val/")):
        if key.startswith(prefix):
            return group + key.removeprefix(prefix)
    return f"{'train' if key in TRAIN_KEYS else 'perf'}/{key}"


class Dashboards:
    """Built on every rank (a missing extra fails before training); opened on rank 0 (RunLog.start_at)."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.board = None  # a TensorBoard SummaryWriter once open() ran
        self.wandb_run = None
        self.wanted = [name for name in ("tensorboard", "wandb") if getattr(config.logging, name)]
        for name in self.wanted:
            if importlib.util.find_spec(name) is None:
                raise ConfigError(
                    f"logging.{name}=true but {name} is not installed: `pip install femtotron[{name}]`, "
                    f"or set logging.{name}=false"
                )

    def open(self, step: int) -> None:
        """The run (re)starts after `step`: what an earlier attempt logged beyond it is superseded."""
        run_dir = self.config.run_dir
        general = self.config.general
        if "tensorboard" in self.wanted:
            from torch.utils.tensorboard import SummaryWriter

            # purge_step: TensorBoard drops the earlier attempt's events from this step on (no duplicates).
            self.board = SummaryWriter(str(run_dir / "tensorboard"), purge_step=step + 1)
            config = yaml.safe_dump(self.config.to_dict(), sort_keys=False)
            self.board.add_text("config", f"```yaml\n{config}```", step)
        if "wandb" in self.wanted:
            import wandb

            # One W&B run per run directory, found again on resume. W&B steps only increase: a step logged
            # before a restart keeps its first value there (metrics.jsonl has the one that counts).
            run_id = hashlib.sha1(str(run_dir.resolve()).encode()).hexdigest()[:16]
            run_dir.mkdir(parents=True, exist_ok=True)
            names = {"project": general.project, "name": general.run, "dir": str(run_dir)}
            try:
                self.wandb_run = wandb.init(**names, id=run_id, resume="allow", config=self.config.to_dict())
            except wandb.errors.Error as error:  # no login, no network: before any step is trained
                raise ConfigError(
                    f"logging.wandb=true but W&B could not start a run: {str(error).rstrip('.')}. Log in "
                    "(`wandb login`, or set WANDB_API_KEY), or set WANDB_MODE=offline to log without network "
                    "and `wandb sync` later, or set logging.wandb=false"
                ) from None

    def write(self, record: dict[str, Any]) -> None:
        step = record["step"]
        scalars = {tag(k): v for k, v in record.items() if k != "step" and isinstance(v, (int, float))}
        if self.board:
            for name, value in scalars.items():
                self.board.add_scalar(name, value, step)
            self.board.flush()  # a run that is killed keeps on the board what metrics.jsonl has
        if self.wandb_run:
            self.wandb_run.log(scalars, step=step)

    def close(self) -> None:
        if self.board:
            self.board.close()
        if self.wandb_run:
            self.wandb_run.finish()
        self.board = self.wandb_run = None
