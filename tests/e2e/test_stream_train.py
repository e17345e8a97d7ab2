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


def test_a_worker_outlives_the_thread_that_started_it():
    """Workers are tied to their parent process, not to the thread that started them: grain
    starts its workers from a prefetch thread that ends on close(), and a worker killed then
    left half an element in its pipe, on which close() waited forever."""
    import multiprocessing
    import threading
    from concurrent.futures import ProcessPoolExecutor

    from boost_jax.data.prepare import _tied_to_parent

    with ProcessPoolExecutor(1, multiprocessing.get_context("spawn"),
                             initializer=_tied_to_parent) as pool:
        first = []
        t = threading.Thread(target=lambda: first.append(pool.submit(os.getpid).result(120)))
        t.start()  # the pool starts its worker in this thread, which then ends
        t.join()
        for _ in range(600):  # until the kernel has ended the thread too
            if not os.path.exists(f"/proc/self/task/{t.native_id}"):
                break
            time.sleep(0.05)
        assert first and pool.submit(os.getpid).result(120) == first[0]


_PREPARE_THEN_STREAM = """
import sys
from boost_jax.config import load_config
from boost_jax.data.pipeline import build_data
from boost_jax.data.prepare import prepare

if __name__ == "__main__":
    shards, corpus, out = sys.argv[1:]
    prepare(corpus, out, "byte", 1, progress=False)  # a process pool first, in this process
    cfg = load_config(None, [f"data.sources=[{{path: {shards}, weight: 1}}]", "data.seq_len=32",
                             "train.global_batch=8", "train.eval_batches=2", "data.workers=1"])
    for round in range(3):
        it = build_data(cfg).train_iter
        for _ in range(3):
            next(it)
        it.close()
        print("closed", round, flush=True)
"""


def test_grain_workers_read_and_close_after_prepares_pool(tmp_path):
    """prepare's process pool, then grain worker processes in the same process: batches come and
    close() returns, three times over (a hang fails on the subprocess timeout)."""
    import argparse

    text = open(argparse.__file__, encoding="utf-8").read()
    (tmp_path / "shards").mkdir()
    # one row group: pieces of ~250 rows, far more than a pipe holds (64 KiB)
    pq.write_table(pa.table({"text": [text[i:i + 400] for i in range(0, len(text), 400)]}),
                   tmp_path / "shards" / "a.parquet")
    shards = str(tmp_path / "shards")
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(text)
    script = tmp_path / "prepare_then_stream.py"
    script.write_text(_PREPARE_THEN_STREAM)
    env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
    with open(tmp_path / "out.txt", "w") as out:  # a file: no pipe a stray worker holds open
        r = subprocess.run([sys.executable, str(script), shards, str(corpus),
                            str(tmp_path / "c.bin")], cwd=ROOT, env=env, stdout=out,
                           stderr=subprocess.STDOUT, timeout=120)
    text = (tmp_path / "out.txt").read_text()
    assert r.returncode == 0 and "closed 2" in text and "leaked" not in text, text
