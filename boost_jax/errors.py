"""User-facing errors: one line naming the problem and the fix, exit code 2.

User text that cannot stand in such a line is refused where it enters: a control character (a
newline in a name or path would start a new line of a script, a log or a comment) or a lone
surrogate (how Python holds argv bytes that are not UTF-8, or a JSON \\ud800 escape), which
cannot be written as UTF-8. Config strings, script values, corpus text and prompts are checked.
"""

from __future__ import annotations

import errno
import functools
import os
import re
import signal
import sys
from typing import Optional

EXIT_USER_ERROR = 2


class UserError(Exception):
    """A mistake in the user's input (config, data, topology); printed as one line, exit 2."""


class ConfigError(UserError):
    pass


class Interrupted(KeyboardInterrupt):
    """A signal that stops a command at once (e.g. the second SIGTERM while it saves): the exit
    code is 128 + the signal, as a shell reports a process the signal killed."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def cli_main(fn):
    """Wrap a CLI entry point: UserError becomes `error: <msg>` on stderr and exit code 2."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            code = fn(*args, **kwargs)
            if sys.stdout is not None:
                sys.stdout.flush()  # a full disk under stdout fails here, not at exit
            return code
        except OSError as e:
            if e.errno == errno.EPIPE:  # the reader left (| head): stop quietly, as SIGPIPE
                _to_devnull()
                _exit_now(128 + signal.SIGPIPE)
            if e.errno not in OUTPUT_FULL:
                raise
            _output_failed(e)
        except UserError as e:
            print(f"error: {e}", file=sys.stderr)
            sys.exit(EXIT_USER_ERROR)
        except Exception as e:
            if (line := out_of_memory(e)) is None:
                raise
            print(f"error: {line}", file=sys.stderr)
            sys.exit(EXIT_USER_ERROR)
        except KeyboardInterrupt as e:  # SIGTERM 143 (schedulers requeue on it), Ctrl-C 130
            signum = getattr(e, "signum", signal.SIGINT)
            print(f"interrupted (signal {int(signum)})", file=sys.stderr)
            _exit_now(128 + int(signum))

    return wrapper


# XLA's words for it: the CPU and BFC allocators' "Out of memory ...", the GPU runtime's
# "RESOURCE_EXHAUSTED: Failed to allocate ..."
_OOM = re.compile(r"(?i)out of memory.*|(?<=RESOURCE_EXHAUSTED: ).*allocat.*")


def out_of_memory(e: BaseException) -> Optional[str]:
    """The one-line error for XLA running out of device memory (a model, batch or layout too
    big for it, as it compiles or runs), else None. Matched by name: this module loads no JAX."""
    if type(e).__name__ not in ("JaxRuntimeError", "XlaRuntimeError"):
        return None
    found = (m.group() for m in map(_OOM.search, str(e).splitlines()) if m)
    what = next(found, None)
    if what is None:
        return None
    return (f"the devices ran out of memory ({what.rstrip('. ')[:200]}); use a smaller model, "
            "batch or sequence, more train.micro_batches or train.remat=full, or a layout that "
            "python -m boost_jax.plan says fits")


EXIT_MACHINE = 1  # the machine's own failure (a full disk), not the user's input
OUTPUT_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


def _output_failed(e: OSError) -> None:
    """A write that no space or device takes (stdout on a full disk, a file a command did not
    catch itself): one line, exit 1. stdout is pointed at /dev/null first, so the text still
    buffered for it cannot fail again at exit with a second message."""
    what = repr(e.filename) if e.filename else "the output (stdout)"
    _to_devnull()
    print(f"error: writing {what} failed ({e.strerror}); free space or write it elsewhere",
          file=sys.stderr)
    _exit_now(EXIT_MACHINE)


def _to_devnull() -> None:
    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):
        pass


def _exit_now(code: int) -> None:
    """Exit without the interpreter's teardown: a signal can land while XLA compiles on its own
    threads, and tearing those down under it crashed the process (a segfault, not the code).
    The `with` blocks (the run's lock, its log) were already left while the exception rose. A
    checkpoint save still in flight is abandoned, not waited for (the run's threads can outlive
    it and the wait would never end): the steps saved before it stay, and the next start
    removes its partial folder."""
    _flush()
    os._exit(code)


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass


# --------------------------------------------------------------------------- user text

CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]")
SURROGATE = re.compile(r"[\ud800-\udfff]")
_UNPRINTABLE = re.compile(f"{CONTROL.pattern}|{SURROGATE.pattern}")


def _first(pattern: re.Pattern, text: str) -> Optional[str]:
    m = pattern.search(text)
    return None if m is None else repr(m.group())[1:-1]


def counted(n: int, noun: str, plural: str = "") -> str:
    """`n` and the noun, plural unless n is 1: "1 node", "48 nodes"."""
    return f"{n:,} {noun}" if n == 1 else f"{n:,} {plural or noun + 's'}"


def control_char(text: str) -> Optional[str]:
    """The first control character in `text` (newline, tab, NUL, ...) as an escape, or None."""
    return _first(CONTROL, text)


def lone_surrogate(text: str) -> Optional[str]:
    """The first lone surrogate in `text` as an escape, or None: not text."""
    return _first(SURROGATE, text)


def escape_controls(text: str) -> str:
    """`text` with every control character and lone surrogate written as its escape (one line,
    printable, encodable as UTF-8)."""
    return _UNPRINTABLE.sub(lambda m: repr(m.group())[1:-1], text)
