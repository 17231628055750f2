"""The data a run trains on: the training and validation sets and the tokenizer the config names, opened and
checked against the model's vocabulary before the model is built, and each step's token ids checked before
they reach the embedding. A wrong path or vocabulary then fails in seconds with the file and the fix, not
after minutes of start-up or as an opaque device assert inside the embedding."""

from __future__ import annotations

import hashlib
import json
from typing import Any

import numpy as np
import torch
from tokenizers import Tokenizer

from femtotron.batch import MicroBatch
from femtotron.config import Config
from femtotron.data.datatrove import DatatroveFolder, check_token_size
from femtotron.data.indexed import digest_ends
from femtotron.data.nanoset import Nanoset, open_nanoset
from femtotron.data.stages import DataStages
from femtotron.data.synthetic import SyntheticTokens
from femtotron.data.tokenizer import eos_token_id, tokenizer_for_model
from femtotron.errors import ConfigError, DataError
from femtotron.parallel.context import ParallelContext

SCANNED_TOKENS = 1 << 24  # per dataset at start: ~30 ms; later tokens are checked batch by batch
# What a changed part of the data identity names, and what resuming with it would do.
DATA_CHANGES = {
    "digest": (
        "the contents of the datasets (data.dataset_folder)",
        "the run would continue at global sample {samples:,} of other data, not where the old data left off",
    ),
    "weights": (
        "the blend weights (data.dataset_folder)",
        "each dataset would be drawn in another share, and samples already trained on would come again",
    ),
    "seed": ("data.seed", "the samples would come in another order: some trained on again, others never"),
    "sequence_length": (
        "tokens.sequence_length",
        "samples would be cut at another length: from global sample {samples:,} on, other tokens",
    ),
    "tokenizer": (
        "the tokenizer's vocabulary (tokenizer.tokenizer_name_or_path)",
        "token ids would stand for other text than the model learned, and its tokenizer.json be replaced",
    ),
}


def check_token_range(nanoset: Nanoset, vocab_size: int, key: str = "data.dataset_folder") -> None:
    """Token ids must be < vocab_size: the start of every dataset file is scanned before the model is
    built."""
    for dataset in nanoset.datasets:
        if isinstance(dataset, SyntheticTokens):  # drawn below vocab_size
            continue
        if isinstance(dataset, DatatroveFolder):
            check_token_size(dataset, vocab_size, key)
        head = dataset.tokens(0, min(dataset.num_tokens, SCANNED_TOKENS))
        largest = int(head.max()) if head.size else 0
        if largest >= vocab_size:
            position = int(np.argmax(head == largest))
            count = int((head >= vocab_size).sum())
            raise DataError(
                f"{dataset.name} ({key}) holds token id {largest} (at token {position:,}; "
                f"{count:,} of the first {head.size:,} tokens are out of range), but "
                f"model.model_config.vocab_size={vocab_size} allows ids 0..{vocab_size - 1}: it was "
                f"tokenized with a larger vocabulary. Set model.model_config.vocab_size >= {largest + 1}, "
                "or re-run `femtotron preprocess` with the tokenizer this model is meant for."
            )


def data_identity(nanoset: Nanoset, tokenizer: Tokenizer | None) -> dict[str, Any]:
    """What a checkpoint records of the data it trained on, to refuse a resume on other data: the datasets
    (their paths, and a digest of each .bin's and .idx's size and first and last MiB, which another corpus
    or another tokenization changes), the blend weights, the seed, the sequence length, the vocabulary.
    With data stages, those of the stage the checkpoint was in (`stage_identity`)."""
    digest = hashlib.sha256()
    for dataset in nanoset.datasets:
        for path in dataset.files:
            digest_ends(digest, path)
    vocab = None
    if tokenizer is not None:
        vocab = hashlib.sha256(json.dumps(sorted(tokenizer.get_vocab().items())).encode()).hexdigest()
    return {
        "datasets": list(nanoset.prefixes),
        "digest": digest.hexdigest(),
        "weights": nanoset.weights.tolist(),
        "seed": nanoset.seed,
        "sequence_length": nanoset.sequence_length,
        "tokenizer": vocab,
    }


def stage_identity(data: DataStages, name: str, tokenizer: Tokenizer | None) -> dict[str, Any]:
    """The data identity of the stage called `name`: a resume compares it with the stage of that name."""
    nanoset = data.nanoset_of(name, "the run's record of its data stages")
    return {**data_identity(nanoset, tokenizer), "stage": name}


def data_changes(saved: dict[str, Any], now: dict[str, Any], samples: int) -> list[str]:
    """Each way the data identity `now` differs from a checkpoint's, with what resuming would do. The paths
    alone may change (data copied to local disk); a tokenizer counts only when both name one."""
    changes = []
    for key, (what, effect) in DATA_CHANGES.items():
        before = saved.get(key)
        after = now[key]
        if before == after or (key == "tokenizer" and None in (before, after)):
            continue
        if key == "digest":
            before = saved.get("datasets")
            after = now["datasets"]
        if key == "tokenizer":  # digests: their first 12 digits tell them apart
            before = before[:12]
            after = after[:12]
        changes.append(
            f"{what} changed ({before} at the save, {after} now): {effect.format(samples=samples)}"
        )
    return changes


def open_run_data(config: Config) -> tuple[DataStages, Nanoset | None, Tokenizer | None]:
    """The training data (every stage) and validation data and the tokenizer the run names, checked against
    the model's vocabulary before the model is built (a wrong path or vocabulary fails in seconds, not after
    minutes)."""
    sequence = config.tokens.sequence_length
    vocab = config.model.model_config_.vocab_size
    train = DataStages(config)
    validation = config.data.validation_folder
    val = open_nanoset(validation, sequence, config.data.seed) if validation is not None else None
    tokenizer = tokenizer_for_model(config.tokenizer.tokenizer_name_or_path, vocab)
    for i, nanoset in enumerate(train.nanosets):
        check_token_range(nanoset, vocab, f"{config.data.stage_path(i)}.dataset_folder")
    if val is not None:
        check_token_range(val, vocab, key="data.validation_folder")
    return train, val, tokenizer


def document_end_id(config: Config, tokenizer: Tokenizer | None) -> int:
    """The end-of-document token id model.document_masking cuts packed samples at."""
    if tokenizer is None:
        raise ConfigError(
            "model.document_masking=true cuts each packed sample at its end-of-document tokens, but no "
            "tokenizer names that token: set tokenizer.tokenizer_name_or_path to the tokenizer.json the data "
            "was preprocessed with, or set model.document_masking=false."
        )
    return eos_token_id(tokenizer)


def check_batch_token_ids(
    micro_batches: list[MicroBatch], vocab_size: int, ctx: ParallelContext, step: int
) -> None:
    """An id >= vocab_size would crash the embedding (on GPU as an opaque device assert). The largest id is
    agreed over dp, so every rank stops here together instead of one leaving the others waiting."""
    # Inputs and targets both: the last target of a sample is no input (a masked target is negative).
    ids = max(max(int(mb.inputs.max()), int(mb.targets.max())) for mb in micro_batches)
    largest_id = torch.tensor(float(ids), device=ctx.device)
    largest = int(ctx.comm.read(ctx.comm.all_reduce(largest_id, ctx.dp_group, op="max"), "largest token id"))
    if largest >= vocab_size:
        raise DataError(
            f"step {step}: the training data holds token id {largest}, but model.model_config.vocab_size="
            f"{vocab_size} allows ids 0..{vocab_size - 1}. The data was tokenized with a larger vocabulary "
            f"than the model's: set model.model_config.vocab_size >= {largest + 1} (a multiple of 64 or 128 "
            "is fastest), or re-run `femtotron preprocess` with the tokenizer this model is meant for."
        )
