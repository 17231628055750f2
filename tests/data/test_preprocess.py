import gzip
import json
import os

import numpy as np
import pytest

from femtotron.data.indexed import IndexedDataset
from femtotron.data.preprocess import preprocess
from femtotron.data.tokenizer import load_tokenizer
from femtotron.errors import DataError


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
    preprocess(source, tokenizer_path, tmp_path / "gz", text_key="content", progress=False)
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
    with pytest.raises(DataError, match=r"no-tokenizer\.json does not exist"):
        preprocess(
            tmp_path / "absent.jsonl", tmp_path / "no-tokenizer.json", tmp_path / "out", progress=False
        )
