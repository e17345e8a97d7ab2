"""The scoring core of the lm-evaluation-harness adapter (boost_jax/infer/score.py), against
boost_jax's own numbers on a tiny trained run: evaluate's window losses and the KV-cache
decoder. Needs no lm_eval; where it is installed, the adapter runs a local task end to end."""

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from train_proc import ROOT, TINY, train_env

SEQ = 24  # data.seq_len = model.max_seq_len: not a multiple of the scorer's length bucket


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, jax_cache):
    out = str(tmp_path_factory.mktemp("score") / "run")
    args = [a for a in TINY if not a.startswith(("model.max_seq_len", "data.seq_len"))]
    p = subprocess.run([sys.executable, "train.py", "--cpu-devices", "1", *args,
                        f"model.max_seq_len={SEQ}", f"data.seq_len={SEQ}", "train.steps=6",
                        "logging.progress=false", f"out_dir={out}"], cwd=ROOT,
                       env=train_env(jax_cache), capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    return out


@pytest.fixture(scope="module")
def scorer(run_dir):
    from boost_jax.infer.load import open_run
    from boost_jax.infer.score import Scorer

    return Scorer(open_run(run_dir), batch_size=3)


_FN = {}


def _nats(scorer, ids):
    """evaluate.window_losses of one exact-length window: summed -log p of its targets."""
    from boost_jax.evaluate import window_losses

    fn = _FN.setdefault(id(scorer), window_losses(scorer.run.cfg.model))
    return float(np.asarray(fn(scorer.run.params, np.asarray([ids], np.int32)))[0])


PAIRS = [("def main(", "):\n    return 0"), ("import ", "os"), ("x = ", "[1, 2]"),
         ("The answer is ", "42"), ("", "class A:"),
         ("a long context that the model cannot read all of, " * 2, " pass")]


def test_loglikelihood_is_evaluate_difference(scorer):
    """log p(cont | ctx) = window loss of EOS+ctx minus that of EOS+ctx+cont (causal model),
    each computed by boost_jax.evaluate at its exact length; a context too long loses its
    start (the first target then shifts into the context's window too)."""
    got = scorer.loglikelihood(PAIRS)
    for (ctx, cont), (lp, _) in zip(PAIRS, got):
        c, t = scorer.encode_pair(ctx, cont)
        whole = (c + t)[-(SEQ + 1):]
        want = _nats(scorer, whole[:len(whole) - len(t)]) - _nats(scorer, whole) \
            if len(whole) - len(t) > 1 else -_nats(scorer, whole)
        assert lp == pytest.approx(want, rel=1e-5, abs=1e-4), (ctx, cont)
    assert all(lp < 0 for lp, _ in got)


def test_trailing_space_moves_to_the_continuation(scorer):
    assert scorer.encode_pair("x =", " 1") == scorer.encode_pair("x = ", "1")
    assert scorer.loglikelihood([("x = ", "1")]) == scorer.loglikelihood([("x =", " 1")])
    assert scorer.loglikelihood([("x = 1", "")]) == [(0.0, True)]  # nothing to predict


def test_rolling_equals_evaluate_on_whole_windows(scorer):
    """A text of exactly two windows: the rolling log-likelihood is minus the nats that
    python -m boost_jax.evaluate's scoring gives for EOS + text."""
    from boost_jax.evaluate import score, windows_of

    text = ("def f(x):\n    return x * 2\n" * 3)[:2 * SEQ]
    ids = [scorer.tok.eos_id, *scorer.tok.encode(text)]
    assert len(ids) == 2 * SEQ + 1
    res = score(scorer.run, windows_of(np.asarray(ids, np.int32), SEQ, None), 2, "text")
    assert res["tokens"] == 2 * SEQ
    (lp,) = scorer.loglikelihood_rolling([text])
    assert lp == pytest.approx(-res["loss"] * res["tokens"], rel=1e-5)
    short = scorer.loglikelihood_rolling(["x = 1\n"])[0]
    assert short == pytest.approx(-_nats(scorer, [scorer.tok.eos_id, *scorer.tok.encode(
        "x = 1\n")]), rel=1e-5, abs=1e-4)


def test_generate_until_is_the_decoders_greedy_output(scorer):
    from boost_jax.infer.decode import Decoder, Sampling

    run, tok = scorer.run, scorer.tok
    for ctx in ["def ", "for i in range(3"]:
        prompt = np.asarray([tok.eos_id, *tok.encode(ctx)], np.int32)
        dec = Decoder(run.cfg.model, run.params, SEQ, Sampling(temperature=0.0),
                      scorer.n_valid)
        ids, _, _ = dec.generate(prompt, SEQ - len(prompt), tok.eos_id)
        ids = [int(i) for i in ids if i != tok.eos_id]
        text = tok.decode(ids)
        assert scorer.generate_until(ctx, [], SEQ - len(prompt)) == text
        # the greedy continuation is what loglikelihood calls greedy; one other token is not
        assert scorer.score_tokens([(list(prompt) + ids, len(ids))])[0][1]
        other = ids[:-1] + [(ids[-1] + 1) % tok.vocab_size]
        assert not scorer.score_tokens([(list(prompt) + other, len(other))])[0][1]
        if len(text) >= 4:
            stop = text[2:4]
            assert scorer.generate_until(ctx, ["\x01never", stop], SEQ - len(prompt)) == \
                text[:text.find(stop)]


def test_generate_until_keeps_the_context_when_asked_for_more_tokens_than_fit(scorer):
    """lm_eval's default max_gen_toks (256) is far above max_len here: the context is kept
    whole and the continuation gets the positions left (the same text as asking for just
    those); only a context that alone fills max_len loses its start."""
    tok = scorer.tok
    for ctx in ["def ", "for i in range(3", "import "]:
        room = SEQ - 1 - len(tok.encode(ctx))
        assert scorer.generate_until(ctx, [], 256) == scorer.generate_until(ctx, [], room)
    long = "x = [" + "1, " * SEQ
    assert len(scorer.generate_until(long, [], 256)) <= 1  # one position left


def _adapter(env, *args, hide_lm_eval=False):
    """python -m boost_jax.lm_eval_adapter; with hide_lm_eval, lm_eval cannot be imported."""
    code = ("import runpy, sys; sys.modules['lm_eval'] = None; "
            "runpy.run_module('boost_jax.lm_eval_adapter', run_name='__main__')")
    pre = ["-c", code] if hide_lm_eval else ["-m", "boost_jax.lm_eval_adapter"]
    return subprocess.run([sys.executable, *pre, *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)


def test_adapter_without_lm_eval_is_one_line_exit_2(tmp_path):
    p = _adapter(dict(os.environ, JAX_PLATFORMS="cpu"), "--model", "boost_jax", "--tasks", "x",
                 hide_lm_eval=True)
    assert p.returncode == 2, p.stderr
    assert p.stderr.strip() == ("error: the lm-evaluation-harness is not installed; install "
                                "the extra (pip install -e '.[lm_eval]')")


TASK = """task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
"""
LOCAL_TASK = os.path.join(ROOT, "configs", "lm_eval")  # python_next: the README's example
TEXTS = ["def add(a, b):\n    return a + b\n", "import os\nprint(os.getcwd())\n"]


def _tasks(tmp, targets):
    """Two local task files next to the shipped multiple-choice one (loglikelihood): bits per
    byte of whole texts (loglikelihood_rolling), exact match of greedy continuations
    (generate_until)."""
    shutil.copy(os.path.join(LOCAL_TASK, "python_next.yaml"), tmp)  # its data path: from ROOT
    (tmp / "text.jsonl").write_text("".join(json.dumps({"text": t, "target": g}) + "\n"
                                            for t, g in zip(TEXTS, targets)))
    (tmp / "bj_ppl.yaml").write_text(TASK.format(name="bj_ppl", data=tmp / "text.jsonl") + (
        "output_type: loglikelihood_rolling\ndoc_to_text: ''\ndoc_to_target: '{{text}}'\n"
        "metric_list:\n  - metric: bits_per_byte\n"))
    (tmp / "bj_gen.yaml").write_text(TASK.format(name="bj_gen", data=tmp / "text.jsonl") + (
        "output_type: generate_until\ndoc_to_text: '{{text}}'\ndoc_to_target: '{{target}}'\n"
        "generation_kwargs:\n  until: ['\\n\\n', 'zz']\n  max_gen_toks: 5\n"
        "metric_list:\n  - metric: exact_match\n"))


def test_lm_eval_scores_local_tasks_as_the_scorer(scorer, run_dir, tmp_path):
    """lm_eval's command line through the adapter, on three local task files (one of them the
    README's configs/lm_eval/python_next.yaml): each metric is what the scorer's own numbers
    give."""
    pytest.importorskip("lm_eval")
    import math

    targets = [scorer.generate_until(TEXTS[0], ["\n\n", "zz"], 5), "not the continuation"]
    _tasks(tmp_path, targets)
    env = dict(os.environ, JAX_PLATFORMS="cpu", HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1",
               HF_HOME=str(tmp_path / "hf"))
    p = _adapter(env, "--model", "boost_jax", "--model_args", f"run={run_dir}",
                 "--batch_size", "3", "--tasks", "python_next,bj_ppl,bj_gen", "--include_path",
                 str(tmp_path), "--output_path", str(tmp_path / "out"))
    assert p.returncode == 0, p.stderr
    (path,) = [os.path.join(d, f) for d, _, fs in os.walk(tmp_path / "out") for f in fs
               if f.startswith("results_")]
    res = json.load(open(path))["results"]

    docs = [json.loads(ln) for ln in open(os.path.join(LOCAL_TASK, "python_next.jsonl"))]
    lls = [np.array([lp for lp, _ in scorer.loglikelihood([(d["context"], c)
                                                           for c in d["choices"]])])
           for d in docs]
    acc = np.mean([np.argmax(ll) == d["label"] for ll, d in zip(lls, docs)])
    norm = np.mean([np.argmax(ll / [len(c) for c in d["choices"]]) == d["label"]
                    for ll, d in zip(lls, docs)])
    assert res["python_next"]["acc,none"] == pytest.approx(acc)
    assert res["python_next"]["acc_norm,none"] == pytest.approx(norm)
    nats = -sum(scorer.loglikelihood_rolling(TEXTS))
    bpb = nats / math.log(2) / sum(len(t.encode()) for t in TEXTS)
    assert res["bj_ppl"]["bits_per_byte,none"] == pytest.approx(bpb, rel=1e-5)
    assert res["bj_gen"]["exact_match,none"] == 0.5
