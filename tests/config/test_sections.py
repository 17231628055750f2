"""The config's sections: rules that belong to one field."""

import pytest

from femtotron.config import load_config_dict
from femtotron.errors import ConfigError


def config_with_run(run: str, tmp_path):
    raw = {
        "general": {"run": run},
        "tokens": {"train_steps": 1},
        "data": {"dataset_folder": "unused"},
        "logging": {"output_dir": str(tmp_path)},
    }
    return load_config_dict(raw)


@pytest.mark.parametrize("run", ["../..", "a/../../b", "/tmp/elsewhere", ""])
def test_general_run_cannot_put_the_run_directory_outside_logging_output_dir(run, tmp_path):
    """The run directory is logging.output_dir/general.run: `general.run=../..` wrote checkpoints, weights and
    metrics two levels above it, an absolute name anywhere."""
    with pytest.raises(
        ConfigError, match=r"general\.run: it would put the run directory outside logging\.output_dir"
    ):
        config_with_run(run, tmp_path)


@pytest.mark.parametrize("run", ["exp1", "sweep/lr3e-4", "with..dots"])
def test_general_run_may_be_a_name_or_a_path_inside_logging_output_dir(run, tmp_path):
    assert config_with_run(run, tmp_path).run_dir == tmp_path / run
