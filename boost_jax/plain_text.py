"""Control characters in user text: a newline in a name or path would start a new line of a
script, a log or a comment, so config strings and script values are refused when they hold one."""

from __future__ import annotations

import re
from typing import Optional

CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]")


def control_char(text: str) -> Optional[str]:
    """The first control character in `text` (newline, tab, NUL, ...) as an escape, or None."""
    m = CONTROL.search(text)
    return None if m is None else repr(m.group())[1:-1]


def escape_controls(text: str) -> str:
    """`text` with every control character written as its escape (one line, printable)."""
    return CONTROL.sub(lambda m: repr(m.group())[1:-1], text)


_SURROGATE = re.compile(r"[\ud800-\udfff]")


def lone_surrogate(text: str) -> Optional[str]:
    """The first lone surrogate in `text` as an escape, or None. Python holds undecodable bytes
    of argv / file names this way, and JSON's \\ud800 escapes decode to them: not text."""
    m = _SURROGATE.search(text)
    return None if m is None else repr(m.group())[1:-1]
