"""One run at a time in a run directory (S5): two real processes, one refused naming the other."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys

import pytest
from distributed import free_port
from helpers import femtotron, torchrun, write_yaml

from femtotron.errors import ConfigError
from femtotron.run_lock import LOCK_FILE, LOCKED_ENV, run_lock

# A process that holds the lock of the run directory argv[1] until it is killed.
HOLD = """
import sys, time
from pathlib import Path
from femtotron.run_lock import run_lock
with run_lock(Path(sys.argv[1])):
    print("held", flush=True)
    time.sleep(600)
"""


def holding(run_dir):
    """A process of its own holding `run_dir`'s lock (started and waited for until it holds it)."""
    env = {key: value for key, value in os.environ.items() if key != LOCKED_ENV}
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(run_dir)], stdout=subprocess.PIPE, text=True, env=env
    )
    assert holder.stdout.readline().strip() == "held"
    return holder


@pytest.mark.distributed
def test_S5_a_second_process_is_refused_naming_the_holder_and_a_killed_holder_frees_the_lock(tmp_path):
    holder = holding(tmp_path / "run")
    try:
        with pytest.raises(ConfigError) as refused, run_lock(tmp_path / "run"):
            pass
        message = str(refused.value)
        assert f"the run directory {tmp_path / 'run'} is in use by process {holder.pid} on host " in message
        assert socket.gethostname() in message and "give this run another general.run" in message
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    with run_lock(tmp_path / "run"):  # the kernel released a killed holder's lock: nothing stale remains
        written = json.loads((tmp_path / "run" / LOCK_FILE).read_text())
        assert written["pid"] == os.getpid() and os.environ[LOCKED_ENV] == str(tmp_path / "run" / LOCK_FILE)
    assert LOCKED_ENV not in os.environ


def test_a_link_planted_as_the_lock_file_is_refused_not_followed(tmp_path):
    target = tmp_path / "elsewhere"
    target.write_text("not yours")
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / LOCK_FILE).symlink_to(target)
    with pytest.raises(ConfigError, match="remove it if it is a link"), run_lock(tmp_path / "run"):
        pass
    assert target.read_text() == "not yours"


@pytest.mark.distributed
def test_S5_two_femtotron_train_on_one_run_directory_the_second_is_refused(tiny_config, tmp_path):
    config = tiny_config("logging.iteration_step_info_interval=1", "tokens.train_steps=1000000")
    path = write_yaml(config, tmp_path / "c.yaml")
    env = {key: value for key, value in os.environ.items() if key != LOCKED_ENV}
    first = subprocess.Popen(
        [sys.executable, "-m", "femtotron", "train", path],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**env, "OMP_NUM_THREADS": "1"},
    )
    try:
        for line in first.stdout:
            if "step 2/" in line:  # training is under way
                break
        second = femtotron("train", path, env={LOCKED_ENV: ""})
        assert second.returncode == ConfigError.exit_code, second.stderr
        assert f"is in use by process {first.pid} on host {socket.gethostname()}" in second.stderr
        assert "Traceback" not in second.stderr
    finally:
        first.send_signal(signal.SIGTERM)
        first.communicate(timeout=120)


@pytest.mark.distributed
def test_under_torchrun_rank_0_takes_the_lock_and_every_rank_stops_with_its_refusal(tiny_config, tmp_path):
    config = tiny_config("parallelism.dp=2", "tokens.batch_accumulation_per_replica=1")
    holder = holding(config.run_dir)
    try:
        run = femtotron("train", write_yaml(config, tmp_path / "c.yaml"), launcher=torchrun(2, free_port()))
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    assert run.returncode != 0
    output = run.stdout + run.stderr
    assert f"is in use by process {holder.pid}" in output
    assert "no word from rank 0" not in output and not (config.run_dir / "metrics.jsonl").exists()
