"""P1/L4: a hang ends with one report of what every rank is doing, within seconds, on every rank."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import yaml
from distributed import free_port

# One rank of a job, started the way torchrun or srun would. `how` breaks it: "skip-send" drops rank 0's
# pipeline send of micro-batch 1; "freeze" stops rank 1 (SIGSTOP) after its first step.
RANK = """
import os, signal, sys
from femtotron.config import load_config
from femtotron.parallel.context import ParallelContext
from femtotron.trainer import Trainer
config, how = load_config(sys.argv[1]), sys.argv[2]
par = config.parallelism
ctx = ParallelContext(par.dp, par.tp, par.pp, collective_timeout_seconds=par.collective_timeout_seconds)
trainer = Trainer(config, ctx)
rank = int(os.environ["RANK"])
if how == "skip-send" and rank == 0:
    exchange = trainer.pipeline.p2p.exchange
    def dropping(send, recv):
        if send is not None and trainer.pipeline.current.micro_batch == 1 and trainer.step == 0:
            send = None
        return exchange(send, recv)
    trainer.pipeline.p2p.exchange = dropping
if how == "freeze" and rank == 1:
    step = trainer.train_step
    def freezing():
        result = step()
        if trainer.step == 1:
            os.kill(os.getpid(), signal.SIGSTOP)
        return result
    trainer.train_step = freezing
trainer.train()
"""


def start_job(tiny_config, tmp_path, how, *overrides):
    config = tiny_config("parallelism.hang_timeout_seconds=4", "parallelism.collective_timeout_seconds=120",
                         "tokens.train_steps=50", *overrides)
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(config.to_dict()))
    port = free_port()
    world = config.parallelism.dp * config.parallelism.pp
    env = {**os.environ, "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
           "OMP_NUM_THREADS": "1"}
    return [subprocess.Popen([sys.executable, "-c", RANK, str(path), how], env={**env, "RANK": str(r),
                             "LOCAL_RANK": str(r)}, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            for r in range(world)]


def test_P1_a_rank_that_skips_a_send_ends_the_job_with_a_report_naming_the_pair(tiny_config, tmp_path):
    start = time.monotonic()
    ranks = start_job(tiny_config, tmp_path, "skip-send", "parallelism.pp=2", "model.model_config.num_hidden_layers=2",
                      "tokens.batch_accumulation_per_replica=4", "tokens.micro_batch_size=1")
    outputs = [rank.communicate(timeout=90)[1] for rank in ranks]
    assert time.monotonic() - start < 60  # not the 120 s collective timeout
    # The rank that reports exits with 4; the other fails on the closed connection (or reports too).
    assert 4 in [rank.returncode for rank in ranks] and all(rank.returncode for rank in ranks), outputs
    # The first rank to see its op pass the timeout reports and exits; the other then fails on the closed pair.
    report = next(output for output in outputs if "hang report" in output)
    assert re.search(r"hang report from rank (\d): rank \1 has waited in recv on pp\[0,1\] for \d+ s "
                     r"\(parallelism.hang_timeout_seconds=4\)", report), report
    assert "rank 0: in recv on pp[0,1] with rank 1" in report and "rank 1: in recv on pp[0,1] with rank 0" in report
    assert ("deadlock: rank 0 and rank 1 each wait to receive from the other (step 1, pipeline backward of "
            "micro-batch 1 on stage 0; step 1, pipeline forward of micro-batch 1 on stage 1): one of them skipped or "
            "reordered a send") in report


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
    assert "rank 1: " in report and "<- silent" in report
