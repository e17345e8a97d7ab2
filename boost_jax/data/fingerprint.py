"""The identity of a run's inputs, saved with every checkpoint: a resume on a corpus or a
tokenizer that changed since (re-prepared with --force, a text file replaced) stops in one line
naming the file, unless checkpoint.accept_changes names its key (data.source, data.sources,
data.tokenizer, or data).

A file's identity is its size and the SHA-256 of its bytes: all of them up to `FULL` (for a
folder, its first `FULL` bytes of text files), beyond that `SAMPLES` blocks spread evenly (a
prepared .bin of many GB is fingerprinted in milliseconds; its metadata, fully hashed, changes
whenever prepare writes it). A folder's is that of every file training reads from it (its text
files, or the parquet / arrow shards of a streaming source), with their relative paths. Modification
times are left out: a copy or a touch is the same corpus.
"""

from __future__ import annotations

import hashlib
import os
from typing import Optional

from boost_jax.errors import UserError

FULL = 256 << 20
SAMPLES, BLOCK = 256, 64 << 10


def _file(path: str, h, budget: list) -> None:
    """Size and bytes of `path` into `h`: all of them while `budget` (bytes left to hash
    whole, shared by a folder's files) lasts, else `SAMPLES` blocks."""
    size = os.path.getsize(path)
    h.update(f"{size}\0".encode())
    with open(path, "rb") as f:
        if size <= budget[0] or size <= SAMPLES * BLOCK:
            budget[0] -= size
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
            return
        for i in range(SAMPLES):
            f.seek((size - BLOCK) * i // (SAMPLES - 1))
            h.update(f.read(BLOCK))


def source_identity(path: str, streamed: bool = False) -> str:
    """"sha256:..." of a corpus: a file (a .bin with its metadata and BPE file) or a folder."""
    from boost_jax.data.shards import STREAM_EXTS
    from boost_jax.data.sources import TEXT_EXTS, _walk

    h, budget = hashlib.sha256(), [FULL]
    if os.path.isdir(path):
        exts = STREAM_EXTS if streamed else TEXT_EXTS
        for rel in _walk(path, exts, {"__pycache__"}):
            h.update(f"{rel}\0".encode("utf-8", "surrogateescape"))  # a name's own bytes
            _file(os.path.join(path, rel), h, budget)
    else:
        _file(path, h, budget)
        stem = os.path.splitext(path)[0]
        for extra in (stem + ".json", stem + ".tokenizer.json") if path.endswith(".bin") else ():
            if os.path.isfile(extra):
                h.update(os.path.basename(extra).encode("utf-8", "surrogateescape") + b"\0")
                _file(extra, h, [FULL])
    return "sha256:" + h.hexdigest()


def input_files(cfg) -> dict:
    """{config key: path} of the run's corpus files and tokenizer file (stdlib: none; a BPE the
    run trains: the one in its out_dir, whose ids the checkpoints hold)."""
    d = cfg.data
    files = {"data.source": d.source} if d.source and d.source != "stdlib" else {}
    files.update({f"data.sources[{i}]": s.path for i, s in enumerate(d.sources or [])})
    from boost_jax.data.tokenizers import tokenizer_file

    tok = tokenizer_file(d.tokenizer, cfg.out_dir)
    if tok is not None:
        files["data.tokenizer"] = tok
    return {k: p for k, p in files.items() if os.path.exists(p)}


def identity(key: str, path: str) -> str:
    """The identity of input `key` (a config key of input_files) at `path`."""
    from boost_jax.data.shards import is_streaming

    return source_identity(path, key.startswith("data.sources") and is_streaming(path))


def identities(cfg) -> dict:
    """{config key: identity} of every input file (saved in each checkpoint's meta)."""
    return {key: identity(key, path) for key, path in input_files(cfg).items()}


def check_unchanged(saved: Optional[dict], now: dict, cfg, step: int, where: str) -> None:
    """A one-line UserError if an input of checkpoint `step` differs from what it was trained
    on (keys in both; a checkpoint from before fingerprints has none) and is not accepted."""
    accepted = cfg.checkpoint.accept_changes
    for key, ident in now.items():
        old = (saved or {}).get(key)
        base = key.split("[", 1)[0]
        if old is None or old == ident or any(
                n in (key, base) or base.startswith(n + ".") for n in accepted):
            continue
        raise UserError(f"checkpoint step {step} in {where} was trained on {key} "
                        f"{input_files(cfg)[key]!r} as it was then, and its content has changed "
                        "since; resuming would continue on other data: restore it, use a new "
                        f"out_dir, or accept the change on purpose with "
                        f"checkpoint.accept_changes=[{base}]")
