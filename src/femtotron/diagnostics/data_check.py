"""Is the model trained on what the user thinks (N3)? The first loss against ln(vocab), and `femtotron
inspect-data`: samples decoded with the positions that count in the loss. The checks every run makes of its
data (token ids against the vocabulary) are data/run_data.py's."""

from __future__ import annotations

import math
import os

import numpy as np
from tokenizers import Tokenizer

from femtotron.batch import IGNORE_INDEX
from femtotron.data.datatrove import DatatroveFolder, is_datatrove_folder
from femtotron.data.documents import DocumentReader
from femtotron.data.indexed import IndexedDataset, resolve_dataset_prefixes
from femtotron.data.nanoset import MicroBatchIterator, Nanoset
from femtotron.data.tokenizer import eos_token_id
from femtotron.errors import DataError

DOCUMENT_END = "[end of document]"  # the end token decodes to nothing: shown, so packing can be seen


def first_loss_warning(loss: float, vocab_size: int) -> str | None:
    """A freshly initialised model predicts nearly uniformly: its first loss is close to ln(vocab_size)."""
    expected = math.log(vocab_size)
    if abs(loss - expected) <= max(1.0, 0.25 * expected):
        return None
    why = (
        "far below: the targets are too easy to predict (repeated or constant data, or inputs leaking into "
        "the targets)"
        if loss < expected
        else "far above: the initialisation is too large (model.init_method.std, usually 0.02) or the "
        "logits are scaled wrongly"
    )
    return (
        f"step 1: loss {loss:.3f}, but a freshly initialised model should start near ln(vocab_size) = "
        f"ln({vocab_size}) = {expected:.3f}; {why}. Look at the data with `femtotron inspect-data CONFIG`."
    )


def inspect_samples(nanoset: Nanoset, tokenizer: Tokenizer | None, sequence_length: int, n: int) -> str:
    """The first `n` samples of training, as the model sees them: where each comes from, the decoded input
    with its documents' ends marked, and which target positions count in the loss."""
    lines = []
    end_id = _end_of_document_id(tokenizer)
    batches = MicroBatchIterator(nanoset, micro_batch_size=n, batch_accumulation=1, dp_rank=0, dp_size=1)
    batch = batches.step_at(0)[0]
    for g, (inputs, targets) in enumerate(zip(batch.inputs.tolist(), batch.targets.tolist(), strict=True)):
        dataset, index = nanoset.locate(g)
        sample = inputs[:1] + targets
        counted = sum(t != IGNORE_INDEX for t in targets)
        lines.append(
            f"sample {g}: {nanoset.datasets[dataset].path_prefix}, sample {index} of that dataset, "
            f"{sequence_length} input tokens; {counted} of {len(targets)} target positions count in the "
            "loss" + ("" if counted == len(targets) else " (masked positions shown as [masked])")
        )
        lines.append(f"  token ids: {sample[:16]}{' ...' if len(sample) > 16 else ''}")
        if end_id is not None:
            ends = [position for position, token in enumerate(sample) if token == end_id]
            lines.append(
                f"  {len(ends)} document end(s), at positions {ends[:16]}{' ...' * (len(ends) > 16)}"
            )
        if tokenizer is not None:
            pieces = [_piece(tokenizer, token, end_id) for token in sample]
            lines.append("  text: " + repr("".join(pieces))[:2000])
        if counted == 0:
            lines.append("  WARNING: no target position counts in the loss: this sample teaches nothing")
    if tokenizer is None:
        lines.append("(set tokenizer.tokenizer_name_or_path to see the text)")
    return "\n".join(lines)


def _end_of_document_id(tokenizer: Tokenizer | None) -> int | None:
    if tokenizer is None:
        return None
    try:
        return eos_token_id(tokenizer)
    except DataError:  # a tokenizer without one: nothing to mark
        return None


def _piece(tokenizer: Tokenizer, token: int, end_id: int | None) -> str:
    if token == IGNORE_INDEX:
        return "[masked]"
    if token == end_id:
        return DOCUMENT_END
    return tokenizer.decode([token])


def describe_data(path: str, tokenizer: Tokenizer | None, sample_characters: int = 400) -> str:
    """`femtotron inspect-data PATH`: what a data source holds, without a config. Tokenized data (a
    `.bin/.idx` prefix, a directory of pairs, a datatrove folder): documents, tokens, the histogram of
    document lengths and the first document decoded. Raw text (whatever `femtotron preprocess` reads):
    documents and their lengths in characters, in tokens too with a tokenizer."""
    if is_datatrove_folder(path):
        folder = DatatroveFolder(path)
        lengths = np.concatenate([np.diff(ends.astype(np.int64), prepend=0) for ends in folder.document_ends])
        kind = f"datatrove folder, {len(folder.document_ends)} file(s), {folder.dtype.name} tokens"
        first = folder.tokens(0, int(lengths[0])) if lengths.size else np.empty(0, folder.dtype)
    elif _is_tokenized(path):
        datasets = [IndexedDataset(prefix) for prefix in resolve_dataset_prefixes(path)]
        lengths = np.concatenate([_document_lengths(d) for d in datasets])
        kind = f"Megatron .bin/.idx, {len(datasets)} pair(s), {datasets[0].dtype.name} tokens"
        first = datasets[0].tokens(0, int(lengths[0])) if lengths.size else np.empty(0, datasets[0].dtype)
    else:
        return _describe_text(path, tokenizer, sample_characters)
    lines = [f"{path}: {kind}; {lengths.size:,} documents, {int(lengths.sum()):,} tokens"]
    lines += _histogram(lengths, "tokens")
    if tokenizer is not None and lengths.size:
        decoded = tokenizer.decode(first.tolist(), skip_special_tokens=False)
        lines.append(f"first document ({lengths[0]:,} tokens), decoded: {decoded[:sample_characters]!r}")
    return "\n".join(lines)


def _is_tokenized(path: str) -> bool:
    """A `.bin/.idx` prefix (or either file), or a directory holding such pairs."""
    if os.path.isdir(path):
        return any(name.endswith(".idx") for name in os.listdir(path))
    return os.path.isfile(path.removesuffix(".bin").removesuffix(".idx") + ".idx")


def _document_lengths(dataset: IndexedDataset) -> np.ndarray:
    """Tokens per document: the sequences between consecutive document indices, summed."""
    ends = np.concatenate([[0], np.cumsum(dataset.sequence_lengths, dtype=np.int64)])
    return np.diff(ends[dataset.document_indices])


def _describe_text(path: str, tokenizer: Tokenizer | None, sample_characters: int) -> str:
    reader = DocumentReader(skip_bad_records=True)
    characters = []
    tokens = []
    first = None
    for text in reader.read([path]):
        first = text if first is None else first
        characters.append(len(text))
        if tokenizer is not None:
            tokens.append(len(tokenizer.encode(text, add_special_tokens=False).ids))
    if first is None:
        raise DataError(f"{path}: no documents in it")
    lines = [f"{path}: raw text; {len(characters):,} documents, {sum(characters):,} characters"]
    if reader.skipped:
        lines.append(f"{reader.skipped:,} bad record(s) skipped; the first: {reader.first_skipped}")
    lines += _histogram(np.array(characters), "characters")
    if tokens:
        lines[0] += f", {sum(tokens):,} tokens"
        lines += _histogram(np.array(tokens), "tokens")
    lines.append(f"first document ({len(first):,} characters): {first[:sample_characters]!r}")
    return "\n".join(lines)


def _histogram(lengths: np.ndarray, unit: str, width: int = 40) -> list[str]:
    """Summary statistics and a histogram in powers of two, one line a bucket."""
    if not lengths.size:
        return []
    lines = [
        f"document length in {unit}: min {lengths.min():,}, median {int(np.median(lengths)):,}, mean "
        f"{lengths.mean():,.0f}, max {lengths.max():,}"
    ]
    buckets = np.floor(np.log2(np.maximum(lengths, 1))).astype(int)
    counts = np.bincount(buckets)
    for power, count in enumerate(counts):
        if count:
            bar = "#" * max(1, round(width * count / counts.max()))
            lines.append(f"  [{2**power:>11,}, {2 ** (power + 1):>11,}) {count:>9,} {bar}")
    return lines
