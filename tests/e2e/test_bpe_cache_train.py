"""A run's cached BPE through the real command: a train.py run that fails after training a
512-token BPE, then one with data.bpe_vocab_size=1024 in the same out_dir, which must not reuse
the failed run's tokenizer (tests/unit/test_bpe_cache.py: the cache's rules in-process).
"""

import json
import os
import re
import subprocess
import sys

from boost_jax.data.bpe_cache import RECORD_FILE
from train_proc import ROOT

# should a run not fail (a reused 512-token BPE fits model.vocab_size=600), it is short
TINY = ["model.d_model=32", "model.n_layers=1", "model.n_heads=2", "model.d_ff=64",
        "model.rank=8", "model.max_seq_len=32", "data.seq_len=32", "train.global_batch=8",
        "train.steps=1", "train.eval_batches=1", "logging.progress=false",
        "logging.tensorboard=false", "logging.plot=false"]


def test_failed_run_cache_is_not_reused_at_another_size(tmp_path):
    """train.py fails after training its 512-token BPE (model.vocab_size too small); the next
    run asks for 1024 tokens: it must get a 1024-token BPE, not the failed run's."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
    env.pop("XLA_FLAGS", None)
    out = tmp_path / "run"

    def train(size, vocab):
        return subprocess.run(
            [sys.executable, "train.py", "data.tokenizer=bpe", f"data.bpe_vocab_size={size}",
             f"model.vocab_size={vocab}", "data.max_bytes=300000", f"out_dir={out}", *TINY], cwd=ROOT, env=env, capture_output=True, text=True,
            timeout=300)

    r = train(512, 300)
    assert r.returncode == 2 and "smaller than the tokenizer's 512 tokens" in r.stderr, r.stderr
    r = train(1024, 600)  # fails again, naming the tokenizer it now has
    m = re.search(r"model\.vocab_size=600 is smaller than the tokenizer's (\d+) tokens", r.stderr)
    assert r.returncode == 2 and m and int(m.group(1)) > 512, r.stderr
    rec = json.loads((out / "tokenizer" / RECORD_FILE).read_text())
    assert rec["bpe_vocab_size"] == 1024 and rec["source"] == "stdlib"


def test_a_runs_own_bpe_replaced_stops_generate_and_resume(tmp_path):
    """The BPE a run trained (out_dir/tokenizer/tokenizer.json) is an input of its checkpoints:
    replaced by another of the same size, generate and a resume stop in one line naming it,
    instead of decoding (or training on) ids the model never saw."""
    from boost_jax.data.tokenizers import train_bpe

    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
    env.pop("XLA_FLAGS", None)
    out = tmp_path / "run"
    run = [sys.executable, "train.py", "data.tokenizer=bpe", "data.bpe_vocab_size=512",
           "model.vocab_size=512", "data.max_bytes=300000", f"out_dir={out}", *TINY]
    r = subprocess.run(run, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    path = out / "tokenizer" / "tokenizer.json"
    other = train_bpe([open(os.path.join(ROOT, "README.md")).read()], 512)
    other._tok.save(str(path))
    assert other.vocab_size == 512
    r = subprocess.run([sys.executable, "-m", "boost_jax.generate", "--run", str(out),
                        "--prompt", "def", "--max-new-tokens", "2"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert "was trained on data.tokenizer" in r.stderr and "has changed since" in r.stderr
    r = subprocess.run([*run, "train.steps=2"], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 2 and "was trained on data.tokenizer" in r.stderr and \
        "checkpoint.accept_changes=[data.tokenizer]" in r.stderr, r.stderr[-3000:]
