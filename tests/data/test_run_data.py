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
