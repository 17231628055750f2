"""Typed training config: sections (`sections.py`), the checked whole (`config.py`), rules and warnings
(`rules.py`), YAML loading (`load.py`)."""

from femtotron.config.config import Config, LlamaConfig
from femtotron.config.load import load_config, load_config_dict
from femtotron.config.rules import Problem, check_world_size

__all__ = ["Config", "LlamaConfig", "Problem", "check_world_size", "load_config", "load_config_dict"]
