"""`data.sources`: a weighted mixture of prepared corpora (.bin files of one tokenizer).

Each source is cut into windows like a single corpus (pipeline.py) and shuffled on its own
(seed derived from data.seed and its position in the list), repeated without end; grain's
`MapDataset.mix` interleaves them deterministically in the proportions of the weights (scaled
so the smallest is 100, then rounded down: exact to about 1%). A source smaller than its share
simply repeats more often. The stream is a pure function of (files, weights, seq_len, seed), so
the iterator state is still the count of windows taken (`{"windows": n}`, pipeline.py), saved
in every checkpoint: a resumed run continues the mixture at the same window.

Validation: each source keeps its own contiguous tail (data.val_fraction of its tokens, as for
one .bin); the eval windows are drawn from those tails in proportion to the weights (largest
remainder, at least one window per source), so val_loss is measured on the training mixture.
data.max_bytes caps each source separately.
"""

from __future__ import annotations

import os

import numpy as np

from boost_jax.data.token_bin import check_intact, meta_path, note, open_bin, read_meta
from boost_jax.data.tokenizers import Tokenizer
from boost_jax.errors import UserError

_SEED_STRIDE = 1_000_003  # source j shuffles with seed + j * stride (source 0: data.seed)


def source_seed(seed: int, j: int) -> int:
    return (seed + j * _SEED_STRIDE) % 2**32


def _check_same_tokenizer(specs) -> None:
    """Every source needs its metadata, and all of them the same tokenizer (ids of two
    tokenizers mean different things)."""
    first = None
    for i, s in enumerate(specs):
        label = f"data.sources[{i}] {s.path!r}"
        if not os.path.exists(s.path):
            raise UserError(f"{label} does not exist; prepare it with python -m "
                            "boost_jax.data.prepare SOURCE OUT.bin or fix the path")
        meta = read_meta(s.path)
        if meta is None:
            raise UserError(f"{label} has no metadata {meta_path(s.path)!r}; prepare it with "
                            "python -m boost_jax.data.prepare (mixtures check tokenizers by it)")
        check_intact(s.path, meta, f"data.sources[{i}]")
        if first is None:
            first = (i, s.path, meta)
        elif meta["tokenizer_fingerprint"] != first[2]["tokenizer_fingerprint"]:
            raise UserError(
                f"{label} was tokenized with {meta['tokenizer']!r} but data.sources[{first[0]}] "
                f"{first[1]!r} with {first[2]['tokenizer']!r}; a mixture needs one tokenizer: "
                f"prepare them all with --tokenizer {first[2]['tokenizer']}")


def _note_repeats(sources) -> None:
    """A corpus listed twice is sampled by the sum of its weights, its validation tail twice:
    said, not refused (a run saved so must still resume and evaluate)."""
    seen: dict = {}
    for i, s in enumerate(sources):
        j = seen.setdefault(os.path.realpath(s.path), i)
        if j != i:
            note(f"note: data.sources[{i}] ({s.path!r}) is data.sources[{j}]'s corpus again: "
                 "it is drawn by the sum of their weights; list each corpus once")


def load_sources(data_cfg, tokenizer: Tokenizer) -> tuple[list, list]:
    """(train arrays, val arrays) of every source, memory-mapped and checked (token_bin.py)."""
    _check_same_tokenizer(data_cfg.sources)
    cap = None
    if data_cfg.max_bytes is not None:
        cap = data_cfg.max_bytes // np.dtype(data_cfg.bin_dtype).itemsize
    _note_repeats(data_cfg.sources)
    trains, vals = [], []
    for i, s in enumerate(data_cfg.sources):
        arr = open_bin(s.path, data_cfg, tokenizer, f"data.sources[{i}]", max_tokens=cap)
        n_val = max(1, int(round(len(arr) * data_cfg.val_fraction)))
        trains.append(arr[: len(arr) - n_val])
        vals.append(arr[len(arr) - n_val:])
    return trains, vals


def shares(weights, count: int) -> list[int]:
    """`count` split in proportion to `weights` (largest remainder; each >= 1 if count allows)."""
    w = np.asarray(weights, np.float64) / np.sum(weights)
    exact = w * count
    out = np.floor(exact).astype(int)
    for j in np.argsort(-(exact - out), kind="stable")[: count - out.sum()]:
        out[j] += 1
    if count >= len(out):
        while (out == 0).any():  # a tiny weight still gets one window: its loss is seen
            out[np.argmax(out)] -= 1
            out[np.argmin(out)] += 1
    return out.tolist()


def mixture_eval_windows(vals: list, weights, seq_len: int, count: int) -> np.ndarray:
    """[count, seq_len + 1] eval windows, each source's share evenly spaced over its tail."""
    parts = []
    for i, (val, k) in enumerate(zip(vals, shares(weights, count))):
        n = max(0, (len(val) - 1) // seq_len)
        if n == 0:
            raise UserError(
                f"the validation tail of data.sources[{i}] has {len(val)} tokens, fewer than "
                f"data.seq_len+1={seq_len + 1}; raise data.val_fraction, use a larger corpus or "
                "lower data.seq_len")
        idx = (np.arange(k) * n) // k if n >= k else np.arange(k) % n
        parts.append(np.asarray(val[(idx * seq_len)[:, None] + np.arange(seq_len + 1)],
                                dtype=np.int32))
    return np.concatenate(parts)
