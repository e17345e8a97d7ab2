"""The run log: what libraries report during a run goes to ``out_dir/run.log``, not the console.

orbax, absl and tensorstore report a failing save from several background threads, each with
its own traceback; on the console they would bury the one line that says what happened and what
to do. While a run is active, Python logging records, uncaught exceptions of other threads and
"exception ignored" reports are written to the run log instead (process p > 0: ``run.<p>.log``),
and the error line names the file. The console keeps the run's own lines. A command-line run
that fails keeps this until the process exits: orbax's failed futures report when they are
collected, during shutdown.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
import traceback
from typing import Optional


class _FileHandler(logging.FileHandler):
    def emit(self, record):
        try:
            super().emit(record)
        except OSError:  # opening it failed: a refused run removed its fresh out_dir
            self.handleError(record)

    def handleError(self, record):  # a full disk must not print a logging traceback instead
        pass


class _Mute(logging.Filter):
    def filter(self, record):
        return False


class RunLog:
    def __init__(self, out_dir: str, process_index: int = 0, keep_after_error: bool = False):
        name = "run.log" if process_index == 0 else f"run.{process_index}.log"
        self.path = os.path.join(out_dir, name)
        self._handler: Optional[logging.Handler] = None
        self._muted: list[logging.Handler] = []
        self._mute = _Mute()
        self._hooks = None
        self._keep_after_error = keep_after_error

    def __enter__(self) -> "RunLog":
        root = logging.getLogger()
        self._handler = _FileHandler(self.path, delay=True)
        self._handler.setFormatter(logging.Formatter(
            "%(asctime)s %(levelname)s %(name)s [%(threadName)s] %(message)s"))
        for h in root.handlers:
            if getattr(h, "stream", None) in (sys.stderr, sys.stdout, sys.__stderr__):
                h.addFilter(self._mute)
                self._muted.append(h)
        root.addHandler(self._handler)
        self._hooks = (threading.excepthook, sys.unraisablehook)
        threading.excepthook = self._thread_exception
        sys.unraisablehook = self._unraisable
        return self

    def __exit__(self, exc_type, *exc) -> None:
        if exc_type is not None and self._keep_after_error:
            return  # a CLI about to exit: what libraries say while shutting down goes here too
        root = logging.getLogger()
        for h in self._muted:
            h.removeFilter(self._mute)
        root.removeHandler(self._handler)
        self._handler.close()
        # a hook installed on top of ours meanwhile chains to ours: leave it in place
        if threading.excepthook == self._thread_exception:
            threading.excepthook = self._hooks[0]
        if sys.unraisablehook == self._unraisable:
            sys.unraisablehook = self._hooks[1]

    def write(self, text: str) -> None:
        try:
            with open(self.path, "a") as f:
                f.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {text.rstrip()}\n")
        except OSError:
            pass

    def exception(self, what: str, exc: BaseException) -> None:
        self.write(what + "\n" + "".join(traceback.format_exception(exc)))

    def _thread_exception(self, args) -> None:
        if args.exc_value is not None:
            name = args.thread.name if args.thread else "?"
            self.exception(f"exception in thread {name}", args.exc_value)

    def _unraisable(self, info) -> None:
        what = f"exception ignored in {info.object!r}" if info.object else "exception ignored"
        if info.exc_value is not None:
            self.exception(info.err_msg or what, info.exc_value)
