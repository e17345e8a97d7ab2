"""A run's cached BPE is bound to the corpus, size and trainer that made it.

Reused when they match; retrained when they do not and no checkpoint uses it (a run that failed
before saving); reused as it is when the run's checkpoints use it (their ids), or refused in one
line if it cannot serve the config (tests/e2e/test_bpe_cache_train.py: the real command).
"""

import json
import os

import numpy as np
import pytest

from boost_jax.config import DataConfig
from boost_jax.data import get_tokenizer
from boost_jax.data.bpe_cache import RECORD_FILE
from boost_jax.errors import UserError

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
