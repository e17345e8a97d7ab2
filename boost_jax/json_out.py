"""Machine-readable JSON outputs hold only valid JSON: a number that is not finite (NaN, inf)
becomes null next to a `<key>_nonfinite: true` flag, so it is neither a bare `NaN` (which strict
JSON readers reject) nor dropped."""

from __future__ import annotations

import json
import math
from typing import Any

FLAG = "_nonfinite"


def finite(obj: Any) -> Any:
    """`obj` with every non-finite float in a mapping replaced by None plus a flag key (in a
    list: None alone); nested mappings and lists too."""
    if isinstance(obj, dict):
        out = {}
        for k, v in obj.items():
            if isinstance(v, float) and not math.isfinite(v):
                out[k], out[f"{k}{FLAG}"] = None, True
            else:
                out[k] = finite(v)
        return out
    if isinstance(obj, (list, tuple)):
        return [None if isinstance(v, float) and not math.isfinite(v) else finite(v) for v in obj]
    return obj


def dumps(obj: Any, **kw) -> str:
    """json.dumps of finite(obj), refusing any NaN that is left (allow_nan=False)."""
    return json.dumps(finite(obj), allow_nan=False, **kw)


def dump(obj: Any, f, **kw) -> None:
    json.dump(finite(obj), f, allow_nan=False, **kw)
