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


def test_a_text_file_is_scored_whole(tmp_path):
    """evaluate --data FILE reads the file as one text: no EOS between training's chunks, each
    of which would be a target worth no bytes and a reset context, and no character cut."""
    import types

    from boost_jax import evaluate
    from boost_jax.data.sources import read_documents
    from boost_jax.data.tokenizers import ByteTokenizer

    text = "✓" * 400  # 1200 bytes, no line break: three chunks for training
    (tmp_path / "c.txt").write_text(text, encoding="utf-8")
    assert len(read_documents(str(tmp_path / "c.txt"), None)) > 1
    run = types.SimpleNamespace(tokenizer=ByteTokenizer())
    ids = evaluate.source_tokens(run, str(tmp_path / "c.txt"), None)
    assert bytes(ids.astype("uint8").tolist()).decode("utf-8") == text


def test_evaluate_refuses_max_tokens_on_the_runs_own_windows(capsys):
    from boost_jax import evaluate

    with pytest.raises(SystemExit) as e:
        evaluate.parse_args(["--run", "r", "--max-tokens", "5"])
    assert e.value.code == 2
    assert "--max-tokens caps a --data SOURCE; --data val scores the run's validation windows " \
           "whole" in capsys.readouterr().err
    assert evaluate.parse_args(["--run", "r", "--data", "x.txt", "--max-tokens", "5"])


@pytest.mark.parametrize("kwargs, said", [
    (dict(step=100), "model_args needs run=OUT_DIR, the training run's out_dir"),
    (dict(run="r", stpe=100), "model_args stpe= is not one of boost_jax's; use run=OUT_DIR, "
                              "step=N, max_length=N"),
    (dict(run="r", step="abc"), "model_args step=abc is not a whole number >= 0"),
    (dict(run="r", batch_size=0), "--batch_size=0 is not a whole number >= 1"),
    (dict(run="r", batch_size="x"), "--batch_size=x is not a whole number >= 1"),
    (dict(run="r", max_length="1.5"), "model_args max_length=1.5 is not a whole number >= 2"),
    (dict(run="nowhere"), "no run at 'nowhere' (no such directory); pass model_args run= the "
                          "out_dir of a training run, e.g. run=runs/demo"),
    (dict(run="my--step-1"), "no run at 'my--step-1' (no such directory)")])
def test_lm_eval_model_args_are_checked_in_one_line(kwargs, said, monkeypatch, tmp_path):
    from boost_jax.errors import UserError
    from boost_jax.lm_eval_adapter import BoostJaxLM

    monkeypatch.chdir(tmp_path)
    with pytest.raises(UserError) as e:
        BoostJaxLM(**kwargs, device="cpu", max_batch_size=None)  # lm_eval adds those two
    assert str(e.value).startswith(said) and "\n" not in str(e.value), str(e.value)


@pytest.mark.parametrize("module, argv, names", [
    ("evaluate", ["--run", "r", "--batch-size", "0"], "--batch-size 0 must be >= 1"),
    ("evaluate", ["--run", "r", "--data", "x.txt", "--max-tokens", "1"],
     "--max-tokens 1 must be >= 2"),
    ("generate", ["--run", "r", "--prompt", "a", "--top-k", "-1"], "--top-k -1 must be >= 0"),
    ("generate", ["--run", "r", "--prompt", "a", "--top-p", "2"], "--top-p 2.0 must be in (0, 1]"),
])
def test_a_bad_sampling_or_scoring_option_is_named_with_its_value(module, argv, names, capsys):
    """Each refused option is named on its own, with the value given (not a pair of rules)."""
    import importlib

    with pytest.raises(SystemExit) as e:
        importlib.import_module(f"boost_jax.{module}").parse_args(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert names in err
    assert not ("--top-k" in err and "--top-p" in err)
    assert not ("--batch-size" in err and "--max-tokens" in err)
