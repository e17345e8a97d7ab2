"""A resume on inputs that changed under the run (data/fingerprint.py): the corpus (a text file
or a mixture's prepared .bin) replaced or re-prepared since the checkpoint stops in one line
naming it, unless checkpoint.accept_changes names its key; a copy or a touch is no change."""

import os
import shutil

import pytest

from boost_jax.config import load_config
from boost_jax.data.fingerprint import source_identity
from boost_jax.data.prepare import prepare
from boost_jax.errors import UserError
from train_proc import TINY

pytestmark = pytest.mark.usefixtures("jax_cache")
RUN = TINY + ["logging.progress=false", "train.eval_every=2", "checkpoint.every=2",
              "checkpoint.async_save=false", "train.global_batch=8"]
TEXT = "def f(x):\n    return x * 2\n" * 3000


def test_identity_follows_content_not_time_or_copies(tmp_path):
    a = tmp_path / "a.txt"
    a.write_text(TEXT)
    first = source_identity(str(a))
    os.utime(a, (1, 1))
    shutil.copy(a, tmp_path / "b.txt")
    assert source_identity(str(a)) == first == source_identity(str(tmp_path / "b.txt"))
    a.write_text(TEXT[:-2] + "y\n")  # one character, same size
    assert source_identity(str(a)) != first
    prepare(str(a), str(tmp_path / "c.bin"), "byte", workers=1, progress=False)
    one = source_identity(str(tmp_path / "c.bin"))
    (tmp_path / "c.json").write_text((tmp_path / "c.json").read_text().replace("byte", "bytE"))
    assert source_identity(str(tmp_path / "c.bin")) != one  # its metadata is part of it
    big = tmp_path / "big.bin"  # sparse, past FULL: sampled, not read whole
    with open(big, "wb") as f:
        f.truncate(300 << 20)
    sampled = source_identity(str(big))
    with open(big, "r+b") as f:
        f.seek((300 << 20) - 1)
        f.write(b"x")  # the last byte lies in the last sample
    assert source_identity(str(big)) != sampled
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "x.txt").write_text("x")
    folder = source_identity(str(tmp_path / "d"))
    (tmp_path / "d" / "y.md").write_text("y")
    assert source_identity(str(tmp_path / "d")) != folder


def _train(out, *extra):
    from boost_jax.train.loop import run

    return run(load_config(None, RUN + [f"out_dir={out}", *extra]))


def test_resume_on_a_changed_text_source_or_mixture_source_stops_unless_accepted(tmp_path):
    src = tmp_path / "corpus.txt"
    src.write_text(TEXT)
    out = tmp_path / "run"
    _train(out, f"data.source={src}", "train.steps=2")
    src.write_text(TEXT.replace("2", "3"))  # replaced under the run, same size
    with pytest.raises(UserError, match=rf"^checkpoint step 2 in {out} was trained on "
                       rf"data\.source '{src}' as it was then, and its content has changed "
                       r"since; .*checkpoint\.accept_changes=\[data\.source\]$"):
        _train(out, f"data.source={src}", "train.steps=4")
    summary = _train(out, f"data.source={src}", "train.steps=4",
                     "checkpoint.accept_changes=[data.source]")
    assert summary["start_step"] == 2 and summary["final_step"] == 4

    bins = []
    for name, text in (("a", TEXT), ("b", TEXT.upper())):
        (tmp_path / f"{name}.txt").write_text(text)
        bins.append(str(tmp_path / f"{name}.bin"))
        prepare(str(tmp_path / f"{name}.txt"), bins[-1], "byte", workers=1, progress=False)
    mix = f"data.sources=[{{path: {bins[0]}, weight: 1}}, {{path: {bins[1]}, weight: 1}}]"
    out = tmp_path / "mix"
    _train(out, mix, "train.steps=2")
    (tmp_path / "b.txt").write_text(TEXT.lower())
    prepare(str(tmp_path / "b.txt"), bins[1], "byte", workers=1, progress=False, force=True)
    with pytest.raises(UserError, match=rf"trained on data\.sources\[1\] '{bins[1]}' as it was "
                       r"then.*checkpoint\.accept_changes=\[data\.sources\]$"):
        _train(out, mix, "train.steps=4")
    assert _train(out, mix, "train.steps=4",
                  "checkpoint.accept_changes=[data.sources]")["start_step"] == 2


def test_a_resume_past_the_profile_steps_says_no_trace_is_written(tmp_path, capfd):
    out = tmp_path / "run"
    _train(out, "train.steps=2")
    capfd.readouterr()
    _train(out, "train.steps=4", "train.profile_steps=[2,3]")
    assert ("warning: train.profile_steps=[2, 3] starts at or before step 2, where this run "
            "resumes; no trace is written (choose steps after 2)") in capfd.readouterr().err
    assert not (out / "profile").exists()


def test_a_changed_tokenizer_file_is_named_unless_accepted(tmp_path):
    from types import SimpleNamespace

    from boost_jax.data.fingerprint import check_unchanged, identities

    tok = tmp_path / "tok.json"
    tok.write_text('{"model": 1}')
    cfg = SimpleNamespace(data=SimpleNamespace(source="stdlib", sources=None, tokenizer=str(tok)),
                          checkpoint=SimpleNamespace(accept_changes=[]),
                          out_dir=str(tmp_path / "run"))  # a Config has one
    saved = identities(cfg)
    assert list(saved) == ["data.tokenizer"]
    check_unchanged(saved, identities(cfg), cfg, 5, "runs/x")
    tok.write_text('{"model": 2}')
    with pytest.raises(UserError, match=rf"^checkpoint step 5 in runs/x was trained on "
                                        rf"data\.tokenizer '{tok}' as it was then.*accept_changes="
                                        r"\[data\.tokenizer\]$"):
        check_unchanged(saved, identities(cfg), cfg, 5, "runs/x")
    for accept in (["data.tokenizer"], ["data"]):
        cfg.checkpoint.accept_changes = accept
        check_unchanged(saved, identities(cfg), cfg, 5, "runs/x")
    check_unchanged({}, identities(cfg), cfg, 5, "runs/x")  # saved before fingerprints


def test_generate_evaluate_and_export_refuse_a_changed_tokenizer_or_val_source(tmp_path):
    """open_run (generate, evaluate, export, lm_eval) checks the run's tokenizer file against
    the step's record, and evaluate's own validation windows its data source: another file
    under either name would give other ids or other windows with no word said."""
    from boost_jax.data.tokenizers import train_bpe
    from boost_jax.evaluate import run_val_windows
    from boost_jax.infer.load import open_run

    src, tok = tmp_path / "corpus.txt", tmp_path / "tok.json"
    src.write_text(TEXT)
    train_bpe([TEXT], 520, save_path=str(tok))
    out = tmp_path / "run"
    _train(out, f"data.source={src}", f"data.tokenizer={tok}", "model.vocab_size=null",
           "train.steps=2")
    assert len(run_val_windows(open_run(str(out))))
    kept = tok.read_bytes()
    train_bpe([TEXT.upper()], 520, save_path=str(tok))
    with pytest.raises(UserError, match=rf"^checkpoint step 2 of run '{out}' was trained on "
                       rf"data\.tokenizer '{tok}' as it was then, and that file has changed "
                       r"since .*; its ids would not match the model's"):
        open_run(str(out))
    tok.write_bytes(kept)
    src.write_text(TEXT.replace("2", "3"))
    run = open_run(str(out))
    with pytest.raises(UserError, match=rf"was trained on data\.source '{src}' as it was then.*"
                       r"its validation split would be other data: restore it, or pass "
                       r"--data FILE$"):
        run_val_windows(run)
