"""Hang report (P1, L4, C2): no rank waits forever without saying why.

A background thread on every rank publishes, every `interval` seconds, what the rank is doing to the
rendezvous store, which stays reachable when collectives are stuck: a heartbeat counter, the op in
flight from parallel/comm.py (kind, group, peer, shape, for how long) and where in the step it is
(step, pipeline action, micro-batch). It also watches:

- its own op: in flight longer than `parallelism.hang_timeout_seconds` (a deadlock: some rank took
  another path), and
- the other ranks' heartbeats: one that stops changing for `silent_seconds` belongs to a process that
  died or froze (on NCCL a dead peer is otherwise noticed only at the collective timeout),
- the store itself: unreachable means the process serving it (rank 0, or the launcher) is gone.

Then it gathers every rank's state into one report that points at the mismatch ("rank 1 waits in
recv from rank 0 (micro-batch 3 ...); rank 0 is in all_reduce on dp[0,2] ..."), prints it and ends
the process, so the launcher ends the job within seconds instead of after the collective timeout.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from femtotron.parallel.context import ParallelContext

EXIT_CODE = 4  # a distributed error, as DistributedError


class Watchdog:
    def __init__(
        self, ctx: ParallelContext, hang_timeout: float, where: Callable[[], str], interval: float = 2.0
    ):
        self.comm, self.messages, self.rank, self.world_size = ctx.comm, ctx.store, ctx.rank, ctx.world_size
        self.hang_timeout, self.where = hang_timeout, where
        # A live rank's thread beats every `interval` s whatever its main thread does: 30 s of silence is
        # death.
        self.interval, self.silent_seconds = interval, min(30.0, hang_timeout)
        self.beats = 0
        self.seen: dict[int, tuple[int, float]] = {}  # rank -> (its heartbeat, when it last changed here)
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, name="femtotron-watchdog", daemon=True)
        self.keys = [f"{ctx.store.key_prefix}state/{r}" for r in range(ctx.world_size)]
        self.store: Any = None

    def start(self) -> Watchdog:
        self.started_at = time.monotonic()
        if self.world_size > 1:
            self.store = (
                self.messages.new_client()
            )  # its own connection: the main thread may wait on the store
            self.thread.start()
        return self

    def stop(self, failed: bool = False) -> None:
        """Stop watching, and tell the others this rank is done (or failed: its own error says why)."""
        self.stopped.set()
        if self.thread.is_alive():
            self.thread.join(timeout=2 * self.interval)
            try:
                self.store.set(
                    self.keys[self.rank], json.dumps({**self.state(), "failed" if failed else "done": True})
                )
            except (RuntimeError, OSError):  # the store's server is gone too; nothing left to tell
                pass

    def state(self) -> dict[str, Any]:
        op, last = self.comm.in_flight, self.comm.last_op
        return {
            "rank": self.rank,
            "beat": self.beats,
            "where": self.where(),
            "op": _op(op),
            "last_op": None if last is None or op is not None else _op(last),
        }

    def _run(self) -> None:
        while not self.stopped.is_set():
            self.beats += 1
            try:
                self.store.set(self.keys[self.rank], json.dumps(self.state()))
                states = self._states()
            except (RuntimeError, OSError) as e:  # the store is gone: whoever served it has died
                if not self.stopped.is_set():
                    self._end(
                        f"the rendezvous store stopped answering ({str(e).splitlines()[0][:200]}): the "
                        "process serving it (rank 0, or the launcher) has died. Look for its error or an "
                        "out-of-memory kill (exit code 137) in its log."
                    )
                return
            now = time.monotonic()
            silent = []
            for rank, state in states.items():
                if state.get("done"):
                    continue
                if state.get("failed"):
                    silent.append(rank)
                    continue
                beat, since = self.seen.get(rank, (-1, now))
                if state["beat"] != beat:
                    self.seen[rank] = (state["beat"], now)
                elif now - since > self.silent_seconds:
                    silent.append(rank)
            missing = [
                r
                for r in range(self.world_size)
                if r not in states and now - self.started_at > self.silent_seconds
            ]
            op = self.comm.in_flight
            if silent or missing:
                self._end(self.report(states, silent + missing, "stopped (failed, died or froze)"))
                return
            if op is not None and now - op.started > self.hang_timeout:
                self._end(
                    self.report(
                        states,
                        [],
                        f"has waited in {op.kind} on {op.group} for {now - op.started:.0f} s "
                        f"(parallelism.hang_timeout_seconds={self.hang_timeout:g})",
                        stuck=True,
                    )
                )
                return
            self.stopped.wait(self.interval)

    def _states(self) -> dict[int, dict[str, Any]]:
        if self.store.check(self.keys):  # one request for all once every rank has reported
            return {r: json.loads(v.decode()) for r, v in enumerate(self.store.multi_get(self.keys))}
        return {
            r: json.loads(self.store.get(k).decode())
            for r, k in enumerate(self.keys)
            if self.store.check([k])
        }

    def report(
        self,
        states: dict[int, dict[str, Any]],
        silent: list[int],
        problem: str,
        stuck: bool = False,
        now: float | None = None,
    ) -> str:
        """Every rank's last published state, with its age as seen here: how long since its heartbeat last
        changed (a frozen rank's state can be far behind what the others do now)."""
        now = time.monotonic() if now is None else now
        lines = [
            f"hang report from rank {self.rank}: "
            + (
                f"rank {self.rank} {problem}"
                if stuck
                else f"rank{'s' * (len(silent) > 1)} {', '.join(map(str, silent))} {problem}"
            )
            + ". What every rank is doing:"
        ]
        for rank in range(self.world_size):
            state = states.get(rank)
            if state is None:
                lines.append(f"  rank {rank}: never reported" + (" <- silent" if rank in silent else ""))
                continue
            age = 0.0 if rank == self.rank else now - self.seen.get(rank, (0, now))[1]
            lines.append(
                f"  rank {rank} (as of {age:.0f} s ago): {describe(state)}"
                + (" <- " + ("failed" if state.get("failed") else "silent") if rank in silent else "")
            )
        lines += mismatches(states)
        lines.append(
            "A rank that took another code path (a different config, data, or an exception it swallowed) is "
            "the usual cause; its own log says more. The job is stopped rather than left waiting."
        )
        return "\n".join(lines)

    def _end(self, report: str) -> None:
        print(f"femtotron: error: {report}", file=sys.stderr, flush=True)
        os._exit(EXIT_CODE)


def _op(op: Any) -> dict[str, Any] | None:
    if op is None:
        return None
    return {
        "kind": op.kind,
        "group": op.group,
        "peer": op.peer,
        "shape": list(op.shape),
        "dtype": op.dtype,
        "seconds": round(time.monotonic() - op.started, 1),
    }


def describe(state: dict[str, Any]) -> str:
    op, last = state.get("op"), state.get("last_op")
    if op is not None:
        doing = (
            f"in {op['kind']} on {op['group']}"
            + (f" with rank {op['peer']}" if op["peer"] is not None else "")
            + f" for a {tuple(op['shape'])} {op['dtype']} tensor, {op['seconds']:g} s so far"
        )
    else:  # on GPUs a collective returns once queued: what was issued last is then the best clue
        doing = "no communication in flight" + (
            ""
            if last is None
            else (
                f" (the last issued: {last['kind']} on {last['group']}"
                + (f" with rank {last['peer']}" if last["peer"] is not None else "")
                + f", {last['seconds']:g} s ago)"
            )
        )
    return f"{doing}; {state['where']}"


def mismatches(states: dict[int, dict[str, Any]]) -> list[str]:
    """Point at the pairs that wait on each other: a receive whose peer is not sending to it."""
    out = []
    for rank, state in sorted(states.items()):
        op = state.get("op")
        if op is None or op["peer"] is None or op["peer"] not in states or op["kind"] != "recv":
            continue
        peer = op["peer"]
        other = states[peer].get("op")
        if other is not None and other["kind"] == "recv" and other["peer"] == rank:
            if rank < peer:
                out.append(
                    f"deadlock: rank {rank} and rank {peer} each wait to receive from the other "
                    f"({state['where']}; {states[peer]['where']}): one of them skipped or reordered a send"
                )
        elif other is None or other["kind"] != "send" or other["peer"] != rank:
            doing = (
                "computing"
                if other is None
                else f"in {other['kind']} on {other['group']}"
                + (f" with rank {other['peer']}" if other["peer"] is not None else "")
            )
            out.append(
                f"mismatch: rank {rank} waits to receive from rank {peer} ({state['where']}), but rank "
                f"{peer} is {doing} ({states[peer]['where']})"
            )
    return out
