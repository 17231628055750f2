"""A finished run's weights: written whole or not at all, read only when they fit the config."""

from __future__ import annotations

import pytest
from helpers import small_disk

from femtotron.errors import WriteError
from femtotron.parallel.context import ParallelContext
from femtotron.serialize.weights import save_weights
from femtotron.trainer import Trainer


def test_a_full_disk_at_the_final_weights_save_is_a_write_error_naming_the_file(tiny_config, tmp_path):
    trainer = Trainer(tiny_config("tokens.train_steps=1"), ParallelContext(), log_to_console=False)
    with small_disk(tmp_path / "disk") as disk:  # 64 KiB; the tiny model's weights take about 400 KiB
        with pytest.raises(WriteError, match=f"cannot write {disk / 'model.safetensors'}: No space left"):
            save_weights(trainer.ctx, trainer.model, disk, trainer.log)
        assert list(disk.iterdir()) == []
