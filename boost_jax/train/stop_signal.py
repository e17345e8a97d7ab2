"""Stopping on a signal: SIGTERM/SIGINT ask the run loop to save and exit at a step boundary,
and every process of a multi-host run learns of a signal any of them received, so all stop
after the same step and none is left waiting in a collective (train/loop.py)."""

from __future__ import annotations

import signal
from typing import Optional

import numpy as np

from boost_jax.errors import Interrupted


def agree_stop(received: Optional[int], nproc: int) -> Optional[int]:
    """The signal any process received, on every process (all stop at the same step)."""
    if nproc == 1:
        return received
    from jax.experimental import multihost_utils

    flags = multihost_utils.process_allgather(np.array([received or 0], np.int32))
    return int(np.max(flags)) or None


EARLY: dict = {}  # the signal catch_early saw, if any


def catch_early() -> None:
    """From a command's start: SIGINT / SIGTERM stop it (exit 128 + the signal) while JAX starts
    and compiles, where Python's own KeyboardInterrupt can land in one of JAX's callbacks and be
    swallowed; a signal swallowed so stops the loop at its first step (StopSignal), as a signal
    during the loop would. A signal the shell told this process to ignore stays ignored."""
    def handle(signum, frame):
        EARLY["signum"] = signum
        raise Interrupted(signum)

    for sig in (signal.SIGTERM, signal.SIGINT):
        if signal.getsignal(sig) is not signal.SIG_IGN:
            signal.signal(sig, handle)


class StopSignal:
    """SIGTERM/SIGINT ask the loop to save and exit instead of dying mid-step."""

    def __init__(self):
        self.received: Optional[int] = None
        self._old = {}

    def __enter__(self):
        if EARLY:  # a start-up signal a JAX callback swallowed: stop at the first step, with
            self.received = EARLY["signum"]  # every process (agree_stop), none left waiting
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                self._old[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread
                pass
        return self

    def _handle(self, signum, frame):
        if self.received is not None:  # second signal: give up at once, exit 128 + it
            raise Interrupted(signum)
        self.received = signum

    def __exit__(self, *exc):
        for sig, old in self._old.items():
            signal.signal(sig, old)
