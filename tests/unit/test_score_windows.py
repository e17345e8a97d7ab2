"""The lm-evaluation-harness adapter's rolling windows (boost_jax/infer/score.py): every token
predicted once, as lm_eval's own windows where it is installed (tests/e2e/test_score.py: the
scorer against a tiny trained run)."""

import pytest


def test_rolling_windows_predict_every_token_once():
    from boost_jax.infer.score import rolling_windows

    assert rolling_windows(list(range(10)), -1, 4) == [
        ([-1, 0, 1, 2, 3], 4), ([3, 4, 5, 6, 7], 4), ([5, 6, 7, 8, 9], 2)]
    assert rolling_windows([7], -1, 4) == [([-1, 7], 1)] and rolling_windows([], -1, 4) == []


def test_rolling_windows_are_lm_evals():
    from boost_jax.infer.score import rolling_windows

    lm_utils = pytest.importorskip("lm_eval.utils")
    for n, m in [(10, 4), (7, 7), (23, 5), (1, 3)]:
        ids = list(range(100, 100 + n))
        theirs = [lm_utils.make_disjoint_window(w)
                  for w in lm_utils.get_rolling_token_windows(ids, -1, m, 1)]
        ours = rolling_windows(ids, -1, m)
        assert [(c + t, len(t)) for c, t in theirs] == ours


def test_evaluate_never_pads_a_batch_past_the_windows_there_are():
    """--batch-size 100000000 over three windows: one batch of three rows, not 1e8 padded
    rows (which ran out of host memory)."""
    import types

    import numpy as np

    from boost_jax import evaluate
    from boost_jax.data.tokenizers import ByteTokenizer

    shapes = []

    def fn(params, rows):
        shapes.append(rows.shape)
        return np.ones(rows.shape[0])

    run = types.SimpleNamespace(params=None, tokenizer=ByteTokenizer())
    sums, seen = [0.0, 0, 0], []
    windows = [np.arange(5) + i for i in range(3)]
    evaluate._score_group(run, fn, windows, 100_000_000, sums, seen.append)
    assert shapes == [(3, 5)] and seen == [3] and sums[:2] == [3.0, 12]


def test_evaluate_names_its_own_flag_and_a_relative_source_it_cannot_find(tmp_path, monkeypatch):
    """--data errors say --data (not data.source, which evaluate does not take); a run trained
    on a relative path, evaluated from elsewhere, says how to fix it instead of 'use stdlib'."""
    import types

    from boost_jax import evaluate
    from boost_jax.config import load_config
    from boost_jax.data.sources import read_documents
    from boost_jax.errors import UserError

    with pytest.raises(UserError, match=r"^--data '.*nope\.txt' does not exist; use a text"):
        read_documents(str(tmp_path / "nope.txt"), None, "--data")
    (tmp_path / "bin.txt").write_bytes(b"\x00" * 64)
    with pytest.raises(UserError, match=r"is not text .*; point --data at UTF-8 text"):
        read_documents(str(tmp_path / "bin.txt"), None, "--data")
    monkeypatch.chdir(tmp_path)
    run = types.SimpleNamespace(cfg=load_config(None, ["data.source=corpus.md"], validate=False),
                                path=str(tmp_path))
    with pytest.raises(UserError, match=r"'corpus\.md' is a relative path .* pass --data FILE"):
        evaluate.run_val_windows(run)
