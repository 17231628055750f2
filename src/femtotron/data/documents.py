"""Reading raw text documents: the one reader shared by tokenizer training and preprocessing.

`.jsonl` / `.jsonl.gz`: one JSON object per line, the text under `text_key` (blank lines are skipped).
`.txt`: the whole file is one document.
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
