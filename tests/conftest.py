import pytest
from helpers import tiny_config_maker, write_patterned_tokens


@pytest.fixture
def tiny_dataset(tmp_path) -> str:
    return write_patterned_tokens(tmp_path / "data" / "patterned")


@pytest.fixture
def tiny_config(tmp_path, tiny_dataset):
    return tiny_config_maker(tmp_path / "runs", tiny_dataset)
