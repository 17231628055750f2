"""The document reader: every input format gives the same documents in the same order; several inputs and
globs; malformed records named by file and line or row, or counted and passed over."""

from __future__ import annotations

import gzip
import json
import os
import re
import tracemalloc

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from femtotron.data.documents import DocumentReader, iter_documents
from femtotron.errors import DataError


def write_jsonl(path, texts, key="text"):
    lines = "".join(json.dumps({key: text, "id": i}) + "\n" for i, text in enumerate(texts))
    if path.name.endswith(".gz"):
        with gzip.open(path, "wt", encoding="utf-8") as f:
            f.write(lines)
    elif path.name.endswith(".zst"):
        path.write_bytes(zstandard.ZstdCompressor().compress(lines.encode()))
    else:
        path.write_text(lines, encoding="utf-8")
    return path


def write_parquet(path, texts, key="text", row_group_size=7):
    """Several row groups, read in batches that do not line up with them."""
    table = pa.table({"id": list(range(len(texts))), key: texts})
    pq.write_table(table, path, row_group_size=row_group_size)
    return path


@pytest.mark.parametrize("name", ["c.jsonl", "c.jsonl.gz", "c.jsonl.zst", "c.parquet"])
def test_every_record_format_reads_the_same_documents(tmp_path, texts, name):
    path = tmp_path / name
    write_parquet(path, texts) if name.endswith(".parquet") else write_jsonl(path, texts)
    assert list(iter_documents(path)) == texts


def test_a_parquet_file_is_read_in_bounded_batches_with_another_column(tmp_path, texts, monkeypatch):
    monkeypatch.setattr("femtotron.data.documents.PARQUET_BATCH_ROWS", 3)
    path = write_parquet(tmp_path / "c.parquet", texts, key="content")
    assert list(DocumentReader("content").read([path])) == texts
    with pytest.raises(DataError, match=r"c.parquet: no column 'text' \(it has id, content\)"):
        list(iter_documents(path))
    # batches of 3 within row groups of 7: the rows are counted across the groups
    with_a_gap = write_parquet(tmp_path / "gap.parquet", [*texts[:9], None, *texts[9:]])
    with pytest.raises(DataError, match=r"gap.parquet, row 9: column 'text' holds NoneType"):
        list(DocumentReader().read([with_a_gap]))


def test_txt_and_md_are_one_document_each_or_one_per_block(tmp_path):
    (tmp_path / "a.md").write_text("# Title\nline\n\n\n  \nsecond block\n")
    (tmp_path / "b.txt").write_text("only one\n")
    assert list(iter_documents(tmp_path)) == ["# Title\nline\n\n\n  \nsecond block\n", "only one\n"]
    assert list(DocumentReader(blocks=True).read([tmp_path])) == ["# Title\nline", "second block", "only one"]


def test_several_inputs_and_globs_are_read_in_order(tmp_path, texts):
    for index in range(3):
        write_jsonl(tmp_path / f"shard-{index}.jsonl", texts[index * 10 : (index + 1) * 10])
    write_parquet(tmp_path / "last.parquet", texts[30:])
    reader = DocumentReader()
    assert list(reader.read([tmp_path / "shard-*.jsonl", tmp_path / "last.parquet"])) == texts
    with pytest.raises(DataError, match=r"nothing-\*.jsonl: no file matches this pattern"):
        list(reader.read([tmp_path / "nothing-*.jsonl"]))


def test_bad_records_are_named_or_skipped_and_counted(tmp_path):
    path = tmp_path / "c.jsonl"
    path.write_text('{"text": "one"}\nnot json\n{"body": "x"}\n{"text": "two"}\n')
    with pytest.raises(DataError, match=r"c.jsonl, line 2: not valid JSON .*--skip-bad-records"):
        list(iter_documents(path))
    reader = DocumentReader(skip_bad_records=True)
    assert list(reader.read([path])) == ["one", "two"]
    assert reader.skipped == 2 and "line 2: not valid JSON" in reader.first_skipped
    table = write_parquet(tmp_path / "c.parquet", ["a", None, "b"])
    with pytest.raises(DataError, match=r"c.parquet, row 1: column 'text' holds NoneType, not text"):
        list(iter_documents(table))
    reader = DocumentReader(skip_bad_records=True)
    assert list(reader.read([table])) == ["a", "b"] and reader.skipped == 1


def test_a_line_too_long_is_skipped_whole_and_the_next_is_read(tmp_path):
    path = tmp_path / "c.jsonl"
    path.write_text(json.dumps({"text": "x" * 100}) + "\n" + json.dumps({"text": "short"}) + "\n")
    reader = DocumentReader(skip_bad_records=True, max_characters=40)
    assert list(reader.read([path])) == ["short"] and reader.skipped == 1


def test_a_damaged_compressed_file_is_named(tmp_path, texts):
    path = write_jsonl(tmp_path / "c.jsonl.zst", texts)
    path.write_bytes(path.read_bytes()[:-20])
    with pytest.raises(DataError, match=r"c.jsonl.zst: cannot be read \(zstd\)"):
        list(iter_documents(path))


def test_a_zst_file_of_several_frames_reads_whole(tmp_path, texts):
    """As pzstd and zstd --long write big files: frames one after the other."""
    lines = [json.dumps({"text": text}) + "\n" for text in texts]
    halves = ["".join(lines[:20]), "".join(lines[20:])]
    frames = b"".join(zstandard.ZstdCompressor().compress(half.encode()) for half in halves)
    (tmp_path / "c.jsonl.zst").write_bytes(frames)
    assert list(iter_documents(tmp_path / "c.jsonl.zst")) == texts


def _zst_bomb(path, characters):
    """A .jsonl.zst of one line of `characters` spaces, then a short line, in a few KB."""
    compressor = zstandard.ZstdCompressor().compressobj()
    parts = [compressor.compress(b'{"text": "')]
    parts += [compressor.compress(b" " * 2**20) for _ in range(characters // 2**20)]
    parts += [compressor.compress(b'"}\n{"text": "after"}\n'), compressor.flush()]
    path.write_bytes(b"".join(parts))


def test_a_zst_bomb_is_refused_in_bounded_memory(tmp_path):
    """A 4 KB .jsonl.zst holding a 128 MiB line: zstandard decompressed it whole at once, then copied what
    was left on every 8 KiB read (a 1 GiB line ran for minutes at 2 GB). A zstd block is at most 128 KiB from
    4 bytes: fed 256 bytes at a time, the decompressor gives at most 8 MiB, and reading stops one character
    past the limit."""
    source = tmp_path / "bomb.jsonl.zst"
    _zst_bomb(source, 2**27)
    assert source.stat().st_size < 2**15
    tracemalloc.start()
    with pytest.raises(DataError, match=r"bomb\.jsonl\.zst, line 1: longer than 65,536 characters"):
        list(DocumentReader(max_characters=2**16).read([source]))
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 2**25, f"{peak:,} bytes"  # 8 MiB of output, joined from its pieces, and a line's worth
    reader = DocumentReader(skip_bad_records=True, max_characters=2**16)
    assert list(reader.read([source])) == ["after"] and reader.skipped == 1


def test_links_out_of_a_directory_or_a_glob_are_refused_and_a_file_named_is_read(tmp_path):
    """A link in a data folder to a file elsewhere (a system file) was read with the rest; one named as an
    input is the user's choice, and a link inside the folder stays there."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "secret.txt").write_text("secret")
    folder = tmp_path / "data"
    folder.mkdir()
    (folder / "a.txt").write_text("one")
    (folder / "b.txt").symlink_to(folder / "a.txt")
    (folder / "c.txt").symlink_to(elsewhere / "secret.txt")
    (folder / "more").symlink_to(elsewhere)  # a walk does not enter it, a glob does
    for given, found in (
        (folder, "c.txt"),
        (folder / "*.txt", "c.txt"),
        (folder / "*/*.txt", "more/secret.txt"),
    ):
        outside = (
            rf"{re.escape(str(folder / found))} leads to {re.escape(str(elsewhere / 'secret.txt'))}, outside"
        )
        with pytest.raises(DataError, match=outside):
            list(iter_documents(given))
    assert list(iter_documents(folder / "c.txt")) == ["secret"]
    (folder / "c.txt").unlink()
    assert list(iter_documents(folder)) == ["one", "one"]
    os.mkfifo(folder / "pipe.jsonl")  # refused, never opened (that would wait for a writer forever)
    with pytest.raises(DataError, match=r"pipe\.jsonl: a named pipe, not a regular file"):
        list(iter_documents(folder))
