"""The run folder's lock: OUT/run.lock, held with fcntl.flock by the process training into OUT (mecefo.train)
or launching into it (mecefo.launch).

The kernel holds the lock, not the file's contents: it is released when its process ends however it ends (a
SIGKILL included), so there is no stale lock to detect and take over, and no window in which the file exists but
says nothing. The file holds the holder's pid only to name it in the refusal. A released lock's file is removed
while still held; a process that locked a file someone removed meanwhile tries again on the new one.
"""

from __future__ import annotations

import fcntl
import os
import time
from pathlib import Path

from .errors import UsageError

LOCK = "run.lock"
_held: dict[Path, int] = {}  # run folder (resolved) -> the descriptor holding its lock, in this process


def lock_holder(out: Path) -> int | None:
    """The pid of another process holding OUT's lock (None: nobody, or this process). A holder whose pid cannot
    be read yet (it is writing it) is reported as 0."""
    if Path(out).resolve() in _held:
        return None
    try:
        fd = os.open(Path(out) / LOCK, os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return _pid_in(fd)
    finally:
        os.close(fd)  # (closing releases a shared lock we may have taken)
    return None


def take_lock(out: Path) -> Path:
    """Hold OUT/run.lock (creating OUT) for the rest of this process or until release_lock; a UsageError naming
    the holder if another process holds it."""
    out = Path(out)
    lock = out / LOCK
    out.mkdir(parents=True, exist_ok=True)
    if out.resolve() in _held:
        raise UsageError(f"--out {out} is in use by a run of this process; choose another --out")
    while True:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
        if not _lock_exclusive(fd):
            holder = _pid_in(fd)
            os.close(fd)
            raise UsageError(f"--out {out} is in use by a live run (pid {holder}, {lock}); wait for it to end or "
                             "choose another --out")
        try:
            same = os.fstat(fd).st_ino == os.stat(lock).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)  # its holder removed the file between our open and our lock: lock the new one
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())
    _held[out.resolve()] = fd
    return lock


def release_lock(out: Path) -> None:
    """Remove OUT/run.lock and release it, if this process holds it."""
    fd = _held.pop(Path(out).resolve(), None)
    if fd is None:
        return
    try:
        (Path(out) / LOCK).unlink(missing_ok=True)
    finally:
        os.close(fd)


def _lock_exclusive(fd: int, tries: int = 20) -> bool:
    """flock(LOCK_EX), without blocking; a lock_holder() of another process holds a shared lock for microseconds,
    so a refusal is retried for about 0.2 s before it is believed."""
    for i in range(tries):
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if i + 1 < tries:
                time.sleep(0.01)
    return False


def _pid_in(fd: int) -> int:
    try:
        return int(os.pread(fd, 32, 0).split()[0])
    except (OSError, ValueError, IndexError):
        return 0
