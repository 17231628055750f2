"""Ctrl-C does what a scheduler's SIGTERM does: the step finishes, a checkpoint is saved, the run says how to
resume and exits 7; a second Ctrl-C stops at once. Sent as a terminal sends it, to the whole foreground
process group of a real `femtotron train`: alone, under its own launcher, and under torchrun."""

import os
import signal
import subprocess
import sys

import pytest
from distributed import free_port
from helpers import torchrun
from helpers import write_cli_config as write_config

pytestmark = [pytest.mark.distributed, pytest.mark.usefixtures("no_launcher")]

SAVED = "SIGINT (Ctrl-C) received: stopped after step"


@pytest.fixture
def config(tmp_path, tiny_dataset):
    # No checkpoint_interval: the default, which saves nothing until the end (the lost run).
    path = write_config(tmp_path / "cfg.yaml", tiny_dataset, None, tmp_path / "runs", micro_batch_size=2)
    return str(path)


def start(*args: str, launcher=()) -> subprocess.Popen:
    """`femtotron train ARGS` as a terminal starts it: a process group of its own, in the foreground."""
    command = [
        sys.executable,
        "-m",
        *launcher,
        *(["-m"] if launcher else []),
        "femtotron.cli",
        "train",
        *args,
    ]
    return subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        start_new_session=True,
    )


def ctrl_c_when(run: subprocess.Popen, seen: str) -> list[str]:
    """Press Ctrl-C once `seen` is printed; the lines printed until then."""
    lines = []
    for line in run.stdout:
        lines.append(line)
        if seen in line:
            os.killpg(run.pid, signal.SIGINT)  # what the terminal does: the whole foreground group
            return lines
    raise AssertionError("".join(lines)[-3000:])


def latest_step(run_dir) -> int:
    return int((run_dir / "checkpoints" / "latest").read_text().strip().removeprefix("step-"))


def test_ctrl_c_saves_a_checkpoint_says_how_to_resume_exits_7_and_the_same_command_resumes(config, tmp_path):
    overrides = ["tokens.train_steps=100000", "logging.iteration_step_info_interval=1", "general.run=ctrl-c"]
    run = start(config, *overrides)
    before = ctrl_c_when(run, "step 3/")
    output = "".join(before) + run.stdout.read()
    assert run.wait(timeout=120) == 7, output[-3000:]
    assert "femtotron: Ctrl-C: finishing this step, then saving a checkpoint and stopping" in output
    assert f"femtotron: stopped: {SAVED}" in output and "error" not in output
    assert "Run the same command again to resume from it" in output
    step = latest_step(tmp_path / "runs" / "ctrl-c")
    assert step >= 3
    resumed = start(config, *overrides[1:], f"tokens.train_steps={step + 2}")
    output = resumed.stdout.read()
    assert resumed.wait(timeout=120) == 0, output[-3000:]
    assert (
        f"checkpoints/step-{step:07d} at step {step} (" in output
        and f"step {step + 2}/{step + 2} | loss" in output
    )
    assert f"step {step}/" not in output  # nothing trained twice


def test_a_second_ctrl_c_stops_at_once_saving_nothing(config, tmp_path):
    run = start(config, "tokens.train_steps=100000", "logging.iteration_step_info_interval=1")
    ctrl_c_when(run, "step 2/")
    for line in run.stdout:  # the first Ctrl-C's notice: the handler ran, the next one ends the process
        if "Ctrl-C again to stop at once" in line:
            os.killpg(run.pid, signal.SIGINT)
            break
    run.stdout.read()
    assert run.wait(timeout=60) == -signal.SIGINT
    # No checkpoint, unless the step had finished and its save begun before the second Ctrl-C.
    assert not (tmp_path / "runs" / "cli" / "checkpoints" / "latest").exists()


def test_ctrl_c_to_a_self_launched_run_reaches_the_ranks_which_save_and_exit_7(config, tmp_path):
    """The terminal's SIGINT reaches only the launcher (torch starts each rank in a session of its own): it
    must pass it on, or torch's agent kills the ranks without a checkpoint."""
    run = start(config, "parallelism.dp=2", "tokens.train_steps=100000", "general.run=launched")
    before = ctrl_c_when(run, "step 2/")
    output = "".join(before) + run.stdout.read()
    assert run.wait(timeout=120) == 7, output[-3000:]
    assert f"femtotron: stopped: {SAVED}" in output and "Traceback" not in output
    assert latest_step(tmp_path / "runs" / "launched") >= 2


def test_a_second_ctrl_c_to_a_self_launched_run_stops_its_ranks_at_once(config, tmp_path):
    run = start(config, "parallelism.dp=2", "tokens.train_steps=100000", "general.run=twice")
    ctrl_c_when(run, "step 2/")
    for line in run.stdout:
        if "Ctrl-C again to stop at once" in line:
            os.killpg(run.pid, signal.SIGINT)
            break
    output = run.stdout.read()
    assert run.wait(timeout=60) == 130, output[-3000:]
    assert "femtotron: stopped at once by a second Ctrl-C, saving nothing" in output


def test_ctrl_c_under_torchrun_reaches_the_ranks_which_save_and_exit_7(config, tmp_path):
    """torchrun passes a SIGINT on to its ranks and waits for them (30 s by default: --shutdown-timeout)."""
    run = start(
        config,
        "parallelism.dp=2",
        "tokens.train_steps=100000",
        "general.run=tr",
        launcher=torchrun(2, free_port()),
    )
    before = ctrl_c_when(run, "step 2/")
    output = "".join(before) + run.stdout.read()
    run.wait(timeout=120)  # torchrun's own exit code and message are torch's
    assert f"femtotron: stopped: {SAVED}" in output, output[-3000:]
    assert latest_step(tmp_path / "runs" / "tr") >= 2
