"""What proves a folder is an export of ours: `MANIFEST`, written by export last, records the
size and CRC-32 of every file export wrote there. `export --force` replaces a folder only when
its manifest is there and every entry matches it: a folder of the user's files (even one named
config.json, model.safetensors, tokenizer.json) or an export edited since is named and kept."""

from __future__ import annotations

import json
import os
from typing import Optional

MANIFEST = "boost_jax_export.json"
FORMAT = "boost_jax export 1"


def write_manifest(folder: str) -> None:
    """Record every file of `folder` (the finished export, not yet published)."""
    from boost_jax.checkpoints.seal import file_crc32

    files = {}
    for name in sorted(os.listdir(folder)):
        path = os.path.join(folder, name)
        files[name] = [os.path.getsize(path), file_crc32(path)]
    with open(os.path.join(folder, MANIFEST), "w") as f:
        json.dump({"format": FORMAT, "files": files}, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def _recorded(folder: str) -> Optional[dict]:
    try:
        with open(os.path.join(folder, MANIFEST), "rb") as f:
            tree = json.loads(f.read(1 << 20))
    except (OSError, ValueError, RecursionError):
        return None
    files = tree.get("files") if isinstance(tree, dict) and tree.get("format") == FORMAT else None
    return files if isinstance(files, dict) else None


def not_ours(folder: str) -> Optional[str]:
    """None if `folder` is an export of ours exactly as export left it, else why not."""
    from boost_jax.checkpoints.seal import file_crc32

    files = _recorded(folder)
    present = sorted(set(os.listdir(folder)) - {MANIFEST})
    if files is None:
        held = f"; it holds {_some(present)}" if present else ""
        return f"has no export manifest ({MANIFEST}){held}"
    extra = [n for n in present if n not in files]
    if extra:
        return f"holds files an export does not write ({_some(extra)})"
    for name in present:
        path = os.path.join(folder, name)
        try:
            same = (os.path.isfile(path) and not os.path.islink(path)
                    and [os.path.getsize(path), file_crc32(path)] == files[name])
        except OSError:
            same = False
        if not same:
            return f"holds {name}, changed since export wrote it"
    return None


def _some(names: list) -> str:
    more = f" and {len(names) - 3} more" if len(names) > 3 else ""
    return ", ".join(names[:3]) + more
