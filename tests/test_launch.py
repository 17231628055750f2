"""`femtotron train` without a launcher starts dp*tp*pp local processes itself, through
torch.distributed.run."""

import contextlib
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from distributed import free_port
from helpers import femtotron, torchrun
from helpers import write_cli_config as write_config
from safetensors.torch import load_file
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from femtotron.config import load_config
from femtotron.errors import ConfigError
from femtotron.generate import load_run
from femtotron.launch import _first_failure_code, adopt_slurm_environment, check_local_devices, first_host

LAUNCH_LINE = (
    "femtotron: dp=2 tp=1 pp=1 needs 2 processes; starting them on this machine with "
    "torch.distributed.run (use torchrun or srun for several nodes)"
)


pytestmark = pytest.mark.usefixtures("no_launcher")  # these tests are about running without a launcher


@pytest.fixture
def config(tmp_path, tiny_dataset):
    # vocab 320 > the tiny dataset's 256 ids; micro-batches of 2 so dp=2 matches dp=1 with accumulation 2.
    return str(write_config(tmp_path / "cfg.yaml", tiny_dataset, None, tmp_path / "runs", micro_batch_size=2))


def losses(run_dir) -> list[float]:
    return [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.distributed
def test_data_parallel_run_starts_its_processes_and_matches_one_process(config, tmp_path):
    result = femtotron("train", config, "parallelism.dp=2", "tokens.train_steps=2")
    assert result.returncode == 0, result.stderr[-3000:]
    assert LAUNCH_LINE in result.stderr and "Traceback" not in result.stderr
    assert "[rank 0 dp0 tp0 pp0] layout: dp=2 tp=1 pp=1 on 2 process(es) on 1 host(s)" in result.stdout
    assert "step 2/2 | loss" in result.stdout
    single = femtotron(
        "train",
        config,
        "tokens.train_steps=2",
        "tokens.batch_accumulation_per_replica=2",
        "general.run=single",
    )
    assert single.returncode == 0, single.stderr[-3000:]
    assert "starting them on this machine" not in single.stderr  # one process needs no launcher
    # The same global batch split over two ranks instead of two micro-batches: the same training.
    assert losses(tmp_path / "runs" / "cli") == pytest.approx(losses(tmp_path / "runs" / "single"), rel=1e-5)


@pytest.mark.distributed
def test_tensor_parallel_run_matches_one_process_under_both_launches(config, tmp_path):
    """tp=2 started by femtotron itself (sequence parallel) and by torchrun (all-reduce mode): the same
    losses as one process, and the saved full-shape weights equal to its weights."""
    single = femtotron("train", config, "tokens.train_steps=3", "general.run=single")
    assert single.returncode == 0, single.stderr[-3000:]
    auto = femtotron(
        "train",
        config,
        "parallelism.tp=2",
        "parallelism.tp_mode=REDUCE_SCATTER",
        "tokens.train_steps=3",
        "general.run=auto",
    )
    assert auto.returncode == 0, auto.stderr[-3000:]
    assert "dp=1 tp=2 pp=1 needs 2 processes" in auto.stderr
    assert "tensor parallel: tp=2, tp_mode=REDUCE_SCATTER" in auto.stdout
    launched = femtotron(
        "train",
        config,
        "parallelism.tp=2",
        "tokens.train_steps=3",
        "general.run=torchrun",
        launcher=torchrun(2, free_port()),
    )
    assert launched.returncode == 0, launched.stderr[-3000:]
    runs = tmp_path / "runs"
    reference = load_file(runs / "single" / "model.safetensors")
    for run in ("auto", "torchrun"):
        assert losses(runs / run) == pytest.approx(losses(runs / "single"), rel=1e-5), run
        records = [json.loads(line) for line in (runs / run / "metrics.jsonl").read_text().splitlines()]
        assert all(0 < r["tp_comm_share"] < 1 for r in records), run
        weights = load_file(runs / run / "model.safetensors")
        assert weights.keys() == reference.keys()
        for name, tensor in reference.items():
            # One step moves a weight by up to lr = 3e-3. Summation order differs with tp, and Adam's
            # normalisation magnifies that where a gradient is near zero (measured: up to 3e-5).
            torch.testing.assert_close(weights[name], tensor, rtol=0, atol=1e-4, msg=f"{run}: {name}")


@pytest.mark.distributed
def test_pipeline_run_matches_one_process_and_its_weights_generate(config, tmp_path):
    """pp=2 started by femtotron itself: the same losses and final weights as one process; each stage
    writes its part, listed in model-parts.json, and `femtotron generate` reads them."""
    common = [
        "tokens.train_steps=3",
        "tokens.batch_accumulation_per_replica=2",
        "model.model_config.tie_word_embeddings=true",
    ]
    single = femtotron("train", config, *common, "general.run=single")
    assert single.returncode == 0, single.stderr[-3000:]
    piped = femtotron("train", config, *common, "parallelism.pp=2", "general.run=piped")
    assert piped.returncode == 0, piped.stderr[-3000:]
    assert "pipeline parallel: pp=2, pp_engine=1f1b, 2 micro-batches" in piped.stdout
    assert "stage 0 (pp rank 0): embedding + layer 0" in piped.stdout
    assert "stage 1 (pp rank 1): layer 1 + final norm + LM head" in piped.stdout
    runs = tmp_path / "runs"
    assert losses(runs / "piped") == pytest.approx(losses(runs / "single"), rel=1e-5)
    records = [json.loads(line) for line in (runs / "piped" / "metrics.jsonl").read_text().splitlines()]
    assert all(0 < r["pp_comm_share"] < 1 for r in records)
    parts = json.loads((runs / "piped" / "model-parts.json").read_text())["parts"]
    assert parts == ["model-pp00-of-02.safetensors", "model-pp01-of-02.safetensors"]
    reference = load_file(runs / "single" / "model.safetensors")
    merged = {}
    for part in parts:
        merged.update(load_file(runs / "piped" / part))
    assert merged.keys() == reference.keys()
    for name, tensor in reference.items():
        torch.testing.assert_close(merged[name], tensor, rtol=0, atol=1e-4, msg=name)
    _, model = load_run(runs / "piped")  # what `femtotron generate` loads
    assert all(torch.equal(p, merged[n]) for n, p in model.state_dict().items())


@pytest.mark.distributed
def test_a_failing_rank_exit_code_reaches_the_caller_without_launcher_noise(config):
    # Only the ranks see this: the token ids are checked against the vocabulary when each rank opens the data.
    result = femtotron(
        "train", config, "parallelism.dp=2", "tokens.train_steps=2", "model.model_config.vocab_size=128"
    )
    assert result.returncode == 3, result.stderr[-3000:]
    assert LAUNCH_LINE in result.stderr
    assert "(data.dataset_folder) holds token id 2" in result.stderr
    for noise in ("Traceback", "ChildFailedError", "failed (exitcode"):
        assert noise not in result.stderr


# A typo breaks the schema, zero_stage=4 a cross-field rule: the parent checks both before starting anything.
@pytest.mark.distributed
@pytest.mark.parametrize(
    "override, field", [("tokens.train_stepz=2", "train_stepz"), ("optimizer.zero_stage=4", "zero_stage")]
)
def test_config_errors_are_reported_once_before_any_process_starts(config, override, field):
    result = femtotron("train", config, "parallelism.dp=2", override)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.count("femtotron: error:") == 1 and field in result.stderr
    assert "starting them on this machine" not in result.stderr


def test_more_processes_than_gpus_is_a_config_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,3")  # what hides the others is named
    check_local_devices(dp=2, tp=1, pp=1)
    with pytest.raises(ConfigError) as raised:
        check_local_devices(dp=4, tp=1, pp=1)
    message = str(raised.value)
    for expected in (
        "parallelism.dp=4",
        "2 GPU(s)",
        "(CUDA_VISIBLE_DEVICES=0,3)",
        "at most 2",
        "torchrun or srun",
    ):
        assert expected in message


def failure(rank: int, exitcode: int, timestamp: int) -> tuple[int, ProcessFailure]:
    f = ProcessFailure(local_rank=rank, pid=1000 + rank, exitcode=exitcode, error_file="<N/A>")
    f.timestamp = timestamp
    return rank, f


def test_the_first_rank_to_fail_on_its_own_sets_the_exit_code(capsys):
    # Rank 0 was stopped by the launcher in the same second as rank 1 failed: rank 1 is the cause.
    assert (
        _first_failure_code(ChildFailedError("femtotron", dict([failure(0, -15, 7), failure(1, 3, 7)]))) == 3
    )
    assert _first_failure_code(ChildFailedError("femtotron", dict([failure(0, 4, 9), failure(1, 3, 8)]))) == 3
    assert capsys.readouterr().err == ""  # the rank printed its own message
    killed = ChildFailedError("femtotron", dict([failure(1, -signal.SIGKILL, 5)]))
    assert _first_failure_code(killed) == 128 + signal.SIGKILL
    assert "rank 1 was killed by SIGKILL" in capsys.readouterr().err
    # torch saw rank 1 killed, then stopped rank 0 with SIGTERM in the same second: rank 1 is the cause.
    stopped = ChildFailedError(
        "femtotron", dict([failure(1, -signal.SIGKILL, 5), failure(0, -signal.SIGTERM, 5)])
    )
    assert _first_failure_code(stopped) == 128 + signal.SIGKILL
    assert "rank 1 was killed by SIGKILL" in capsys.readouterr().err


@pytest.mark.parametrize(
    "nodelist, host",
    [("gpu[07-09,12],cpu1", "gpu07"), ("node3,node4", "node3"), ("login-a", "login-a"), ("n[1-2]", "n1")],
)
def test_first_host_of_a_slurm_node_list(nodelist, host):
    assert first_host(nodelist) == host


# What Slurm 22.05.8 (slurmctld + slurmd on one host) set in `sbatch --ntasks=2 --wrap ...`: the batch
# shell, one process, has SLURM_PROCID and SLURM_NTASKS too, but no SLURM_STEP_* (ids and lists as there).
BATCH_SHELL = {
    "SLURM_JOB_ID": "4",
    "SLURM_JOBID": "4",
    "SLURM_JOB_NODELIST": "vm",
    "SLURM_NODELIST": "vm",
    "SLURM_NNODES": "1",
    "SLURM_JOB_NUM_NODES": "1",
    "SLURM_NTASKS": "2",
    "SLURM_NPROCS": "2",
    "SLURM_TASKS_PER_NODE": "2",
    "SLURM_CPUS_ON_NODE": "2",
    "SLURM_PROCID": "0",
    "SLURM_LOCALID": "0",
    "SLURM_NODEID": "0",
    "SLURM_GTIDS": "0",
}
# ... and what its `srun` added in each of the step's two tasks (task 1 shown; task 0 has PROCID/LOCALID 0).
SRUN_STEP = {
    **BATCH_SHELL,
    "SLURM_STEP_ID": "0",
    "SLURM_STEPID": "0",
    "SLURM_STEP_NODELIST": "vm",
    "SLURM_STEP_NUM_NODES": "1",
    "SLURM_STEP_NUM_TASKS": "2",
    "SLURM_STEP_TASKS_PER_NODE": "2",
    "SLURM_GTIDS": "0,1",
    "SLURM_PROCID": "1",
    "SLURM_LOCALID": "1",
}


def free_job_id() -> int:
    """A job id whose rendezvous port in train.sbatch (20000 + id % 20000) is free here."""
    for job_id in random.sample(range(20000), 100):
        with socket.socket() as s, contextlib.suppress(OSError):
            s.bind(("127.0.0.1", 20000 + job_id))
            return job_id
    raise AssertionError("no free port between 20000 and 39999")


def test_slurm_variables_become_torchrun_variables():
    env = {**SRUN_STEP, "SLURM_JOB_ID": "123456", "SLURM_STEP_NODELIST": "gpu[07-10]"}
    assert adopt_slurm_environment(env)
    assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"]) == ("1", "2", "1")
    assert (env["MASTER_ADDR"], env["MASTER_PORT"]) == ("gpu07", str(20000 + 123456 % 20000))
    # torchrun inside an allocation, or a single task: left alone.
    assert not adopt_slurm_environment({**SRUN_STEP, "WORLD_SIZE": "16"})
    assert not adopt_slurm_environment({**SRUN_STEP, "SLURM_NTASKS": "1", "SLURM_STEP_NUM_TASKS": "1"})


def test_a_batch_script_is_not_a_task_of_a_job_step():
    """`sbatch --ntasks=2 --wrap "femtotron train ..."`: the batch shell is one process, not task 0 of 2.
    Taken for one, it waited for a task 1 that never came."""
    env = dict(BATCH_SHELL)
    assert not adopt_slurm_environment(env)
    assert env == BATCH_SHELL


@pytest.mark.distributed
def test_a_batch_script_starts_the_layouts_processes_itself(config, tmp_path):
    """`femtotron train CONFIG parallelism.dp=2` in the batch shell of `sbatch --ntasks=2` runs as on any
    machine: it starts its 2 processes locally (it waited for a rank 1 and exited 4)."""
    shell = {**BATCH_SHELL, "SLURM_JOB_NODELIST": "127.0.0.1", "SLURM_JOB_ID": str(free_job_id())}
    overrides = [
        "parallelism.dp=2",
        "tokens.train_steps=2",
        "general.run=batch",
        "parallelism.init_timeout_seconds=20",
    ]
    result = femtotron("train", config, *overrides, env=shell)
    assert result.returncode == 0, result.stderr[-3000:]
    assert LAUNCH_LINE in result.stderr and "Slurm task" not in result.stderr
    assert len(losses(tmp_path / "runs" / "batch")) == 2


@pytest.mark.distributed
def test_srun_style_tasks_train_together(config, tmp_path):
    """Two processes started the way `srun --ntasks 2` starts them (only SLURM_* set) form one dp=2 run."""
    base = {
        **os.environ,
        **SRUN_STEP,
        "OMP_NUM_THREADS": "1",
        "SLURM_JOB_ID": str(free_job_id()),
        "SLURM_STEP_NODELIST": "127.0.0.1",
    }
    tasks = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "femtotron",
                "train",
                config,
                *"parallelism.dp=2 tokens.train_steps=2 general.run=srun".split(),
            ],
            env={**base, "SLURM_PROCID": str(r), "SLURM_LOCALID": str(r)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(2)
    ]
    outputs = [task.communicate(timeout=240) for task in tasks]
    assert [task.returncode for task in tasks] == [0, 0], outputs[0][1][-3000:]
    assert "Slurm task 0 of 2; rendezvous at 127.0.0.1:" in outputs[0][1]
    assert "starting them on this machine" not in outputs[0][1] + outputs[1][1]
    assert "layout: dp=2 tp=1 pp=1 on 2 process(es)" in outputs[0][0]
    assert len(losses(tmp_path / "runs" / "srun")) == 2


@pytest.mark.distributed
def test_D3_debug_sets_the_distributed_debug_variables_and_every_rank_logs(config):
    result = femtotron("train", config, "parallelism.dp=2", "tokens.train_steps=2", "--debug")
    assert result.returncode == 0, result.stderr[-3000:]
    for rank in (0, 1):
        assert f"[rank {rank}] --debug: NCCL_DEBUG=INFO TORCH_DISTRIBUTED_DEBUG=DETAIL" in result.stderr
        assert f"[rank {rank} dp{rank} tp0 pp0] step 2/2 | loss" in result.stdout


@pytest.mark.distributed
def test_sigterm_to_a_self_launched_run_saves_and_exits_7_as_under_torchrun(config, tmp_path):
    """A scheduler signals the process it started: the launcher. The ranks must get it, save a checkpoint and
    stop, and the launcher exit 7 (not torch's 143), so a requeue script sees the same code either way."""
    overrides = [
        "parallelism.dp=2",
        "tokens.train_steps=100000",
        "checkpoints.checkpoint_interval=1000",
        "logging.iteration_step_info_interval=1",
        "general.run=term",
    ]
    run = subprocess.Popen(
        [sys.executable, "-m", "femtotron", "train", config, *overrides],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    for line in run.stdout:
        if "step 2/" in line:  # training is under way
            run.send_signal(signal.SIGTERM)
            break
    output = run.stdout.read()
    assert run.wait(timeout=120) == 7, output[-3000:]
    assert "SIGTERM received: stopped after step" in output
    saved = tmp_path / "runs" / "term" / "checkpoints"
    assert int((saved / "latest").read_text().strip().removeprefix("step-")) >= 2


@pytest.mark.distributed
def test_two_torchrun_agents_as_two_nodes_train_like_one_process(config, tmp_path):
    """Two torchrun agents of 2 processes each meet at a c10d rendezvous as two nodes (what `torchrun --nnodes
    2` on two machines does) and train dp=2 x tp=2 together: the losses and final weights of one process."""
    port = free_port()
    agent = [
        *[sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2"],
        *["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"nodes{port}"],
        *["-m", "femtotron.cli", "train", config, "parallelism.dp=2", "parallelism.tp=2"],
        *["tokens.train_steps=3", "general.run=nodes"],
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    nodes = [subprocess.Popen(agent, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)]
    nodes.append(subprocess.Popen(agent, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outputs = [node.communicate(timeout=240) for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], [err[-3000:] for _, err in outputs]
    # Rank 0 logs: it is on one of the nodes, and sees the 4 processes of both.
    layout = "layout: dp=2 tp=2 pp=1 on 4 process(es)"
    assert [layout in out for out, _ in outputs].count(True) == 1, outputs
    single = femtotron(
        "train",
        config,
        "tokens.train_steps=3",
        "tokens.batch_accumulation_per_replica=2",
        "general.run=single",
    )
    assert single.returncode == 0, single.stderr[-3000:]
    runs = tmp_path / "runs"
    assert losses(runs / "nodes") == pytest.approx(losses(runs / "single"), rel=1e-5)
    weights = load_file(runs / "nodes" / "model.safetensors")
    reference = load_file(runs / "single" / "model.safetensors")
    assert weights.keys() == reference.keys()
    for name, tensor in reference.items():  # as in the tp test above: Adam magnifies summation order
        torch.testing.assert_close(weights[name], tensor, rtol=0, atol=1e-4, msg=name)


SBATCH = Path(__file__).parents[1] / "examples" / "slurm" / "train.sbatch"


def test_the_slurm_script_default_config_fills_its_nodes():
    text = SBATCH.read_text()
    option = {m[0]: int(m[1]) for m in re.findall(r"^#SBATCH --(nodes|gpus-per-node)=(\d+)", text, re.M)}
    default = re.search(r"^config=\$\{1:-(\S+)\}$", text, re.M)[1]
    parallelism = load_config(SBATCH.parents[2] / default).parallelism
    assert parallelism.dp * parallelism.tp * parallelism.pp == option["nodes"] * option["gpus-per-node"]
    assert "--signal=B:USR1@" in text and "#SBATCH --requeue" in text


# Stand-ins for Slurm's commands on one machine (Slurm itself cannot run in CI): srun starts its command once
# per node, scancel signals those tasks, scontrol names 127.0.0.1 as every node and notes a requeue.
FAKE_SLURM = {
    "srun": """while [[ $1 == --* ]]; do shift; done
for ((node = 0; node < SLURM_NNODES; node++)); do "$@" & echo $! >> "$FAKE_SLURM/tasks"; done
status=0; for task in $(cat "$FAKE_SLURM/tasks"); do wait "$task" || status=$?; done; exit $status""",
    "scancel": 'kill -s "${1#--signal=}" $(cat "$FAKE_SLURM/tasks")',
    "scontrol": """case $1 in show) for ((n = 0; n < SLURM_NNODES; n++)); do echo 127.0.0.1; done ;;
requeue) echo "$2" > "$FAKE_SLURM/requeued" ;; esac""",
}


def fake_slurm(directory: Path, **replaced: str) -> dict[str, str]:
    """FAKE_SLURM's commands (some `replaced`) as scripts in `directory`: the environment that finds them."""
    directory.mkdir()
    for name, body in {**FAKE_SLURM, **replaced}.items():
        (directory / name).write_text(f"#!/bin/bash\n{body}\n")
        (directory / name).chmod(0o755)
    # python and torchrun: this Python's
    return {
        "PATH": f"{directory}:{Path(sys.executable).parent}:{os.environ['PATH']}",
        "FAKE_SLURM": str(directory),
    }


def submitted(config, tmp_path, overrides: str, **slurm: str) -> subprocess.CompletedProcess:
    """train.sbatch run under the variables Slurm sets in a batch script, with an srun that only prints the
    command it was given (and the OMP_NUM_THREADS it would pass on): a stand-in, as Slurm cannot run in CI
    (the script was run under a real Slurm 22.05.8 too: docs/training.md, "Several nodes")."""
    srun = 'echo "OMP_NUM_THREADS=$OMP_NUM_THREADS srun $*"'
    env = {**os.environ, **fake_slurm(tmp_path / "fake_slurm", srun=srun), "SLURM_JOB_ID": "77", **slurm}
    env.pop("OMP_NUM_THREADS", None)
    return subprocess.run(
        ["bash", str(SBATCH), config, *overrides.split()], env=env, capture_output=True, text=True
    )


@pytest.mark.distributed
@pytest.mark.parametrize(
    "node, overrides, per_node",
    [
        ({"SLURM_NNODES": "1", "SLURM_GPUS_ON_NODE": "4"}, "parallelism.dp=2", 2),  # --exclusive: all 4 GPUs
        ({"SLURM_NNODES": "1"}, "parallelism.dp=2", 2),  # a CPU node: no SLURM_GPUS_ON_NODE
        ({"SLURM_NNODES": "2", "SLURM_GPUS_ON_NODE": "8"}, "parallelism.dp=4 parallelism.tp=2 --debug", 4),
    ],
)
def test_the_slurm_script_starts_the_layouts_processes_on_each_node(
    config, tmp_path, node, overrides, per_node
):
    """One rank per process of dp * cp * tp * pp, spread over the nodes; not one per GPU of the node (a dp=2
    run on a 4-GPU node had WORLD_SIZE=4), nor 8 on a CPU node."""
    job = submitted(config, tmp_path, overrides, **node)
    assert job.returncode == 0, job.stderr
    launched = job.stdout.splitlines()[-1]
    assert f"--nnodes {node['SLURM_NNODES']} --nproc-per-node {per_node} " in launched
    assert launched.endswith(f"-m femtotron train {config} {overrides}")


@pytest.mark.distributed
def test_the_slurm_script_gives_each_rank_its_share_of_a_cpu_node(config, tmp_path):
    job = submitted(config, tmp_path, "parallelism.dp=2", SLURM_NNODES="1", SLURM_CPUS_ON_NODE="16")
    assert job.returncode == 0, job.stderr
    assert job.stdout.splitlines()[-1].startswith("OMP_NUM_THREADS=8 srun ")


@pytest.mark.distributed
@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            "parallelism.dp=2",
            "dp * cp * tp * pp = 2 processes cannot be spread evenly over the job's 4 nodes",
        ),
        ("parallelism.dq=2", "unknown key 'dq' in parallelism"),
    ],
)
def test_the_slurm_script_refuses_a_layout_before_starting_anything(config, tmp_path, overrides, message):
    job = submitted(config, tmp_path, overrides, SLURM_NNODES="4")
    assert job.returncode == 2, job.stdout + job.stderr
    assert message in job.stderr and "Traceback" not in job.stderr
    assert "srun" not in job.stdout


@pytest.mark.distributed
def test_the_slurm_script_stops_at_its_time_limit_signal_requeues_and_resumes(config, tmp_path):
    """examples/slurm/train.sbatch on two "nodes" of 2 processes (dp=2 x tp=2), with Slurm's commands
    played by stand-ins: the SIGUSR1 Slurm sends before the time limit makes the ranks save and stop and the
    job requeue itself; the requeued job (the same command) resumes from that checkpoint and finishes."""
    syntax = subprocess.run(["bash", "-n", str(SBATCH)], capture_output=True, text=True)
    assert syntax.returncode == 0, syntax.stderr
    fake = tmp_path / "fake_slurm"
    env = {
        **os.environ,
        **fake_slurm(fake),
        "OMP_NUM_THREADS": "1",
        "SLURM_JOB_ID": str(free_job_id()),
        "SLURM_JOB_NODELIST": "node[1-2]",
        "SLURM_NNODES": "2",
    }
    overrides = (
        "parallelism.dp=2 parallelism.tp=2 tokens.train_steps=40 checkpoints.checkpoint_interval=1000 "
        "logging.iteration_step_info_interval=1 general.run=slurm"
    ).split()
    job = subprocess.Popen(
        ["bash", str(SBATCH), config, *overrides],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    for line in job.stdout:
        if "step 2/40" in line:
            job.send_signal(signal.SIGUSR1)  # what `#SBATCH --signal=B:USR1@300` does
            break
    output = job.stdout.read()
    assert job.wait(timeout=120) == 0, output[-3000:]
    assert "time limit near" in output and "SIGUSR1 received: stopped after step" in output
    assert (fake / "requeued").read_text().strip() == env["SLURM_JOB_ID"]
    stopped_at = int((tmp_path / "runs" / "slurm" / "checkpoints" / "latest").read_text().strip()[5:])
    assert 2 <= stopped_at < 40
    (fake / "requeued").unlink()
    (fake / "tasks").unlink()
    requeued = subprocess.run(
        ["bash", str(SBATCH), config, *overrides],
        env={**env, "SLURM_RESTART_COUNT": "1"},
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert requeued.returncode == 0, requeued.stdout[-3000:] + requeued.stderr[-3000:]
    assert (
        f"resumed from {tmp_path / 'runs' / 'slurm' / 'checkpoints'}/step-{stopped_at:07d}" in requeued.stdout
    )
    assert not (fake / "requeued").exists()  # finished: no requeue
    records = [
        json.loads(line) for line in (tmp_path / "runs" / "slurm" / "metrics.jsonl").read_text().splitlines()
    ]
    assert [r["step"] for r in records if "loss" in r] == list(range(1, 41))  # the others: checkpoints


@pytest.mark.distributed
def test_the_rank_killed_first_is_named_not_the_one_the_launcher_then_stopped(config):
    """Rank 1 is SIGKILLed when it opens the data; rank 0 waits for it in a collective until the launcher
    stops it. The message blamed rank 0 and SIGTERM."""
    crash = {"FEMTOTRON_CRASH_AT": "dataset.opened", "FEMTOTRON_CRASH_RANK": "1"}
    result = femtotron("train", config, "parallelism.dp=2", "tokens.train_steps=2", env=crash)
    assert result.returncode == 128 + signal.SIGKILL, result.stderr[-3000:]
    assert "femtotron: error: rank 1 was killed by SIGKILL" in result.stderr
    assert "rank 0 was killed" not in result.stderr and "Traceback" not in result.stderr
