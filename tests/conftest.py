import multiprocessing.process
import os
import subprocess

import pytest
import torch
from helpers import tiny_config_maker, write_patterned_tokens


def pytest_collection_modifyitems(config, items):
    """Tests marked `cuda` need a CUDA GPU: without one they are skipped, saying so."""
    if torch.cuda.is_available():
        return
    no_gpu = pytest.mark.skip(reason="cuda: needs a CUDA GPU (torch.cuda.is_available() is False)")
    for item in items:
        if item.get_closest_marker("cuda"):
            item.add_marker(no_gpu)


@pytest.fixture(autouse=True)
def processes_only_in_distributed_tests(request, monkeypatch):
    """`pytest -m "not distributed"` is the fast tier: a test that starts processes (ranks, the launcher, the
    command line) must be marked `distributed`, or it fails here instead of slowing that tier down."""
    if request.node.get_closest_marker("distributed"):
        return

    def refuse(*args, **kwargs):
        raise AssertionError(f"{request.node.name} starts a process: mark it @pytest.mark.distributed")

    monkeypatch.setattr(subprocess.Popen, "__init__", refuse)
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", refuse)


@pytest.fixture(autouse=True, scope="session")
def own_cache(tmp_path_factory):
    """The MFU yardstick is cached per machine under XDG_CACHE_HOME (metrics.peak_flops): not the user's."""
    os.environ["XDG_CACHE_HOME"] = str(tmp_path_factory.mktemp("cache"))


@pytest.fixture
def tiny_dataset(tmp_path) -> str:
    return write_patterned_tokens(tmp_path / "data" / "patterned")


@pytest.fixture
def tiny_config(tmp_path, tiny_dataset):
    return tiny_config_maker(tmp_path / "runs", tiny_dataset)


@pytest.fixture
def no_launcher(monkeypatch):
    """For tests of running *without* a launcher, even if pytest itself was started by torchrun or srun."""
    for name in (
        "WORLD_SIZE",
        "RANK",
        "LOCAL_RANK",
        "MASTER_ADDR",
        "MASTER_PORT",
        "TORCHELASTIC_RUN_ID",
        "SLURM_PROCID",
        "SLURM_NTASKS",
    ):
        monkeypatch.delenv(name, raising=False)
