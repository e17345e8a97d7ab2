"""User-facing errors: one line naming the problem and the fix, exit code 2."""

from __future__ import annotations

import functools
import sys

EXIT_USER_ERROR = 2


class UserError(Exception):
    """A mistake in the user's input (config, data, topology); printed as one line, exit 2."""


class ConfigError(UserError):
    pass


def cli_main(fn):
    """Wrap a CLI entry point: UserError becomes `error: <msg>` on stderr and exit code 2."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except UserError as e:
            print(f"error: {e}", file=sys.stderr)
            sys.exit(EXIT_USER_ERROR)
        except KeyboardInterrupt:
            print("interrupted", file=sys.stderr)
            sys.exit(130)

    return wrapper
