"""Megatron-Core's indexed dataset: a `.bin` of raw tokens and an `.idx` that says where each sequence is.

`.idx` layout (all little-endian): magic `MMIDIDX\\x00\\x00`, u64 version 1, u8 dtype code, u64 sequence
count S, u64 document-index length D, int32[S] sequence lengths, int64[S] byte offsets into `.bin`,
int64[D] document boundaries (0 ... S). Files written here load in Megatron-Core and the other way round.
Every way a pair can be missing or corrupt is reported as a `DataError` naming the file (failure mode L3).
"""

from __future__ import annotations

import array
import contextlib
import os
import struct
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np

from femtotron.atomic import current_umask, remove, remove_stale, temporary_name, write_error
from femtotron.crash_points import crash_point
from femtotron.errors import DataError

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
_HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, S, D: 34 bytes, no padding
# Position + 1 is the dtype code stored in the header.
_DTYPE_NAMES = ("uint8", "int8", "int16", "int32", "int64", "float64", "float32", "uint16")
DTYPE_CODES: dict[int, np.dtype] = {i + 1: np.dtype(name) for i, name in enumerate(_DTYPE_NAMES)}

DIGESTED_BYTES = 1 << 20  # of each end of a file: a digest of its contents that costs milliseconds


def digest_ends(digest: Any, path: str) -> None:
    """Add file `path`'s size and first and last DIGESTED_BYTES to `digest`: another corpus, another
    tokenization or an edit near either end changes them. The data identity (run_data.py) and the text
    cache's key (text_cache.py)."""
    size = os.path.getsize(path)
    digest.update(f"{size}:".encode())
    with open(path, "rb") as f:
        digest.update(f.read(DIGESTED_BYTES))
        f.seek(max(size - DIGESTED_BYTES, 0))
        digest.update(f.read())


def token_dtype_for(vocab_size: int) -> np.dtype:
    """uint16 when every token id (0 ... vocab_size - 1) fits in it, else int32 (half the disk otherwise)."""
    return np.dtype(np.uint16) if vocab_size <= 65536 else np.dtype(np.int32)


def _le(dtype: np.dtype) -> np.dtype:
    """The format is little-endian whatever the host is."""
    return np.dtype(dtype).newbyteorder("<")


def _fix(prefix: str) -> str:
    return (
        "To produce the files: femtotron preprocess --input corpus.jsonl --tokenizer tokenizer.json "
        f"--output-prefix {prefix}"
    )


def _corrupt(path: str, problem: str) -> DataError:
    """`path` is a `.bin` or `.idx` file."""
    return DataError(
        f"{path}: {problem}. The dataset is corrupt or was not fully written.\n{_fix(path[:-4])}"
    )


def _scan(directory: str) -> tuple[list[str], list[str]]:
    """(prefixes with both `.bin` and `.idx`, file names of `.bin`/`.idx` without their partner), sorted."""
    names = set(os.listdir(directory))
    stems = {n[:-4] for n in names if n.endswith((".bin", ".idx"))}
    pairs = sorted(s for s in stems if f"{s}.bin" in names and f"{s}.idx" in names)
    lone = sorted(n for n in names if n.endswith((".bin", ".idx")) and n[:-4] not in pairs)
    return [os.path.join(directory, s) for s in pairs], lone


def _describe(directory: str) -> str:
    """What a person looking for a dataset in `directory` would want to know is there."""
    if not os.path.isdir(directory):
        return f"directory {directory!r} does not exist"
    pairs, lone = _scan(directory)
    none = f"{directory!r} holds zero .bin/.idx pairs and no datatrove .ds files"
    parts = [f"pairs in {directory!r}: {', '.join(pairs)}" if pairs else none]
    parts += [f"files without their partner: {', '.join(lone)}"] if lone else []
    return "; ".join(parts)


# Why a `.bin` can be alone: the writer removes the old `.idx` before moving the new files into place.
_HALF = "half a pair: a preprocess replacing this dataset was killed midway; run it again"


def _missing(prefix: str) -> DataError:
    bin_path = f"{prefix}.bin"
    idx_path = f"{prefix}.idx"
    if os.path.exists(bin_path):
        what = f"{bin_path} exists but {idx_path} does not ({_HALF})"
    elif os.path.exists(idx_path):
        what = f"{idx_path} exists but {bin_path} does not"
    else:
        what = f"neither {bin_path} nor {idx_path} exists"
    where = _describe(os.path.dirname(prefix) or ".")
    return DataError(f"dataset {prefix!r} not found: {what} ({where}).\n{_fix(prefix)}")


class IndexedDataset:
    """Read-only, memory-mapped view of one `.bin`/`.idx` pair; checks the pair fully on open."""

    def __init__(self, path_prefix: str | os.PathLike) -> None:
        self.path_prefix = os.fspath(path_prefix)
        bin_path = f"{self.path_prefix}.bin"
        idx_path = f"{self.path_prefix}.idx"
        if not (os.path.isfile(bin_path) and os.path.isfile(idx_path)):
            raise _missing(self.path_prefix)
        # numpy cannot memory-map an empty file; an empty index is reported as truncated below.
        if os.path.getsize(idx_path):
            idx = np.memmap(idx_path, np.uint8, "r")
        else:
            idx = np.empty(0, np.uint8)
        if idx.size < _HEADER.size:
            raise _corrupt(idx_path, f"truncated: {idx.size} bytes, shorter than the header")
        magic, version, code, count, doc_count = _HEADER.unpack(idx[: _HEADER.size].tobytes())
        if magic != MAGIC:
            raise _corrupt(idx_path, f"bad magic {magic!r}, expected {MAGIC!r}")
        if version != VERSION:
            raise _corrupt(idx_path, f"unsupported version {version}, expected {VERSION}")
        if code not in DTYPE_CODES:
            raise _corrupt(idx_path, f"unknown dtype code {code}, expected one of 1-8")
        expected = _HEADER.size + 12 * count + 8 * doc_count
        # Megatron's multimodal variant appends one int8 mode per sequence; the tokens are still readable.
        if idx.size not in (expected, expected + count):
            raise _corrupt(
                idx_path,
                f"size {idx.size} bytes does not match its header ({count} sequences, {doc_count} document "
                f"boundaries need {expected} bytes){' - truncated' if idx.size < expected else ''}",
            )
        self.dtype = DTYPE_CODES[code]
        offset = _HEADER.size
        self.sequence_lengths = np.frombuffer(idx, dtype="<i4", count=count, offset=offset)
        self.sequence_pointers = np.frombuffer(idx, dtype="<i8", count=count, offset=offset + 4 * count)
        self.document_indices = np.frombuffer(idx, dtype="<i8", count=doc_count, offset=offset + 12 * count)
        self.num_tokens = int(self.sequence_lengths.sum(dtype=np.int64))
        self.num_documents = doc_count - 1
        self.files = [bin_path, idx_path]
        self.name = bin_path  # what messages about its tokens name
        self._check_index(idx_path, count)

        itemsize = self.dtype.itemsize
        bin_size = os.path.getsize(bin_path)
        if bin_size != self.num_tokens * itemsize:
            raise _corrupt(
                bin_path,
                f"size {bin_size} bytes, but {idx_path} lists {self.num_tokens} tokens of {self.dtype} "
                f"= {self.num_tokens * itemsize} bytes",
            )
        # Offsets are checked to be contiguous, so the .bin file *is* the concatenation of all sequences.
        if bin_size:
            self._tokens = np.memmap(bin_path, _le(self.dtype), "r")
        else:
            self._tokens = np.empty(0, self.dtype)
        crash_point("dataset.opened")

    def _check_index(self, idx_path: str, count: int) -> None:
        lengths = self.sequence_lengths
        pointers = self.sequence_pointers
        docs = self.document_indices
        if count and lengths.min() < 0:
            raise _corrupt(idx_path, "a sequence length is negative")
        expected = np.zeros(count, dtype=np.int64)
        np.cumsum(lengths[:-1], dtype=np.int64, out=expected[1:])
        bad = np.flatnonzero(pointers != expected * self.dtype.itemsize)
        if bad.size:
            i = int(bad[0])
            raise _corrupt(
                idx_path,
                f"byte offsets inconsistent with sequence lengths: sequence {i} starts at byte "
                f"{int(pointers[i])}, expected {int(expected[i]) * self.dtype.itemsize}",
            )
        if docs.size == 0 or docs[0] != 0 or docs[-1] != count:
            found = f"first={int(docs[0])}, last={int(docs[-1])}" if docs.size else "first=None, last=None"
            raise _corrupt(
                idx_path, f"document index must run from 0 to the sequence count {count}, found {found}"
            )
        if np.any(np.diff(docs) < 0):
            raise _corrupt(idx_path, "document index is not sorted")

    def __len__(self) -> int:
        return len(self.sequence_lengths)

    def __getitem__(self, i: int) -> np.ndarray:
        """Sequence `i` (negative: from the end; IndexError beyond), a view of the memory map (no copy)."""
        start = int(self.sequence_pointers[i]) // self.dtype.itemsize
        return self.tokens(start, start + int(self.sequence_lengths[i]))

    def tokens(self, start: int, stop: int) -> np.ndarray:
        """Tokens `start ... stop` of all sequences concatenated in order (crossing document boundaries)."""
        return np.asarray(self._tokens[start:stop])

    def num_samples(self, sequence_length: int) -> int:
        return max(self.num_tokens - 1, 0) // sequence_length

    def sample(self, i: int, sequence_length: int) -> np.ndarray:
        """Tokens `[i*L, i*L + L + 1)` of the stream: consecutive samples overlap by one token."""
        return self.tokens(i * sequence_length, (i + 1) * sequence_length + 1)


class IndexedDatasetWriter:
    """Builds a `.bin`/`.idx` pair; both appear (atomically, by rename) only when `finalize()` runs.
    `add_document(tokens)` is one document of one sequence; or, as Megatron: `add_item`s, `end_document`.
    Subclasses write other layouts (preprocess.DatatroveWriter) by their suffixes, dtypes, `_index_bytes`."""

    DATA_SUFFIX = ".bin"
    INDEX_SUFFIX = ".idx"
    DTYPES = tuple(DTYPE_CODES.values())

    def __init__(self, path_prefix: str | os.PathLike, dtype: np.dtype | type) -> None:
        self.path_prefix = os.fspath(path_prefix)
        self.dtype = np.dtype(dtype)
        if self.dtype not in self.DTYPES:
            raise ValueError(f"dtype {self.dtype} cannot be stored in this format; use one of {self.DTYPES}")
        self._data_path = f"{self.path_prefix}{self.DATA_SUFFIX}"
        self._index_path = f"{self.path_prefix}{self.INDEX_SUFFIX}"
        directory = os.path.dirname(self.path_prefix) or "."
        try:
            os.makedirs(directory, exist_ok=True)
            for stale in remove_stale(directory, os.path.basename(self.path_prefix)):
                print(f"femtotron: removed {stale}, left by a preprocess that was killed", file=sys.stderr)
            self._tmp_bin = temporary_name(self._data_path)
            self._tmp_idx = temporary_name(self._index_path)
            remove(self._tmp_bin)
            self._bin = open(self._tmp_bin, "xb")  # noqa: SIM115 (closed by finalize or abort)
        except OSError as e:
            raise _cannot_write(f"{self._data_path}/{self.INDEX_SUFFIX}", e) from e
        # 8 bytes per sequence and document, not a Python int's 36: a corpus of 100M documents keeps 1.6 GB
        # of index in memory until finalize, not 7 GB.
        self._lengths = array.array("q")
        self._documents = array.array("q", [0])

    def add_item(self, tokens: Sequence[int] | np.ndarray) -> None:
        array = np.asarray(tokens)
        if array.ndim != 1:
            raise ValueError(f"a sequence must be 1-D, got shape {array.shape}")
        if array.size and array.dtype.kind in "iu" and self.dtype.kind in "iu":
            info = np.iinfo(self.dtype)
            if array.min() < info.min or array.max() > info.max:
                raise ValueError(f"token ids {array.min()}...{array.max()} do not fit in {self.dtype}")
        try:
            self._bin.write(array.astype(_le(self.dtype), copy=False).tobytes())
        except OSError as e:
            raise _cannot_write(f"{self._data_path}/{self.INDEX_SUFFIX}", e) from e
        self._lengths.append(int(array.size))

    def end_document(self) -> None:
        self._documents.append(len(self._lengths))

    def add_document(self, tokens: Sequence[int] | np.ndarray) -> None:
        self.add_item(tokens)
        self.end_document()

    def finalize(self) -> None:
        """Write the index, then move both files into place. The old `.idx` goes first: a kill midway leaves
        a `.bin` without its `.idx`, refused as half a pair, never a new `.bin` paired with the old index.
        On any failure (a full disk, say) both temporaries are removed: none stays to fill the disk."""
        try:
            self._bin.close()
            self._write_index()
            remove(self._index_path)
            crash_point("preprocess.idx_removed")
            os.replace(self._tmp_bin, self._data_path)
            crash_point("preprocess.bin_renamed")
            os.replace(self._tmp_idx, self._index_path)
        except OSError as e:
            self.abort()
            raise _cannot_write(f"{self._data_path}/{self.INDEX_SUFFIX}", e) from e
        except BaseException:
            self.abort()
            raise

    def _index_bytes(self) -> list[bytes]:
        lengths = np.asarray(self._lengths, dtype=np.int64)
        if lengths.size and lengths.max() > np.iinfo(np.int32).max:
            raise ValueError("a sequence longer than 2**31 - 1 tokens cannot be indexed")
        pointers = np.zeros(lengths.size, dtype="<i8")
        np.cumsum(lengths[:-1] * self.dtype.itemsize, out=pointers[1:])
        header = _HEADER.pack(MAGIC, VERSION, _code(self.dtype), lengths.size, len(self._documents))
        documents = np.asarray(self._documents, dtype="<i8")
        return [header, lengths.astype("<i4").tobytes(), pointers.tobytes(), documents.tobytes()]

    def _write_index(self) -> None:
        with open(self._tmp_idx, "xb") as f:
            f.writelines(self._index_bytes())
        for path in (self._tmp_bin, self._tmp_idx):  # the usual permissions for what is shared
            os.chmod(path, 0o666 & ~current_umask())

    def abort(self) -> None:
        """Drop what was written; nothing appears at the prefix."""
        with contextlib.suppress(OSError):  # a full disk fails the last flush too; the file goes anyway
            self._bin.close()
        remove(self._tmp_bin)
        remove(self._tmp_idx)

    def __enter__(self) -> IndexedDatasetWriter:
        return self

    def __exit__(self, exc_type: type | None, *_: object) -> None:
        if exc_type is None:
            self.finalize()
        else:
            self.abort()


def _cannot_write(files: str, error: OSError) -> Exception:
    """A full disk, a read-only file system or no permission, named with the dataset's files."""
    return write_error(error, files) or DataError(f"cannot write {files}: {error}")


def _code(dtype: np.dtype) -> int:
    return next(code for code, d in DTYPE_CODES.items() if d == dtype)


def resolve_dataset_prefixes(path: str | os.PathLike) -> list[str]:
    """Checked prefixes from a dataset entry: a prefix (`data/corpus`; a trailing `.bin`/`.idx` tolerated) or
    a directory (all its pairs, sorted), each opened: a bad dataset stops the run before the model exists."""
    path = os.fspath(path)
    if os.path.isdir(path):
        prefixes, lone = _scan(path)
        if lone or not prefixes:  # with a lone file, the other pairs alone would silently leave it out
            half = f" ({_HALF}, or remove the lone file)" if lone else ""
            raise DataError(
                f"dataset directory {path!r} holds no usable dataset: {_describe(path)}{half}.\n"
                f"{_fix(os.path.join(path, 'corpus'))}"
            )
    else:
        prefixes = [path[:-4] if path.endswith((".bin", ".idx")) else path]
    for prefix in prefixes:
        IndexedDataset(prefix)
    return prefixes
