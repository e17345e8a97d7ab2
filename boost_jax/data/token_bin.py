"""A corpus tokenized ahead of time: `<name>.bin` (raw token ids, native byte order, one dtype)
next to `<name>.json`, its metadata, both written by `python -m boost_jax.data.prepare`:

    {"format": "boost_jax.tokens/1", "dtype": "uint16", "n_tokens": ..., "n_documents": ...,
     "max_id": ..., "eos_id": ..., "vocab_size": ..., "tokenizer": "byte" | path given,
     "tokenizer_fingerprint": "byte" | "sha256:<canonical tokenizer JSON>", "source": ...}

Documents are followed by the tokenizer's EOS id. Training (sources.py) and evaluation open the
file with `open_bin`: a np.memmap, never read into memory. With metadata the file is checked
against it (size, dtype) and against the run's tokenizer (fingerprint, ids in range) without
reading a token; a .bin without metadata falls back to scanning its ids once.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Optional

import numpy as np

from boost_jax.errors import UserError

FORMAT = "boost_jax.tokens/1"


def meta_path(bin_path: str) -> str:
    return os.path.splitext(bin_path)[0] + ".json"


def read_meta(bin_path: str) -> Optional[dict]:
    """The metadata next to a .bin (None if there is none, or it is not ours)."""
    from boost_jax.file_kind import check_input

    path = meta_path(bin_path)
    check_input(path, "the metadata file")
    check_input(bin_path, "the token file")
    try:
        with open(path) as f:
            meta = json.load(f)
    except (OSError, ValueError, RecursionError):
        return None
    return meta if isinstance(meta, dict) and meta.get("format") == FORMAT else None


BIN_DTYPES = ("uint16", "uint32", "int32")  # config.DataConfig.bin_dtype's choices
# what every reader relies on: key -> the type its value must have
FIELDS = {"dtype": str, "n_tokens": int, "max_id": int, "tokenizer": str,
          "tokenizer_fingerprint": str}


def _damage(meta: dict) -> Optional[str]:
    """What is wrong with metadata that says it is ours (None: nothing)."""
    for key, tp in FIELDS.items():
        v = meta.get(key)
        if not isinstance(v, tp) or isinstance(v, bool):
            return f"its {key!r} is {'missing' if key not in meta else repr(v)}"
    if meta["dtype"] not in BIN_DTYPES:
        return f"its dtype {meta['dtype']!r} is none of {', '.join(BIN_DTYPES)}"
    if meta["n_tokens"] < 0:
        return f"its n_tokens is {meta['n_tokens']}"
    return None


def check_intact(path: str, meta: dict, label: str) -> None:
    """A one-line error for metadata that says it is ours but lacks what readers rely on."""
    damage = _damage(meta)
    if damage is not None:
        raise UserError(f"{label} {path!r} has damaged metadata {meta_path(path)} ({damage}); "
                        "prepare it again with python -m boost_jax.data.prepare")


def check_meta(path: str, meta: dict, tokenizer, dtype: str, label: str) -> None:
    """One-line errors for a .bin whose metadata disagrees with the file, dtype or tokenizer."""
    check_intact(path, meta, label)
    if meta["dtype"] != dtype:
        raise UserError(f"{label} {path!r} holds {meta['dtype']} ids (see {meta_path(path)}) but "
                        f"data.bin_dtype={dtype}; set data.bin_dtype={meta['dtype']}")
    size = os.path.getsize(path)
    if size != meta["n_tokens"] * np.dtype(dtype).itemsize:
        raise UserError(f"{label} {path!r} is {size} bytes but its metadata {meta_path(path)} "
                        f"says {meta['n_tokens']} {dtype} tokens; it was changed after "
                        "prepare: prepare it again")
    mine = getattr(tokenizer, "fingerprint", None)
    if mine != meta["tokenizer_fingerprint"]:
        name = getattr(tokenizer, "name", "?")
        fix = (f"prepare it with --tokenizer {name}" if label == "--data"  # evaluate: the run's
               else f"set data.tokenizer={meta['tokenizer']}")
        raise UserError(f"{label} {path!r} was tokenized with {meta['tokenizer']!r}, another "
                        f"tokenizer than this run's {name!r}; {fix} (the ids only mean "
                        "something under the tokenizer that made them)")
    if meta["max_id"] >= tokenizer.vocab_size:
        raise UserError(f"{label} {path!r} holds token id {meta['max_id']} outside the "
                        f"tokenizer's 0..{tokenizer.vocab_size - 1}; prepare it again")


def note(line: str) -> None:
    """A line on stderr from the first process only (said once, not once per process): what
    the data does that is easy to miss."""
    import jax

    if jax.process_index() == 0:
        print(line, file=sys.stderr, flush=True)


def open_bin(path: str, data_cfg, tokenizer, label: str = "data.source",
             max_tokens: Optional[int] = None) -> np.memmap:
    """The ids of a .bin as a read-only memmap (checked as the module docstring says)."""
    dtype = data_cfg.bin_dtype
    meta = read_meta(path)
    if meta is not None:
        check_meta(path, meta, tokenizer, dtype, label)
    itemsize = np.dtype(dtype).itemsize
    size = os.path.getsize(path)
    if size % itemsize:
        raise UserError(
            f"{label} {path!r} is {size} bytes, not a multiple of data.bin_dtype="
            f"{dtype} ({itemsize} bytes); set the dtype it was written with")
    n = size // itemsize if max_tokens is None else min(size // itemsize, max_tokens)
    if n < size // itemsize:
        note(f"note: data.max_bytes keeps {n:,} of the {size // itemsize:,} tokens of "
             f"{label} {path!r}; set data.max_bytes=null to train on all of them")
    if n < 2:
        raise UserError(f"{label} {path!r} holds fewer than 2 tokens; it needs a real corpus")
    arr = np.memmap(path, dtype=dtype, mode="r", shape=(n,))
    if meta is None:  # nothing recorded: scan the ids once
        top, low = int(arr.max()), int(arr.min())
        if low < 0 or top >= tokenizer.vocab_size:
            raise UserError(
                f"{label} {path!r} holds token id {top if top >= 0 else low} outside the "
                f"tokenizer's 0..{tokenizer.vocab_size - 1}; set data.tokenizer to the "
                "tokenizer.json it was made with")
    return arr
