"""Start a multi-process run's local processes when `femtotron train` is run without a launcher.

`femtotron train CONFIG parallelism.dp=2` should work on one machine as plainly as a dp=1 run, without the
user having to learn torchrun first. Rather than manage processes itself, femtotron runs
torch.distributed.run (the code behind `torchrun`) inside this process. It picks a free port, starts one
`python -m femtotron <same arguments>` per rank with RANK, WORLD_SIZE, MASTER_ADDR and the rest set, and
stops the others when one fails. The children therefore take exactly the path they take under torchrun.

Several machines need torchrun on each node, or srun with one task per process: then
`adopt_slurm_environment` turns Slurm's variables into torchrun's, and no local launcher runs.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import signal
import sys
from collections.abc import MutableMapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

# torch logs every child failure at ERROR level under this name, timestamped like a crash of the
# launcher itself; the failing child has already printed its own message, so the line is only noise.
_FAILURE_LOGGER = "torch.distributed.elastic.multiprocessing.api"
FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)


def adopt_slurm_environment(env: MutableMapping[str, str]) -> bool:
    """Under `srun` with one task per process, set what torchrun would have set, from Slurm's variables.

    Without this, every task of `srun python -m femtotron train ...` would see no launcher (no WORLD_SIZE)
    and start its own local processes: as many copies of the whole run as there are tasks. So each task
    becomes one rank: SLURM_PROCID is its RANK, SLURM_NTASKS the WORLD_SIZE, and SLURM_LOCALID its
    LOCAL_RANK, the GPU it takes on its node.

    Task 0 runs on the first node of the job step, so that node hosts the rendezvous store (MASTER_ADDR).
    The port (MASTER_PORT) is derived from the job id, so that every task computes the same one without
    talking to the others, and two jobs sharing a node do not collide. A MASTER_ADDR or MASTER_PORT
    already set is kept.

    Nothing changes when WORLD_SIZE is set (a launcher such as torchrun, started by srun once per node,
    has set the variables already), when the step has a single task (it is a one-process run, or starts
    its local processes as on any machine), or outside a job step: a batch script (`sbatch --ntasks=2
    --wrap ...`) has SLURM_PROCID=0 and SLURM_NTASKS=2 too, but is one process, with no task 1 to wait
    for; only srun's tasks have SLURM_STEP_ID. Returns whether it set anything.
    """
    already_launched = "WORLD_SIZE" in env
    under_srun = "SLURM_STEP_ID" in env and "SLURM_PROCID" in env
    several_tasks = int(env.get("SLURM_NTASKS", "1")) > 1
    if already_launched or not under_srun or not several_tasks:
        return False
    env["RANK"] = env["SLURM_PROCID"]
    env["WORLD_SIZE"] = env["SLURM_NTASKS"]
    env["LOCAL_RANK"] = env.get("SLURM_LOCALID", "0")
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or "127.0.0.1"
    env.setdefault("MASTER_ADDR", first_host(nodelist))
    port = 20000 + int(env.get("SLURM_JOB_ID", "0")) % 20000
    env.setdefault("MASTER_PORT", str(port))
    return True


def first_host(nodelist: str) -> str:
    """The first host of a Slurm node list: "gpu[07-09,12],cpu1" -> "gpu07"."""
    prefix, index = re.match(r"([^,\[]+)(?:\[([^\],-]+))?", nodelist).groups()
    return prefix + (index or "")


def launched_by_torchrun() -> bool:
    """True inside a process started by torchrun (or any launcher that sets WORLD_SIZE).

    WORLD_SIZE is what ParallelContext reads, so keying on it keeps the two from ever disagreeing.
    """
    return "WORLD_SIZE" in os.environ


def check_local_devices(dp: int, tp: int, pp: int, cp: int = 1) -> None:
    """Refuse a layout needing more local processes than GPUs: each needs one of those this one sees."""
    import torch

    from femtotron.errors import ConfigError

    processes = dp * cp * tp * pp
    gpus = torch.cuda.device_count()
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
    """Run `python -m femtotron *argv` as `nprocs` ranks on this machine; return the exit code to exit with.

    The code is 0 when every rank finished. When one failed, torch stops the others, and the code is that
    of the rank that failed first, so that a script sees the same code as under torchrun: the code its
    femtotron error carries (errors.py; 2 for a bad config, 7 for a run stopped by SIGTERM, SIGUSR1 or
    Ctrl-C after saving a checkpoint), 1 for a traceback, or 128 + the signal for a rank killed without a
    message. Ctrl-C, SIGTERM and SIGUSR1 go on to the ranks (`StopForwarding`); another signal that
    reached this launcher and made torch stop the ranks gives 128 + that signal. `what` names the layout
    for the message.
    """
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
    with StopForwarding() as forwarding:
        # The signals torch's agent handles itself (by stopping the ranks): not those forwarded.
        handled = "SIGHUP,SIGQUIT" if forwarding.previous else "SIGTERM,SIGINT,SIGHUP,SIGQUIT"
        flags = ["--standalone", "--nproc-per-node", str(nprocs), "--signals-to-handle", handled]
        args = torchrun.parse_args([*flags, "-m", "femtotron", *argv])
        failure_log = logging.getLogger(_FAILURE_LOGGER)
        level = failure_log.level
        failure_log.setLevel(logging.CRITICAL)
        try:
            # run(), not main(): main's @record handler prints a page-long banner for any child failure.
            torchrun.run(args)
        except ChildFailedError as e:
            if forwarding.interrupts > 1:
                print("femtotron: stopped at once by a second Ctrl-C, saving nothing", file=sys.stderr)
                return 128 + signal.SIGINT
            return _first_failure_code(e)
        except SignalException as e:  # a signal torch handles reached the launcher; it has stopped the ranks
            return 128 + int(e.sigval)
        finally:
            failure_log.setLevel(level)
    return 0


class StopForwarding:
    """Inside it, SIGTERM, SIGUSR1 and Ctrl-C (SIGINT) sent to this launcher go on to the ranks.

    A scheduler sends the first two ("stop soon") to the process it started, which is this launcher, and a
    terminal sends Ctrl-C to it alone (torch starts each rank in a session of its own). Passed on, they
    reach the ranks' own handlers (stop_signals.py): the ranks finish the step, save a checkpoint and exit
    7, and the launcher passes that 7 on, as each rank does under torchrun or srun. Left to torch's agent,
    SIGTERM and SIGINT would kill the ranks without a checkpoint, and SIGUSR1 would kill the launcher
    outright. A second Ctrl-C kills the ranks at once (SIGKILL: a rank waiting inside a collective would not
    run a handler); one before any rank started stops the launch.

    The ranks are found through /proc; where there is none, nothing is forwarded and torch's handling
    stays (`previous` is empty).
    """

    def __init__(self) -> None:
        self.interrupts = 0
        self.previous: dict[int, object] = {}

    def __enter__(self) -> StopForwarding:
        if os.path.isdir("/proc/self"):
            self.previous = {sig: signal.signal(sig, self.forward) for sig in FORWARDED_SIGNALS}
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)

    def forward(self, signum: int, _frame: object) -> None:
        ranks = _child_processes()
        if signum == signal.SIGINT:
            if not ranks:
                raise KeyboardInterrupt
            self.interrupts += 1
            if self.interrupts > 1:
                signum = signal.SIGKILL
        for pid in ranks:
            with contextlib.suppress(ProcessLookupError):  # exited meanwhile
                os.kill(pid, signum)


def _child_processes() -> list[int]:
    """This process's children, from /proc (the ranks torch started, each in a session of its own)."""
    me = os.getpid()
    children = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            # a process gone meanwhile is skipped
            with contextlib.suppress(OSError, IndexError, ValueError), open(f"/proc/{entry}/stat") as f:
                # pid (comm) state ppid ...: comm may hold spaces, so split after its closing parenthesis
                after_comm = f.read().rsplit(")", 1)[1]
                parent = int(after_comm.split()[1])
                if parent == me:
                    children.append(int(entry))
    return children


def _first_failure_code(error: ChildFailedError) -> int:
    """The exit code of the rank that failed first: the others were stopped because of it.

    Failure times have one-second resolution, so among ties a rank that exited on its own is preferred over
    one killed by a signal (a negative exit code), and then the one torch saw first: it lists the failures
    in that order, so a rank SIGKILLed mid-collective comes before the peer it then stopped (SIGTERM).
    """
    order = list(error.failures)

    def first(item: tuple[int, Any]) -> tuple[float, bool, int]:
        rank, failure = item
        return (failure.timestamp, failure.exitcode < 0, order.index(rank))

    rank, failure = min(error.failures.items(), key=first)
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
