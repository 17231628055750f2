"""Untokenized text as training data (`text_dataset`, nanotron's `hf_dataset_or_datasets`): a Hugging Face
`datasets` directory or .jsonl / .jsonl.gz / .txt files, tokenized once, at start, into `data.cache_dir`, and
read from there by every later run while the text and the tokenizer are the same.

A cached copy is named by a digest of what decides its tokens: each text file's path, modification time, size
and first and last MiB (as the data identity digests dataset files: an edit keeping size and time is seen),
the text column, and the tokenizer's vocabulary and rules. Changing any of them tokenizes again into a new
name; the old copy is left (delete data.cache_dir to reclaim it). The .bin/.idx pair appears only when
complete (data/preprocess.py), so a run killed while tokenizing leaves nothing taken for a finished copy.

The process that starts a run tokenizes, before any rank exists (the local launcher, or the one process), so
its progress bar is the user's. Under torchrun or Slurm, rank 0 tokenizes what is missing and the other
ranks wait for its word through the rendezvous store (`tokenized_by_rank_0`).
"""

from __future__ import annotations

import hashlib
import os
import sys
import time
from collections.abc import Iterator

from femtotron.config import Config
from femtotron.config.sections import DataSource
from femtotron.data.documents import SUFFIXES, DocumentReader, files_in, is_hf_dataset
from femtotron.data.indexed import digest_ends
from femtotron.data.tokenizer import load_tokenizer
from femtotron.errors import DataError, FemtotronError
from femtotron.store import Store

# Text per tokenizing process: a small corpus is tokenized in this process (a pool takes a second to start).
BYTES_PER_WORKER = 64 * 2**20
# No time limit for rank 0's word: tokenizing a corpus takes as long as it takes, and if rank 0 dies its
# store (or torchrun, which stops every rank when one fails) ends the wait.
WAIT_FOREVER = 10 * 365 * 24 * 3600.0
# How long another node may take to see rank 0's new files on a shared file system: NFS caches what a
# directory holds for up to acdirmax, 60 s by default.
VISIBLE_SECONDS = 60.0


def cache_dir(config: Config) -> str:
    return config.data.cache_dir or os.path.join(config.logging.output_dir, "data_cache")


def _inputs(path: str) -> list[str]:
    """The files whose contents a text source's tokens come from."""
    if os.path.isfile(path):
        return [path]
    return files_in(path, suffixes="" if is_hf_dataset(path) else SUFFIXES)  # "": every file


def _missing(path: str, where: str, tokenizer: str) -> DataError:
    """A text source that is not here: perhaps a Hub name, which a run does not fetch."""
    local = os.path.join("data", os.path.basename(os.path.normpath(path)) or "text")
    return DataError(
        f"{path} ({where}.text_dataset): no such file or directory here; femtotron reads local text only "
        f"(a Hugging Face datasets directory, files ending in {', '.join(SUFFIXES)}, or a directory of "
        f'them). A Hub dataset is fetched once, then read from disk: `python -c "import datasets; '
        f"datasets.load_dataset('{path}', split='train').save_to_disk('{local}')\"`, then set "
        f"text_dataset: {local}, or tokenize it yourself: `femtotron preprocess --input {local} --tokenizer "
        f"{tokenizer} --output-prefix {local}-tokens` and set dataset_folder: {local}-tokens."
    )


def tokenizer_digest(tokenizer_path: str) -> str:
    """What decides a tokenizer's ids (its vocabulary and rules): read once per config, not once per path."""
    return hashlib.sha256(load_tokenizer(tokenizer_path).to_str().encode()).hexdigest()


def cached_prefix(path: str, text_column: str, tokenizer: str, directory: str) -> str:
    """Where the tokens of text source `path` are (or will be) cached: a .bin/.idx prefix in `directory`.
    `tokenizer`: the tokenizer's digest (`tokenizer_digest`)."""
    digest = hashlib.sha256()
    for file in _inputs(path):
        digest.update(f"{os.path.relpath(file, path)}:{os.stat(file).st_mtime_ns}\n".encode())
        digest_ends(digest, file)
    digest.update(f"column:{text_column}\ntokenizer:{tokenizer}\n".encode())
    name = os.path.basename(os.path.normpath(path)) or "text"
    return os.path.join(directory, f"{name}-{digest.hexdigest()[:16]}")


def _sources(config: Config) -> Iterator[tuple[str, DataSource]]:
    """(where in the config, source) of every text source."""
    for index, stage in enumerate(config.data.stage_list()):
        if stage.text_dataset is not None:
            yield config.data.stage_path(index), stage


def _text_paths(source: DataSource) -> list[str]:
    spec = source.text_dataset
    return [spec] if isinstance(spec, str) else list(spec)


def tokenized_spec(source: DataSource, config: Config) -> str | list[str] | dict[str, float]:
    """The source's text_dataset with each path replaced by its cached tokens (weights kept)."""
    directory = cache_dir(config)
    tokenizer = tokenizer_digest(config.tokenizer.tokenizer_name_or_path)
    column = source.text_column

    def cached(path: str) -> str:
        prefix = cached_prefix(path, column, tokenizer, directory)
        if not os.path.isfile(f"{prefix}.idx"):
            raise DataError(
                f"{path} (text_dataset) is not tokenized yet (nor since it or the tokenizer changed): "
                f"`femtotron train CONFIG` tokenizes it at start into {directory}, and so does "
                "`femtotron inspect-data CONFIG`."
            )
        return prefix

    spec = source.text_dataset
    if isinstance(spec, dict):
        return {cached(path): weight for path, weight in spec.items()}
    return cached(spec) if isinstance(spec, str) else [cached(path) for path in spec]


def tokenize_text_data(config: Config) -> list[str]:
    """Tokenize every text source not cached yet (with a progress bar on a terminal); a line for each."""
    from femtotron.data.preprocess import preprocess

    lines = []
    directory = cache_dir(config)
    tokenizer = config.tokenizer.tokenizer_name_or_path
    sources = list(_sources(config))
    for where, source in sources:  # a path that is not here, before the tokenizer is read
        missing = [path for path in _text_paths(source) if not os.path.exists(path)]
        if missing:
            raise _missing(missing[0], where, tokenizer)
    digest = tokenizer_digest(tokenizer) if sources else ""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    for where, source in sources:
        for path in _text_paths(source):
            prefix = cached_prefix(path, source.text_column, digest, directory)
            if os.path.isfile(f"{prefix}.bin") and os.path.isfile(f"{prefix}.idx"):
                lines.append(f"{where}.text_dataset {path}: tokenized already, reading {prefix}.bin/.idx")
                continue
            os.makedirs(directory, exist_ok=True)
            size = sum(os.path.getsize(file) for file in _inputs(path))
            workers = max(1, min(cpus, size // BYTES_PER_WORKER))
            print(
                f"femtotron: tokenizing {path} ({where}.text_dataset) into {prefix}.bin/.idx", file=sys.stderr
            )
            summary = preprocess(
                path, tokenizer, prefix, workers=workers, reader=DocumentReader(source.text_column)
            )
            lines.append(
                f"{where}.text_dataset {path}: tokenized {summary.documents:,} documents, {summary.tokens:,} "
                f"tokens into {prefix}.bin/.idx"
            )
    return lines


def tokenized_by_rank_0(config: Config, store: Store, rank: int) -> None:
    """Under a launcher: rank 0 tokenizes what is missing, the others wait for its word (its error, if any,
    becomes theirs, so every rank stops with the same message)."""
    if next(_sources(config), None) is None:
        return
    key = store.fresh_key("text data")
    if rank == 0:
        try:
            tokenize_text_data(config)
        except FemtotronError as e:
            store.post(key, f"error:{e}")
            raise
        store.post(key, "done")
        return
    word = store.collect([key], WAIT_FOREVER).get(key, "error:rank 0 gave no word on the text data")
    if word != "done":
        raise DataError(f"rank 0 could not tokenize the text data: {word.removeprefix('error:')}")
    directory = cache_dir(config)
    digest = tokenizer_digest(config.tokenizer.tokenizer_name_or_path)
    for _, source in _sources(config):
        for path in _text_paths(source):
            prefix = cached_prefix(path, source.text_column, digest, directory)
            _wait_until_visible([f"{prefix}.bin", f"{prefix}.idx"], rank, VISIBLE_SECONDS)


def _wait_until_visible(files: list[str], rank: int, seconds: float) -> None:
    """Return once every one of rank 0's new `files` is seen here: on a shared file system another node
    may see them a while later. Not within `seconds`: an error naming the first missing and the fix."""
    deadline = time.monotonic() + seconds
    while missing := [file for file in files if not os.path.isfile(file)]:
        if time.monotonic() > deadline:
            raise DataError(
                f"rank {rank}: {missing[0]} is not visible here {seconds:g} s after rank 0 tokenized into "
                "it. Set data.cache_dir to a directory every node shares, or tokenize before the job starts "
                "(`femtotron inspect-data CONFIG` on one node)."
            )
        time.sleep(0.5)
