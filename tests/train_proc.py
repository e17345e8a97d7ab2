"""train.py as a subprocess for the crash and out_dir tests: start, watch metrics.jsonl, signal."""

import glob
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# a tiny CoLA run the multi-process tests train (1 x 8 devices against 2 x 4)
TINY = ["model.d_model=32", "model.n_layers=2", "model.n_heads=2", "model.d_ff=64",
        "model.rank=8", "model.max_seq_len=32", "data.seq_len=32", "data.max_bytes=300000",
        "train.global_batch=8", "train.eval_batches=2", "train.log_every=1",
        "logging.tensorboard=false", "logging.plot=false", "optim.lr=0.01",
        "optim.warmup_frac=0.1"]


def train_env(jax_cache):
    """Environment of a train.py subprocess sharing the module's compile cache."""
    e = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1",
             JAX_COMPILATION_CACHE_DIR=jax_cache,
             JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
             JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="-1")
    e.pop("XLA_FLAGS", None)
    return e


class TrainProcess:
    """train.py in a subprocess, stdout and stderr to one file (no pipe to fill up); `base` holds
    the overrides every run of a test module shares."""

    base: list = []

    def __init__(self, out_dir, env, *extra, python_prefix=()):
        self.out_dir = str(out_dir)
        os.makedirs(self.out_dir, exist_ok=True)
        n = len(glob.glob(os.path.join(self.out_dir, "..", "proc*.log")))
        self.log = os.path.join(os.path.dirname(self.out_dir), f"proc{n}.log")
        self._f = open(self.log, "w")
        self.t0 = time.time_ns()
        self.p = subprocess.Popen(
            [sys.executable, *python_prefix, os.path.join(ROOT, "train.py"), "--cpu-devices", "8",
             *self.base, f"out_dir={self.out_dir}", *extra], cwd=ROOT, env=env, stdout=self._f,
            stderr=subprocess.STDOUT)

    def wait(self, timeout=240):
        try:
            code = self.p.wait(timeout)
        finally:
            if self.p.poll() is None:
                self.p.kill()
            self._f.close()
        return code

    def kill(self):
        self.p.kill()
        return self.wait()

    @property
    def output(self):
        return open(self.log).read()

    @property
    def lines(self):
        return [ln for ln in self.output.splitlines() if ln.strip()]

    def until_trained(self, step, timeout=240):
        """Wait until this process itself logged `step` (rows of earlier runs do not count)."""
        path = os.path.join(self.out_dir, "metrics.jsonl")
        self.until(lambda: os.path.exists(path) and os.stat(path).st_mtime_ns > self.t0
                   and self.trained_to() >= step, timeout, poll=0.002)

    def trained_to(self):
        """Highest step in metrics.jsonl (rows are flushed as they are logged)."""
        path = os.path.join(self.out_dir, "metrics.jsonl")
        if not os.path.exists(path):
            return 0
        steps = [0]
        for line in open(path):
            try:
                steps.append(json.loads(line).get("step", 0))
            except ValueError:
                pass
        return max(steps)

    def until(self, cond, timeout=240, poll=0.002):
        t0 = time.monotonic()
        while not cond():
            if self.p.poll() is not None:
                raise AssertionError(f"train.py exited ({self.p.returncode}) early:\n{self.output}")
            if time.monotonic() - t0 > timeout:
                raise AssertionError(f"timed out waiting:\n{self.output}")
            time.sleep(poll)


def assert_same_metrics(want: list, got: list, rtol: float = 1e-5) -> None:
    """metrics.jsonl rows of two runs: the same steps log loss and val_loss, with equal values."""
    import numpy as np

    for key in ("loss", "val_loss"):
        ra = {r["step"]: r[key] for r in want if key in r}
        rb = {r["step"]: r[key] for r in got if key in r}
        assert sorted(ra) == sorted(rb), key
        np.testing.assert_allclose([rb[s] for s in sorted(ra)], [ra[s] for s in sorted(ra)],
                                   rtol=rtol)


def metric_losses(out_dir):
    """{step: loss} of out_dir/metrics.jsonl; a step logged twice fails (resume drops re-done rows)."""
    rows = [json.loads(line) for line in open(os.path.join(out_dir, "metrics.jsonl"))]
    steps = [r["step"] for r in rows if "loss" in r]
    assert len(steps) == len(set(steps)), f"duplicate metric rows: {steps}"
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def checkpoint_steps(out_dir):
    d = os.path.join(out_dir, "checkpoints")
    return sorted(int(n) for n in os.listdir(d) if n.isdigit()) if os.path.isdir(d) else []
