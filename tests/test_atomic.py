import os
import stat
import subprocess
import sys

import pytest
import torch
from helpers import make_read_only, small_disk
from safetensors.torch import save_file

from femtotron.atomic import atomic_path, copy_file, remove_stale, temporary_name
from femtotron.errors import FemtotronError, WriteError


@pytest.fixture
def disk(tmp_path):
    with small_disk(tmp_path / "disk") as mount_point:
        yield mount_point


def test_a_symlink_planted_at_the_temporary_name_is_replaced_not_followed(tmp_path):
    outside = tmp_path / "outside.txt"
    outside.write_text("precious")
    target = tmp_path / "out" / "config.yaml"
    target.parent.mkdir()
    os.symlink(outside, temporary_name(target))
    with atomic_path(target) as tmp:
        with open(tmp, "w") as f:
            f.write("new")
    assert outside.read_text() == "precious"
    assert target.read_text() == "new" and not target.is_symlink()
    assert not os.path.lexists(temporary_name(target))


def test_copy_file_replaces_a_symlink_at_the_target(tmp_path):
    outside = tmp_path / "outside.json"
    outside.write_text("precious")
    source = tmp_path / "source.json"
    source.write_text("{}")
    target = tmp_path / "tokenizer.json"
    target.symlink_to(outside)
    copy_file(source, target)
    assert outside.read_text() == "precious"
    assert target.read_text() == "{}" and not target.is_symlink()


def test_files_get_the_umask_mode_even_from_safetensors(tmp_path):
    old = os.umask(0o022)
    try:
        with atomic_path(tmp_path / "model.safetensors") as tmp:
            save_file({"w": torch.zeros(2)}, tmp)
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "model.safetensors").stat().st_mode) == 0o644


def test_a_full_disk_is_a_write_error_naming_the_file_and_leaves_no_temporary(disk):
    target = disk / "model.safetensors"
    with pytest.raises(WriteError) as raised, atomic_path(target) as tmp:
        save_file({"w": torch.zeros(64 * 1024)}, tmp)  # 256 KiB on a 64 KiB disk
    message = str(raised.value)
    assert str(target) in message and "No space left on device" in message and "free space" in message
    assert isinstance(raised.value, FemtotronError) and isinstance(raised.value, OSError)
    assert list(disk.iterdir()) == []

    with pytest.raises(WriteError, match="config.yaml"), atomic_path(disk / "config.yaml") as tmp:
        with open(tmp, "wb") as f:
            f.write(b"x" * 128 * 1024)
    assert list(disk.iterdir()) == []


def test_a_read_only_file_system_is_a_write_error(disk):
    make_read_only(disk)
    with pytest.raises(WriteError, match="read-only: choose a writable directory"):
        copy_file(__file__, disk / "tokenizer.json")


def test_an_unreadable_source_is_not_called_a_write_error(tmp_path):
    with pytest.raises(FileNotFoundError):
        copy_file(tmp_path / "missing.json", tmp_path / "tokenizer.json")


KILLED_WRITE = """
import sys
from femtotron.atomic import atomic_path
with atomic_path(sys.argv[1]) as tmp:
    open(tmp, "w").write("new")
"""


@pytest.mark.distributed
def test_a_kill_before_the_rename_keeps_the_old_file_and_the_next_run_removes_the_temporary(tmp_path):
    target = tmp_path / "config.yaml"
    target.write_text("old")
    env = os.environ | {"FEMTOTRON_CRASH_AT": "atomic.written"}
    killed = subprocess.run([sys.executable, "-c", KILLED_WRITE, str(target)], env=env, timeout=60)
    assert killed.returncode == -9
    assert target.read_text() == "old"
    leftovers = [p for p in tmp_path.iterdir() if p != target]
    assert len(leftovers) == 1 and leftovers[0].read_text() == "new"
    live = tmp_path / temporary_name("live")  # this process's own: still being written
    live.mkdir()
    assert remove_stale(tmp_path) == leftovers
    assert sorted(tmp_path.iterdir()) == sorted([target, live])
