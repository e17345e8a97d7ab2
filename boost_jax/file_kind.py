"""Only regular files are read as inputs or replaced as outputs: a device (/dev/zero never ends,
/dev/full is a node of the machine), a FIFO (blocks until a writer comes) or a socket is named
and refused. Opening with O_NONBLOCK lets a FIFO be opened and refused instead of waited on.
A leaf module (imports only errors), so the readers and writers can all use it."""

from __future__ import annotations

import os
import stat
from typing import Optional

from boost_jax.errors import UserError

KINDS = ((stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
         (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a folder"),
         (stat.S_ISLNK, "a link"), (stat.S_ISREG, "a regular file"))


def describe(mode: int) -> str:
    return next((name for test, name in KINDS if test(mode)), "not a regular file")


def special(path: str, folder: bool = False) -> Optional[str]:
    """What `path` (links followed) is when it exists as neither a regular file nor, with
    `folder`, a directory: e.g. "a FIFO"; None when it is one of those or does not exist."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return None
    if stat.S_ISREG(mode) or (folder and stat.S_ISDIR(mode)):
        return None
    return describe(mode)


def read_regular(path: str, what: str, limit: int) -> bytes:
    """The bytes of the regular file `path` (called `what` in errors), at most `limit` of them:
    UserError for a device, FIFO or socket (never blocked on) and for a larger file."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as e:
        raise UserError(f"cannot read {what} {path!r} ({e.strerror}); check the path and its "
                        "permissions") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):  # before fdopen, which refuses a folder with a traceback
        os.close(fd)
        raise UserError(f"{what} {path!r} is {describe(st.st_mode)}, not a regular file; "
                        "pass a file (devices, FIFOs and sockets are never read)")
    with os.fdopen(fd, "rb") as f:
        if st.st_size > limit:
            raise UserError(f"{what} {path!r} is {st.st_size:,} bytes, more than the "
                            f"{limit:,} a {what} may have; pass the right file")
        os.set_blocking(fd, True)
        raw = f.read(limit + 1)
    if len(raw) > limit:  # grew while read
        raise UserError(f"{what} {path!r} is more than the {limit:,} bytes a {what} may have; "
                        "pass the right file")
    return raw


def check_input(path: str, label: str) -> None:
    """A UserError if `path` exists as a device, FIFO or socket (a folder or a file is fine):
    reading one blocks forever or never ends."""
    kind = special(path, folder=True)
    if kind is not None:
        raise UserError(f"{label} {path!r} is {kind}, not a regular file; point it at a file "
                        "(devices, FIFOs and sockets are never read)")
