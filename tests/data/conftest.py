"""Shared fixtures for the data tests: a small synthetic corpus and a tokenizer trained on it once."""

import json

import helpers
import numpy as np
import pytest
from helpers import tokenize_with_datatrove

from femtotron.data.tokenizer import train_tokenizer

WORDS = "the a model token data train loss step batch layer pipeline tensor shard rank seed epoch".split()


def _make_texts(n: int, seed: int = 0) -> list[str]:
    """Deterministic sentences of varied length, with some non-ASCII text to exercise byte-level BPE."""
    rng = np.random.default_rng(seed)
    texts = [" ".join(rng.choice(WORDS, size=rng.integers(3, 30))) + "." for _ in range(n)]
    texts[1] = "naïve café — 数据 🚀 tabs\tand\nnewlines"
    return texts


@pytest.fixture
def texts() -> list[str]:
    return _make_texts(40, seed=1)


@pytest.fixture(scope="session")
def tokenizer_path(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tokenizer")
    corpus = directory / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in _make_texts(300)), encoding="utf-8")
    path = directory / "tokenizer.json"
    train_tokenizer([corpus], vocab_size=400, output_path=path)
    return path


@pytest.fixture
def small_disk(tmp_path):
    """A real 64 KiB tmpfs (root only), unmounted after the test (helpers.small_disk)."""
    with helpers.small_disk(tmp_path / "disk") as mount_point:
        yield mount_point


@pytest.fixture(scope="session")
def datatrove_folder(tmp_path_factory, tokenizer_path):
    folder = tmp_path_factory.mktemp("datatrove") / "tokenized"
    return tokenize_with_datatrove(folder, tokenizer_path, ["the", "model", "data", "loss", "rank"])
