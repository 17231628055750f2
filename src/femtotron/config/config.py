"""The typed config (nanotron's key names): `Config`, the sections of sections.py checked by the rules.

No torch, no network: a config is checked (config/rules.py) before any process exists, so a bad one fails
in a second with a message instead of hanging a cluster.

The section models and the root's fields live in config/sections.py, so that the rules can be typed
without importing this module, which calls them. The section classes are named here too, for the code that
imports them from here.
"""

from __future__ import annotations

from pydantic import ValidationInfo, model_validator

from femtotron.config.rules import rule_problems
from femtotron.config.sections import (
    CheckpointsArgs,
    ConfigFields,
    DataArgs,
    DatasetSpec,
    DataSource,
    DataStage,
    GeneralArgs,
    InitMethod,
    LlamaConfig,
    LoggingArgs,
    LossScaleArgs,
    LRSchedulerArgs,
    ModelArgs,
    MoEConfig,
    OptimizerArgs,
    OptimizerFactoryArgs,
    ParallelismArgs,
    ProfilingArgs,
    RopeScaling,
    TokenizerArgs,
    TokensArgs,
)

__all__ = [
    "SKIP_RULES",
    "OptimizerFactoryArgs",
    "CheckpointsArgs",
    "Config",
    "ConfigFields",
    "DataArgs",
    "DataSource",
    "DataStage",
    "DatasetSpec",
    "GeneralArgs",
    "InitMethod",
    "LRSchedulerArgs",
    "LlamaConfig",
    "LoggingArgs",
    "LossScaleArgs",
    "ModelArgs",
    "MoEConfig",
    "OptimizerArgs",
    "ParallelismArgs",
    "ProfilingArgs",
    "RopeScaling",
    "TokenizerArgs",
    "TokensArgs",
]

# Validation context flag: the loader checks the rules itself so it can report them next to field errors.
SKIP_RULES = "femtotron_skip_rules"


class Config(ConfigFields):
    """A whole training run. Loading one builds nothing.

    Validating one (from YAML through load.py, or `Config.model_validate` in Python) checks every cross-field
    rule, so that no code ever holds a config that breaks one. Fields derived from others stay as given
    (null: the schedule's decay follows `tokens.train_steps`, optim/lr_schedule.py), so that a run's saved
    config.yaml, reused with another `train_steps`, derives them anew instead of keeping the old run's.
    """

    @model_validator(mode="after")
    def _check(self, info: ValidationInfo) -> Config:
        skip_rules = (info.context or {}).get(SKIP_RULES)
        problems = [] if skip_rules else rule_problems(self)
        if problems:
            raise ValueError("\n".join(str(p) for p in problems))
        return self
