"""data.sources through train.py: a tokenizer that does not match a source's is a one-line error
(exit 2), and a mixture run killed with SIGKILL resumes exactly."""

import json
import os
import signal
import subprocess
import sys

import pytest

from boost_jax.config import load_config
from boost_jax.data.tokenizers import train_bpe
from mixture_corpora import _corpus, _sources, corpora  # noqa: F401 (a fixture)
from train_proc import ROOT, TINY, TrainProcess, assert_same_metrics, train_env


# --------------------------------------------------------------------------- prepared corpora


def test_tokenizer_mismatch_is_one_line_exit_2(corpora, tmp_path):
    a, _ = corpora
    tok = str(tmp_path / "tok.json")
    train_bpe([open(a, "rb").read().decode("latin-1")[:20000]], 600, save_path=tok)
    c = _corpus(tmp_path, "c", "json.decoder", tokenizer=tok)
    r = subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), *TINY, _sources(a, c),
                        f"out_dir={tmp_path / 'run'}"], cwd=ROOT, capture_output=True, text=True,
                       env=dict(os.environ, JAX_PLATFORMS="cpu"), timeout=120)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: data.sources[1] "), r.stderr
    assert f"was tokenized with {tok!r} but data.sources[0]" in lines[0]
    assert "--tokenizer byte" in lines[0]


# --------------------------------------------------------------------------- kill -9, resume

STEPS = 10
RUN = TINY + [f"train.steps={STEPS}", "train.eval_every=5", "checkpoint.every=3",
              "logging.progress=false", "data.max_bytes=null"]


def _losses(out_dir):
    return [json.loads(x) for x in open(os.path.join(out_dir, "metrics.jsonl"))]


def test_mixture_resumes_exactly_after_sigkill(corpora, jax_cache, tmp_path):
    from boost_jax.train.loop import run

    a, b = corpora
    mix = RUN + [_sources(a, b)]
    ref = str(tmp_path / "ref")
    run(load_config(None, mix + [f"out_dir={ref}"]))

    class Train(TrainProcess):
        base = mix

    env = train_env(jax_cache)
    out = tmp_path / "run"
    t = Train(out, env)
    t.until(lambda: os.path.exists(out / "checkpoints" / "3" / "data" / "metadata"))
    t.until_trained(4)
    assert t.kill() == -signal.SIGKILL  # after the step-3 checkpoint, mid-training
    assert not os.path.exists(out / "checkpoints" / str(STEPS))
    state = json.load(open(out / "checkpoints" / "3" / "data" / "metadata"))
    assert state == {"windows": 3 * 8}  # the mixture's position (8 windows a step)
    t = Train(out, env)
    assert t.wait() == 0, t.output
    assert "resumed from step" in t.output
    rows = _losses(out)
    assert sorted(r["step"] for r in rows if "loss" in r) == list(range(1, STEPS + 1))
    assert_same_metrics(_losses(ref), rows, rtol=1e-6)
    # evaluate --run scores the mixture's own eval windows: it reproduces the logged val_loss
    r = subprocess.run([sys.executable, "-m", "boost_jax.evaluate", "--run", str(out), "--json"],
                       cwd=ROOT, capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    logged = [x for x in rows if "val_loss" in x][-1]
    assert json.loads(r.stdout.splitlines()[-1])["loss"] == pytest.approx(logged["val_loss"],
                                                                          rel=1e-5)
