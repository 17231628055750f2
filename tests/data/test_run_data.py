"""N3: token ids the model cannot embed are named, with where they are, before any model is built."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from femtotron.data.indexed import IndexedDatasetWriter
from femtotron.data.nanoset import Nanoset
from femtotron.data.run_data import check_token_range
from femtotron.errors import DataError


def test_the_out_of_range_message_gives_the_largest_id_with_its_own_position(tmp_path):
    writer = IndexedDatasetWriter(str(tmp_path / "d"), np.uint16)
    writer.add_document(np.array([5, 300, 7, 900, 3, 8, 9, 10, 11, 12, 13, 14], dtype=np.uint16))
    writer.finalize()
    with pytest.raises(DataError) as info:
        check_token_range(Nanoset([str(tmp_path / "d")], None, 4, seed=0), vocab_size=256)
    assert (
        f"{tmp_path / 'd'}.bin (data.dataset_folder) holds token id 900 (at token 3; 2 of the first 12 "
        "tokens are out of range)" in str(info.value)
    )
    assert "vocab_size >= 901" in str(info.value)


def test_an_id_beyond_the_vocabulary_in_a_batch_is_caught_also_as_the_last_target():
    """Past the scanned start of a dataset each batch is checked; a sample's last token is only a target."""
    from femtotron.batch import MicroBatch
    from femtotron.data.run_data import check_batch_token_ids
    from femtotron.parallel.context import ParallelContext

    tokens = torch.randint(0, 200, (2, 9))
    tokens[1, -1] = 300
    with pytest.raises(
        DataError, match=r"step 5: the training data holds token id 300, but .*vocab_size=256"
    ):
        check_batch_token_ids([MicroBatch.from_tokens(tokens)], 256, ParallelContext(), step=5)
    check_batch_token_ids([MicroBatch.from_tokens(tokens[:, :-1])], 256, ParallelContext(), step=5)


def write_tokens(prefix, tokens):
    writer = IndexedDatasetWriter(str(prefix), np.uint16)
    writer.add_document(np.array(tokens, dtype=np.uint16))
    writer.finalize()
    return str(prefix)


def test_the_data_identity_tells_other_contents_apart_but_not_the_same_bytes_elsewhere(tmp_path):
    from femtotron.data.run_data import data_changes, data_identity

    def identity(prefix, seed=0, sequence_length=4):
        return data_identity(Nanoset([prefix], None, sequence_length, seed=seed), None)

    saved = identity(write_tokens(tmp_path / "a", range(40)))
    assert data_changes(saved, identity(write_tokens(tmp_path / "copy", range(40))), 8) == []
    other = data_changes(saved, identity(write_tokens(tmp_path / "b", range(1, 41))), 8)  # as many tokens
    assert other == [
        f"the contents of the datasets (data.dataset_folder) changed ([{str(tmp_path / 'a')!r}] at the save, "
        f"[{str(tmp_path / 'b')!r}] now): the run would continue at global sample 8 of other data, not where "
        "the old data left off"
    ]
    reordered = data_changes(saved, identity(str(tmp_path / "a"), seed=1, sequence_length=8), 8)
    assert [change.split(" changed")[0] for change in reordered] == ["data.seed", "tokens.sequence_length"]


def test_a_tokenizer_counts_in_the_identity_only_when_both_sides_name_one():
    from femtotron.data.run_data import data_changes

    base = {"datasets": [], "digest": "d", "weights": [1.0], "seed": 0, "sequence_length": 4}
    assert data_changes({**base, "tokenizer": None}, {**base, "tokenizer": "ab" * 32}, 0) == []
    changed = data_changes({**base, "tokenizer": "ab" * 32}, {**base, "tokenizer": "cd" * 32}, 0)
    assert changed[0].startswith(
        "the tokenizer's vocabulary (tokenizer.tokenizer_name_or_path) changed (ababab"
    )
