"""Small messages between ranks through the rendezvous store: strings posted under keys and collected.

The store (a TCP server on rank 0, or torchrun's agent) stays reachable when collectives are stuck, so it
carries what must get through regardless: which checkpoint to load, whether every rank finished its part
of a save, where a NaN came from, and the hang watchdog's heartbeats. With one process it is a dict.
"""

from __future__ import annotations

import contextlib
import os
from datetime import timedelta

import torch.distributed as dist


class Store:
    def __init__(self, store: dist.Store | None = None, address: tuple[str, int] | None = None) -> None:
        self.store = store
        self.address = address
        self._posted: dict[str, str] = {}
        self._keys = 0
        # torchrun's store outlives a worker restart: keys carry the attempt, so old attempts' go unread.
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        self.key_prefix = f"femtotron/attempt{attempt}/"

    def fresh_key(self, prefix: str) -> str:
        """A key no earlier call used. Every rank calls it in the same order, so all get the same one."""
        self._keys += 1
        return f"{prefix}{self._keys}"

    def new_client(self) -> dist.Store | None:
        """Another connection to the store (None with one process): a client serves one request at a time, so
        a thread that must get through while the main thread waits on it (the watchdog) needs its own."""
        if self.address is None:
            return None
        host, port = self.address
        limit = timedelta(seconds=30)
        return dist.TCPStore(host, port, is_master=False, timeout=limit, wait_for_workers=False)

    def for_another_thread(self) -> Store:
        """This store through a connection of its own (`new_client`), for a thread that talks to it while the
        main thread may too (the background checkpoint writer). With one process, the same messages."""
        other = Store(self.new_client(), self.address)
        other.key_prefix = self.key_prefix
        other._posted = self._posted
        return other

    def post(self, key: str, value: str) -> None:
        """Publish a string under `key`."""
        if self.store is None:
            self._posted[key] = value
        else:
            self.store.set(f"{self.key_prefix}post/{key}", value)

    def collect(self, keys: list[str], timeout: float, remove: bool = False) -> dict[str, str]:
        """Wait up to `timeout` seconds for every key; return those posted (the caller names any missing).
        `remove`: delete them from the store (only this rank reads them), so they do not pile up."""
        if self.store is None:
            take = self._posted.pop if remove else self._posted.get
            return {k: take(k) for k in keys if k in self._posted}
        full = [f"{self.key_prefix}post/{k}" for k in keys]
        with contextlib.suppress(RuntimeError, OSError):  # a timeout: some key never came
            self.store.wait(full, timedelta(seconds=timeout))
        got = {}
        for key, full_key in zip(keys, full, strict=True):
            if self.store.check([full_key]):
                got[key] = self.store.get(full_key).decode()
        if remove:
            for key in got:
                self.store.delete_key(f"{self.key_prefix}post/{key}")
        return got
