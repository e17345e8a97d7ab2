"""data.sources: a weighted mixture of prepared corpora. Its proportions, its determinism and
exact resume in the pipeline, per-process shards, validation from every source, and errors
(tests/e2e/test_mixture_train.py: through train.py, killed with SIGKILL and resumed)."""

import json
import os
import re

import numpy as np
import pytest

from boost_jax.config import load_config
from boost_jax.data.mixture import shares
from boost_jax.data.pipeline import build_data, make_mixture_iterator
from boost_jax.errors import ConfigError, UserError
from mixture_corpora import _sources, corpora  # noqa: F401 (a fixture)
from train_proc import TINY

A, B = 1000, 2000  # the two test corpora's token ids lie in [A, A+300) and [B, B+300)


def _arr(base, n):
    return (base + np.arange(n) % 299).astype(np.int32)


def _take(it, n):
    return [next(it) for _ in range(n)]


def _from_a(batch):
    """Rows of a batch that come from corpus A (every window lies inside one corpus)."""
    return int(np.sum(batch["inputs"][:, 0] < B))


def test_proportions_follow_the_weights():
    toks = [_arr(A, 32 * 37 + 1), _arr(B, 32 * 11 + 1)]  # sizes unlike the weights
    for w in ([0.7, 0.3], [1.0, 3.0]):
        batches = _take(make_mixture_iterator(toks, w, 32, 8, seed=0), 100)
        share = sum(_from_a(b) for b in batches) / 800
        assert abs(share - w[0] / sum(w)) < 0.01, (w, share)
        windows = {tuple(r) for b in batches for r in b["inputs"]}
        assert len(windows) == 37 + 11  # each source repeats (its epochs), nothing else


def test_mixture_is_deterministic_and_resumes_through_json():
    toks = [_arr(A, 16 * 20 + 1), _arr(B, 16 * 9 + 1)]
    straight = _take(make_mixture_iterator(toks, [2, 1], 16, 4, seed=3), 15)
    it = make_mixture_iterator(toks, [2, 1], 16, 4, seed=3)
    head = _take(it, 6)
    state = json.loads(json.dumps(it.get_state()))
    it2 = make_mixture_iterator(toks, [2, 1], 16, 4, seed=3)
    it2.set_state(state)
    got = head + _take(it2, 9)
    assert all(np.array_equal(x["inputs"], y["inputs"]) for x, y in zip(got, straight))
    other = _take(make_mixture_iterator(toks, [2, 1], 16, 4, seed=4), 15)
    assert not all(np.array_equal(x["inputs"], y["inputs"]) for x, y in zip(other, straight))


def test_processes_split_each_global_batch():
    toks = [_arr(A, 16 * 20 + 1), _arr(B, 16 * 9 + 1)]
    single = _take(make_mixture_iterator(toks, [0.6, 0.4], 16, 6, seed=1), 4)
    parts = [_take(make_mixture_iterator(toks, [0.6, 0.4], 16, 2, 1, p, 3), 4) for p in range(3)]
    for k in range(4):
        rows = np.concatenate([p[k]["inputs"] for p in parts])
        assert sorted(map(tuple, rows)) == sorted(map(tuple, single[k]["inputs"]))


def test_shares():
    assert shares([0.7, 0.3], 8) == [6, 2]
    assert shares([1, 1, 1], 8) == [3, 3, 2]
    assert shares([0.999, 0.001], 4) == [3, 1]  # every source is evaluated
    assert sum(shares([0.2, 0.5, 0.3], 13)) == 13


# --------------------------------------------------------------------------- prepared corpora


def test_build_data_mixes_and_evaluates_every_source(corpora):
    a, b = corpora
    cfg = load_config(None, TINY + [_sources(a, b), "data.max_bytes=null"])
    data = build_data(cfg)
    n_a = os.path.getsize(a) // 2
    assert data.n_train_tokens + data.n_val_tokens == n_a + os.path.getsize(b) // 2
    rows = np.concatenate([v["inputs"] for v in data.val_batches])  # 2 batches of 8
    tail_a = np.fromfile(a, np.uint16)[-int(round(n_a * 0.05)):]
    from_a = sum(bytes(r.astype(np.uint8)) in bytes(tail_a.astype(np.uint8)) for r in rows)
    assert from_a == shares([0.7, 0.3], 16)[0]


def test_a_corpus_listed_twice_is_said(corpora, capsys):
    """Drawn by the sum of its weights: a note, not a refusal (a run saved with it resumes)."""
    a, _ = corpora
    twice = f"data.sources=[{{path: {a}, weight: 1}}, {{path: {os.path.dirname(a)}/./" \
            f"{os.path.basename(a)}, weight: 1}}]"
    build_data(load_config(None, TINY + [twice, "data.max_bytes=null"]))
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and re.match(r"note: data\.sources\[1\] \('.*/\./.*'\) is "
                                             r"data\.sources\[0\]'s corpus again", err), err
    build_data(load_config(None, TINY + [_sources(*corpora), "data.max_bytes=null"]))
    assert "again" not in capsys.readouterr().err


def test_errors(corpora, tmp_path):
    a, b = corpora
    with pytest.raises(UserError, match=r"data.sources\[1\] '.*nope.bin' does not exist"):
        build_data(load_config(None, TINY + [_sources(a, tmp_path / "nope.bin")]))
    with pytest.raises(ConfigError, match=r"data.sources\[1\].weight=0.0 must be > 0"):
        load_config(None, [_sources(a, b, wb=0)])
    with pytest.raises(ConfigError, match=r"data.sources\[0\].weight=inf must be a finite"):
        load_config(None, [_sources(a, b, wa="inf")])
    with pytest.raises(ConfigError, match="data.source='x.txt' and data.sources are both set"):
        load_config(None, [_sources(a, b), "data.source=x.txt"])
    bare = tmp_path / "bare.bin"
    bare.write_bytes(open(a, "rb").read())
    with pytest.raises(UserError, match=r"data.sources\[1\] '.*bare.bin' has no metadata"):
        build_data(load_config(None, TINY + [_sources(a, bare)]))
