"""`femtotron inspect-data` (diagnostics/data_check.py): samples decoded as the model sees them."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from femtotron.data.indexed import IndexedDatasetWriter
from femtotron.data.nanoset import open_nanoset
from femtotron.diagnostics.data_check import DOCUMENT_END, describe_data, first_loss_warning, inspect_samples

TOKENIZER = Path(__file__).parents[2] / "examples" / "tokenizer.json"


def test_packed_documents_show_where_each_ends(tmp_path):
    """The end token decodes to nothing: without a mark, two documents packed into one sample read as one."""
    tokenizer = Tokenizer.from_file(str(TOKENIZER))
    end = tokenizer.token_to_id("<|endoftext|>")
    words = tokenizer.encode(" the king is dead").ids
    writer = IndexedDatasetWriter(str(tmp_path / "docs"), np.uint16)
    for _ in range(8):
        writer.add_document(np.array([*words, end], dtype=np.uint16))
    writer.finalize()
    length = 2 * (len(words) + 1)
    report = inspect_samples(open_nanoset(str(tmp_path / "docs"), length, 1234), tokenizer, length, 1)
    text = next(line for line in report.splitlines() if line.startswith("  text: "))
    assert text.count(DOCUMENT_END) == 2
    assert "  2 document end(s), at positions [" in report
    assert text.count("king") == 2


def test_no_tokenizer_shows_ids_and_says_how_to_see_text(tmp_path):
    writer = IndexedDatasetWriter(str(tmp_path / "docs"), np.uint16)
    for start in range(4):
        writer.add_document(np.arange(start, start + 40, dtype=np.uint16))
    writer.finalize()
    report = inspect_samples(open_nanoset(str(tmp_path / "docs"), 16, 1234), None, 16, 2)
    assert report.count("token ids: ") == 2 and "document end" not in report
    assert report.endswith("(set tokenizer.tokenizer_name_or_path to see the text)")


def test_a_first_loss_far_from_ln_vocab_says_which_way_and_why():
    assert first_loss_warning(5.6, 256) is None
    assert "far below" in first_loss_warning(0.5, 256)
    assert "far above" in first_loss_warning(12.0, 256)


TOKENIZER = Path("examples/tokenizer.json")
CORPUS = Path("examples/data/shakespeare.jsonl.gz")


def _counts(description: str) -> dict[int, int]:
    """The histogram's buckets: lower bound -> documents."""
    buckets = {}
    for line in description.splitlines():
        if line.startswith("  ["):
            low, _, count = line.strip("[ ").replace(",", "").replace(")", "").split()[:3]
            buckets[int(low)] = int(count)
    return buckets


def test_inspect_data_describes_tokenized_data_in_either_layout_alike(tmp_path):
    from femtotron.data.preprocess import preprocess

    texts = ["one two three", "four", "five six seven eight nine ten " * 40]
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(f'{{"text": "{text}"}}\n' for text in texts))
    for output_format, prefix in (("megatron", tmp_path / "m" / "c"), ("datatrove", tmp_path / "d" / "c")):
        preprocess(corpus, TOKENIZER, prefix, progress=False, output_format=output_format)
    tokenizer = Tokenizer.from_file(str(TOKENIZER))
    lengths = [len(tokenizer.encode(text, add_special_tokens=False).ids) + 1 for text in texts]  # + EOS
    megatron = describe_data(str(tmp_path / "m" / "c"), tokenizer)
    datatrove = describe_data(str(tmp_path / "d"), None)
    assert f"3 documents, {sum(lengths):,} tokens" in megatron and "Megatron .bin/.idx, 1 pair(s)" in megatron
    assert f"3 documents, {sum(lengths):,} tokens" in datatrove and "datatrove folder, 1 file(s)" in datatrove
    assert f"min {min(lengths):,}, " in datatrove and f"max {max(lengths):,}" in datatrove
    assert _counts(megatron) == _counts(datatrove) and sum(_counts(megatron).values()) == 3
    assert "first document (4 tokens), decoded: 'one two three<|endoftext|>'" in megatron


def test_inspect_data_describes_raw_text_in_characters_and_tokens(tmp_path, capsys):
    from femtotron.cli import main

    assert main(["inspect-data", str(CORPUS), "--tokenizer", str(TOKENIZER)]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"{CORPUS}: raw text; 42 documents, 5,057,239 characters, ")
    assert "document length in characters: min 2,097" in out and "document length in tokens:" in out
    assert "first document (133,683 characters): \"ALL'S WELL THAT ENDS WELL" in out
    (tmp_path / "empty.jsonl").write_text("")
    assert main(["inspect-data", str(tmp_path / "empty.jsonl")]) == 3
    assert "empty.jsonl: no documents in it" in capsys.readouterr().err
