"""P1/L4: a hang ends with one report of what every rank is doing, within seconds, on every rank."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest
import yaml
from distributed import free_port

from femtotron.diagnostics.watchdog import Watchdog, flight_recorder_folder, nccl_flight_recorder
from femtotron.parallel.context import ParallelContext

# One rank of a job, started the way torchrun or srun would. `how` breaks it: "skip-send" drops rank 0's
# pipeline send of micro-batch 1; "skip-ring" its first send round the cp ring; "freeze" stops rank 1
# (SIGSTOP) after its first step.
RANK = """
import os, signal, sys
from femtotron.config import load_config
from femtotron.parallel.context import ParallelContext
from femtotron.trainer import Trainer
config, how = load_config(sys.argv[1]), sys.argv[2]
ctx = ParallelContext.from_config(config)
trainer = Trainer(config, ctx)
rank = int(os.environ["RANK"])
if how == "skip-send" and rank == 0:
    exchange = trainer.pipeline.p2p.exchange
    def dropping(send, recv):
        if send is not None and trainer.pipeline.current.micro_batch == 1 and trainer.state.step == 0:
            send = None
        return exchange(send, recv)
    trainer.pipeline.p2p.exchange = dropping
if how == "skip-ring" and rank == 0:  # receives its first block of keys and values, never sends its own
    import torch
    from femtotron.parallel.context_parallel import ContextParallel
    shift = ContextParallel.start_shift
    def receiving_only(self, tensor, tag):
        ContextParallel.start_shift = shift
        received = torch.empty_like(tensor)
        incoming = self.links[1]
        return received, self.comm.start_p2p("recv", received, incoming.ranks[0], incoming, tag), None
    ContextParallel.start_shift = receiving_only
if how == "freeze" and rank == 1:
    step = trainer.train_step
    def freezing():
        result = step()
        if trainer.state.step == 1:
            os.kill(os.getpid(), signal.SIGSTOP)
        return result
    trainer.train_step = freezing
trainer.train()
"""


def start_job(tiny_config, tmp_path, how, *overrides):
    config = tiny_config(
        "parallelism.hang_timeout_seconds=4",
        "parallelism.collective_timeout_seconds=120",
        "tokens.train_steps=50",
        *overrides,
    )
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(config.to_dict()))
    port = free_port()
    world = config.parallelism.world_size
    env = {
        **os.environ,
        "WORLD_SIZE": str(world),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "OMP_NUM_THREADS": "1",
    }
    return [
        subprocess.Popen(
            [sys.executable, "-c", RANK, str(path), how],
            env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(world)
    ]


@pytest.mark.distributed
def test_P1_a_rank_that_skips_a_send_ends_the_job_with_a_report_naming_the_pair(tiny_config, tmp_path):
    start = time.monotonic()
    ranks = start_job(
        tiny_config,
        tmp_path,
        "skip-send",
        "parallelism.pp=2",
        "model.model_config.num_hidden_layers=2",
        "tokens.batch_accumulation_per_replica=4",
        "tokens.micro_batch_size=1",
    )
    outputs = [rank.communicate(timeout=90)[1] for rank in ranks]
    assert time.monotonic() - start < 60  # not the 120 s collective timeout
    # The rank that reports exits with 4; the other fails on the closed connection (or reports too).
    assert 4 in [rank.returncode for rank in ranks] and all(rank.returncode for rank in ranks), outputs
    # The first rank to see its op pass the timeout reports and exits; the other then fails on the closed
    # pair.
    report = next(output for output in outputs if "hang report" in output)
    assert re.search(
        r"hang report from rank (\d): rank \1 has waited in recv on pp\[\d->\1\] for \d+ s "
        r"\(parallelism.hang_timeout_seconds=4\)",
        report,
    ), report
    # Each direction between two stages has its own group: rank 0 receives on pp[1->0], rank 1 on pp[0->1].
    assert re.search(r"rank 0 \(as of \d+ s ago\): in recv on pp\[1->0\] with rank 1", report), report
    assert re.search(r"rank 1 \(as of \d+ s ago\): in recv on pp\[0->1\] with rank 0", report), report
    assert (
        "deadlock: rank 0 and rank 1 each wait to receive from the other (step 1, pipeline backward of "
        "micro-batch 1 on stage 0; step 1, pipeline forward of micro-batch 1 on stage 1): one of them "
        "skipped or reordered a send"
    ) in report


@pytest.mark.distributed
def test_a_ring_transfer_that_never_comes_is_named_like_a_pipeline_one(tiny_config, tmp_path):
    ranks = start_job(tiny_config, tmp_path, "skip-ring", "parallelism.cp=2", "tokens.micro_batch_size=1")
    outputs = [rank.communicate(timeout=90)[1] for rank in ranks]
    assert 4 in [rank.returncode for rank in ranks] and all(rank.returncode for rank in ranks), outputs
    report = next(output for output in outputs if "hang report" in output)
    # Rank 1 waits for the block rank 0 never sent, on the ring's one-way group from 0 to 1.
    assert re.search(r"rank 1 \(as of \d+ s ago\): in recv on cp\[0->1\] with rank 0", report), report


@pytest.mark.distributed
def test_P1_a_frozen_rank_ends_the_job_on_the_others_within_60_s(tiny_config, tmp_path):
    ranks = start_job(tiny_config, tmp_path, "freeze", "parallelism.dp=2", "tokens.micro_batch_size=2")
    start = time.monotonic()
    try:
        _, report = ranks[0].communicate(timeout=90)
        assert time.monotonic() - start < 60 and ranks[0].returncode == 4, report
    finally:
        ranks[1].send_signal(signal.SIGKILL)
        ranks[1].communicate()
    assert "hang report from rank 0: rank 1 stopped (failed, died or froze)" in report
    assert re.search(r"rank 1 \(as of (\d+) s ago\): .*<- silent", report), report
    assert int(re.search(r"rank 1 \(as of (\d+) s ago\)", report).group(1)) >= 4  # silent for 4 s at least


def test_the_report_says_how_old_each_rank_s_state_is():
    """A frozen rank's last published state can be far behind: the report gives its age (the time since that
    rank published it), so "step 1" is not read as now."""
    dog = Watchdog(ParallelContext(), hang_timeout=600, where=lambda: "step 9")
    dog.world_size = 2  # as if a second rank had published its state
    states = {
        0: {
            "rank": 0,
            "beat": 50,
            "time": 99.0,
            "where": "step 9, pipeline forward of micro-batch 0 on stage 0",
            "ops": [],
            "last_op": None,
        },
        1: {
            "rank": 1,
            "beat": 3,
            "time": 62.0,
            "where": "step 1, pipeline forward of micro-batch 0 on stage 0",
            "ops": [],
            "last_op": None,
        },
    }
    report = dog.report(states, [1], "stopped (failed, died or froze)", now=100.0)
    assert "  rank 0 (as of 0 s ago): no communication in flight; step 9" in report  # the reporter's own: now
    assert "  rank 1 (as of 38 s ago): no communication in flight; step 1, pipeline forward" in report


# Two ranks; rank 0 starts an all-reduce rank 1 never joins and goes on without waiting for it, as a rank does
# on NCCL, where the call returns once the op is queued: its main thread is elsewhere, not in the op.
QUEUED = """
import time, torch
from femtotron.diagnostics.watchdog import Watchdog, nccl_flight_recorder
from femtotron.parallel.context import ParallelContext
ctx = ParallelContext(dp=2, collective_timeout_seconds=120)
Watchdog(ctx, hang_timeout=3, where=lambda: "step 7", interval=0.5).start()
if ctx.rank == 0:
    ctx.comm.start_all_reduce(torch.ones(4), ctx.dp_group)
time.sleep(60)
"""


@pytest.mark.distributed
def test_P1_an_op_that_never_completes_is_reported_though_no_call_waits_in_it(tmp_path):
    """On GPUs a collective call (and a wait on its work) returns at once; a mismatch then blocks the host
    elsewhere (reading a loss), or nowhere yet. The op itself, unfinished past the timeout, is reported; the
    other rank is told to end too, and each first writes torch's flight recorder (gloo's here, as NCCL's on
    GPUs), which NCCL would otherwise write only at its own, later, timeout."""
    port = free_port()
    started = time.monotonic()
    recorder = tmp_path / "nccl_flight_recorder"
    env = {
        **os.environ,
        "WORLD_SIZE": "2",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "TORCH_FR_BUFFER_SIZE": "100",
        "TORCH_FR_DUMP_TEMP_FILE": str(recorder / "rank_"),
    }
    ranks = [
        subprocess.Popen(
            [sys.executable, "-c", QUEUED],
            env={**env, "RANK": str(r), "LOCAL_RANK": str(r), "OMP_NUM_THREADS": "1"},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(2)
    ]
    try:
        outputs = [rank.communicate(timeout=50)[1] for rank in ranks]
    finally:
        for rank in ranks:
            rank.kill()
            rank.communicate()
    report = outputs[0]
    assert [rank.returncode for rank in ranks] == [4, 4] and time.monotonic() - started < 50, outputs
    assert (
        "femtotron: error: rank 1 stops with the job: rank 0 found it stuck (its log says what every rank "
        "was doing); this rank's flight recorder: " in (outputs[1])
    )
    assert (
        "Every rank's flight recorder (its last collectives and transfers, as torch records them) is "
        in report
    )
    assert (
        f"written to {recorder}: `python -m torch.distributed.flight_recorder.fr_trace {recorder}`" in report
    )
    # torch's own format (a pickle, not read here): rank 0 recorded the all-reduce it started
    assert b"gloo:all_reduce" in (recorder / "rank_0").read_bytes() and (recorder / "rank_1").stat().st_size
    assert re.search(
        r"hang report from rank 0: rank 0 has waited in all_reduce on dp\[0,1\] for \d+ s "
        r"\(parallelism.hang_timeout_seconds=3\)",
        report,
    ), report
    assert re.search(
        r"rank 0 \(as of 0 s ago\): in all_reduce on dp\[0,1\] for a \(4,\) torch.float32", report
    )
    assert re.search(r"rank 1 \(as of \d+ s ago\): no communication in flight; step 7", report), report


def test_the_nccl_flight_recorder_dumps_into_the_run_directory_unless_the_user_set_it_up(
    tmp_path, monkeypatch
):
    for name in ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE", "TORCH_NCCL_DUMP_ON_TIMEOUT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv("TORCH_FR_DUMP_TEMP_FILE", raising=False)
    assert nccl_flight_recorder()
    assert os.environ["TORCH_FR_BUFFER_SIZE"] == "2000" and os.environ["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    flight_recorder_folder(tmp_path / "run")
    assert os.environ["TORCH_FR_DUMP_TEMP_FILE"] == str(tmp_path / "run" / "nccl_flight_recorder" / "rank_")
    assert (tmp_path / "run" / "nccl_flight_recorder").is_dir()
    monkeypatch.setenv("TORCH_FR_BUFFER_SIZE", "64")  # the user's own set-up stays
    monkeypatch.setenv("TORCH_FR_DUMP_TEMP_FILE", "/elsewhere/trace_")
    assert not nccl_flight_recorder() and os.environ["TORCH_FR_BUFFER_SIZE"] == "64"
    flight_recorder_folder(tmp_path / "other")
    assert os.environ["TORCH_FR_DUMP_TEMP_FILE"] == "/elsewhere/trace_"
