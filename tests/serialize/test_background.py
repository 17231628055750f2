"""checkpoints.async_save: the background writer saves what a synchronous save does, bit for bit; resumes
from it are exact, on the same mesh and another; a full disk is named; a host without room is refused."""

from __future__ import annotations

import ctypes
import errno
import json
import os
import random
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from checkpoint_runs import (
    assert_one_process_continues,
    assert_the_resume_is_bit_exact,
    make,
    train,
    whole_then_halves,
)
from distributed import run_ranks
from helpers import LIBC, femtotron, small_disk, write_yaml

from femtotron.cli import main
from femtotron.errors import ConfigError
from femtotron.parallel.context import ParallelContext
from femtotron.serialize import saving
from femtotron.serialize.background import Staging, staging_shortfall
from femtotron.serialize.files import MANIFEST, CheckpointError, CheckpointReader, Slice, rank_file
from femtotron.trainer import Trainer

ASYNC = "checkpoints.async_save=true"


def test_an_async_save_writes_the_files_a_synchronous_save_writes(tiny_config):
    """A save every step, so each waits for the previous one's write: every checkpoint, byte for byte."""
    runs = {}
    for label, mode in (("sync", "false"), ("async", "true")):
        config = make(
            tiny_config, label, "checkpoints.checkpoint_interval=1", f"checkpoints.async_save={mode}", steps=4
        )
        torch.manual_seed(0)  # the RNG states saved: femtotron draws nothing from them, the process did
        random.seed(0)
        np.random.seed(0)
        runs[label] = train(config, ParallelContext()), config.run_dir / "checkpoints"
    (sync, sync_dir), (background, async_dir) = runs.values()
    assert background["losses"] == sync["losses"]
    for step in range(1, 5):
        name = f"step-{step:07d}"
        assert (sync_dir / name / rank_file(0)).read_bytes() == (async_dir / name / rank_file(0)).read_bytes()
        manifests = [json.loads((d / name / MANIFEST).read_text()) for d in (sync_dir, async_dir)]
        for key in ("files", "tensors", "step", "consumed_samples", "rng", "mesh", "data_identity"):
            assert manifests[0][key] == manifests[1][key], (name, key)
    assert (async_dir / "latest").read_text().strip() == "step-0000004"


def test_C3_resume_from_an_async_checkpoint_is_bit_exact_and_the_log_says_what_it_cost(tiny_config, capsys):
    whole = train(make(tiny_config, "whole"), ParallelContext())
    first = make(tiny_config, "first", "checkpoints.checkpoint_interval=2", ASYNC, steps=3)
    capsys.readouterr()
    half = [result.loss for result in Trainer(first, ParallelContext()).train()]
    out = capsys.readouterr().out
    assert "checkpoint of step 2: training stopped" in out and "MiB for the background writer" in out
    assert "MiB written in the background in" in out
    records = [json.loads(line) for line in (first.run_dir / "metrics.jsonl").read_text().splitlines()]
    saves = [r for r in records if "checkpoint_step" in r]
    # Step 2's write is reported at a later step or at the end; step 3's (the last) at the end.
    assert [r["checkpoint_step"] for r in saves] == [2, 3] and all(r["step"] >= 2 for r in saves)
    assert all(r["checkpoint_stall_seconds"] > 0 and r["checkpoint_write_seconds"] > 0 for r in saves)
    saved = first.run_dir / "checkpoints"
    rest = train(make(tiny_config, "rest", f"checkpoints.resume_checkpoint_path={saved}"), ParallelContext())
    assert half + rest["losses"] == whole["losses"]
    assert all(torch.equal(rest["weights"][n], w) for n, w in whole["weights"].items())
    assert all(torch.equal(rest["masters"][n], w) for n, w in whole["masters"].items())


@pytest.mark.distributed
def test_C3_C1_an_async_checkpoint_at_2x2x2_resumes_bit_exact_and_on_one_process(tiny_config):
    per_rank, saved = whole_then_halves(tiny_config, "async-", ASYNC, dp=2, tp=2, pp=2, zero=1)
    assert_the_resume_is_bit_exact(per_rank)
    assert_one_process_continues(tiny_config, "async-single", saved, per_rank)


def test_a_requeued_async_run_resumes_its_own_checkpoint_and_a_finished_one_is_done(
    tiny_config, tmp_path, capsys
):
    """An exception (here a kill as KeyboardInterrupt) waits for the background write: the checkpoint of
    step 2 is committed, and the same command continues from it; once finished, it is already done."""
    config = make(tiny_config, "requeued", "checkpoints.checkpoint_interval=2", ASYNC, steps=4)
    trainer = Trainer(config, ParallelContext(), log_to_console=False)
    one_step = trainer.train_step

    def dying():
        if trainer.state.step == 2:
            raise KeyboardInterrupt("killed")
        return one_step()

    trainer.train_step = dying
    with pytest.raises(KeyboardInterrupt):
        trainer.train()
    assert (config.run_dir / "checkpoints" / "latest").read_text().strip() == "step-0000002"
    path = write_yaml(config, tmp_path / "c.yaml")
    capsys.readouterr()
    assert main(["train", path]) == 0
    assert (
        f"resumed from {config.run_dir / 'checkpoints' / 'step-0000002'} at step 2" in capsys.readouterr().out
    )
    assert main(["train", path]) == 0
    assert "already done" in capsys.readouterr().out


def test_a_disk_that_fills_during_async_saves_names_the_bytes_and_keeps_the_last_good_checkpoint(
    tiny_config, tmp_path
):
    measured = make(tiny_config, "measured", "checkpoints.checkpoint_interval=2", steps=2)
    train(measured, ParallelContext())
    size = sum(f.stat().st_size for f in (measured.run_dir / "checkpoints" / "step-0000002").iterdir())
    with small_disk(tmp_path / "disk", size="4m") as where:
        config = make(
            tiny_config,
            "full",
            "checkpoints.checkpoint_interval=2",
            f"checkpoints.checkpoints_path={where}",
            ASYNC,
            steps=6,
        )
        free = shutil.disk_usage(where).free
        (where / "filler").write_bytes(b"\0" * (free - size * 3 // 2))  # room for one checkpoint, not two
        with pytest.raises(CheckpointError) as failed:
            Trainer(config, ParallelContext(), log_to_console=False).train()
        message = str(failed.value)
        assert (
            f"cannot write checkpoint file {where / '.tmp-step-0000004' / rank_file(0)}: No space" in message
        )
        assert (
            "bytes; " in message
            and "are free there" in message
            and "previous checkpoint is intact" in message
        )
        assert (where / "latest").read_text().strip() == "step-0000002"
        assert (where / "step-0000002" / MANIFEST).is_file()


def test_a_host_without_room_for_the_staging_buffers_is_refused_with_the_fix():
    gib = 2**30
    assert staging_shortfall(per_rank=gib, ranks_here=8, available=9 * gib) is None
    problem = staging_shortfall(per_rank=gib, ranks_here=8, available=7 * gib)
    assert (
        "1.00 GiB per rank, 8.00 GiB for the 8 rank(s) on this host, which has 7.00 GiB available" in problem
    )
    assert "Fix: set checkpoints.async_save=false" in problem


CLONE_NEWNS = 0x00020000  # unshare(2): a mount namespace of this process's own
MS_REC_PRIVATE = (1 << 14) | (1 << 18)  # mount(2): MS_REC | MS_PRIVATE, nothing propagates out


def see_a_cgroup_at_its_memory_limit() -> None:
    """This process alone (a mount namespace of its own) sees what a container at its memory limit sees: a
    cgroup v2 memory.max that memory.current has reached, on a tmpfs over /sys/fs/cgroup. Root only."""
    if (
        LIBC.unshare(CLONE_NEWNS)
        or LIBC.mount(b"none", b"/", None, MS_REC_PRIVATE, None)  # before the mount below: kept in here
        or LIBC.mount(b"tmpfs", b"/sys/fs/cgroup", b"tmpfs", 0, b"size=64k")
    ):
        raise OSError(ctypes.get_errno(), "cannot give this rank a cgroup of its own at its memory limit")
    for name in ("memory.max", "memory.current"):
        Path("/sys/fs/cgroup", name).write_text(f"{2**30}\n")


def _train_with_rank_1_out_of_host_memory(rank, config):
    """The ConfigError the run stops with on this rank (None: it trained)."""
    if rank == 1:
        see_a_cgroup_at_its_memory_limit()
    ctx = ParallelContext(dp=2, collective_timeout_seconds=10)
    try:
        Trainer(config, ctx, log_to_console=False).train()
    except ConfigError as e:
        return str(e)
    finally:
        ctx.close()
    return None


@pytest.mark.distributed
def test_a_host_without_room_for_the_staging_buffers_stops_the_ranks_of_every_host_before_step_1(tiny_config):
    """Rank 1's host has no room for its staging buffers, rank 0's has (the machine's real memory). Both stop
    before step 1, each saying why; rank 0 going on instead would hang at its first collective."""
    # unshare(2) of mounts needs CAP_SYS_ADMIN: root, and not in an unprivileged container (as small_disk).
    probe = f"import ctypes, sys; sys.exit(ctypes.CDLL(None).unshare({CLONE_NEWNS}) != 0)"
    if os.geteuid() != 0 or subprocess.run([sys.executable, "-c", probe]).returncode != 0:
        pytest.skip("needs root for a mount namespace that gives one rank a cgroup at its memory limit")
    config = make(tiny_config, "no-room", "checkpoints.checkpoint_interval=2", ASYNC, dp=2, steps=2)
    rank_0, rank_1 = run_ranks(_train_with_rank_1_out_of_host_memory, 2, config, timeout=120)
    assert "for the 2 rank(s) on this host, which has 0.00 GiB available" in rank_1
    assert rank_0 == (
        "checkpoints.async_save=true: another host has no room for its ranks' staging buffers; its rank's "
        "error says how much. Fix: set checkpoints.async_save=false."
    )
    assert not (config.run_dir / "checkpoints" / "latest").exists()


def test_an_async_save_waits_for_the_write_still_running_and_raises_its_failure(tiny_config, monkeypatch):
    """A save every step on a slow disk. `BackgroundSaves.start` must wait for the write still running: else
    it copies step 2's values into the staging buffers that step 1's writer is reading (step 1's checkpoint
    then holds step 2's weights), and it forgets a failed write, the run going on without its checkpoints.
    The trainer waits before each start too, which hid a start that did not."""
    config = make(tiny_config, "slow-disk", "checkpoints.checkpoint_interval=1", ASYNC, steps=3)
    trainer = Trainer(config, ParallelContext(), log_to_console=False)
    saves = trainer.checkpointer.background
    next_save_started = threading.Event()
    write = saving.write_rank_file

    def slow_disk(directory, *args, **kwargs):  # in the writer thread
        next_save_started.wait(timeout=2)  # the write takes 2 s, or until the next save has its values
        if directory.name == ".tmp-step-0000002":
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return write(directory, *args, **kwargs)

    monkeypatch.setattr(saving, "write_rank_file", slow_disk)
    trainer.train_step()
    saves.start(trainer.parts)
    step_1 = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    trainer.train_step()
    saves.start(trainer.parts)
    next_save_started.set()
    trainer.train_step()
    with pytest.raises(
        CheckpointError, match=r"(?s)step-0000002 was not committed: .*rank 0: OSError: \[Errno 5\]"
    ):
        saves.start(trainer.parts)
    with CheckpointReader(config.run_dir / "checkpoints" / "step-0000001") as reader:
        for name, weights in step_1.items():
            assert torch.equal(reader.read(f"model/{name}", ((0,) * weights.dim(), weights.shape)), weights)


def test_staging_buffers_are_reused_by_the_next_save():
    staging = Staging(pinned=False)
    values = torch.arange(12, dtype=torch.float32).view(3, 4)
    first = staging.stage([Slice("model/w", (3, 4), ((0, 0), (3, 4)), values)])
    buffer = staging.buffers[torch.float32].data_ptr()
    assert torch.equal(first[0].values, values) and first[0].values.data_ptr() == buffer
    second = staging.stage([Slice("model/w", (3, 4), ((0, 0), (3, 4)), values * 2)])
    assert second[0].values.data_ptr() == buffer and torch.equal(second[0].values, values * 2)
    assert staging.bytes() == 48


def test_staging_on_cuda_pins_exactly_its_slices_bytes_where_torchs_pinned_allocator_rounds_up(monkeypatch):
    """A fake CUDA: `pin_memory=True` pins what torch 2.13's caching host allocator does (each request rounded
    up to a power of two), cudaHostRegister what it is given. The staging must pin the bytes the host-memory
    check counts (88 float32 + 10 bfloat16 here), not 128 + 16; an outgrown buffer is unlocked."""
    locked = []
    unlocked = []
    zeros = torch.zeros

    def caching_host_allocator(*size, pin_memory=False, **kwargs):
        values = zeros(*size, **kwargs)
        if pin_memory:
            locked.append(1 << (values.nbytes - 1).bit_length())
        return values

    class FakeCudart:
        def cudaHostRegister(self, pointer, nbytes, flags):
            locked.append(nbytes)
            return 0

        def cudaHostUnregister(self, pointer):
            unlocked.append(pointer)
            return 0

    monkeypatch.setattr(torch, "zeros", caching_host_allocator)
    monkeypatch.setattr(torch.cuda, "cudart", FakeCudart)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    staging = Staging(pinned=True)
    weights = torch.randn(3, 5)
    slices = [
        Slice("model/w", (3, 5), ((0, 0), (3, 5)), weights),
        Slice("optimizer/m", (7,), ((0,), (7,)), torch.randn(7)),
        Slice("model/b", (5,), ((0,), (5,)), torch.randn(5, dtype=torch.bfloat16)),
    ]
    staged = staging.stage(slices)
    assert locked == [88, 10] and staging.bytes() == sum(piece.values.nbytes for piece in slices)
    assert torch.equal(staged[0].values, weights)
    outgrown = staging.buffers[torch.float32].data_ptr()
    del staged  # views keep their buffer, locked, alive
    staging.stage([*slices, Slice("model/v", (2,), ((0,), (2,)), torch.randn(2))])
    assert locked[-1] == 96 and unlocked == [outgrown]


def training_losses(run_dir):
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in records if "loss" in r]


@pytest.mark.distributed
@pytest.mark.usefixtures("no_launcher")
def test_C2_a_rank_killed_during_the_background_write_leaves_the_previous_checkpoint_and_the_run_resumes(
    tiny_config, tmp_path
):
    """Two ranks through the launcher; rank 1 is SIGKILLed while its background writer writes step 4's file,
    training going on meanwhile. Step 4 is never committed; the same command then resumes step 2, and the
    losses are the uninterrupted run's, exactly."""
    whole = make(tiny_config, "whole", "checkpoints.save_final_state=false", dp=2)
    assert femtotron("train", write_yaml(whole, tmp_path / "whole.yaml")).returncode == 0
    config = make(tiny_config, "killed", "checkpoints.checkpoint_interval=2", ASYNC, dp=2)
    path = write_yaml(config, tmp_path / "killed.yaml")
    first = femtotron("train", path, "tokens.train_steps=2")
    assert first.returncode == 0, first.stderr[-3000:]
    crash = {"FEMTOTRON_CRASH_AT": "checkpoint.tensor_written", "FEMTOTRON_CRASH_RANK": "1"}
    killed = femtotron("train", path, env=crash)
    assert killed.returncode != 0 and "rank 1 was killed by SIGKILL" in killed.stderr, killed.stderr[-3000:]
    saved = config.run_dir / "checkpoints"
    assert (saved / ".tmp-step-0000004").is_dir() and not (saved / "step-0000004").exists()
    assert (saved / "latest").read_text().strip() == "step-0000002"
    resumed = femtotron("train", path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from {saved / 'step-0000002'} at step 2" in resumed.stdout
    assert training_losses(config.run_dir) == training_losses(whole.run_dir)
    assert (saved / "latest").read_text().strip() == "step-0000006"
