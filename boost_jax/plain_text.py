"""Control characters and undecodable bytes in user text: a newline in a name or path would
start a new line of a script, a log or a comment, and a lone surrogate (how Python holds argv
bytes that are not UTF-8, or a JSON \\ud800 escape) cannot be written as UTF-8. Config strings
and script values holding one are refused."""

from __future__ import annotations

import re
from typing import Optional

CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]")
SURROGATE = re.compile(r"[\ud800-\udfff]")
_UNPRINTABLE = re.compile(f"{CONTROL.pattern}|{SURROGATE.pattern}")


def _first(pattern: re.Pattern, text: str) -> Optional[str]:
    m = pattern.search(text)
    return None if m is None else repr(m.group())[1:-1]


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
