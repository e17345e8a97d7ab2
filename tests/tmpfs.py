"""A small tmpfs for the full-disk tests: mounted where the system lets us (root), else None."""

import contextlib
import os
import subprocess


@contextlib.contextmanager
def small_tmpfs(parent, size: str):
    """Yield a tmpfs of `size` (mount's size=, e.g. "16m") mounted at parent/disk, or None where
    it cannot be mounted; unmounted afterwards."""
    mnt = parent / "disk"
    mnt.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}",
                                            "tmpfs", str(mnt)], capture_output=True).returncode:
        yield None
        return
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)
