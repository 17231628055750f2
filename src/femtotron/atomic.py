"""Write files so a reader never sees half of one: write beside the target, then rename over it."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[str]:
    """Yield a temporary path next to `path`; on success it replaces `path`, on error it is removed."""
    path = os.fspath(path)
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        yield tmp
        os.replace(tmp, path)  # atomic on POSIX within one file system
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
