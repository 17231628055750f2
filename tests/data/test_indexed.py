import os
import struct
import warnings

import numpy as np
import pytest
import torch

from femtotron.data.indexed import (
    IndexedDataset,
    IndexedDatasetWriter,
    resolve_dataset_prefixes,
    token_dtype_for,
)
from femtotron.errors import DataError


def _documents(dtype, n=30, seed=0):
    rng = np.random.default_rng(seed)
    high = min(np.iinfo(dtype).max, 100_000)
    return [rng.integers(0, high, size=rng.integers(0, 40)).astype(dtype) for _ in range(n)]


def _write(prefix, documents, dtype):
    with IndexedDatasetWriter(prefix, dtype) as writer:
        for document in documents:
            writer.add_document(document)
    return str(prefix)


@pytest.fixture
def prefix(tmp_path):
    """A good little uint16 dataset: 3 documents of 4, 2 and 5 tokens."""
    return _write(tmp_path / "corpus", [[1, 2, 3, 4], [5, 6], [7, 8, 9, 10, 11]], np.uint16)


def test_token_dtype_for():
    assert token_dtype_for(32_000) == np.uint16
    assert token_dtype_for(65_536) == np.uint16
    assert token_dtype_for(65_537) == np.int32
    assert token_dtype_for(128_256) == np.int32


@pytest.mark.parametrize("dtype", [np.uint16, np.int32])
def test_round_trip(tmp_path, dtype):
    documents = _documents(dtype)
    ds = IndexedDataset(_write(tmp_path / "rt", documents, dtype))
    assert len(ds) == len(documents) and ds.dtype == dtype
    assert ds.num_tokens == sum(len(d) for d in documents)
    np.testing.assert_array_equal(ds.document_indices, np.arange(len(documents) + 1))
    for i, document in enumerate(documents):
        np.testing.assert_array_equal(ds[i], document)
    np.testing.assert_array_equal(ds.tokens(0, ds.num_tokens), np.concatenate(documents))
    assert os.path.getsize(tmp_path / "rt.bin") == ds.num_tokens * np.dtype(dtype).itemsize
    assert sorted(os.listdir(tmp_path)) == ["rt.bin", "rt.idx"]  # temp files renamed away


def test_get_slices_and_megatron_style_items(tmp_path):
    with IndexedDatasetWriter(tmp_path / "m", np.int32) as writer:
        writer.add_item([1, 2, 3])
        writer.add_item([4, 5])
        writer.end_document()
        writer.add_document(np.array([6, 7, 8, 9]))
    ds = IndexedDataset(tmp_path / "m")
    np.testing.assert_array_equal(ds.document_indices, [0, 2, 3])
    np.testing.assert_array_equal(ds[0], [1, 2, 3])
    np.testing.assert_array_equal(ds[-1], [6, 7, 8, 9])
    with pytest.raises(IndexError):
        ds[3]


def test_writer_leaves_nothing_behind_on_error(tmp_path):
    with pytest.raises(ValueError, match="do not fit"):
        with IndexedDatasetWriter(tmp_path / "x", np.uint16) as writer:
            writer.add_document([1, 2])
            writer.add_document([70_000])
    assert os.listdir(tmp_path) == []


@pytest.fixture(scope="module")
def megatron_indexed():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # megatron-core warns that Apex/TE are absent; irrelevant here
        try:
            from megatron.core.datasets import indexed_dataset
        except ImportError as e:
            pytest.skip(f"megatron-core's indexed_dataset cannot be imported here: {e}")
    return indexed_dataset


@pytest.mark.parametrize("dtype", [np.uint16, np.int32])
def test_megatron_reads_our_files(tmp_path, megatron_indexed, dtype):
    documents = _documents(dtype)
    prefix = _write(tmp_path / "ours", documents, dtype)
    theirs = megatron_indexed.IndexedDataset(prefix)
    assert len(theirs) == len(documents)
    np.testing.assert_array_equal(theirs.document_indices, np.arange(len(documents) + 1))
    for i, document in enumerate(documents):
        np.testing.assert_array_equal(theirs[i], document)
        assert theirs[i].dtype == dtype


@pytest.mark.parametrize("dtype", [np.uint16, np.int32])
def test_we_read_megatron_files_byte_for_byte(tmp_path, megatron_indexed, dtype):
    documents = _documents(dtype, seed=1)
    builder = megatron_indexed.IndexedDatasetBuilder(str(tmp_path / "theirs.bin"), dtype=dtype)
    for i, document in enumerate(documents):  # two-sequence documents exercise the document index
        builder.add_item(torch.from_numpy(document.astype(np.int64)))
        if i % 2:
            builder.end_document()
    builder.end_document()
    builder.finalize(str(tmp_path / "theirs.idx"))

    ours = IndexedDataset(tmp_path / "theirs")
    reference = megatron_indexed.IndexedDataset(str(tmp_path / "theirs"))
    np.testing.assert_array_equal(ours.document_indices, reference.document_indices)
    for i, document in enumerate(documents):
        np.testing.assert_array_equal(ours[i], document)

    with IndexedDatasetWriter(tmp_path / "ours", dtype) as writer:
        for i, document in enumerate(documents):
            writer.add_item(document)
            if i % 2:
                writer.end_document()
        writer.end_document()
    for suffix in (".bin", ".idx"):
        assert (tmp_path / f"ours{suffix}").read_bytes() == (tmp_path / f"theirs{suffix}").read_bytes()


# --- L3: every way a dataset can be missing or corrupt is named, explained, and the fix given ---


def _patch(path, offset, data):
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


S = 3  # sequences in the `prefix` fixture
POINTERS = 34 + 4 * S
DOCS = 34 + 12 * S

CORRUPTIONS = {
    "bad magic": (lambda p: _patch(f"{p}.idx", 0, b"NOTANIDX\x00"), ".idx", "bad magic"),
    "wrong version": (lambda p: _patch(f"{p}.idx", 9, struct.pack("<Q", 2)), ".idx", "unsupported version 2"),
    "unknown dtype": (lambda p: _patch(f"{p}.idx", 17, b"\x09"), ".idx", "unknown dtype code 9"),
    "truncated idx": (lambda p: os.truncate(f"{p}.idx", DOCS + 8), ".idx", "truncated"),
    "idx shorter than header": (lambda p: os.truncate(f"{p}.idx", 20), ".idx", "shorter than the header"),
    "bin size": (lambda p: os.truncate(f"{p}.bin", 21), ".bin", "size 21 bytes, but .* lists 11 tokens"),
    "offsets": (
        lambda p: _patch(f"{p}.idx", POINTERS + 8, struct.pack("<q", 6)),
        ".idx",
        "offsets inconsistent",
    ),
    "doc index start": (lambda p: _patch(f"{p}.idx", DOCS, struct.pack("<q", 1)), ".idx", "found first=1"),
    "doc index end": (lambda p: _patch(f"{p}.idx", DOCS + 24, struct.pack("<q", 2)), ".idx", "last=2"),
}


@pytest.mark.parametrize("case", CORRUPTIONS)
def test_L3_corrupt_files_are_named(prefix, case):
    corrupt, suffix, problem = CORRUPTIONS[case]
    corrupt(prefix)
    with pytest.raises(DataError, match=problem) as error:
        resolve_dataset_prefixes(prefix)
    message = str(error.value)
    assert message.startswith(f"{prefix}{suffix}: ")
    assert (
        f"femtotron preprocess --input corpus.jsonl --tokenizer tokenizer.json --output-prefix {prefix}"
        in message
    )


@pytest.mark.parametrize("present", [".bin", ".idx"])
def test_L3_half_a_pair_says_which_half(prefix, present):
    missing = ".idx" if present == ".bin" else ".bin"
    os.remove(f"{prefix}{missing}")
    with pytest.raises(DataError) as error:
        IndexedDataset(prefix)
    message = str(error.value)
    assert f"{prefix}{present} exists but {prefix}{missing} does not" in message
    assert "femtotron preprocess" in message


def test_wrong_prefix_lists_the_pairs_nearby(prefix, tmp_path):
    _write(tmp_path / "other", [[1]], np.uint16)
    with pytest.raises(DataError) as error:
        resolve_dataset_prefixes(tmp_path / "corpus_text_document")
    message = str(error.value)
    assert f"neither {tmp_path}/corpus_text_document.bin nor" in message
    assert f"{tmp_path}/corpus, {tmp_path}/other" in message
    assert "femtotron preprocess" in message


def test_missing_directory_is_named(tmp_path):
    with pytest.raises(DataError, match=r"directory .*nowhere' does not exist.*\n.*femtotron preprocess"):
        resolve_dataset_prefixes(tmp_path / "nowhere" / "corpus")


def test_L3_directory_with_zero_pairs(tmp_path):
    (tmp_path / "lonely.bin").write_bytes(b"")
    with pytest.raises(DataError) as error:
        resolve_dataset_prefixes(tmp_path)
    message = str(error.value)
    assert f"{str(tmp_path)!r} holds zero .bin/.idx pairs" in message
    assert "without their partner: lonely.bin" in message
    assert "femtotron preprocess" in message


def test_resolve_prefix_file_or_directory(prefix, tmp_path):
    _write(tmp_path / "another", [[3, 4]], np.uint16)
    assert resolve_dataset_prefixes(prefix) == [prefix]
    assert resolve_dataset_prefixes(f"{prefix}.idx") == [prefix]
    assert resolve_dataset_prefixes(tmp_path) == [str(tmp_path / "another"), prefix]


def test_S9_directory_with_half_a_pair_beside_a_pair_is_refused(prefix, tmp_path):
    """The other pairs alone would silently leave out the dataset a killed preprocess was replacing."""
    _write(tmp_path / "other", [[1]], np.uint16)
    os.remove(f"{prefix}.idx")
    with pytest.raises(DataError, match=r"without their partner: corpus\.bin \(half a pair: a preprocess"):
        resolve_dataset_prefixes(tmp_path)
