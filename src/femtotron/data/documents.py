"""Reading raw text documents: the one reader shared by tokenizer training, preprocessing and the text a run
tokenizes at start (data/text_cache.py).

`.jsonl` / `.jsonl.gz`: one JSON object per line, the text under `text_key` (blank lines are skipped).
`.txt`: the whole file is one document. A Hugging Face `datasets` directory (`save_to_disk`): its rows in
order, the text in column `text_key` (a `DatasetDict`: its "train" split), read a record batch at a time
with pyarrow. Any other directory: the files in it and below ending in the suffixes above, in sorted order.
"""

from __future__ import annotations

import gzip
import json
import os
from collections.abc import Iterator
from typing import IO

from femtotron.errors import DataError

SUFFIXES = (".jsonl", ".jsonl.gz", ".txt")
# The longest document (or .jsonl line) read, in characters: 64 Mi, a long book many times over. A line is
# read at most this far, so a gzip bomb (one 3 GB line from 3 MB) is refused instead of filling memory.
MAX_DOCUMENT_CHARACTERS = 2**26


def _open(path: str) -> IO[str]:
    if path.endswith(".gz"):
        return gzip.open(path, "rt", encoding="utf-8")
    return open(path, encoding="utf-8")


def iter_documents(
    path: str | os.PathLike, text_key: str = "text", max_characters: int = MAX_DOCUMENT_CHARACTERS
) -> Iterator[str]:
    """Yield the text of each document in `path`, in file order; a document or line longer than
    `max_characters` is refused."""
    path = os.fspath(path)
    if os.path.isdir(path):
        if is_hf_dataset(path):
            yield from _hf_rows(path, text_key, max_characters)
            return
        files = text_files(path)
        if not files:
            raise DataError(
                f"{path}: a directory without any {', '.join(SUFFIXES)} file, and not a Hugging Face "
                "datasets directory (save_to_disk writes state.json or dataset_dict.json)"
            )
        for file in files:
            yield from iter_documents(file, text_key, max_characters)
        return
    if not path.endswith(SUFFIXES):
        raise DataError(f"{path}: unsupported input; expected a file ending in {', '.join(SUFFIXES)}")
    if not os.path.isfile(path):
        raise DataError(f"{path}: input file does not exist")
    try:
        with _open(path) as f:
            if path.endswith(".txt"):
                text = f.read(max_characters + 1)
                if len(text) > max_characters:
                    raise _too_long(path, "the file", max_characters)
                yield text
                return
            line_number = 0
            # One character more than a full line: a longer line is refused as soon as that much is read.
            while line := f.readline(max_characters + 1):
                line_number += 1
                if len(line) > max_characters and not line.endswith("\n"):
                    raise _too_long(path, f"line {line_number}", max_characters)
                if line.strip():
                    yield _text_of(line, path, line_number, text_key)
    except (UnicodeDecodeError, gzip.BadGzipFile, EOFError) as e:
        raise DataError(
            f"{path}: cannot be read as UTF-8 text{' (gzip)' if path.endswith('.gz') else ''}: {e}"
        ) from e


def text_files(directory: str) -> list[str]:
    """The text files in `directory` and below, in sorted order (the order documents are read)."""
    found = [
        os.path.join(root, name)
        for root, _, names in os.walk(directory)
        for name in names
        if name.endswith(SUFFIXES)
    ]
    return sorted(found)


def is_hf_dataset(path: str) -> bool:
    """A directory `datasets`' save_to_disk wrote: a Dataset (state.json), DatasetDict (dataset_dict.json)."""
    return any(os.path.isfile(os.path.join(path, name)) for name in ("state.json", "dataset_dict.json"))


def _hf_rows(path: str, text_key: str, max_characters: int) -> Iterator[str]:
    """The `text_key` column of a saved `datasets` Dataset, row by row (a DatasetDict: its "train" split)."""
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
        yield from _hf_rows(os.path.join(path, "train"), text_key, max_characters)
        return
    try:
        import pyarrow as pa
    except ImportError:
        raise DataError(
            f"{path} is a Hugging Face datasets directory; reading it needs pyarrow: pip install "
            "'femtotron[hf]' (or pyarrow)"
        ) from None
    with open(os.path.join(path, "state.json"), encoding="utf-8") as f:
        state = json.load(f)
    for record in state.get("_data_files", []):
        arrow = os.path.join(path, os.path.basename(str(record.get("filename", ""))))
        with pa.memory_map(arrow) as source:
            reader = pa.ipc.open_stream(source)  # datasets writes Arrow's streaming format
            if text_key not in reader.schema.names:
                raise DataError(
                    f"{arrow}: no column {text_key!r} (it has {', '.join(reader.schema.names)}); give the "
                    "column that holds the text (text_column, or --text-key)"
                )
            for batch in reader:
                for row, text in enumerate(batch.column(text_key).to_pylist()):
                    if not isinstance(text, str):
                        raise DataError(f"{arrow}: column {text_key!r} holds {type(text).__name__}, not text")
                    if len(text) > max_characters:
                        raise _too_long(arrow, f"row {row} of a batch", max_characters)
                    yield text


def _too_long(path: str, where: str, max_characters: int) -> DataError:
    return DataError(
        f"{path}, {where}: longer than {max_characters:,} characters (rule: a document is at most that "
        "long; a gzip bomb, or a file that is not one document per line?). Split the document, or remove it."
    )


def _text_of(line: str, path: str, line_number: int, text_key: str) -> str:
    try:
        record = json.loads(line)
    except RecursionError:
        raise DataError(
            f"{path}, line {line_number}: JSON nested too deeply to be a document. "
            'Each line must be one JSON object, e.g. {"text": "..."}.'
        ) from None
    except json.JSONDecodeError as e:
        raise DataError(
            f"{path}, line {line_number}: not valid JSON ({e.msg} at column {e.colno}). "
            'Each line must be one JSON object, e.g. {"text": "..."}.'
        ) from e
    if not isinstance(record, dict) or not isinstance(record.get(text_key), str):
        keys = sorted(record) if isinstance(record, dict) else type(record).__name__
        raise DataError(
            f"{path}, line {line_number}: no string field {text_key!r} (found {keys}). "
            "Pass --text-key with the field that holds the text."
        )
    return record[text_key]
