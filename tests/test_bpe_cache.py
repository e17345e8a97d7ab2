"""A run's cached BPE is bound to the corpus, size and trainer that made it.

Reused when they match; retrained when they do not and no checkpoint uses it (a run that failed
before saving); reused as it is when the run's checkpoints use it (their ids), or refused in one
line if it cannot serve the config. The real command: a train.py run that fails after training
a 512-token BPE, then one with data.bpe_vocab_size=1024 in the same out_dir.
"""

import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from boost_jax.config import DataConfig
from boost_jax.data import get_tokenizer
from boost_jax.data.bpe_cache import RECORD_FILE
from boost_jax.errors import UserError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# should a run not fail (a reused 512-token BPE fits model.vocab_size=600), it is short
TINY = ["model.d_model=32", "model.n_layers=1", "model.n_heads=2", "model.d_ff=64",
        "model.rank=8", "model.max_seq_len=32", "data.seq_len=32", "train.global_batch=8",
        "train.steps=1", "train.eval_batches=1", "logging.progress=false",
        "logging.tensorboard=false", "logging.plot=false"]
LETTERS = list("abcdefghijklmnopqrstuvwxyz")


def _texts(seed, n=30):
    """Words of random letters: enough distinct pairs for well over 600 merges."""
    rng = np.random.default_rng(seed)
    words = ["".join(rng.choice(LETTERS, rng.integers(3, 9))) for _ in range(3000)]
    return [" ".join(rng.choice(words, 300)) for _ in range(n)]


def _mtime(path):
    return os.stat(path).st_mtime_ns


def test_reused_only_when_corpus_and_size_match(tmp_path):
    cache = tmp_path / "run" / "tokenizer"
    tok_file, rec_file = cache / "tokenizer.json", cache / RECORD_FILE
    a, b = _texts(1), _texts(2)
    get_tokenizer(DataConfig(tokenizer="bpe", bpe_vocab_size=512), lambda: a, str(cache))
    rec = json.loads(rec_file.read_text())
    assert rec["bpe_vocab_size"] == 512 and rec["documents"] == len(a)
    t0 = _mtime(tok_file)
    get_tokenizer(DataConfig(tokenizer="bpe", bpe_vocab_size=512), lambda: a, str(cache))
    assert _mtime(tok_file) == t0  # same corpus and size: reused
    tok = get_tokenizer(DataConfig(tokenizer="bpe", bpe_vocab_size=600), lambda: a, str(cache))
    assert _mtime(tok_file) != t0 and json.loads(rec_file.read_text())["bpe_vocab_size"] == 600
    assert tok.vocab_size > 512  # retrained at the new size
    t1 = _mtime(tok_file)
    get_tokenizer(DataConfig(tokenizer="bpe", bpe_vocab_size=600), lambda: b, str(cache))
    assert _mtime(tok_file) != t1  # another corpus: retrained
    assert json.loads(rec_file.read_text())["corpus_sha256"] != rec["corpus_sha256"]
    # a tokenizer.json without its record (or a record of another file): retrained
    rec_file.write_text(json.dumps(dict(json.loads(rec_file.read_text()), tokenizer_sha256="0")))
    t2 = _mtime(tok_file)
    get_tokenizer(DataConfig(tokenizer="bpe", bpe_vocab_size=600), lambda: b, str(cache))
    assert _mtime(tok_file) != t2


def test_kept_when_checkpoints_use_it(tmp_path):
    run = tmp_path / "run"
    cache = run / "tokenizer"
    cfg = DataConfig(tokenizer="bpe", bpe_vocab_size=600)
    first = get_tokenizer(cfg, lambda: _texts(1), str(cache))
    (run / "checkpoints" / "3").mkdir(parents=True)
    t0 = _mtime(cache / "tokenizer.json")
    again = get_tokenizer(cfg, lambda: _texts(2), str(cache))  # the data changed on resume
    assert _mtime(cache / "tokenizer.json") == t0
    assert np.array_equal(first.encode("alpha beta gamma"), again.encode("alpha beta gamma"))
    with pytest.raises(UserError, match=r"cached BPE .* has \d+ tokens but "
                                        r"data\.bpe_vocab_size=512, and this run's checkpoints "
                                        r"use it \(it was trained on another corpus and "
                                        r"with data\.bpe_vocab_size=600\); set "
                                        r"data\.bpe_vocab_size=600 or use a fresh out_dir"):
        get_tokenizer(DataConfig(tokenizer="bpe", bpe_vocab_size=512), lambda: _texts(2),
                      str(cache))


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
