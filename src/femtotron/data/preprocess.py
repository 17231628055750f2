"""Text documents -> tokens -> a Megatron-Core .bin/.idx pair (or datatrove's .ds/.ds.index), one
EOS-terminated sequence per document."""

from __future__ import annotations

import collections
import multiprocessing
import os
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
from tqdm import tqdm

from femtotron.atomic import remove, temporary_name
from femtotron.data.datatrove import TOKEN_DTYPES, token_size_for
from femtotron.data.documents import DocumentReader
from femtotron.data.indexed import IndexedDatasetWriter, token_dtype_for
from femtotron.data.tokenizer import eos_token_id, load_tokenizer

# A unit of work: up to this many documents or characters, large enough to amortise inter-process traffic,
# small enough that every worker gets some and that tokenizing it stays small (an Encoding takes ~40 bytes a
# character: a chunk of 256 book-length documents took 900 MiB).
CHUNK_DOCUMENTS = 256
CHUNK_CHARACTERS = 2**20


class DatatroveWriter(IndexedDatasetWriter):
    """Builds `PREFIX.ds` and `PREFIX.ds.index` (uint64 document ends) as datatrove writes them; both
    appear only when `finalize()` runs, as for the Megatron pair (the old index removed first)."""

    DATA_SUFFIX = ".ds"
    INDEX_SUFFIX = ".ds.index"
    DTYPES = tuple(TOKEN_DTYPES.values())

    def _index_bytes(self) -> list[bytes]:
        ends = np.concatenate([[0], np.cumsum(self._lengths, dtype=np.int64)])[
            np.asarray(self._documents)[1:]
        ]
        return [ends.astype("<u8").tobytes()]


class Shards:
    """Documents into numbered pairs (`00000.bin/.idx`, or `.ds/.ds.index`) of at most `shard_bytes` of tokens
    each (a document is never split), in a directory that appears whole at `directory` once every shard is
    written: an interrupted run leaves nothing that looks like a complete dataset. Data stages and the Nanoset
    read such a directory as one dataset, its pairs in order."""

    def __init__(self, writer_class: type, directory: str, dtype: np.dtype, shard_bytes: int) -> None:
        self.writer_class = writer_class
        self.directory = directory
        self.dtype = np.dtype(dtype)
        self.shard_bytes = shard_bytes
        self.staging = temporary_name(directory)
        remove(self.staging)  # a killed run's, or a link planted there: never written through
        os.makedirs(self.staging)
        self.count = 0
        self.written = 0  # bytes of tokens in the current shard
        self.current = self._next()

    def _next(self) -> IndexedDatasetWriter:
        writer = self.writer_class(os.path.join(self.staging, f"{self.count:05d}"), self.dtype)
        self.count += 1
        self.written = 0
        return writer

    def add_document(self, ids: np.ndarray) -> None:
        size = ids.size * self.dtype.itemsize  # as stored, whatever dtype the encoder gave
        if self.written and self.written + size > self.shard_bytes:
            self.current.finalize()
            self.current = self._next()
        self.current.add_document(ids)
        self.written += size

    def __enter__(self) -> Shards:
        return self

    def __exit__(self, exc_type: type | None, *_: object) -> None:
        if exc_type is not None:
            self.current.abort()
            remove(self.staging)
            return
        self.current.finalize()
        replaced = temporary_name(f"{self.directory}.replaced")
        # An earlier run's directory (or a file, a link) is set aside, and removed once the new one is there.
        if os.path.lexists(self.directory):
            os.rename(self.directory, replaced)
        os.rename(self.staging, self.directory)
        remove(replaced)


@dataclass(frozen=True, kw_only=True)
class PreprocessSummary:
    documents: int
    tokens: int
    output_prefix: str
    dtype: str
    shards: int = 1  # output pairs (--shard-size)
    skipped: int = 0  # bad records passed over (--skip-bad-records)
    first_skipped: str | None = None  # the first one's message


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
    chunk: list[str] = []
    characters = 0
    for text in texts:
        chunk.append(text)
        characters += len(text)
        if len(chunk) == CHUNK_DOCUMENTS or characters >= CHUNK_CHARACTERS:
            yield chunk
            chunk = []
            characters = 0
    if chunk:
        yield chunk


def available_cpus() -> int:
    """The CPUs this process may run on (a Slurm or container limit included), the default --workers."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def in_order(
    pool: Any, chunks: Iterator[list[str]], window: int
) -> Iterator[tuple[list[str], list[np.ndarray]]]:
    """Each chunk with its tokens, in input order, with at most `window` chunks read ahead: memory follows
    the workers' batches, not the corpus (Pool.imap would read the input as fast as it can)."""
    pending: collections.deque = collections.deque()
    for chunk in chunks:
        pending.append((chunk, pool.apply_async(_encode_in_worker, (chunk,))))
        if len(pending) >= window:
            done, result = pending.popleft()
            yield done, result.get()
    while pending:
        done, result = pending.popleft()
        yield done, result.get()


def preprocess(
    inputs: str | os.PathLike | list[str | os.PathLike],
    tokenizer_path: str | os.PathLike,
    output_prefix: str | os.PathLike,
    workers: int = 1,
    reader: DocumentReader | None = None,
    progress: bool = True,
    output_format: str = "megatron",
    shard_bytes: int | None = None,
) -> PreprocessSummary:
    """Tokenize `inputs` (files, directories, globs: data/documents.py) into `output_prefix`.bin/.idx
    (`output_format` "datatrove": `.ds`/`.ds.index`), which appear only when every document is written.
    `workers` > 1 tokenizes in a process pool, in order: the files are byte-identical for any number of
    workers. `reader`: how the inputs are read (text key, blocks, bad records). `shard_bytes`: the output is a
    directory `output_prefix` of shards of at most that many bytes of tokens (`Shards`)."""
    tokenizer_path = os.fspath(tokenizer_path)
    output_prefix = os.fspath(output_prefix)
    inputs = [inputs] if isinstance(inputs, (str, os.PathLike)) else inputs
    reader = reader or DocumentReader()
    encoder = _Encoder(tokenizer_path)  # fails fast on a bad tokenizer, before any worker starts
    chunks = _chunks(reader.read(inputs))
    # disable=None: the bar only on a terminal; in a log file its carriage returns would pile up.
    what = os.fspath(inputs[0]) + (f" and {len(inputs) - 1} more" if len(inputs) > 1 else "")
    bar = tqdm(
        desc=f"preprocess {what}",
        unit="B",
        unit_scale=True,
        file=sys.stderr,
        disable=None if progress else True,
    )
    writer_class = IndexedDatasetWriter
    dtype = encoder.dtype
    if output_format == "datatrove":  # datatrove's token size, as its DocumentTokenizer decides it
        writer_class = DatatroveWriter
        dtype = TOKEN_DTYPES[token_size_for(encoder.tokenizer.get_vocab_size(with_added_tokens=True))]
    if shard_bytes is None:
        output = writer_class(output_prefix, dtype)
    else:
        output = Shards(writer_class, output_prefix, dtype, shard_bytes)
    with bar, output as writer:
        if workers > 1:
            # spawn, not fork: forking a process that already ran Rust thread pools can deadlock.
            context = multiprocessing.get_context("spawn")
            with context.Pool(workers, initializer=_init_worker, initargs=(tokenizer_path,)) as pool:
                documents, tokens = _write(in_order(pool, chunks, window=2 * workers), writer, bar)
        else:
            documents, tokens = _write(((chunk, encoder(chunk)) for chunk in chunks), writer, bar)
    return PreprocessSummary(
        documents=documents,
        tokens=tokens,
        output_prefix=output_prefix,
        dtype=np.dtype(dtype).name,
        shards=output.count if shard_bytes is not None else 1,
        skipped=reader.skipped,
        first_skipped=reader.first_skipped,
    )


def _write(
    encoded: Iterable[tuple[list[str], list[np.ndarray]]], writer: IndexedDatasetWriter | Shards, bar: tqdm
) -> tuple[int, int]:
    """Write every chunk's documents; the bar counts the text's bytes (UTF-8), documents and tokens."""
    documents = tokens = 0
    for texts, chunk in encoded:
        for ids in chunk:
            writer.add_document(ids)
            tokens += ids.size
        documents += len(chunk)
        bar.update(sum(len(text.encode("utf-8")) for text in texts))
        bar.set_postfix(docs=f"{documents:,}", tokens=f"{tokens:,}", refresh=False)
    return documents, tokens
