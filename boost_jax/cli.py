"""Command-line parsing shared by train.py, the planner, the communication analyzer and the
tools that use a trained run (generate, evaluate, export, data.prepare).

Dotted `key=value` config overrides may stand anywhere on the line, before, between or after
the options, and argparse's own mistakes (an unknown option, a missing value) are one line
`error: ...` with exit code 2 like every other input error.

What these commands print or write as JSON (--json reports, metrics.jsonl, the run summary) is
strict JSON: a number that is not finite (NaN, inf) becomes null next to a `<key>_nonfinite:
true` flag, so it is neither a bare `NaN` (which strict JSON readers reject) nor dropped.
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
from typing import Any

from boost_jax.errors import EXIT_USER_ERROR, control_char, lone_surrogate


class Parser(argparse.ArgumentParser):
    """argparse whose mistakes are one line `error: ...` and exit code 2."""

    def __init__(self, **kwargs):
        kwargs.setdefault("formatter_class", argparse.RawDescriptionHelpFormatter)
        super().__init__(**kwargs)

    def error(self, message: str):
        print(f"error: {message}; see {self.prog} --help", file=sys.stderr)
        sys.exit(EXIT_USER_ERROR)


class _Once(argparse.Action):
    """An option given once: a second --config would silently drop the first."""

    def __call__(self, parser, namespace, values, option_string=None):
        if getattr(namespace, self.dest, None) is not None:
            parser.error(f"{option_string} is given twice ({getattr(namespace, self.dest)!r} "
                         f"and {values!r}); give one, and set single keys as key=value")
        setattr(namespace, self.dest, values)


class OverrideParser(Parser):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.add_argument("--config", default=None, action=_Once,
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


# --------------------------------------------------------------------------- JSON outputs

NONFINITE = "_nonfinite"  # the flag key's suffix


def json_finite(obj: Any) -> Any:
    """`obj` with every non-finite float in a mapping replaced by None plus a flag key (in a
    list: None alone); nested mappings and lists too."""
    if isinstance(obj, dict):
        out = {}
        for k, v in obj.items():
            if isinstance(v, float) and not math.isfinite(v):
                out[k], out[f"{k}{NONFINITE}"] = None, True
            else:
                out[k] = json_finite(v)
        return out
    if isinstance(obj, (list, tuple)):
        return [None if isinstance(v, float) and not math.isfinite(v) else json_finite(v)
                for v in obj]
    return obj


def json_dumps(obj: Any, **kw) -> str:
    """json.dumps of json_finite(obj), refusing any NaN that is left (allow_nan=False)."""
    return json.dumps(json_finite(obj), allow_nan=False, **kw)


def json_dump(obj: Any, f, **kw) -> None:
    json.dump(json_finite(obj), f, allow_nan=False, **kw)


def flop_rate(x: float) -> str:
    """FLOP/s in the unit that shows them, by size: TFLOP/s from 1 TFLOP/s up (an accelerator),
    GFLOP/s below (a CPU, whose rate reads 0.0 in TFLOP/s)."""
    return f"{x / 1e12:.1f} TFLOP/s" if x >= 0.99995e12 else f"{x / 1e9:.1f} GFLOP/s"


def shell_word(text: str) -> str:
    """`text` as one shell word on one line, for a command we print for the user to paste:
    shell-quoted, or where it holds a control character (a newline would end the line) or
    bytes that are not UTF-8, bash's $'...' with each of those bytes escaped."""
    if control_char(text) is None and lone_surrogate(text) is None:
        return shlex.quote(text)
    out = []
    for ch in text:
        if ch in "\\'":
            out.append("\\" + ch)
        elif control_char(ch) is None and lone_surrogate(ch) is None:
            out.append(ch)
        else:
            out += [f"\\x{b:02x}" for b in _utf8(ch)]
    return "$'" + "".join(out) + "'"


def _utf8(ch: str) -> bytes:
    try:  # a byte of argv that was not UTF-8 comes back as itself
        return ch.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:
        return ch.encode("utf-8", "surrogatepass")

