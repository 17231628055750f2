"""Typed training config: schema and rules (`config.py`), YAML loading with clear errors (`load.py`)."""

from femtotron.config.config import Config, Problem, check_world_size, config_warnings, parameter_count
from femtotron.config.load import load_config, load_config_dict

__all__ = [
    "Config",
    "Problem",
    "check_world_size",
    "config_warnings",
    "load_config",
    "load_config_dict",
    "parameter_count",
]
