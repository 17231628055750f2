"""`femtotron inspect-data` (diagnostics/data_check.py): samples decoded as the model sees them."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from femtotron.data.indexed import IndexedDatasetWriter
from femtotron.data.nanoset import open_nanoset
from femtotron.diagnostics.data_check import DOCUMENT_END, first_loss_warning, inspect_samples

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
