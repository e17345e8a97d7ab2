"""data.sources=[{path: FOLDER_OF_PARQUET}] through train.py without `prepare`: tokenized by grain
worker processes, killed with SIGKILL after a checkpoint, resumed with the same losses as an
uninterrupted run; evaluate --run scores the same validation windows; a resume on changed
shards stops in one line."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

pa = pytest.importorskip("pyarrow")
import pyarrow.parquet as pq  # noqa: E402

from boost_jax.config import load_config  # noqa: E402
from train_proc import ROOT, TINY, TrainProcess, assert_same_metrics, train_env  # noqa: E402

STEPS = 10


def _shards(d):
    """Three parquet shards of standard-library text, 400 B documents."""
    import argparse
    import json.decoder

    text = "".join(open(m.__file__, encoding="utf-8").read() for m in (argparse, json.decoder))
    docs = [text[i:i + 400] for i in range(0, len(text), 400)]
    d.mkdir()
    for k in range(3):
        pq.write_table(pa.table({"text": docs[k::3]}), d / f"part-{k}.parquet",
                       row_group_size=40)
    return str(d)


def _run_args(path):
    return TINY + [f"train.steps={STEPS}", "train.eval_every=5", "checkpoint.every=3",
                   "logging.progress=false", f"data.sources=[{{path: {path}, weight: 1}}]",
                   "data.workers=1"]


def _rows(out_dir):
    return [json.loads(x) for x in open(os.path.join(out_dir, "metrics.jsonl"))]


def _children(pid):
    """Pids of the direct children of `pid` (grain's worker processes among them)."""
    out = []
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/children") as f:
                out += [int(x) for x in f.read().split()]
        except FileNotFoundError:  # a thread that ended since the listing
            pass
    return out


def _gone(pid, timeout=30):
    end = time.time() + timeout
    while time.time() < end:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().split(") ", 1)[1].startswith("Z"):
                    return True  # a zombie: exited, waiting for its reaper
        except FileNotFoundError:
            return True
        time.sleep(0.1)
    return False


def test_stream_resumes_exactly_after_sigkill(jax_cache, tmp_path):
    from boost_jax.train.loop import run

    shards = _shards(tmp_path / "shards")
    ref = str(tmp_path / "ref")
    run(load_config(None, _run_args(shards) + [f"out_dir={ref}"]))

    class Train(TrainProcess):
        base = _run_args(shards)

    env = train_env(jax_cache)
    out = tmp_path / "run"
    t = Train(out, env)
    t.until(lambda: os.path.exists(out / "checkpoints" / "3" / "data" / "metadata"))
    t.until_trained(4)
    workers = _children(t.p.pid)
    assert workers, "no grain worker process"
    assert t.kill() == -signal.SIGKILL  # after the step-3 checkpoint, mid-training
    assert all(_gone(w) for w in workers), "a grain worker outlived its SIGKILLed trainer"
    state = json.load(open(out / "checkpoints" / "3" / "data" / "metadata"))
    assert set(state) == {"piece", "offset"}  # the streaming position, saved with the weights
    t = Train(out, env)
    assert t.wait() == 0, t.output
    assert "resumed from step" in t.output and "leaked" not in t.output, t.output
    rows = _rows(out)
    assert sorted(r["step"] for r in rows if "loss" in r) == list(range(1, STEPS + 1))
    assert_same_metrics(_rows(ref), rows, rtol=1e-6)

    # evaluate --run rebuilds the validation windows from the shards: the logged val_loss
    r = subprocess.run([sys.executable, "-m", "boost_jax.evaluate", "--run", str(out), "--json"],
                       cwd=ROOT, capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    logged = [x for x in rows if "val_loss" in x][-1]
    assert json.loads(r.stdout.splitlines()[-1])["loss"] == pytest.approx(logged["val_loss"],
                                                                          rel=1e-5)

    # a shard rewritten since: a resume stops in one line (fingerprinted like a prepared .bin)
    pq.write_table(pa.table({"text": ["another document"] * 50}),
                   os.path.join(shards, "part-1.parquet"))
    t = Train(out, env, f"train.steps={STEPS + 2}")
    assert t.wait() == 2, t.output
    err = [ln for ln in t.lines if ln.startswith("error:")]
    assert len(err) == 1 and "data.sources[0]" in err[0] and "has changed since" in err[0], \
        t.output
