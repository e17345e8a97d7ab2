"""One run per out_dir: an exclusive lock on ``out_dir/.lock`` held for the whole run.

Two runs writing one out_dir would interleave their metrics rows, overwrite each other's
summary and save into one checkpoint directory. The lock is ``fcntl.flock``: the kernel drops
it however the holder ends (exit, exception, kill -9), so a dead run never blocks the next one.
The holder writes who it is (pid, host, start time, command) into the file and empties it on a
clean exit, so a record found when taking the lock names a run that died while holding it; it
is reported and taken over. With several processes, process 0 holds the lock for all of them
and every process learns the outcome before touching out_dir.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import sys
import time
from typing import Callable, Optional

from boost_jax.errors import UserError
from boost_jax.names import LOCK_FILE

# filesystems mounted without lock support (some NFS/Lustre set-ups) answer with these
_UNSUPPORTED = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL}


class OutDirBusy(UserError):
    """Another live run holds out_dir."""


def _describe(record: dict) -> str:
    cmd = " ".join(record.get("argv") or [])
    cmd = cmd if len(cmd) <= 120 else cmd[:117] + "..."
    started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(record.get("started", 0)))
    return (f"pid {record.get('pid', '?')} on host {record.get('host', '?')}, started "
            f"{started}" + (f": {cmd}" if cmd else ""))


class RunLock:
    def __init__(self, out_dir: str):
        self.out_dir = out_dir
        self.path = os.path.join(out_dir, LOCK_FILE)
        self._fd: Optional[int] = None

    def _read(self, fd: int) -> Optional[dict]:
        os.lseek(fd, 0, os.SEEK_SET)
        raw = os.read(fd, 1 << 16)
        if not raw.strip():
            return None
        try:
            rec = json.loads(raw)
        except (ValueError, RecursionError):
            return {}
        return rec if isinstance(rec, dict) else {}

    def acquire(self) -> tuple[bool, Optional[dict]]:
        """(locked, record of a dead holder taken over or None). Raises OutDirBusy if a live run
        holds it; (False, None) where the filesystem cannot lock at all."""
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            rec = self._read(fd)
            os.close(fd)
            who = _describe(rec) if rec else "its details are not written yet"
            raise OutDirBusy(
                f"out_dir {self.out_dir!r} is in use by another run ({who}); wait for it to "
                "finish or stop it, or choose another out_dir=...") from None
        except OSError as e:
            os.close(fd)
            if e.errno in _UNSUPPORTED:
                return False, None
            raise
        stale = self._read(fd)
        me = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time(),
              "argv": [os.path.basename(sys.argv[0])] + sys.argv[1:]}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(me).encode(), 0)
        self._fd = fd
        return True, stale

    def release(self) -> None:
        if self._fd is None:
            return
        try:  # empty record first: a record left in the file means the holder died
            os.ftruncate(self._fd, 0)
        except OSError:
            pass
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)
        self._fd = None


def _all_agree(ok: bool, nproc: int) -> bool:
    if nproc == 1:
        return ok
    import numpy as np
    from jax.experimental import multihost_utils

    return bool(np.min(multihost_utils.process_allgather(np.array([int(ok)], np.int32))))


@contextlib.contextmanager
def hold_out_dir(out_dir: str, primary: bool, nproc: int, warn: Callable[[str], None],
                 check: Optional[Callable[[], None]] = None):
    """Hold the out_dir lock (from process 0) for the body; every process raises if it is taken
    or if `check` (run by process 0 before it takes the lock) raises a UserError."""
    lock, error, locked, stale = RunLock(out_dir), None, False, None
    if primary:
        try:
            if check is not None:
                check()
            locked, stale = lock.acquire()
        except UserError as e:
            error = e
    if not _all_agree(error is None, nproc):
        raise error or UserError(f"out_dir {out_dir!r} was refused by process 0 (its error line "
                                 "says why: another run holds it, or it holds files that are no "
                                 "run); wait for that run or choose another out_dir")
    if primary and not locked:
        warn(f"out_dir {out_dir!r} cannot be locked on this filesystem; nothing stops another "
             "run from writing into it at the same time")
    if stale is not None:
        warn(f"out_dir {out_dir!r} was held by a run that died without releasing it "
             f"({_describe(stale) if stale else 'no details'}); taking it over")
    try:
        yield
    finally:
        lock.release()
