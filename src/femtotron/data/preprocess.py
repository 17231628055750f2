"""Text documents -> tokens -> a Megatron-Core .bin/.idx pair (or datatrove's .ds/.ds.index), one
EOS-terminated sequence per document."""

from __future__ import annotations

import itertools
import multiprocessing
import os
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import numpy as np
from tqdm import tqdm

from femtotron.data.datatrove import TOKEN_DTYPES, token_size_for
from femtotron.data.documents import iter_documents
from femtotron.data.indexed import IndexedDatasetWriter, token_dtype_for
from femtotron.data.tokenizer import eos_token_id, load_tokenizer

_CHUNK = 256  # documents per unit of work: large enough to amortise inter-process traffic


class DatatroveWriter(IndexedDatasetWriter):
    """Builds `PREFIX.ds` and `PREFIX.ds.index` (uint64 document ends) as datatrove writes them; both
    appear only when `finalize()` runs, as for the Megatron pair (the old index removed first)."""

    DATA_SUFFIX = ".ds"
    INDEX_SUFFIX = ".ds.index"
    DTYPES = tuple(TOKEN_DTYPES.values())

    def _index_bytes(self) -> list[bytes]:
        ends = np.concatenate([[0], np.cumsum(self._lengths, dtype=np.int64)])[self._documents[1:]]
        return [ends.astype("<u8").tobytes()]


@dataclass(frozen=True)
class PreprocessSummary:
    documents: int
    tokens: int
    output_prefix: str
    dtype: str


class _Encoder:
    """Turns a chunk of texts into token arrays; one per process, so workers load the tokenizer once."""

    def __init__(self, tokenizer_path: str) -> None:
        self.tokenizer = load_tokenizer(tokenizer_path)
        self.eos = eos_token_id(self.tokenizer)
        self.dtype = token_dtype_for(self.tokenizer.get_vocab_size(with_added_tokens=True))

    def __call__(self, texts: list[str]) -> list[np.ndarray]:
        # No BOS/template tokens: the stream is plain text separated by EOS, as Megatron and nanotron expect.
        encodings = self.tokenizer.encode_batch(texts, add_special_tokens=False)
        return [np.array([*e.ids, self.eos], dtype=self.dtype) for e in encodings]


_worker_encoder: _Encoder | None = None


def _init_worker(tokenizer_path: str) -> None:
    global _worker_encoder
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # the pool is the parallelism; avoid nested thread pools
    _worker_encoder = _Encoder(tokenizer_path)


def _encode_in_worker(texts: list[str]) -> list[np.ndarray]:
    assert _worker_encoder is not None, "worker used before _init_worker"
    return _worker_encoder(texts)


def _chunks(texts: Iterable[str]) -> Iterator[list[str]]:
    it = iter(texts)
    while chunk := list(itertools.islice(it, _CHUNK)):
        yield chunk


def preprocess(
    input_path: str | os.PathLike,
    tokenizer_path: str | os.PathLike,
    output_prefix: str | os.PathLike,
    workers: int = 1,
    text_key: str = "text",
    progress: bool = True,
    output_format: str = "megatron",
) -> PreprocessSummary:
    """Tokenize `input_path` (.jsonl, .jsonl.gz or .txt) into `output_prefix`.bin/.idx (`output_format`
    "datatrove": `.ds`/`.ds.index`), which appear only when every document is written. `workers > 1`
    tokenizes in a process pool, byte-identically (in order)."""
    tokenizer_path = os.fspath(tokenizer_path)
    output_prefix = os.fspath(output_prefix)
    encoder = _Encoder(tokenizer_path)  # fails fast on a bad tokenizer, before any worker starts
    chunks = _chunks(iter_documents(input_path, text_key))
    # disable=None: the bar only on a terminal; in a log file its carriage returns would pile up.
    bar = tqdm(
        desc=f"preprocess {input_path}", unit=" docs", file=sys.stderr, disable=None if progress else True
    )
    writer_class = IndexedDatasetWriter
    dtype = encoder.dtype
    if output_format == "datatrove":  # datatrove's token size, as its DocumentTokenizer decides it
        writer_class = DatatroveWriter
        dtype = TOKEN_DTYPES[token_size_for(encoder.tokenizer.get_vocab_size(with_added_tokens=True))]
    with bar, writer_class(output_prefix, dtype) as writer:
        if workers > 1:
            # spawn, not fork: forking a process that already ran Rust thread pools can deadlock.
            context = multiprocessing.get_context("spawn")
            with context.Pool(workers, initializer=_init_worker, initargs=(tokenizer_path,)) as pool:
                encoded: Iterable[list[np.ndarray]] = pool.imap(_encode_in_worker, chunks)
                documents, tokens = _write(encoded, writer, bar)
        else:
            documents, tokens = _write(map(encoder, chunks), writer, bar)
    return PreprocessSummary(
        documents=documents, tokens=tokens, output_prefix=output_prefix, dtype=writer.dtype.name
    )


def _write(encoded: Iterable[list[np.ndarray]], writer: IndexedDatasetWriter, bar: tqdm) -> tuple[int, int]:
    documents = tokens = 0
    for chunk in encoded:
        for ids in chunk:
            writer.add_document(ids)
            tokens += ids.size
        documents += len(chunk)
        bar.update(len(chunk))
    return documents, tokens
