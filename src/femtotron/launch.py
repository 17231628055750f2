"""Start a multi-process run's local processes when `femtotron train` is run without a launcher.

So that `femtotron train CONFIG parallelism.dp=2` works on one machine as plainly as dp=1, this process runs
torch.distributed.run (the code behind `torchrun`): one `python -m femtotron <same arguments>` per rank, on a
free port, all stopped when one fails; the children take exactly the path they take under torchrun.
Several machines need torchrun on each node, or srun with one task per process (adopt_slurm_environment).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import signal
import sys
from collections.abc import MutableMapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

# torch logs every child failure at ERROR level under this name, timestamped like a crash of the
# launcher itself; the failing child has already printed its own message, so the line is only noise.
_FAILURE_LOGGER = "torch.distributed.elastic.multiprocessing.api"


def adopt_slurm_environment(env: MutableMapping[str, str]) -> bool:
    """Under `srun` (a task per process, else each starts its own), set torchrun's variables from Slurm's;
    return whether it did. Task 0's node hosts the store, on a port from the job id (jobs share nodes)."""
    if "WORLD_SIZE" in env or "SLURM_PROCID" not in env or int(env.get("SLURM_NTASKS", "1")) <= 1:
        return False
    env["RANK"], env["WORLD_SIZE"] = env["SLURM_PROCID"], env["SLURM_NTASKS"]
    env["LOCAL_RANK"] = env.get("SLURM_LOCALID", "0")
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or "127.0.0.1"
    env.setdefault("MASTER_ADDR", first_host(nodelist))
    env.setdefault("MASTER_PORT", str(20000 + int(env.get("SLURM_JOB_ID", "0")) % 20000))
    return True


def first_host(nodelist: str) -> str:
    """The first host of a Slurm node list: "gpu[07-09,12],cpu1" -> "gpu07"."""
    prefix, index = re.match(r"([^,\[]+)(?:\[([^\],-]+))?", nodelist).groups()
    return prefix + (index or "")


def launched_by_torchrun() -> bool:
    """True under torchrun (or any launcher that sets WORLD_SIZE, which is what ParallelContext reads)."""
    return "WORLD_SIZE" in os.environ


def check_local_devices(dp: int, tp: int, pp: int, cp: int = 1) -> None:
    """Refuse a layout needing more local processes than GPUs: each needs one of those this one sees."""
    import torch

    from femtotron.errors import ConfigError

    processes, gpus = dp * cp * tp * pp, torch.cuda.device_count()
    if torch.cuda.is_available() and processes > gpus:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        shown = f" (CUDA_VISIBLE_DEVICES={visible})" if visible is not None else ""
        raise ConfigError(
            f"parallelism.dp={dp} * cp={cp} * tp={tp} * pp={pp} = {processes} processes, but {gpus} GPU(s) "
            f"are visible here{shown} and each process needs its own. Fix: lower parallelism.dp/cp/tp/pp so "
            f"their product is at most {gpus}, or run across several nodes with torchrun or srun (e.g. "
            f"`torchrun --nnodes N --nproc-per-node {gpus} ... -m femtotron train CONFIG` on each node)."
        )


def launch_local(nprocs: int, argv: list[str], what: str = "this run") -> int:
    """Run `python -m femtotron *argv` as `nprocs` local ranks; 0, or the first failed rank's exit code."""
    import torch.distributed.run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    print(
        f"femtotron: {what} needs {nprocs} processes; starting them on this machine with "
        "torch.distributed.run (use torchrun or srun for several nodes)",
        file=sys.stderr,
        flush=True,
    )
    # torchrun sets the same default (N ranks each threading over every core would oversubscribe the
    # CPU), but announces it with a four-line warning.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    forwarded = _forward_stop_signals()
    # The signals torch's agent handles itself (by stopping the ranks): not SIGTERM when it is forwarded.
    handled = "SIGINT,SIGHUP,SIGQUIT" if forwarded else "SIGTERM,SIGINT,SIGHUP,SIGQUIT"
    flags = ["--standalone", "--nproc-per-node", str(nprocs), "--signals-to-handle", handled]
    args = torchrun.parse_args([*flags, "-m", "femtotron", *argv])
    failure_log = logging.getLogger(_FAILURE_LOGGER)
    level = failure_log.level
    failure_log.setLevel(logging.CRITICAL)
    try:
        # run(), not main(): main's @record handler prints a page-long banner for any child failure.
        torchrun.run(args)
    except ChildFailedError as e:
        return _first_failure_code(e)
    except SignalException as e:  # Ctrl-C or a kill reached the launcher; torch has stopped the ranks
        return 128 + int(e.sigval)
    finally:
        failure_log.setLevel(level)
        for sig, handler in forwarded.items():
            signal.signal(sig, handler)
    return 0


def _forward_stop_signals() -> dict[int, object]:
    """SIGTERM and SIGUSR1 go on to the ranks, which save a checkpoint and exit 7, passed on (torch's agent
    would kill them, exit 143; SIGUSR1 would kill the launcher). Needs /proc to find the ranks."""
    if not os.path.isdir("/proc/self"):
        return {}

    def forward(signum: int, _frame: object) -> None:
        for pid in _child_processes():
            with contextlib.suppress(ProcessLookupError):  # exited meanwhile
                os.kill(pid, signum)

    return {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGUSR1)}


def _child_processes() -> list[int]:
    """This process's children, from /proc (the ranks torch started, each in a session of its own)."""
    me, children = os.getpid(), []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            # a process gone meanwhile is skipped
            with contextlib.suppress(OSError, IndexError, ValueError), open(f"/proc/{entry}/stat") as f:
                # pid (comm) state ppid ...: comm may hold spaces, so split after its closing parenthesis
                if int(f.read().rsplit(")", 1)[1].split()[1]) == me:
                    children.append(int(entry))
    return children


def _first_failure_code(error: ChildFailedError) -> int:
    """The exit code of the rank that failed first (the others were stopped because of it). Failure times
    have one-second resolution: among ties, a rank that exited on its own, not one killed with a signal."""
    rank, failure = min(error.failures.items(), key=lambda kv: (kv[1].timestamp, kv[1].exitcode < 0, kv[0]))
    if failure.exitcode >= 0:
        return failure.exitcode  # the rank printed its own message (a femtotron error or a traceback)
    sig = -failure.exitcode
    name = next((s.name for s in signal.Signals if s == sig), f"signal {sig}")
    print(
        f"femtotron: error: rank {rank} was killed by {name} without a message (SIGKILL usually means the "
        "machine ran out of memory: lower tokens.micro_batch_size or use fewer processes)",
        file=sys.stderr,
    )
    return 128 + sig
