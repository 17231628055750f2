"""Folders tokenized by datatrove's `DocumentTokenizer`, as nanotron's Nanoset reads them.

Each `NAME.ds` is raw little-endian tokens (uint16, or uint32 when the vocabulary exceeds 65,536 ids) and
`NAME.ds.index` the uint64 end (in tokens, exclusive) of every document; `NAME.ds.metadata` (optional) says
`tokenizer|token size`. A sample is what datatrove's `DatatroveFolderDataset` gives: each file, in sorted
order, is cut into non-overlapping windows of `sequence_length + 1` tokens, a file's last partial window
dropped. `NAME.ds.loss` (loss masks) is not read, as neither datatrove's dataset nor nanotron reads it.
"""

from __future__ import annotations

import os

import numpy as np

from femtotron.errors import DataError

TOKEN_DTYPES = {2: np.dtype("<u2"), 4: np.dtype("<u4")}
_FIX = (
    "Re-tokenize it with datatrove's DocumentTokenizer (save_index=True, the default) or with "
    "`femtotron preprocess --format datatrove --output-prefix {folder}/corpus ...`."
)


def token_size_for(vocab_size: int) -> int:
    """Bytes per token as datatrove and nanotron decide it: 4 when the ids do not fit in uint16."""
    return 4 if vocab_size > 65536 else 2


def is_datatrove_folder(path: str | os.PathLike) -> bool:
    return os.path.isdir(path) and any(name.endswith(".ds") for name in os.listdir(path))


def _memmap(path: str, dtype: np.dtype) -> np.ndarray:
    """numpy cannot memory-map an empty file."""
    return np.memmap(path, dtype, "r") if os.path.getsize(path) else np.empty(0, dtype)


def _corrupt(path: str, problem: str) -> DataError:
    folder = os.path.dirname(path)
    return DataError(f"{path}: {problem}.\n{_FIX.format(folder=folder)}")


def _metadata_token_size(path: str) -> int | None:
    """The token size a `.ds.metadata` names on its first line (`tokenizer|size`), or None without one."""
    if not os.path.isfile(f"{path}.metadata"):
        return None
    # Not UTF-8 throughout is no matter: only the size is read, and one that is not 2 or 4 names the file.
    with open(f"{path}.metadata", encoding="utf-8", errors="replace") as f:
        size = f.readline().strip().rsplit("|", 1)[-1]
    if size not in ("2", "4"):
        raise _corrupt(f"{path}.metadata", f"first line names token size {size!r}, expected 2 or 4")
    return int(size)


def _open_file(path: str) -> tuple[np.ndarray, np.ndarray | None]:
    """(document ends, token size or None for an empty file) of one `.ds`, checked against its index."""
    index = f"{path}.index"
    if not os.path.isfile(index):
        raise _corrupt(path, f"its document index {index} is missing")
    if os.path.getsize(index) % 8:
        raise _corrupt(index, f"size {os.path.getsize(index)} bytes is not a whole number of uint64 ends")
    ends = np.asarray(_memmap(index, np.dtype("<u8")))
    if np.any(np.diff(ends.astype(np.int64)) < 0):
        raise _corrupt(index, "document ends are not sorted")
    last = int(ends[-1]) if ends.size else 0
    size = os.path.getsize(path)
    sizes = [s for s in TOKEN_DTYPES if s * last == size]
    if (last or size) and not sizes:
        raise _corrupt(
            path,
            f"size {size} bytes, but {index} ends its last document at token {last:,} ({2 * last} bytes "
            f"of 2-byte or {4 * last} of 4-byte tokens): the file is truncated or not fully written",
        )
    found = sizes[0] if last else None  # an empty file holds tokens of any size
    named = _metadata_token_size(path)
    if named is not None and found is not None and named != found:
        raise _corrupt(f"{path}.metadata", f"names {named}-byte tokens, but {path} holds {found}-byte tokens")
    return ends, found


class DatatroveFolder:
    """Read-only, memory-mapped view of a datatrove folder's `*.ds` files; checks every file on open."""

    def __init__(self, folder: str | os.PathLike) -> None:
        self.path_prefix = os.fspath(folder)  # the name Nanoset's messages and data identity use
        self.name = os.path.join(self.path_prefix, "*.ds")  # token positions count over them, sorted
        listed = sorted(os.listdir(self.path_prefix))
        megatron = [n for n in listed if n.endswith((".bin", ".idx"))]
        if megatron:  # read as datatrove, they would be left out without a word
            raise DataError(
                f"{self.path_prefix} holds datatrove .ds files and Megatron files ({', '.join(megatron)}): a "
                "folder is read as one kind. Move the .bin/.idx pairs to a folder of their own and list both "
                "folders in data.dataset_folder."
            )
        names = [n for n in listed if n.endswith(".ds")]
        paths = [os.path.join(self.path_prefix, n) for n in names]
        opened = [_open_file(p) for p in paths]
        sizes = {size for _, size in opened if size is not None}
        if len(sizes) > 1:
            raise DataError(
                f"{self.path_prefix}: its .ds files mix 2- and 4-byte tokens; a folder is one tokenization.\n"
                + _FIX.format(folder=self.path_prefix)
            )
        self.token_size = sizes.pop() if sizes else 2
        self.dtype = TOKEN_DTYPES[self.token_size]
        self.files = [f for p in paths for f in (p, f"{p}.index")]
        self.document_ends = [ends for ends, _ in opened]
        self.num_documents = sum(ends.size for ends in self.document_ends)
        self._tokens = [_memmap(p, self.dtype) for p in paths]
        self._starts = np.cumsum([0] + [t.size for t in self._tokens])
        self.num_tokens = int(self._starts[-1])
        self._windows: dict[int, np.ndarray] = {}

    def num_samples(self, sequence_length: int) -> int:
        return int(self._window_starts(sequence_length)[-1])

    def _window_starts(self, sequence_length: int) -> np.ndarray:
        if sequence_length not in self._windows:
            windows = [t.size // (sequence_length + 1) for t in self._tokens]
            self._windows[sequence_length] = np.cumsum([0, *windows])
        return self._windows[sequence_length]

    def sample(self, i: int, sequence_length: int) -> np.ndarray:
        """Window i of `sequence_length + 1` tokens, counted over the files in sorted order."""
        starts = self._window_starts(sequence_length)
        file = int(np.searchsorted(starts, i, side="right")) - 1
        start = (i - int(starts[file])) * (sequence_length + 1)
        return np.asarray(self._tokens[file][start : start + sequence_length + 1])

    def tokens(self, start: int, stop: int) -> np.ndarray:
        """Tokens `start ... stop` of all files concatenated in sorted order."""
        parts = [
            t[max(start - first, 0) : max(stop - first, 0)]
            for t, first in zip(self._tokens, self._starts, strict=False)
        ]
        return np.concatenate([np.asarray(p) for p in parts]).astype(self.dtype, copy=False)


def check_token_size(folder: DatatroveFolder, vocab_size: int, key: str) -> None:
    """nanotron reads a folder with the token size its vocabulary implies: another size is other ids."""
    expected = token_size_for(vocab_size)
    if folder.num_tokens and folder.token_size != expected:
        raise DataError(
            f"{folder.path_prefix} ({key}) holds {folder.token_size}-byte tokens, but "
            f"model.model_config.vocab_size={vocab_size} means {expected}-byte tokens (4 only above 65,536 "
            "ids, as datatrove and nanotron decide): it was tokenized for another vocabulary. Re-tokenize it "
            "with the model's tokenizer, or set vocab_size to that tokenizer's."
        )
