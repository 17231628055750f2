"""Fixed-length training samples over tokenized datasets: shuffled per epoch, blended by weight, resumable.

Every sample is a pure function of (global sample index g, seed), so resuming a run only needs the number
of samples consumed, and any data-parallel layout sees the same samples in the same global order.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np
import torch

from femtotron.batch import MicroBatch
from femtotron.data.datatrove import DatatroveFolder, is_datatrove_folder
from femtotron.data.indexed import IndexedDataset, resolve_dataset_prefixes
from femtotron.data.synthetic import SyntheticTokens
from femtotron.errors import DataError

# What a Nanoset draws samples from: a Megatron pair, a datatrove folder, or random tokens.
Dataset = IndexedDataset | DatatroveFolder | SyntheticTokens
_BLOCK = 1 << 16  # global samples per lazily built blending block


class _Blender:
    """Decides which dataset global sample g comes from, and which of that dataset's samples it is.

    Greedy rule: the next sample goes to the dataset that lags its weight the most, the one whose next
    sample is due first at `(served + 0.5) / weight` (float64; ties to the lower dataset index). This is the
    highest-averages (Sainte-Laguë) apportionment, so after g samples each dataset's count stays within
    about one sample of `weight * g`, at every g and not only at the end of an epoch.

    Dataset d's k-th sample is due at `(k + 0.5) / weight_d` whatever the others do. So a block of the blend
    is one vectorised merge of due times, built from the per-dataset counters at its start: O(1) amortised
    per sample, with no per-sample Python loop. A resume replays only the counters of the blocks before it,
    not the samples.
    """

    def __init__(self, weights: np.ndarray) -> None:
        self.weights = weights
        self._starts = [np.zeros(len(weights), dtype=np.int64)]  # counters at the start of each block
        self._cache: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def locate(self, g: int) -> tuple[int, int]:
        block, offset = divmod(g, _BLOCK)
        datasets, indices = self._block(block)
        return int(datasets[offset]), int(indices[offset])

    def counts(self, g: int) -> np.ndarray:
        """Samples each dataset gives among global samples [0, g)."""
        block, offset = divmod(g, _BLOCK)
        datasets, _ = self._block(block)
        return self._starts[block] + np.bincount(datasets[:offset], minlength=len(self.weights))

    def _block(self, block: int) -> tuple[np.ndarray, np.ndarray]:
        if block not in self._cache:
            while len(self._starts) <= block:  # a block's counters need every block before it
                self._build(len(self._starts) - 1)
            self._build(block)
        return self._cache[block]

    def _build(self, block: int) -> None:
        counts = self._starts[block]
        k = counts[:, None] + np.arange(_BLOCK)  # each dataset's next _BLOCK samples are the candidates
        due = (k + 0.5) / self.weights[:, None]
        # A stable sort of the dataset-major rows keeps equal due times in dataset order: ties to the lower.
        chosen = np.argsort(due.ravel(), kind="stable")[:_BLOCK]
        datasets = chosen // _BLOCK
        indices = k.ravel()[chosen]
        if block + 1 == len(self._starts):
            self._starts.append(counts + np.bincount(datasets, minlength=len(counts)))
        if len(self._cache) >= 2:  # training walks forward: keep the current and previous block only
            self._cache.pop(next(iter(self._cache)))
        self._cache[block] = (datasets, indices)


class Nanoset:
    """Samples of `sequence_length + 1` tokens (inputs and targets overlap by one) from blended datasets.

    A Megatron dataset's documents form one token stream; its sample i is tokens `[i*L, i*L + L + 1)`; a
    datatrove folder's sample i is its i-th window of L + 1 tokens, as datatrove cuts it (data/datatrove.py).
    Each dataset's samples come in a fresh permutation each epoch
    (`np.random.default_rng((*stream, epoch))`, the stream `(seed, dataset_index)`), so `nanoset[g]`
    exists for every g >= 0. `weights` (normalised): each dataset's share; None: proportional to size.

    `datasets`: paths (opened here) or opened datasets. A later data stage continues a dataset an earlier one
    drew from (data/stages.py): `streams` gives it that stage's permutation stream and `skip` the draws that
    stage made, so its k-th draw here is draw `skip + k` of the same stream.
    """

    def __init__(
        self,
        datasets: Sequence[str | os.PathLike | Dataset],
        weights: Sequence[float] | None,
        sequence_length: int,
        seed: int,
        *,
        streams: Sequence[tuple[int, ...]] | None = None,
        skip: Sequence[int] | None = None,
    ) -> None:
        if sequence_length < 1:
            raise ValueError(f"sequence_length must be >= 1, got {sequence_length}")
        if not datasets:
            raise DataError("no dataset given: the data section lists no dataset path")
        self.datasets = [open_dataset(d) if isinstance(d, (str, os.PathLike)) else d for d in datasets]
        self.prefixes = [ds.path_prefix for ds in self.datasets]
        self.sequence_length = sequence_length
        self.seed = seed
        self.streams = list(streams) if streams is not None else [(seed, d) for d in range(len(datasets))]
        self.skip = list(skip) if skip is not None else [0] * len(datasets)
        self.samples_per_dataset = [ds.num_samples(sequence_length) for ds in self.datasets]
        for ds, n in zip(self.datasets, self.samples_per_dataset, strict=True):
            if ds.dtype.kind not in "iu":
                raise DataError(f"{ds.path_prefix}.bin holds {ds.dtype} values, not token ids")
            if n == 0:
                raise DataError(
                    f"{ds.path_prefix}: {ds.num_tokens} tokens is too few for one sample of sequence_length "
                    f"+ 1 = {sequence_length + 1} tokens; use more data or a shorter tokens.sequence_length"
                )
        self.weights = self._normalise(weights)
        self._blender = _Blender(self.weights) if len(self.datasets) > 1 else None
        self._permutations: dict[tuple[int, int], np.ndarray] = {}

    def _normalise(self, weights: Sequence[float] | None) -> np.ndarray:
        raw = np.asarray(self.samples_per_dataset if weights is None else weights, dtype=np.float64)
        if raw.shape != (len(self.datasets),) or not np.all(np.isfinite(raw)) or np.any(raw <= 0):
            raise DataError(
                f"dataset weights {raw.tolist()} must be one positive number per dataset "
                f"({len(self.datasets)}: {', '.join(self.prefixes)})"
            )
        return raw / raw.sum()

    @property
    def num_documents(self) -> int:
        return sum(ds.num_documents for ds in self.datasets)

    @property
    def num_tokens(self) -> int:
        return sum(ds.num_tokens for ds in self.datasets)

    @property
    def samples_per_epoch(self) -> int:
        return sum(self.samples_per_dataset)

    def epochs_for(self, num_samples: int) -> float:
        """Passes over the most-repeated dataset in a run drawing `num_samples` samples."""
        shares = zip(self.weights, self.samples_per_dataset, strict=True)
        return float(max(w * num_samples / n for w, n in shares))

    def locate(self, g: int) -> tuple[int, int]:
        """(dataset index, sample index within that dataset) of global sample g."""
        if g < 0:
            raise IndexError(f"global sample index must be >= 0, got {g}")
        dataset, k = self._blender.locate(g) if self._blender else (0, g)
        epoch, position = divmod(k + self.skip[dataset], self.samples_per_dataset[dataset])
        return dataset, int(self._permutation(dataset, epoch)[position])

    def draws(self, samples: int) -> list[int]:
        """How many of global samples [0, samples) each dataset gives."""
        if self._blender is None:
            return [samples]
        return self._blender.counts(samples).tolist()

    def _permutation(self, dataset: int, epoch: int) -> np.ndarray:
        key = (dataset, epoch)
        if key not in self._permutations:
            if len(self._permutations) >= 2 * len(self.datasets):  # epochs are walked forward: keep recent
                self._permutations.pop(next(iter(self._permutations)))
            rng = np.random.default_rng((*self.streams[dataset], epoch))
            self._permutations[key] = rng.permutation(self.samples_per_dataset[dataset])
        return self._permutations[key]

    def __getitem__(self, g: int) -> np.ndarray:
        dataset, sample = self.locate(g)
        return self.datasets[dataset].sample(sample, self.sequence_length).astype(np.int64)


def open_dataset(path: str | os.PathLike) -> Dataset:
    """A datatrove folder (it holds `*.ds` files), else a Megatron `.bin/.idx` prefix."""
    return DatatroveFolder(path) if is_datatrove_folder(path) else IndexedDataset(path)


def _resolve(folder: str) -> list[str]:
    """A datatrove folder is one dataset, as nanotron blends by folder; a directory of pairs is each pair."""
    return [folder] if is_datatrove_folder(folder) else resolve_dataset_prefixes(folder)


def open_nanoset(folders: str | list[str] | dict[str, float], sequence_length: int, seed: int) -> Nanoset:
    """A Nanoset over `data.dataset_folder`: a prefix or directory, a list, or {prefix: weight}."""
    if isinstance(folders, dict):
        prefixes = []
        weights = []
        for folder, weight in folders.items():
            found = _resolve(folder)
            prefixes += found
            weights += [weight / len(found)] * len(found)  # a directory's pairs share its weight
        return Nanoset(prefixes, weights, sequence_length, seed)
    folders = [folders] if isinstance(folders, str) else folders
    return Nanoset([p for f in folders for p in _resolve(f)], None, sequence_length, seed)


class MicroBatchIterator:
    """One data-parallel rank's micro-batches, step by step.

    A step consumes the next `micro_batch_size * batch_accumulation * dp_size` global samples; rank r takes
    the r-th contiguous chunk and cuts it into `batch_accumulation` micro-batches. The samples a step sees
    therefore do not depend on dp_size, so a run may be resumed on another number of replicas.
    `step_at(consumed_samples)` gives any step's samples, so resuming needs only the saved
    `consumed_samples`, and no iterator state is checkpointed.
    """

    def __init__(
        self, nanoset: Nanoset, *, micro_batch_size: int, batch_accumulation: int, dp_rank: int, dp_size: int
    ) -> None:
        if min(micro_batch_size, batch_accumulation, dp_size) < 1 or not 0 <= dp_rank < dp_size:
            raise ValueError(
                f"need micro_batch_size, batch_accumulation, dp_size >= 1 and 0 <= dp_rank < dp_size; got "
                f"{micro_batch_size}, {batch_accumulation}, {dp_size}, dp_rank={dp_rank}"
            )
        self.nanoset = nanoset
        self.micro_batch_size = micro_batch_size
        self.batch_accumulation = batch_accumulation
        self.dp_rank = dp_rank

    def step_at(self, consumed_samples: int) -> list[MicroBatch]:
        """This rank's `batch_accumulation` micro-batches of the step that starts after `consumed_samples`."""
        per_rank = self.micro_batch_size * self.batch_accumulation
        first = consumed_samples + self.dp_rank * per_rank
        starts = range(first, first + per_rank, self.micro_batch_size)
        stacked = (np.stack([self.nanoset[g] for g in range(s, s + self.micro_batch_size)]) for s in starts)
        return [MicroBatch.from_tokens(torch.from_numpy(tokens)) for tokens in stacked]
