"""The process umask set for a block, and a file's permission bits: what the safe-write tests
check new files and folders against."""

import contextlib
import os
import stat


@contextlib.contextmanager
def _umask(mask):
    old = os.umask(mask)
    try:
        yield
    finally:
        os.umask(old)


def _mode(path):
    return stat.S_IMODE(os.stat(path).st_mode)
