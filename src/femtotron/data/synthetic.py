"""Random token ids in place of a corpus (`data.synthetic: true`, nanotron's `dataset: null`): a run measures
its throughput before any data is tokenized. Nothing can be learned from them: the loss stays near
ln(vocab_size)."""

from __future__ import annotations

import numpy as np

# Samples per "epoch": the Nanoset permutes them like any dataset's (8 MiB of indices); each is drawn anew
# from its own index, so an epoch boundary repeats nothing that matters for a throughput run.
SYNTHETIC_SAMPLES = 1 << 20


class SyntheticTokens:
    """Sample i: `sequence_length + 1` ids uniform over [0, vocab_size), a function of (seed, i, length)."""

    def __init__(self, vocab_size: int, seed: int) -> None:
        self.vocab_size = vocab_size
        self.seed = seed
        self.path_prefix = f"synthetic tokens (uniform over {vocab_size} ids)"
        self.name = self.path_prefix
        self.files: list[str] = []  # nothing on disk: the data identity is the seed and the vocabulary
        self.dtype = np.dtype(np.int64)
        self.num_documents = 0
        self.num_tokens = 0  # none stored; the samples are made as they are read

    def num_samples(self, sequence_length: int) -> int:
        return SYNTHETIC_SAMPLES

    def sample(self, i: int, sequence_length: int) -> np.ndarray:
        rng = np.random.default_rng((self.seed, i, sequence_length))
        return rng.integers(0, self.vocab_size, sequence_length + 1, dtype=np.int64)
