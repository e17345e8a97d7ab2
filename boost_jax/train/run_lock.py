"""One run per out_dir: an exclusive lock on ``out_dir/.lock`` held for the whole run.

Two runs writing one out_dir would interleave their metrics rows, overwrite each other's
summary and save into one checkpoint directory. The lock is ``fcntl.flock``: the kernel drops
it however the holder ends (exit, exception, kill -9), so a dead run never blocks the next one.
The holder writes who it is (pid, host, start time, command) into the file and empties it on a
clean exit, so a record found when taking the lock names a run that died while holding it; it
is reported and taken over. With several processes, process 0 holds the lock for all of them
and every process learns the outcome before touching out_dir.

A run refused before it wrote anything (bad data, a failed tracker start) leaves an out_dir
that was missing or empty as it found it: the lock file is removed while still held (a run
that opened the old file sees it is no longer the path's and opens it again), then the
folders the run created, each only if empty.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import stat
import sys
import time
from typing import Callable, Optional

from boost_jax.errors import UserError
from boost_jax.names import LOCK_FILE

# filesystems mounted without lock support (some NFS/Lustre set-ups) answer with these
_UNSUPPORTED = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL}


class OutDirBusy(UserError):
    """Another live run holds out_dir."""


FOREIGN = object()  # a lock file holding something no run wrote


def lock_record(raw: bytes):
    """What a lock file's bytes say: None (empty, or zeros a crash left: a run ended, or none
    wrote yet), the record of the run that holds or held it (a JSON object with its pid; {} for
    one cut short), or FOREIGN."""
    raw = raw.strip(b"\0 \t\r\n")
    if not raw:
        return None
    try:
        rec = json.loads(raw)
    except (ValueError, RecursionError):
        return {} if raw.startswith(b'{"pid": ') else FOREIGN
    return rec if isinstance(rec, dict) and "pid" in rec else FOREIGN


def is_run_lock(path: str) -> bool:
    """`path` is a regular file a run's lock left (empty or holding a run's record)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return False
    try:
        return stat.S_ISREG(os.fstat(fd).st_mode) and \
            lock_record(os.pread(fd, 1 << 16, 0)) is not FOREIGN
    finally:
        os.close(fd)


def _describe(record: dict) -> str:
    cmd = " ".join(record.get("argv") or [])
    cmd = cmd if len(cmd) <= 120 else cmd[:117] + "..."
    started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(record.get("started", 0)))
    return (f"pid {record.get('pid', '?')} on host {record.get('host', '?')}, started "
            f"{started}" + (f": {cmd}" if cmd else ""))


def _same_file(fd: int, path: str) -> bool:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    mine = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino)


def fresh_dirs(out_dir: str) -> Optional[list[str]]:
    """None if out_dir holds anything (or is no folder); else the folders a run creates for it,
    outermost first: none for an empty folder, out_dir and its missing parents otherwise."""
    if os.path.lexists(out_dir):
        try:
            return None if os.listdir(out_dir) else []
        except OSError:
            return None
    missing, d = [], out_dir
    while d and not os.path.lexists(d):
        missing.insert(0, d)
        parent = os.path.dirname(d)
        d = parent if parent != d else ""
    return missing


class RunLock:
    def __init__(self, out_dir: str):
        self.out_dir = out_dir
        self.path = os.path.join(out_dir, LOCK_FILE)
        self._fd: Optional[int] = None

    def _read(self, fd: int):
        return lock_record(os.pread(fd, 1 << 16, 0))

    def _lock(self) -> Optional[int]:
        """The locked fd of the file at self.path, None where the filesystem cannot lock. A
        file unlinked by a refused run (release(remove=True)) after we opened it is opened anew."""
        while True:
            os.makedirs(self.out_dir, exist_ok=True)  # a refused fresh run may have removed it
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                rec = self._read(fd)
                os.close(fd)
                who = _describe(rec) if rec and rec is not FOREIGN else \
                    "its details are not written yet"
                raise OutDirBusy(
                    f"out_dir {self.out_dir!r} is in use by another run ({who}); wait for it "
                    "to finish or stop it, or choose another out_dir=...") from None
            except OSError as e:
                os.close(fd)
                if e.errno in _UNSUPPORTED:
                    return None
                raise
            if _same_file(fd, self.path):
                return fd
            os.close(fd)

    def acquire(self) -> tuple[bool, Optional[dict]]:
        """(locked, record of a dead holder taken over or None). Raises OutDirBusy if a live run
        holds it; (False, None) where the filesystem cannot lock at all."""
        fd = self._lock()
        if fd is None:
            return False, None
        stale = self._read(fd)
        if stale is FOREIGN:  # the user's file of that name: never emptied or taken over
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)
            raise UserError(f"out_dir {self.out_dir!r} holds {LOCK_FILE}, a file no run wrote "
                            "(it holds no run record) where a run keeps its lock; move it away "
                            "or choose another out_dir=...")
        argv = [os.path.basename(sys.argv[0])] + sys.argv[1:]  # a few KiB at most: read whole
        me = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time(),
              "argv": [a[:200] for a in argv[:40]]}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(me).encode(), 0)
        self._fd = fd
        return True, stale

    def release(self, remove: bool = False) -> None:
        """Unlock; with `remove` the lock file is unlinked first, while still held."""
        if remove:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
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


def _empty_folders(out_dir: str) -> Optional[list[str]]:
    """The folders under out_dir (not links), innermost first, if they and out_dir hold nothing
    else but out_dir's lock file; None otherwise."""
    out = []
    def fail(e: OSError):
        raise e

    for top, dirs, files in os.walk(out_dir, topdown=False, onerror=fail):
        files = set(files) - ({LOCK_FILE} if top == out_dir else set())
        if files or any(os.path.islink(os.path.join(top, d)) for d in dirs):
            return None
        out.append(top)
    return out[:-1]  # out_dir itself aside


def _leave_as_found(lock: RunLock, fresh: list[str]) -> None:
    """A failed run on an out_dir that was missing or empty: if the lock file and empty folders
    (checkpoints/, which the run made: nothing was in out_dir before it) are all it holds,
    remove them (the lock file still held) and the folders the run created, innermost first."""
    try:
        empty = _empty_folders(lock.out_dir)
    except OSError:
        empty = None
    alone = empty is not None
    for d in empty or []:
        try:
            os.rmdir(d)
        except OSError:
            alone = False
    lock.release(remove=alone)
    for d in reversed(fresh if alone else []):
        try:
            os.rmdir(d)
        except OSError:  # something else is in it now: keep it
            return


@contextlib.contextmanager
def hold_out_dir(out_dir: str, primary: bool, nproc: int, warn: Callable[[str], None],
                 check: Optional[Callable[[], None]] = None, fresh: Optional[list] = None):
    """Hold the out_dir lock (from process 0) for the body; every process raises if it is taken
    or if `check` (run by process 0 before it takes the lock) raises a UserError. `fresh`
    (fresh_dirs, taken before out_dir was created): when the body raises, process 0 leaves
    out_dir as it was before the run if the run wrote nothing else in it."""
    lock, error, locked, stale = RunLock(out_dir), None, False, None
    if primary:
        try:
            if check is not None:
                check()
            locked, stale = lock.acquire()
        except UserError as e:
            error = e
    try:
        if not _all_agree(error is None, nproc):
            raise error or UserError(
                f"out_dir {out_dir!r} was refused by process 0 (its error line says why: "
                "another run holds it, or it holds files that are no run); wait for that run "
                "or choose another out_dir")
        if primary and not locked:
            warn(f"out_dir {out_dir!r} cannot be locked on this filesystem; nothing stops "
                 "another run from writing into it at the same time")
        if stale is not None:
            warn(f"out_dir {out_dir!r} was held by a run that died without releasing it "
                 f"({_describe(stale) if stale else 'no details'}); taking it over")
        yield
    except BaseException:
        if primary and fresh is not None and error is None:
            _leave_as_found(lock, fresh)
        raise
    finally:
        lock.release()
