"""README error tables against the regexes the tests check the real messages with."""

import os
import re

from train_proc import ROOT


def check_readme_table(after: str, before: str, regexes) -> int:
    """Every `error: ...` message of the README between `after` and `before` that begins as
    one of `regexes` (the first 12 characters of its text before the first special character,
    when there are as many) must match one such regex whole; returns how many were checked.
    Regexes holding a test's temporary paths (`.*`) are left out."""
    text = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    table = text.split(after, 1)[1].split(before, 1)[0]
    regexes = [r for r in regexes if ".*" not in r]
    checked = 0
    for msg in re.findall(r"`error: ([^`]*)`", table):
        claim = []
        for regex in regexes:
            head = re.split(r"[\\.^$*+?()\[\]{}|]", regex, maxsplit=1)[0]
            if len(head) >= 12 and msg.startswith(head[:12]):
                claim.append(regex)
        if claim:
            assert any(re.match(r, msg) for r in claim), f"README: {msg!r}\nrows: {claim}"
            checked += 1
    return checked
