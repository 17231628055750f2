import sys
from pathlib import Path

import numpy as np
import pytest

# Tests import the shared helpers (tests/distributed.py) as a top-level module.
sys.path.insert(0, str(Path(__file__).parent))

from femtotron.config import load_config_dict  # noqa: E402
from femtotron.data.indexed import IndexedDatasetWriter  # noqa: E402

TINY_VOCAB = 256


def write_patterned_tokens(prefix: Path, documents: int = 12, length: int = 700, seed: int = 0) -> str:
    """Documents following t[i+1] = (5 t[i] + 3) mod V from a random start, with 10% noise: learnable fast."""
    rng = np.random.default_rng(seed)
    writer = IndexedDatasetWriter(str(prefix), np.uint16)
    for _ in range(documents):
        tokens = np.empty(length, dtype=np.int64)
        tokens[0] = rng.integers(1, TINY_VOCAB)
        for i in range(1, length):
            tokens[i] = (5 * tokens[i - 1] + 3) % TINY_VOCAB
        noise = rng.random(length) < 0.1
        tokens[noise] = rng.integers(1, TINY_VOCAB, noise.sum())
        writer.add_document(tokens.astype(np.uint16))
    writer.finalize()
    return str(prefix)


@pytest.fixture
def tiny_dataset(tmp_path) -> str:
    return write_patterned_tokens(tmp_path / "data" / "patterned")


def tiny_config_maker(runs_dir: Path, dataset: str):
    """Configs for a ~100k-parameter fp32 model on the patterned data; overrides are dotted keys."""

    def make(*overrides: str, **sections):
        raw = {
            "general": {"run": "tiny", "seed": 3},
            "model": {"model_config": {"vocab_size": TINY_VOCAB, "hidden_size": 64, "intermediate_size": 128,
                                       "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                                       "max_position_embeddings": 64},
                      "dtype": "float32"},
            "tokens": {"sequence_length": 32, "micro_batch_size": 4, "train_steps": 10},
            "optimizer": {"learning_rate_scheduler": {"learning_rate": 3e-3, "lr_warmup_steps": 2}},
            "data": {"dataset_folder": dataset},
            "logging": {"output_dir": str(runs_dir)},
        }
        for section, values in sections.items():
            raw[section] = {**raw.get(section, {}), **values}
        return load_config_dict(raw, overrides=overrides)

    return make


@pytest.fixture
def tiny_config(tmp_path, tiny_dataset):
    return tiny_config_maker(tmp_path / "runs", tiny_dataset)
