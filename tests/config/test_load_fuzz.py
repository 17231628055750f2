"""Every example config, broken in many small ways: always a ConfigError naming the broken path, never
another exception (an unknown key in the optional `moe:` section raised AttributeError)."""

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

from femtotron.config import Config, load_config
from femtotron.config.load import _section
from femtotron.errors import ConfigError

EXAMPLES = sorted((Path(__file__).parents[2] / "examples").glob("**/*.yaml"))
UNKNOWN = "unknwn_key"


def section_paths(model: Any = Config, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """Every section of the schema, optional ones (`X | None`) included, by YAML key names."""
    paths = [prefix]
    for name, info in model.model_fields.items():
        sub = _section(info.annotation)
        if sub is not None:
            paths += section_paths(sub, (*prefix, info.alias or name))
    return paths


def leaf_paths(data: dict, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    paths = []
    for key, value in data.items():
        paths += leaf_paths(value, (*prefix, key)) if isinstance(value, dict) else [(*prefix, key)]
    return paths


def section_at(data: dict, path: tuple[str, ...]) -> dict:
    """The mapping at `path`, created (or replacing a null) where the example has none."""
    node = data
    for key in path:
        if not isinstance(node.get(key), dict):
            node[key] = {}
        node = node[key]
    return node


def problem_paths(tmp_path: Path, data: dict) -> list[str]:
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    with pytest.raises(ConfigError) as info:
        load_config(path)
    return [p.path for p in info.value.problems]


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_an_unknown_key_at_every_depth_is_named(tmp_path, example):
    original = yaml.safe_load(example.read_text())
    for section in section_paths():
        for value in (1, {"nested": 1}, None):
            data = copy.deepcopy(original)
            section_at(data, section)[UNKNOWN] = value
            assert ".".join((*section, UNKNOWN)) in problem_paths(tmp_path, data), (section, value)


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_every_misspelt_key_is_named(tmp_path, example):
    original = yaml.safe_load(example.read_text())
    for *parents, leaf in leaf_paths(original):
        data = copy.deepcopy(original)
        section = section_at(data, tuple(parents))
        section[leaf[:-1] + "_"] = section.pop(leaf)
        assert ".".join([*parents, leaf[:-1] + "_"]) in problem_paths(tmp_path, data)


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_a_section_of_the_wrong_shape_is_named(tmp_path, example):
    original = yaml.safe_load(example.read_text())
    for section in section_paths()[1:]:
        for value in ([1, 2], "text", 3):
            data = copy.deepcopy(original)
            *parents, leaf = section
            section_at(data, tuple(parents))[leaf] = value
            assert ".".join(section) in problem_paths(tmp_path, data), (section, value)
