import gzip
import json
import os
import signal
import subprocess
import sys

import numpy as np
import pytest
from helpers import preprocess_command

from femtotron.data.documents import DocumentReader, iter_documents
from femtotron.data.indexed import IndexedDataset, resolve_dataset_prefixes
from femtotron.data.preprocess import preprocess
from femtotron.data.tokenizer import load_tokenizer
from femtotron.errors import DataError, WriteError


def _jsonl_lines(texts, key="text"):
    return "".join(json.dumps({key: t, "id": i}) + "\n" for i, t in enumerate(texts))


def _check(prefix, texts, tokenizer_path):
    tokenizer = load_tokenizer(tokenizer_path)
    ds = IndexedDataset(prefix)
    assert len(ds) == len(texts) and len(ds.document_indices) == len(texts) + 1
    assert ds.dtype == np.uint16
    for i, text in enumerate(texts):
        tokens = ds[i]
        assert tokens[-1] == 0  # <|endoftext|> closes every document
        assert 0 not in tokens[:-1]
        assert tokenizer.decode(tokens[:-1].tolist()) == text
    return ds


def test_jsonl(tmp_path, texts, tokenizer_path):
    source = tmp_path / "corpus.jsonl"
    source.write_text(_jsonl_lines(texts) + "\n", encoding="utf-8")  # a trailing blank line is skipped
    summary = preprocess(source, tokenizer_path, tmp_path / "out" / "corpus", progress=False)
    ds = _check(tmp_path / "out" / "corpus", texts, tokenizer_path)
    assert (summary.documents, summary.tokens, summary.dtype) == (len(texts), ds.num_tokens, "uint16")


def test_jsonl_gz_with_other_text_key(tmp_path, texts, tokenizer_path):
    source = tmp_path / "corpus.jsonl.gz"
    with gzip.open(source, "wt", encoding="utf-8") as f:
        f.write(_jsonl_lines(texts, key="content"))
    preprocess(source, tokenizer_path, tmp_path / "gz", reader=DocumentReader("content"), progress=False)
    _check(tmp_path / "gz", texts, tokenizer_path)


def test_txt_is_one_document(tmp_path, texts, tokenizer_path):
    source = tmp_path / "book.txt"
    text = "\n\n".join(texts)
    source.write_text(text, encoding="utf-8")
    summary = preprocess(source, tokenizer_path, tmp_path / "book", progress=False)
    assert summary.documents == 1
    _check(tmp_path / "book", [text], tokenizer_path)


@pytest.mark.distributed
def test_workers_give_identical_files(tmp_path, texts, tokenizer_path):
    source = tmp_path / "corpus.jsonl"
    source.write_text(_jsonl_lines(texts * 20), encoding="utf-8")  # 800 documents: several chunks
    preprocess(source, tokenizer_path, tmp_path / "one", workers=1, progress=False)
    preprocess(source, tokenizer_path, tmp_path / "two", workers=2, progress=False)
    for suffix in (".bin", ".idx"):
        assert (tmp_path / f"one{suffix}").read_bytes() == (tmp_path / f"two{suffix}").read_bytes()


@pytest.mark.distributed
@pytest.mark.parametrize("workers", [1, 2])
def test_bad_json_line_is_named_and_nothing_is_written(tmp_path, texts, tokenizer_path, workers):
    source = tmp_path / "corpus.jsonl"
    source.write_text(_jsonl_lines(texts * 10) + '{"text": "unterminated\n', encoding="utf-8")
    with pytest.raises(DataError, match=r"corpus\.jsonl, line 401: not valid JSON"):
        preprocess(source, tokenizer_path, tmp_path / "out", workers=workers, progress=False)
    assert sorted(os.listdir(tmp_path)) == ["corpus.jsonl"]


def test_missing_text_key_suggests_flag(tmp_path, texts, tokenizer_path):
    source = tmp_path / "corpus.jsonl"
    source.write_text(_jsonl_lines(texts[:3], key="body"), encoding="utf-8")
    with pytest.raises(
        DataError, match=r"line 1: no string field 'text' \(found \['body', 'id'\]\).*--text-key"
    ):
        preprocess(source, tokenizer_path, tmp_path / "out", progress=False)


def test_unsupported_or_missing_input(tmp_path, tokenizer_path):
    with pytest.raises(DataError, match=r"corpus\.csv: unsupported input"):
        preprocess(tmp_path / "corpus.csv", tokenizer_path, tmp_path / "out", progress=False)
    with pytest.raises(DataError, match=r"absent\.jsonl: input file does not exist"):
        preprocess(tmp_path / "absent.jsonl", tokenizer_path, tmp_path / "out", progress=False)
    os.mkfifo(tmp_path / "pipe.jsonl")  # said to be one, not "does not exist"; never opened
    with pytest.raises(
        DataError, match=r"pipe\.jsonl: a named pipe, not a regular file; .* regular files ending"
    ):
        preprocess(tmp_path / "pipe.jsonl", tokenizer_path, tmp_path / "out", progress=False)
    with pytest.raises(DataError, match=r"no-tokenizer\.json does not exist"):
        preprocess(
            tmp_path / "absent.jsonl", tmp_path / "no-tokenizer.json", tmp_path / "out", progress=False
        )


def _tokens(prefix) -> list[list[int]]:
    return [sequence.tolist() for sequence in IndexedDataset(prefix)]


def _old_dataset(tmp_path, texts, tokenizer_path, prefix):
    source = tmp_path / "old.jsonl"
    source.write_text(_jsonl_lines(texts), encoding="utf-8")
    preprocess(source, tokenizer_path, prefix, progress=False)
    return _tokens(prefix)


def _many_short_documents(tmp_path):
    """3,000 one-word documents: a 12 KB .bin and a 60 KB .idx (12 + 8 bytes a document)."""
    source = tmp_path / "short.jsonl"
    source.write_text(_jsonl_lines(["the"] * 3000), encoding="utf-8")
    return source


@pytest.mark.distributed
@pytest.mark.parametrize("point", ["preprocess.idx_removed", "preprocess.bin_renamed"])
def test_S9_killed_while_replacing_a_dataset_leaves_it_intact_or_refused(
    tmp_path, texts, tokenizer_path, point
):
    """The new corpus has the old one's documents in another order: as many tokens, so a new .bin beside the
    old .idx (the order the files used to be moved in) passed every check and was read as wrong sequences."""
    prefix = tmp_path / "out" / "corpus"
    old = _old_dataset(tmp_path, texts, tokenizer_path, prefix)
    source = tmp_path / "new.jsonl"
    source.write_text(_jsonl_lines(texts[::-1]), encoding="utf-8")
    command = [sys.executable, "-m", "femtotron", "preprocess", "--input", str(source)]
    command += ["--tokenizer", str(tokenizer_path), "--output-prefix", str(prefix)]
    killed = subprocess.run(command, env={**os.environ, "FEMTOTRON_CRASH_AT": point}, capture_output=True)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    try:
        assert _tokens(prefix) == old
    except DataError as error:
        assert f"{prefix}.bin exists but {prefix}.idx does not (half a pair" in str(error)
    with pytest.raises(DataError, match="half a pair"):
        resolve_dataset_prefixes(tmp_path / "out")  # nor is a directory read without it
    finished = subprocess.run(command, capture_output=True, text=True)
    assert finished.returncode == 0, finished.stderr
    assert "left by a preprocess that was killed" in finished.stderr
    assert _tokens(prefix) == [tokens for tokens in old[::-1]]
    assert sorted(os.listdir(tmp_path / "out")) == ["corpus.bin", "corpus.idx"]


def test_L1_a_full_disk_while_writing_the_index_leaves_nothing_behind(small_disk, texts, tokenizer_path):
    """The .bin fits, the .idx does not: the .bin's temporary stayed and the disk stayed full."""
    prefix = small_disk / "corpus"
    old = _old_dataset(small_disk.parent, texts, tokenizer_path, prefix)
    with pytest.raises(
        WriteError, match=f"cannot write {prefix}.bin/.idx: No space left on device. Fix: free"
    ):
        preprocess(_many_short_documents(small_disk.parent), tokenizer_path, prefix, progress=False)
    assert sorted(os.listdir(small_disk)) == ["corpus.bin", "corpus.idx"]
    assert _tokens(prefix) == old


# Runs preprocess with files limited to 20,000 bytes (as `ulimit -f`): writes past it fail with EFBIG.
LIMITED = """
import resource, signal, sys
from femtotron.cli import main
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # else the kernel kills the process at the limit
resource.setrlimit(resource.RLIMIT_FSIZE, (20_000, 20_000))
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.distributed
def test_L1_a_file_size_limit_while_writing_the_index_leaves_nothing_behind(tmp_path, texts, tokenizer_path):
    prefix = tmp_path / "out" / "corpus"
    old = _old_dataset(tmp_path, texts, tokenizer_path, prefix)
    command = [sys.executable, "-c", LIMITED, "preprocess", "--input", str(_many_short_documents(tmp_path))]
    command += ["--tokenizer", str(tokenizer_path), "--output-prefix", str(prefix)]
    result = subprocess.run(command, capture_output=True, text=True)
    assert result.returncode == WriteError.exit_code, result.stderr
    assert f"cannot write {prefix}.bin/.idx: File too large" in result.stderr
    assert "Traceback" not in result.stderr
    assert sorted(os.listdir(tmp_path / "out")) == ["corpus.bin", "corpus.idx"]
    assert _tokens(prefix) == old


def _gzip_bomb(path, characters: int, before: str = "") -> None:
    """`before`, then one JSON line of `characters` spaces, written in 1 MiB pieces: ~1 KB of gzip a MiB."""
    with gzip.open(path, "wt", encoding="utf-8") as f:
        f.write(before + '{"text": "')
        for _ in range(characters // 2**20):
            f.write(" " * 2**20)
        f.write('"}\n')


def test_E4_gzip_bomb_is_refused_naming_its_line(tmp_path, texts, tokenizer_path):
    """A 64 KB gzip holding a 64 MiB + 1 MiB line: read whole, a 3 GB line filled memory (MemoryError)."""
    source = tmp_path / "bomb.jsonl.gz"
    _gzip_bomb(source, 2**26 + 2**20, before=_jsonl_lines(texts[:2]))
    assert source.stat().st_size < 2**17
    with pytest.raises(DataError, match=r"bomb\.jsonl\.gz, line 3: longer than 67,108,864 characters"):
        preprocess(source, tokenizer_path, tmp_path / "out", progress=False)
    assert sorted(os.listdir(tmp_path)) == ["bomb.jsonl.gz"]


def test_E4_a_long_line_within_the_bound_is_read(tmp_path):
    source = tmp_path / "long.jsonl.gz"
    _gzip_bomb(source, 2**20)
    assert [len(text) for text in iter_documents(source, max_characters=2**20 + 12)] == [2**20]
    with pytest.raises(DataError, match=r"line 1: longer than 1,048,587 characters"):
        list(iter_documents(source, max_characters=2**20 + 11))


def test_E4_a_txt_longer_than_the_bound_is_refused(tmp_path):
    source = tmp_path / "book.txt"
    source.write_text("x" * 101)
    with pytest.raises(DataError, match=r"book\.txt, the file: longer than 100 characters"):
        list(iter_documents(source, max_characters=100))


def test_deeply_nested_json_line_is_named(tmp_path, tokenizer_path):
    source = tmp_path / "nested.jsonl"
    source.write_text('{"text": "ok"}\n' + "[" * 100_000 + "]" * 100_000 + "\n")
    with pytest.raises(DataError, match=r"nested\.jsonl, line 2: JSON nested too deeply"):
        preprocess(source, tokenizer_path, tmp_path / "out", progress=False)


@pytest.mark.parametrize(
    ("line", "problem"),
    [
        (
            '{"text": "a \\ud800 b"}',
            r"field 'text' holds a lone surrogate \\ud800 at character 2, which is no text",
        ),
        ('{"text": "a", "n": ' + "9" * 5000 + "}", r"a JSON number of more than 4,300 digits"),
    ],
)
def test_a_record_python_cannot_take_as_text_is_named_or_skipped(tmp_path, tokenizer_path, line, problem):
    """json.loads reads a lone surrogate (the tokenizer then raised a TypeError) and refuses a 5,000-digit
    number with a ValueError: both were tracebacks."""
    source = tmp_path / "corpus.jsonl"
    source.write_text(_jsonl_lines(["before"]) + line + "\n" + _jsonl_lines(["after"]))
    with pytest.raises(DataError, match=rf"corpus\.jsonl, line 2: {problem}.*--skip-bad-records"):
        preprocess(source, tokenizer_path, tmp_path / "out", progress=False)
    reader = DocumentReader(skip_bad_records=True)
    summary = preprocess(source, tokenizer_path, tmp_path / "out", reader=reader, progress=False)
    assert summary.documents == 2 and summary.skipped == 1


def test_a_zst_file_of_random_bytes_is_named(tmp_path, tokenizer_path):
    source = tmp_path / "random.jsonl.zst"
    source.write_bytes(np.random.default_rng(0).bytes(4096))
    reader = DocumentReader(skip_bad_records=True)  # a file that is no zstd is no bad record
    with pytest.raises(DataError, match=r"random\.jsonl\.zst: cannot be read \(zstd\): not zstd data"):
        preprocess(source, tokenizer_path, tmp_path / "out", reader=reader, progress=False)
    assert sorted(os.listdir(tmp_path)) == ["random.jsonl.zst"]


@pytest.mark.distributed  # the command in a process of its own, its stderr a pipe as in a batch job's log
def test_a_log_file_gets_no_progress_bar(tmp_path, texts, tokenizer_path):
    command = preprocess_command(_many_short_documents(tmp_path), tokenizer_path, tmp_path / "corpus")
    result = subprocess.run(command, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert "\r" not in result.stderr and "docs" not in result.stderr
    assert result.stdout.startswith(f"wrote {tmp_path / 'corpus'}.bin/.idx")


def _write_parquet(path, texts):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": texts}), path, row_group_size=64)
    return path


@pytest.mark.distributed
@pytest.mark.parametrize("workers", [1, 2])
def test_parquet_and_a_glob_of_jsonl_shards_give_the_files_of_one_jsonl(
    tmp_path, texts, tokenizer_path, workers
):
    many = texts * 20  # 800 documents: several chunks, each worker several
    (tmp_path / "one.jsonl").write_text(_jsonl_lines(many), encoding="utf-8")
    _write_parquet(tmp_path / "all.parquet", many)
    for shard in range(4):
        (tmp_path / f"shard-{shard}.jsonl").write_text(_jsonl_lines(many[shard * 200 : (shard + 1) * 200]))
    preprocess(tmp_path / "one.jsonl", tokenizer_path, tmp_path / "jsonl", workers=1, progress=False)
    preprocess(
        tmp_path / "all.parquet", tokenizer_path, tmp_path / "parquet", workers=workers, progress=False
    )
    preprocess(
        [tmp_path / "shard-*.jsonl"], tokenizer_path, tmp_path / "shards", workers=workers, progress=False
    )
    for suffix in (".bin", ".idx"):
        expected = (tmp_path / f"jsonl{suffix}").read_bytes()
        assert (tmp_path / f"parquet{suffix}").read_bytes() == expected
        assert (tmp_path / f"shards{suffix}").read_bytes() == expected


# preprocess in a process of its own, printing its peak resident memory (VmHWM: this process's own, from its
# exec on; a child's ru_maxrss would start at its parent's).
PEAK = """
import sys
from femtotron.data.preprocess import preprocess
preprocess(sys.argv[1], sys.argv[2], sys.argv[3], workers=int(sys.argv[4]), progress=False)
print(next(line for line in open("/proc/self/status") if line.startswith("VmHWM")).split()[1])
"""


@pytest.mark.distributed
@pytest.mark.parametrize("workers", [1, 2])
def test_memory_follows_the_batches_not_the_corpus(tmp_path, tokenizer_path, workers):
    """A corpus four times larger (10 MB, then 40 MB) takes no more memory beyond a few MB: documents are
    read, tokenized and written a window of chunks at a time (with workers: at most 2 x workers chunks ahead;
    both corpora fill that window), and the index grows by 16 bytes a document."""
    document = json.dumps({"text": ("pipeline shard epoch token " * 100).strip()}) + "\n"  # ~2.7 KB
    peaks = []
    for count in (4000, 16000):
        source = tmp_path / f"c{count}.jsonl"
        source.write_text(document * count)
        command = [sys.executable, "-c", PEAK, str(source), str(tokenizer_path), str(tmp_path / f"o{count}")]
        done = subprocess.run([*command, str(workers)], capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-2000:]
        peaks.append(int(done.stdout.split()[-1]) * 1024)
    assert peaks[1] - peaks[0] < 8 * 2**20, peaks  # 30 MB more text


def test_the_cli_counts_skipped_records_and_names_the_first(tmp_path, texts, tokenizer_path, capsys):
    from femtotron.cli import main

    source = tmp_path / "c.jsonl"
    source.write_text(_jsonl_lines(texts[:3]) + "oops\n" + _jsonl_lines(texts[3:5]))
    arguments = ["preprocess", "--input", str(source), "--tokenizer", str(tokenizer_path), "--workers", "1"]
    assert main([*arguments, "--output-prefix", str(tmp_path / "o")]) == 3
    assert "c.jsonl, line 4: not valid JSON" in capsys.readouterr().err
    assert main([*arguments, "--output-prefix", str(tmp_path / "o"), "--skip-bad-records"]) == 0
    out = capsys.readouterr().out
    assert (
        "skipped 1 bad record(s) (--skip-bad-records); the first: " in out and "line 4: not valid JSON" in out
    )
    assert f"wrote {tmp_path / 'o'}.bin/.idx: 5 documents" in out


@pytest.mark.parametrize("output_format", ["megatron", "datatrove"])
def test_shards_hold_the_tokens_of_one_pair_and_appear_only_whole(
    tmp_path, texts, tokenizer_path, output_format
):
    from femtotron.data.datatrove import DatatroveFolder

    source = tmp_path / "c.jsonl"
    source.write_text(_jsonl_lines(texts * 5), encoding="utf-8")
    preprocess(source, tokenizer_path, tmp_path / "one", progress=False)
    whole = IndexedDataset(tmp_path / "one")
    out = tmp_path / "sharded"
    out.mkdir()
    (out / "stale.bin").write_bytes(b"an earlier run's")  # replaced whole, not mixed in
    summary = preprocess(
        source, tokenizer_path, out, progress=False, output_format=output_format, shard_bytes=2000
    )
    names = sorted(p.name for p in out.iterdir())
    assert summary.shards > 3 and "stale.bin" not in names and len(names) == 2 * summary.shards
    if output_format == "datatrove":
        folder = DatatroveFolder(out)
        assert folder.tokens(0, folder.num_tokens).tolist() == whole.tokens(0, whole.num_tokens).tolist()
        sizes = [(out / f"{i:05d}.ds").stat().st_size for i in range(summary.shards)]
    else:
        shards = [IndexedDataset(out / f"{i:05d}") for i in range(summary.shards)]
        tokens = np.concatenate([s.tokens(0, s.num_tokens) for s in shards])
        assert tokens.tolist() == whole.tokens(0, whole.num_tokens).tolist()
        assert sum(s.num_documents for s in shards) == whole.num_documents
        sizes = [(out / f"{i:05d}.bin").stat().st_size for i in range(summary.shards)]
    assert max(sizes) <= 2000 and sum(sizes) == whole.num_tokens * 2
    (tmp_path / "bad.jsonl").write_text(_jsonl_lines(texts) + "oops\n")
    with pytest.raises(DataError, match="line 41: not valid JSON"):
        preprocess(
            tmp_path / "bad.jsonl", tokenizer_path, tmp_path / "half", progress=False, shard_bytes=2000
        )
    assert sorted(os.listdir(tmp_path)) == [
        "bad.jsonl",
        "c.jsonl",
        "one.bin",
        "one.idx",
        "sharded",
    ]  # no half


def test_a_document_that_exactly_fills_a_shard_stays_in_it(tmp_path, tokenizer_path, capsys):
    """--shard-size is the most a shard holds: a document ending exactly at the size belongs to the shard it
    fills. A shard cut when full rather than when over it (>= for >) gave one shard more than the data
    needs, here six shards of one document instead of three of two."""
    from femtotron.cli import main

    source = tmp_path / "six.jsonl"
    source.write_text(_jsonl_lines(["pipeline shard"] * 6), encoding="utf-8")
    preprocess(source, tokenizer_path, tmp_path / "one", progress=False)
    document_bytes = IndexedDataset(tmp_path / "one").num_tokens * 2 // 6  # uint16 tokens, equal documents
    arguments = ["preprocess", "--input", str(source), "--tokenizer", str(tokenizer_path), "--workers", "1"]
    out = tmp_path / "sharded"
    assert main([*arguments, "--output-prefix", str(out), "--shard-size", str(2 * document_bytes)]) == 0
    assert "(3 shard(s) of .bin/.idx; train on the directory)" in capsys.readouterr().out
    shards = [IndexedDataset(out / f"{i:05d}") for i in range(3)]
    assert [shard.num_documents for shard in shards] == [2, 2, 2]
    assert sorted(os.listdir(out)) == [f"{i:05d}{suffix}" for i in range(3) for suffix in (".bin", ".idx")]
