"""Hang report (P1, L4, C2): no rank waits forever without saying why.

A background thread on every rank publishes, every `interval` seconds, what the rank is doing to the
rendezvous store, which stays reachable when collectives are stuck: a heartbeat counter, the ops it issued
that have not completed (from parallel/comm.py: kind, group, peer, shape, for how long; on GPUs a call
returns once its op is queued, so these, not the call the main thread is in, are what the rank waits for),
and where in the step it is (step, pipeline action, micro-batch). It watches:

- its own ops: the oldest unfinished for longer than `parallelism.hang_timeout_seconds` (a deadlock: some
  rank took another path);
- on rank 0 only (one reader, not every rank reading every rank), the other ranks' heartbeats: one that
  stops changing for `silent_seconds` belongs to a process that died or froze (on NCCL a dead peer is
  otherwise noticed only at the collective timeout);
- the store itself: unreachable means the process serving it (rank 0, or the launcher) is gone.

Then it gathers every rank's state into one report that points at the mismatch ("rank 1 waits in
recv from rank 0 (micro-batch 3 ...); rank 0 is in all_reduce on dp[0,2] ..."), prints it and ends
the process; through the store it tells the other ranks to end too, so the job ends within seconds
instead of after the collective timeout. Where torch's flight recorder is on (`nccl_flight_recorder`, on
GPUs), every rank first writes its record of its last collectives and transfers into the run directory:
NCCL's own watchdog would write it only at the collective timeout, which this report comes before.

The ranks meet at the store before watching starts, so a rank still building its model is not taken for
a dead one.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

from femtotron.errors import DistributedError
from femtotron.parallel.comm import OpInFlight, write_flight_recorder
from femtotron.parallel.context import ParallelContext

EXIT_CODE = 4  # a distributed error, as DistributedError
# How long the reporting rank waits for the others to write their flight recorders before it ends.
DUMP_SECONDS = 10.0


def nccl_flight_recorder() -> bool:
    """Turn on PyTorch's NCCL flight recorder (a ring buffer of each rank's last collectives) unless the user
    set it up (False then); must run before the process group exists: creating it reads these."""
    if "TORCH_FR_BUFFER_SIZE" in os.environ or "TORCH_NCCL_TRACE_BUFFER_SIZE" in os.environ:
        return False
    os.environ["TORCH_FR_BUFFER_SIZE"] = "2000"
    os.environ.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
    return True


def flight_recorder_folder(run_dir: Path) -> None:
    """Where the flight recorder is dumped when NCCL times a collective out, `<run dir>/nccl_flight_recorder/
    rank_<n>`, unless the user chose. Set once the ranks agree on the run's name (%date is each rank's own
    clock): torch reads it at its first dump, the watchdog when it starts. `python -m
    torch.distributed.flight_recorder.fr_trace DIR` reads the dumps."""
    folder = run_dir / "nccl_flight_recorder"
    folder.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("TORCH_FR_DUMP_TEMP_FILE", str(folder / "rank_"))


class Watchdog:
    def __init__(
        self,
        ctx: ParallelContext,
        hang_timeout: float,
        where: Callable[[], str],
        interval: float = 2.0,
        start_timeout: float = 300.0,
    ):
        self.comm = ctx.comm
        self.messages = ctx.store
        self.rank = ctx.rank
        self.world_size = ctx.world_size
        self.hang_timeout = hang_timeout
        self.where = where
        self.start_timeout = start_timeout
        self.interval = interval
        # A live rank's thread beats every `interval` s whatever its main thread does: 30 s of silence
        # is death.
        self.silent_seconds = min(30.0, hang_timeout)
        self.beats = 0
        self.seen: dict[int, tuple[int, float]] = {}  # rank -> (its heartbeat, when it last changed here)
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, name="femtotron-watchdog", daemon=True)
        self.keys = [f"{ctx.store.key_prefix}state/{r}" for r in range(ctx.world_size)]
        # Set by the rank that reports, read by every other: end now. Each answers once its record is out.
        self.stop_key = f"{ctx.store.key_prefix}watchdog/stop"
        self.dumped_keys = [f"{ctx.store.key_prefix}watchdog/dumped/{r}" for r in range(ctx.world_size)]
        self.backend = ctx.backend
        buffer_sizes = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")
        recording = any(os.environ.get(name) for name in buffer_sizes)
        prefix = os.environ.get("TORCH_FR_DUMP_TEMP_FILE")
        # Named as torch's own dumps are, the prefix then the rank, so that fr_trace reads them alike.
        self.flight_recorder = Path(f"{prefix}{self.rank}") if recording and prefix else None
        self.store: Any = None

    def start(self) -> Watchdog:
        """Publish this rank's state, wait until every rank has (a rank slow to build its model is not a
        dead one), then watch."""
        if self.world_size > 1:
            # A connection of its own: the main thread may be waiting on the store.
            self.store = self.messages.new_client()
            self.store.set(self.keys[self.rank], json.dumps(self.state()))
            try:
                self.store.wait(self.keys, timedelta(seconds=self.start_timeout))
            except (RuntimeError, OSError):
                missing = [r for r in range(self.world_size) if not self.store.check([self.keys[r]])]
                raise DistributedError(
                    f"ranks {missing} did not reach the start of training within {self.start_timeout:g} s "
                    "of this rank (parallelism.init_timeout_seconds): look for their errors, or raise the "
                    "timeout if building the model is that slow."
                ) from None
            self.thread.start()
        return self

    def stop(self, failed: bool = False) -> None:
        """Stop watching, and tell the others this rank is done (or failed: its own error says why)."""
        self.stopped.set()
        if self.thread.is_alive():
            self.thread.join(timeout=2 * self.interval)
            ending = "failed" if failed else "done"
            try:
                self.store.set(self.keys[self.rank], json.dumps({**self.state(), ending: True}))
            except (RuntimeError, OSError):  # the store's server is gone too; nothing left to tell
                pass

    def state(self) -> dict[str, Any]:
        ops = self.comm.unfinished()
        last = self.comm.last_op
        return {
            "rank": self.rank,
            "beat": self.beats,
            "time": time.time(),
            "where": self.where(),
            "ops": [_op(op) for op in ops],
            # Only when nothing is unfinished: then the op issued last is the best clue.
            "last_op": None if last is None or ops else _op(last),
        }

    def _run(self) -> None:
        while not self.stopped.is_set():
            self.beats += 1
            try:
                self.store.set(self.keys[self.rank], json.dumps(self.state()))
                if self.store.check([self.stop_key]):
                    self._stop_as_told()
                states = self._states() if self.rank == 0 else None
            except (RuntimeError, OSError) as e:  # the store is gone: whoever served it has died
                if not self.stopped.is_set():
                    self._end(
                        f"the rendezvous store stopped answering ({str(e).splitlines()[0][:200]}): the "
                        "process serving it (rank 0, or the launcher) has died. Look for its error or an "
                        "out-of-memory kill (exit code 137) in its log."
                    )
                return
            now = time.monotonic()
            silent = self._silent(states, now) if states is not None else []
            if silent:
                self._end(self.report(states, silent, "stopped (failed, died or froze)"))
                return
            ops = self.comm.unfinished()
            if ops and now - ops[0].started > self.hang_timeout:
                # A rank that missed a beat may have frozen just after this op started: the silence check
                # above names it within silent_seconds, a better report than this wait.
                states = self._states()
                if self._silent(states, now, 1.5 * self.interval):
                    self.stopped.wait(self.interval)
                    continue
                op = _waited_on({"ops": [_op(op) for op in ops]})
                group = f" on {op['group']}" if op["group"] else ""
                problem = (
                    f"has waited in {op['kind']}{group} for {op['seconds']:.0f} s "
                    f"(parallelism.hang_timeout_seconds={self.hang_timeout:g})"
                )
                self._end(self.report(states, [], problem, stuck=True))
                return
            self.stopped.wait(self.interval)

    def _silent(self, states: dict[int, dict[str, Any]], now: float, after: float | None = None) -> list[int]:
        """The ranks that failed, or whose heartbeat has not changed for `after` (silent_seconds) seconds."""
        after = self.silent_seconds if after is None else after
        silent = []
        for rank, state in states.items():
            if state.get("done"):
                continue
            beat, since = self.seen.get(rank, (-1, now))
            if state["beat"] != beat:
                self.seen[rank] = (state["beat"], now)
            if state.get("failed") or (state["beat"] == beat and now - since > after):
                silent.append(rank)
        return silent

    def _states(self) -> dict[int, dict[str, Any]]:
        return {r: json.loads(v.decode()) for r, v in enumerate(self.store.multi_get(self.keys))}

    def report(
        self,
        states: dict[int, dict[str, Any]],
        silent: list[int],
        problem: str,
        stuck: bool = False,
        now: float | None = None,
    ) -> str:
        """Every rank's last published state, with its age: how long ago that rank published it (a frozen
        rank's state can be far behind what the others do now)."""
        now = time.time() if now is None else now
        if stuck:
            who = f"rank {self.rank}"
        else:
            who = f"rank{'s' * (len(silent) > 1)} {', '.join(map(str, silent))}"
        lines = [f"hang report from rank {self.rank}: {who} {problem}. What every rank is doing:"]
        for rank, state in sorted(states.items()):
            age = 0.0 if rank == self.rank else max(0.0, now - state["time"])
            line = f"  rank {rank} (as of {age:.0f} s ago): {describe(state)}"
            if rank in silent:
                line += " <- failed" if state.get("failed") else " <- silent"
            lines.append(line)
        lines += mismatches(states)
        lines.append(
            "A rank that took another code path (a different config, data, or an exception it swallowed) is "
            "the usual cause; its own log says more. The job is stopped rather than left waiting."
        )
        if self.flight_recorder is not None:
            folder = self.flight_recorder.parent
            lines.append(
                f"Every rank's flight recorder (its last collectives and transfers, as torch records them) "
                f"is written to {folder}: `python -m torch.distributed.flight_recorder.fr_trace {folder}` "
                "lines them up across ranks."
            )
        return "\n".join(lines)

    def _end(self, report: str) -> None:
        """Write this rank's flight recorder, print the report, and tell every rank to end."""
        self._write_flight_recorder()
        print(f"femtotron: error: {report}", file=sys.stderr, flush=True)
        with contextlib.suppress(RuntimeError, OSError):  # the store may be what failed
            self.store.set(self.stop_key, str(self.rank))
        self._exit_with_the_others()

    def _stop_as_told(self) -> None:
        reporter = self.store.get(self.stop_key).decode()
        self._write_flight_recorder()
        message = (
            f"femtotron: error: rank {self.rank} stops with the job: rank {reporter} found it stuck (its "
            "log says what every rank was doing)"
        )
        if self.flight_recorder:
            message += f"; this rank's flight recorder: {self.flight_recorder}"
        print(message, file=sys.stderr, flush=True)
        self._exit_with_the_others()

    def _write_flight_recorder(self) -> None:
        with contextlib.suppress(RuntimeError, OSError):  # a record lost must not stop the report
            if self.flight_recorder is not None:
                write_flight_recorder(self.flight_recorder, self.backend)
            self.store.set(self.dumped_keys[self.rank], "")

    def _exit_with_the_others(self) -> None:
        """End once every rank has written its flight recorder, or after DUMP_SECONDS (a frozen rank never
        does): a launcher kills the whole job when its first process ends, and a record half written is
        lost."""
        with contextlib.suppress(RuntimeError, OSError):
            self.store.wait(self.dumped_keys, timedelta(seconds=DUMP_SECONDS))
        os._exit(EXIT_CODE)


def _op(op: OpInFlight) -> dict[str, Any]:
    return {
        "kind": op.kind,
        "group": op.group,
        "peer": op.peer,
        "shape": list(op.shape),
        "dtype": op.dtype,
        "seconds": round(time.monotonic() - op.started, 1),
    }


def _doing(op: dict[str, Any]) -> str:
    group = f" on {op['group']}" if op["group"] else ""
    peer = f" with rank {op['peer']}" if op["peer"] is not None else ""
    tensor = f"a {tuple(op['shape'])} {op['dtype']} tensor"
    return f"{op['kind']}{group}{peer} for {tensor}, {op['seconds']:g} s so far"


def _waited_on(state: dict[str, Any]) -> dict[str, Any] | None:
    """Of a rank's unfinished ops, the one it waits on: the oldest receive, collective or wait for the device
    (a pending send waits on its receiver rather than holding this rank up)."""
    ops = state.get("ops") or []
    return next((op for op in ops if op["kind"] != "send"), ops[0] if ops else None)


def describe(state: dict[str, Any]) -> str:
    ops = state.get("ops") or []
    last = state.get("last_op")
    op = _waited_on(state)
    if op is not None:
        others = [_doing(other) for other in ops if other is not op]
        doing = f"in {_doing(op)}"
        if others:
            doing += f" (also unfinished: {'; '.join(others)})"
    else:  # nothing unfinished: what was issued last is the best clue
        doing = "no communication in flight"
        if last is not None:
            peer = f" with rank {last['peer']}" if last["peer"] is not None else ""
            doing += f" (the last issued: {last['kind']} on {last['group']}{peer}, {last['seconds']:g} s ago)"
    return f"{doing}; {state['where']}"


def mismatches(states: dict[int, dict[str, Any]]) -> list[str]:
    """Point at the pairs that wait on each other: a receive whose peer is not sending to it."""
    out = []
    pairs = set()  # (rank, peer) pairs already looked at
    for rank, state in sorted(states.items()):
        for op in state.get("ops") or []:
            peer = op["peer"]
            if op["kind"] != "recv" or peer not in states or (rank, peer) in pairs:
                continue
            pairs.add((rank, peer))
            theirs = states[peer].get("ops") or []
            if any(other["kind"] == "recv" and other["peer"] == rank for other in theirs):
                if rank < peer:
                    out.append(
                        f"deadlock: rank {rank} and rank {peer} each wait to receive from the other "
                        f"({state['where']}; {states[peer]['where']}): one of them skipped or reordered a "
                        "send"
                    )
            elif not any(other["kind"] == "send" and other["peer"] == rank for other in theirs):
                other = _waited_on(states[peer])
                doing = "computing" if other is None else f"in {_doing(other)}"
                out.append(
                    f"mismatch: rank {rank} waits to receive from rank {peer} ({state['where']}), but rank "
                    f"{peer} is {doing} ({states[peer]['where']})"
                )
    return out
