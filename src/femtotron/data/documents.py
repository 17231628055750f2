"""Reading raw text documents: the one reader shared by tokenizer training, preprocessing and the text a run
tokenizes at start (data/text_cache.py).

`.jsonl`, `.jsonl.gz`, `.jsonl.zst`: one JSON object per line, the text under `text_key` (blank lines are
skipped). `.parquet`: the column `text_key`, a row group at a time. `.txt`, `.md`: the whole file is one
document, or with `blocks` each run of lines between blank lines is. A Hugging Face `datasets` directory
(`save_to_disk`): its rows in order, the text in column `text_key` (a `DatasetDict`: its "train" split), read
a record batch at a time with pyarrow. Any other directory: the files in it and below ending in the suffixes
above, in sorted order. Several inputs, or a glob (`shards/*.parquet`), are read one after the other. A
file found in a directory or by a glob must be a regular file inside it, links resolved (`found_in`): a link
there to a file elsewhere is refused; a file named as an input is read wherever a link to it leads.

A malformed record (a line that is not JSON or not text, has no text, or is too long; a row without text)
stops the read naming the file and the line or row; with `skip_bad_records` it is counted
(`DocumentReader.skipped`) and the read goes on. A file that cannot be read at all always stops it.
"""

from __future__ import annotations

import glob
import gzip
import importlib
import io
import json
import os
import stat
import sys
from collections.abc import Iterator
from types import ModuleType
from typing import IO, Any

from femtotron.errors import DataError

SUFFIXES = (".jsonl", ".jsonl.gz", ".jsonl.zst", ".parquet", ".txt", ".md")
WHOLE_FILES = (".txt", ".md")  # a file is a document (or, with blocks, its blank-line separated parts are)
# The longest document (or .jsonl line) read, in characters: 64 Mi, a long book many times over. A line is
# read at most this far, so a gzip bomb (one 3 GB line from 3 MB) is refused instead of filling memory.
MAX_DOCUMENT_CHARACTERS = 2**26
PARQUET_BATCH_ROWS = 1024  # rows handed on at a time
# A zstd block decodes to at most 128 KiB from as little as 4 bytes (one byte repeated): fed this many bytes
# at a time, the decompressor gives at most 8 MiB a call however much a file holds (32 KB can hold a 1 GiB
# line), and still hundreds of MB/s.
ZSTD_FEED_BYTES = 256


def _open(path: str) -> IO[str]:
    if path.endswith(".gz"):
        return gzip.open(path, "rt", encoding="utf-8")
    if path.endswith(".zst"):
        zstandard = _optional("zstandard", path, "'femtotron[zstd]' (or zstandard)")
        return io.TextIOWrapper(io.BufferedReader(ZstdFile(path, zstandard)), encoding="utf-8")
    return open(path, encoding="utf-8")


class ZstdFile(io.RawIOBase):
    """A .zst file's decompressed bytes, frame after frame, a bounded piece at a time. A file cut short is an
    error: zstandard's own stream reader ends quietly there, so a truncated shard would lose its last
    documents unseen."""

    def __init__(self, path: str, zstandard: ModuleType) -> None:
        self.zstandard = zstandard
        self.file = open(path, "rb")  # noqa: SIM115 - closed with this object
        self.frame = zstandard.ZstdDecompressor().decompressobj()
        self.between_frames = False  # one has ended and the next not begun: the only place the file may end
        self.compressed = memoryview(b"")  # as read from the file
        self.fed = 0  # bytes of it given to the decompressor
        self.pending = memoryview(b"")  # decompressed, not read yet

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        while not self.pending:
            if self.frame.eof:  # the next frame, if any, begins in the bytes fed last
                self.fed -= len(self.frame.unused_data)
                self.frame = self.zstandard.ZstdDecompressor().decompressobj()
                self.between_frames = True
            if self.fed == len(self.compressed):
                self.compressed = memoryview(self.file.read(1 << 20))
                self.fed = 0
            if not self.compressed:
                if self.between_frames:
                    return 0
                raise OSError("the file ends inside a zstd frame: it is truncated")
            piece = self.compressed[self.fed : self.fed + ZSTD_FEED_BYTES]
            self.fed += len(piece)
            self.between_frames = False
            try:
                self.pending = memoryview(self.frame.decompress(piece))
            except self.zstandard.ZstdError as e:
                raise OSError(f"not zstd data, or damaged ({e})") from None
        size = min(len(buffer), len(self.pending))
        buffer[:size] = self.pending[:size]
        self.pending = self.pending[size:]
        return size

    def close(self) -> None:
        self.file.close()
        super().close()


def _optional(module: str, path: str, install: str) -> ModuleType:
    """An optional package a format needs, or an error naming the file and how to install it."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise DataError(f"{path}: reading it needs {module}: pip install {install}") from None


def expand_inputs(inputs: list[str | os.PathLike]) -> list[str]:
    """Each input as given, or a glob's matches in sorted order; a glob that matches nothing is refused."""
    paths = []
    for given in map(os.fspath, inputs):
        if not glob.has_magic(given):
            paths.append(given)
            continue
        matches = sorted(glob.glob(given, recursive=True))
        if not matches:
            raise DataError(f"{given}: no file matches this pattern")
        root = given
        while glob.has_magic(root):
            root = os.path.dirname(root)
        paths += [found_in(root or os.curdir, match) for match in matches]
    return paths


class DocumentReader:
    """Reads documents from inputs (files, directories, globs); counts the bad records it skipped."""

    def __init__(
        self,
        text_key: str = "text",
        *,
        blocks: bool = False,
        skip_bad_records: bool = False,
        max_characters: int = MAX_DOCUMENT_CHARACTERS,
    ) -> None:
        self.text_key = text_key
        self.blocks = blocks
        self.skip_bad_records = skip_bad_records
        self.max_characters = max_characters
        self.skipped = 0
        self.first_skipped: str | None = None  # the first bad record's message, for the summary

    def read(self, inputs: list[str | os.PathLike]) -> Iterator[str]:
        """Every document of every input, in order."""
        for path in expand_inputs(inputs):
            yield from self._read_path(path)

    def _bad(self, error: DataError) -> None:
        """A malformed record: raised, or (skip_bad_records) counted."""
        if not self.skip_bad_records:
            raise error
        self.skipped += 1
        self.first_skipped = self.first_skipped or str(error)

    def _read_path(self, path: str) -> Iterator[str]:
        if os.path.isdir(path):
            if is_hf_dataset(path):
                yield from self._hf_rows(path)
                return
            files = files_in(path)
            if not files:
                raise DataError(
                    f"{path}: a directory without any {', '.join(SUFFIXES)} file, and not a Hugging Face "
                    "datasets directory (save_to_disk writes state.json or dataset_dict.json)"
                )
            for file in files:
                yield from self._read_path(file)
            return
        if not path.endswith(SUFFIXES):
            raise DataError(f"{path}: unsupported input; expected a file ending in {', '.join(SUFFIXES)}")
        regular_file(path)
        if path.endswith(".parquet"):
            yield from self._parquet_rows(path)
            return
        try:
            with _open(path) as f:
                if path.endswith(WHOLE_FILES):
                    yield from self._whole_file(f, path)
                    return
                line_number = 0
                # One character more than a full line: a longer line is refused as soon as that much is read.
                while line := f.readline(self.max_characters + 1):
                    line_number += 1
                    if len(line) > self.max_characters and not line.endswith("\n"):
                        self._bad(_too_long(path, f"line {line_number}", self.max_characters))
                        _skip_rest_of_line(f, self.max_characters)
                    elif line.strip():
                        text = _text_of(line, path, line_number, self.text_key)
                        if isinstance(text, DataError):
                            self._bad(text)
                        else:
                            yield text
        except (UnicodeDecodeError, gzip.BadGzipFile, EOFError) as e:
            raise DataError(f"{path}: cannot be read as UTF-8 text{_compression(path)}: {e}") from e
        except OSError as e:  # ZstdFile raises zstandard's errors as OSErrors
            raise DataError(f"{path}: cannot be read{_compression(path)}: {e}") from e

    def _whole_file(self, f: IO[str], path: str) -> Iterator[str]:
        text = f.read(self.max_characters + 1)
        if len(text) > self.max_characters:
            raise _too_long(path, "the file", self.max_characters)
        if not self.blocks:
            yield text
            return
        # Blank lines (only whitespace) end a block; a block of only whitespace is no document.
        block: list[str] = []
        for line in [*text.splitlines(keepends=True), "\n"]:
            if line.strip():
                block.append(line)
            elif block:
                yield "".join(block).rstrip("\n")
                block = []

    def _parquet_rows(self, path: str) -> Iterator[str]:
        """The `text_key` column of a parquet file, at most PARQUET_BATCH_ROWS rows of one row group at a
        time (pyarrow decodes a row group's column whole: memory follows the file's row groups)."""
        parquet = _optional("pyarrow.parquet", path, "'femtotron[hf]' (or pyarrow)")
        try:
            # Buffered reads: a column chunk is read a MiB at a time, not whole beside its decoded values.
            table = parquet.ParquetFile(path, buffer_size=2**20, pre_buffer=False)
        except Exception as e:  # noqa: BLE001 - pyarrow raises its own ArrowInvalid for a file that is no parquet
            raise DataError(f"{path}: cannot be read as parquet: {e}") from None
        if self.text_key not in table.schema_arrow.names:
            raise _no_column(path, self.text_key, table.schema_arrow.names)
        row = 0
        # A row group at a time: a batch spanning groups would join them, and 1,024 rows of books are 190 MB.
        for group in range(table.metadata.num_row_groups):
            batches = table.iter_batches(
                batch_size=PARQUET_BATCH_ROWS, row_groups=[group], columns=[self.text_key]
            )
            for batch in batches:
                yield from self._column(batch.column(0).to_pylist(), path, row)
                row += batch.num_rows

    def _column(self, values: list, path: str, first_row: int) -> Iterator[str]:
        """The texts of a column's values; `first_row`: the row number of the first, for messages."""
        for row, text in enumerate(values, start=first_row):
            if not isinstance(text, str):
                self._bad(
                    DataError(
                        f"{path}, row {row}: column {self.text_key!r} holds {type(text).__name__}, not text"
                    )
                )
            elif len(text) > self.max_characters:
                self._bad(_too_long(path, f"row {row}", self.max_characters))
            else:
                yield text

    def _hf_rows(self, path: str) -> Iterator[str]:
        """The `text_key` column of a saved `datasets` Dataset, row by row (a DatasetDict: its "train"
        split)."""
        dict_file = os.path.join(path, "dataset_dict.json")
        if os.path.isfile(dict_file):
            with open(dict_file, encoding="utf-8") as f:
                splits = json.load(f).get("splits", [])
            if "train" not in splits:
                example = os.path.join(path, str(splits[0]) if splits else "SPLIT")
                raise DataError(
                    f"{path}: a DatasetDict without a 'train' split (it has {', '.join(map(str, splits))}): "
                    f"point at the split to read, e.g. {example}"
                )
            yield from self._hf_rows(os.path.join(path, "train"))
            return
        pa = _optional("pyarrow", path, "'femtotron[hf]' (or pyarrow)")
        with open(os.path.join(path, "state.json"), encoding="utf-8") as f:
            state = json.load(f)
        for record in state.get("_data_files", []):
            arrow = found_in(path, os.path.join(path, os.path.basename(str(record.get("filename", "")))))
            with pa.memory_map(arrow) as source:
                reader = pa.ipc.open_stream(source)  # datasets writes Arrow's streaming format
                if self.text_key not in reader.schema.names:
                    raise _no_column(arrow, self.text_key, reader.schema.names)
                row = 0
                for batch in reader:
                    yield from self._column(batch.column(self.text_key).to_pylist(), arrow, row)
                    row += batch.num_rows


def iter_documents(
    path: str | os.PathLike, text_key: str = "text", max_characters: int = MAX_DOCUMENT_CHARACTERS
) -> Iterator[str]:
    """Yield the text of each document in `path`, in file order; a malformed record is refused."""
    return DocumentReader(text_key, max_characters=max_characters).read([path])


def files_in(directory: str, suffixes: str | tuple[str, ...] = SUFFIXES) -> list[str]:
    """The files in `directory` and below ending in `suffixes` (text files), in sorted order (the order
    documents are read); each must be a regular file inside `directory`."""
    found = [
        os.path.join(root, name)
        for root, _, names in os.walk(directory)
        for name in names
        if name.endswith(suffixes)
    ]
    return sorted(regular_file(found_in(directory, path)) for path in found)


def found_in(directory: str, path: str) -> str:
    """`path`, found in `directory` (by a walk, a glob or a datasets directory's list), refused when it leads
    outside it, links resolved: a link planted in a data folder (to a system file, say) is not read, as
    serialize/hf.py's `inside` refuses one in a model directory."""
    real = os.path.realpath(path)
    root = os.path.realpath(directory)
    if os.path.commonpath([real, root]) != root:
        raise DataError(
            f"{path} leads to {real}, outside {directory} where it was found: files are read from a "
            "directory or a glob only when they are inside it, links resolved. Name the file itself as an "
            "input (or a text_dataset path) if you mean it, or copy it into the directory."
        )
    return path


def regular_file(path: str) -> str:
    """`path`, refused unless it is a regular file (or a link to one): a pipe or a device is never opened."""
    if os.path.isfile(path):
        return path
    if not os.path.exists(path):
        raise DataError(f"{path}: input file does not exist")
    kind = "a named pipe" if stat.S_ISFIFO(os.stat(path).st_mode) else "a socket or a device"
    raise DataError(
        f"{path}: {kind}, not a regular file; text is read from regular files ending in "
        f"{', '.join(SUFFIXES)} (and directories of them). Write the stream to a file first (e.g. a "
        ".jsonl.zst) and give that."
    )


def is_hf_dataset(path: str) -> bool:
    """A directory `datasets`' save_to_disk wrote: a Dataset (state.json), DatasetDict (dataset_dict.json)."""
    return any(os.path.isfile(os.path.join(path, name)) for name in ("state.json", "dataset_dict.json"))


def _compression(path: str) -> str:
    return {".gz": " (gzip)", ".zst": " (zstd)"}.get(os.path.splitext(path)[1], "")


def _skip_rest_of_line(f: IO[str], max_characters: int) -> None:
    """Read past the rest of a line too long to be a record, a bounded piece at a time."""
    while (piece := f.readline(max_characters)) and not piece.endswith("\n"):
        pass


def _no_column(path: str, text_key: str, names: list[str]) -> DataError:
    return DataError(
        f"{path}: no column {text_key!r} (it has {', '.join(names)}); give the column that holds the text "
        "(text_column, or --text-key)"
    )


def _too_long(path: str, where: str, max_characters: int) -> DataError:
    return DataError(
        f"{path}, {where}: longer than {max_characters:,} characters (rule: a document is at most that "
        "long; a gzip bomb, or a file that is not one document per line?). Split the document, or remove it "
        "(or pass --skip-bad-records)."
    )


def _text_of(line: str, path: str, line_number: int, text_key: str) -> str | DataError:
    """The text of one .jsonl line, or the error that says why it has none."""
    try:
        record = json.loads(line)
    except RecursionError:
        return DataError(
            f"{path}, line {line_number}: JSON nested too deeply to be a document. "
            'Each line must be one JSON object, e.g. {"text": "..."} (or pass --skip-bad-records).'
        )
    except json.JSONDecodeError as e:
        return DataError(
            f"{path}, line {line_number}: not valid JSON ({e.msg} at column {e.colno}). "
            'Each line must be one JSON object, e.g. {"text": "..."} (or pass --skip-bad-records).'
        )
    except ValueError:  # the one other error json raises: an integer longer than int() converts
        return DataError(
            f"{path}, line {line_number}: a JSON number of more than {sys.get_int_max_str_digits():,} "
            "digits, longer than Python reads. Remove or quote it (or pass --skip-bad-records)."
        )
    if not isinstance(record, dict) or not isinstance(record.get(text_key), str):
        keys = sorted(record) if isinstance(record, dict) else type(record).__name__
        return DataError(
            f"{path}, line {line_number}: no string field {text_key!r} (found {keys}). "
            "Pass --text-key with the field that holds the text (or --skip-bad-records)."
        )
    text = record[text_key]
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:  # a "\\ud800" escape: JSON allows it, but it is half a character
        return DataError(
            f"{path}, line {line_number}: field {text_key!r} holds a lone surrogate "
            f"\\u{ord(text[e.start]):x} at character {e.start}, which is no text a tokenizer can encode "
            "(half of a character's UTF-16 pair). Remove or fix the record (or pass --skip-bad-records)."
        )
    return text
