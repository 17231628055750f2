import multiprocessing.process
import os
import subprocess

# TorchInductor (model.compile) compiles in this process, not in a pool of workers: ranks forked after the
# pool started would wait on workers they do not have.
os.environ["TORCHINDUCTOR_COMPILE_THREADS"] = "1"

import numpy as np
import pytest
import torch
from helpers import TINY_VOCAB, tiny_config_maker, write_patterned_tokens
from tokenizers import Tokenizer, models

from femtotron.data.indexed import IndexedDatasetWriter
from femtotron.parallel.comm import EMULATE_NCCL


def pytest_collection_modifyitems(config, items):
    """Tests marked `cuda` need a CUDA GPU: without one they are skipped, saying so."""
    if torch.cuda.is_available():
        return
    no_gpu = pytest.mark.skip(reason="cuda: needs a CUDA GPU (torch.cuda.is_available() is False)")
    for item in items:
        if item.get_closest_marker("cuda"):
            item.add_marker(no_gpu)


# Where every distributed test runs twice: as gloo behaves, and with gloo made to behave as NCCL does
# (parallel/comm.py, EMULATE_NCCL), so code that works on gloo by luck fails here rather than on GPUs.
BOTH_SEMANTICS = (
    "tests/parallel/",
    "tests/optim/test_zero.py",
    "tests/diagnostics/test_watchdog.py",
    "tests/models/test_compile.py",  # compiled graphs between collectives
)


def pytest_generate_tests(metafunc):
    where = metafunc.definition.path.relative_to(metafunc.config.rootpath).as_posix()
    if metafunc.definition.get_closest_marker("distributed") and where.startswith(BOTH_SEMANTICS):
        metafunc.parametrize("comm_semantics", ["gloo", "nccl-semantics"], indirect=True)


# Autouse, so that it is in every test's fixture closure before parametrization: a fixture that is only
# added to `metafunc.fixturenames` in pytest_generate_tests is parametrized but never run (pytest 8+), and
# every "nccl-semantics" case then ran as plain gloo (tests/parallel/test_comm.py checks it now).
@pytest.fixture(autouse=True)
def comm_semantics(request, monkeypatch):
    """The ranks a test starts (forked or launched) inherit the choice through the environment; tests that
    run once (not parametrized) keep the environment as it is."""
    semantics = getattr(request, "param", None)
    if semantics == "nccl-semantics":
        monkeypatch.setenv(EMULATE_NCCL, "1")
    elif semantics == "gloo":
        monkeypatch.delenv(EMULATE_NCCL, raising=False)
    return semantics


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


# The documents of the document-masking tests: patterned tokens, each document ended by this id.
DOCUMENT_END = 0


def write_documents(prefix, documents=200, seed=0) -> str:
    """Documents of 3 to 20 patterned tokens, each ended by DOCUMENT_END: boundaries in every sample."""
    rng = np.random.default_rng(seed)
    writer = IndexedDatasetWriter(str(prefix), np.uint16)
    for _ in range(documents):
        length = int(rng.integers(3, 21))
        tokens = [int(rng.integers(1, TINY_VOCAB))]
        for _ in range(length - 2):
            tokens.append((5 * tokens[-1] + 3) % (TINY_VOCAB - 1) + 1)
        writer.add_document(np.array([*tokens, DOCUMENT_END], dtype=np.uint16))
    writer.finalize()
    return str(prefix)


def write_tokenizer(path) -> str:
    vocab = {"<|endoftext|>": DOCUMENT_END, **{f"t{i}": i for i in range(1, TINY_VOCAB)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="t1"))
    tokenizer.add_special_tokens(["<|endoftext|>"])
    tokenizer.save(str(path))
    return str(path)


@pytest.fixture
def documents_config(tiny_config, tmp_path):
    data, tokenizer = write_documents(tmp_path / "documents"), write_tokenizer(tmp_path / "tokenizer.json")

    def make(*overrides):
        return tiny_config(
            "model.document_masking=true",
            f"data.dataset_folder={data}",
            f"tokenizer.tokenizer_name_or_path={tokenizer}",
            *overrides,
        )

    return make
