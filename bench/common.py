"""What the bench scripts share: random token data and a femtotron Trainer for a model shape."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from femtotron.config import load_config_dict
from femtotron.data.indexed import IndexedDatasetWriter
from femtotron.parallel.context import ParallelContext
from femtotron.trainer import Trainer

MODEL_KEYS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "vocab_size")


def write_random_tokens(prefix: Path, vocab: int, tokens: int) -> None:
    writer = IndexedDatasetWriter(str(prefix), np.uint16)
    rng = np.random.default_rng(0)
    for _ in range(8):
        writer.add_document(rng.integers(1, vocab, tokens // 8, dtype=np.uint16))
    writer.finalize()


def shape_trainer(shape: dict, dtype: str, data_prefix: Path, run_dir: Path, run: str = "bench",
                  parallelism: dict | None = None) -> Trainer:
    """A one-process Trainer for `shape` (the MODEL_KEYS plus sequence_length and micro_batch_size)."""
    config = load_config_dict({
        "general": {"run": run},
        "model": {"model_config": {**{k: shape[k] for k in MODEL_KEYS},
                                   "max_position_embeddings": shape["sequence_length"]},
                  "dtype": dtype},
        "parallelism": parallelism or {},
        "tokens": {"sequence_length": shape["sequence_length"], "micro_batch_size": shape["micro_batch_size"],
                   "train_steps": 10**6},
        "data": {"dataset_folder": str(data_prefix)},
        "logging": {"output_dir": str(run_dir)},
        "checkpoints": {"save_final_state": False},
    })
    return Trainer(config, ParallelContext(), log_to_console=False)
