"""Values that enter a generated shell script are data, never code.

Each value is checked against a fully anchored pattern (``re.fullmatch``: ``$`` would accept a
trailing newline) or for control characters, then written shell-quoted; comments are escaped so
a value cannot start a line of its own; embedded text ends at a delimiter it cannot contain.
"""

from __future__ import annotations

import hashlib
import re
import shlex
from boost_jax.errors import UserError, control_char, escape_controls, lone_surrogate

# `#SBATCH` values: sbatch splits these lines itself, so no spaces, quotes or shell characters.
SLURM_NAME = r"[A-Za-z0-9][A-Za-z0-9_.+-]*"
SLURM_NAMES = rf"{SLURM_NAME}(?:,{SLURM_NAME})*"  # e.g. --partition=batch,debug
SLURM_CONSTRAINT = r"[A-Za-z0-9_.,:&|*\[\]()-]+"
MODULE = r"[A-Za-z0-9_.+/@:-]+"
ENV_NAME = r"[A-Za-z_][A-Za-z0-9_]*"
# A profile's scratch root is expanded by the job's shell ("$PSCRATCH"): variables, no code.
SCRATCH = r"(?:[A-Za-z0-9_./{}-]|\$[A-Za-z_][A-Za-z0-9_]*|\$\{[A-Za-z_][A-Za-z0-9_]*\})+"


def check_text(what: str, value: str, fix: str) -> str:
    """`value` holds no control character (a newline would start a line of the script)."""
    c = control_char(value)
    if c is not None:
        raise UserError(f"{what} {value!r} contains a control character ({c}); {fix}")
    if lone_surrogate(value) is not None:  # argv bytes that are not UTF-8: the script is UTF-8
        raise UserError(f"{what} {value!r} is not UTF-8 text; {fix}")
    return value


def check_word(what: str, value: str, pattern: str, allowed: str) -> str:
    """`value` matches `pattern` as a whole: a word a scheduler or the shell reads as data."""
    if not isinstance(value, str) or not re.fullmatch(pattern, value):
        raise UserError(f"{what} {value!r} is not valid in a batch script; use {allowed}")
    return value


def comment(text: str) -> str:
    """`# text` on one line whatever `text` holds (control characters are escaped)."""
    return "# " + escape_controls(text)


def quote(value: str, what: str = "value") -> str:
    """One shell word holding exactly `value` (no expansion, no second line)."""
    return shlex.quote(check_text(what, value, "remove it"))


def heredoc_delimiter(text: str, stem: str) -> str:
    """A delimiter no line of `text` equals (a line equal to it would end the heredoc early
    and run the rest of `text` as commands); fixed by `text`, so one config, one script."""
    lines = set(text.splitlines())
    tag = hashlib.sha256(text.encode()).hexdigest()[:12]
    n = 0
    while True:
        delim = f"{stem}_{tag}" + (f"_{n}" if n else "")
        if delim not in lines:
            return delim
        n += 1


def heredoc(target: str, text: str, stem: str) -> list[str]:
    """Lines writing `text` verbatim to the file named by shell word `target`: a quoted
    delimiter, so the shell expands nothing in `text`."""
    delim = heredoc_delimiter(text, stem)
    return [f"cat > {target} <<'{delim}'", text.rstrip("\n"), delim]
