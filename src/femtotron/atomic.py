"""Write files so a reader never sees half of one: write beside the target, then rename over it.

The rename replaces whatever is at the target, a symlink included, and never writes through one: a file
from elsewhere linked into an output directory (a git clone of a model repository, say) stays as it was.
A write that fails for want of space or permission becomes a `WriteError` naming the file and the fix.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from safetensors import SafetensorError

from femtotron.crash_points import crash_point
from femtotron.errors import WriteError

FIXES = {
    errno.ENOSPC: "free space on that file system, or choose a directory on another one",
    errno.EDQUOT: "free space within your quota, or choose a directory on another file system",
    errno.EROFS: "the file system is read-only: choose a writable directory",
    errno.EACCES: "you may not write there: choose a directory you can write, or fix its permissions",
    errno.EFBIG: "the file is larger than the file system or `ulimit -f` allows: raise the limit or choose "
    "another directory",
}
TEMPORARY = re.compile(r"\.tmp(\d+)$")  # what atomic_path and staging directories name their temporaries


def temporary_name(path: str | os.PathLike) -> str:
    """`path` with this process's temporary suffix (`remove_stale` removes it once the process is gone)."""
    return f"{os.fspath(path)}.tmp{os.getpid()}"


@contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[str]:
    """Yield a temporary path next to `path`; on success it replaces `path`, on error it is removed."""
    path = os.fspath(path)
    tmp = temporary_name(path)
    try:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        remove(tmp)  # a file or link planted there: write a fresh file, never through a link
        yield tmp
        if os.path.isfile(tmp):  # safetensors writes mode 0600 whatever the umask says
            os.chmod(tmp, 0o666 & ~current_umask())
        crash_point("atomic.written")
        os.replace(tmp, path)  # atomic on POSIX within one file system
    except (OSError, SafetensorError) as e:
        error = write_error(e, path)
        if error is None:
            raise
        raise error from None
    finally:
        remove(tmp)


def write_error(error: BaseException, path: str | os.PathLike) -> WriteError | None:
    """A `WriteError` for `path` when `error` is a full disk, a read-only file system or no permission
    (safetensors reports the OS error as text: `... (os error 28)`)."""
    code = getattr(error, "errno", None)
    found = re.search(r"\(os error (\d+)\)", str(error))
    if code is None and found:
        code = int(found.group(1))
    # A file read for the write (copy_file's source) that cannot be read is no write problem.
    source = getattr(error, "filename", None)
    read = source not in (None, os.fspath(path), temporary_name(path)) and os.path.isfile(source)
    if code not in FIXES or isinstance(error, WriteError) or read:
        return None
    written = WriteError(f"cannot write {os.fspath(path)}: {os.strerror(code)}. Fix: {FIXES[code]}.")
    written.errno = code
    written.filename = os.fspath(path)
    return written


def current_umask() -> int:
    mask = os.umask(0)  # the only way to read it is to set it
    os.umask(mask)
    return mask


def remove(path: str | os.PathLike) -> None:
    """Remove a file, a link (not what it points to) or a directory tree at `path`, if there is one."""
    if not os.path.lexists(path):
        return
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    else:
        os.unlink(path)


def copy_file(source: str | os.PathLike, target: str | os.PathLike) -> None:
    """Copy `source` to `target` atomically; a symlink at `target` is replaced, not written through."""
    with atomic_path(target) as tmp:
        shutil.copyfile(source, tmp)


def remove_stale(directory: str | os.PathLike, prefix: str = "") -> list[Path]:
    """Remove the temporaries (`*.tmp<PID>`, names starting with `prefix`) in `directory` that a killed
    process left: those whose process no longer exists on this machine. Returns what it removed."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    removed = []
    for entry in sorted(directory.iterdir()):
        found = TEMPORARY.search(entry.name)
        if found and entry.name.startswith(prefix) and not alive(int(found.group(1))):
            remove(entry)
            removed.append(entry)
    return removed


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):  # no such process (or no such pid at all)
        return False
    except PermissionError:  # another user's
        return True
    return True
