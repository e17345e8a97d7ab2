"""Command-line parsing shared by train.py, the planner, the communication analyzer and the
tools that use a trained run (generate, evaluate, export, data.prepare).

Dotted `key=value` config overrides may stand anywhere on the line, before, between or after
the options, and argparse's own mistakes (an unknown option, a missing value) are one line
`error: ...` with exit code 2 like every other input error.
"""

from __future__ import annotations

import argparse
import sys

from boost_jax.errors import EXIT_USER_ERROR


class Parser(argparse.ArgumentParser):
    """argparse whose mistakes are one line `error: ...` and exit code 2."""

    def __init__(self, **kwargs):
        kwargs.setdefault("formatter_class", argparse.RawDescriptionHelpFormatter)
        super().__init__(**kwargs)

    def error(self, message: str):
        print(f"error: {message}; see {self.prog} --help", file=sys.stderr)
        sys.exit(EXIT_USER_ERROR)


class OverrideParser(Parser):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.add_argument("--config", default=None,
                          help="YAML config (default: built-in defaults)")
        self.add_argument("overrides", nargs="*", metavar="key=value",
                          help="dotted config overrides, anywhere on the line, e.g. "
                               "train.steps=50 out_dir=runs/x")

    def parse(self, argv=None) -> argparse.Namespace:
        args, unknown = self.parse_known_intermixed_args(argv)
        if unknown:  # name the options only: whether argparse also lists the value after one
            # depends on where the overrides stand on the line
            self.error("unrecognized arguments: "
                       + " ".join([a for a in unknown if a.startswith("-")] or unknown))
        return args
