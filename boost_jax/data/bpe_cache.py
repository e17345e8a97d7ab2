"""A run's trained BPE (out_dir/tokenizer/tokenizer.json) is bound to what made it.

Next to the tokenizer, `tokenizer.record.json` records the corpus it was trained on (a sha256 of
the training documents, plus the source and settings for people), the vocabulary size and the
trainer, and the sha256 of the tokenizer file itself (a half-written pair does not match).

- The cache is reused when the record matches the corpus and settings of this run.
- Otherwise, when no checkpoint of the run uses the cache (say a run that failed before its
  first save), the BPE is retrained and both files replaced.
- When checkpoints use it, the cached ids are the model's: it is reused as it is (a resume with
  another vocabulary is refused by the resume check), or refused in one line if it cannot be.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from typing import Callable, Iterable, Optional

from boost_jax.errors import UserError
from boost_jax.names import CHECKPOINTS_DIR
from boost_jax.safe_write import file_mode

RECORD_FILE = "tokenizer.record.json"
# What decides the merges besides the corpus and size: change it when train_bpe changes.
TRAINER = ("byte-level BPE, EOS <|endoftext|> id 0, byte alphabet, no prefix space, words "
           "cut at 256 bytes")  # tokenizers.BPE_MAX_WORD
_MATCH = ("corpus_sha256", "bpe_vocab_size", "trainer")


def corpus_digest(texts: Iterable[str]) -> tuple[str, int]:
    """sha256 of the documents in order (each length-prefixed, so splits differ) and their count."""
    h, n = hashlib.sha256(), 0
    for t in texts:
        b = t.encode("utf-8", "surrogatepass")
        h.update(len(b).to_bytes(8, "little"))
        h.update(b)
        n += 1
    return h.hexdigest(), n


def _file_sha256(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def wanted(data_cfg, texts: list) -> dict:
    digest, n = corpus_digest(texts)
    return {"corpus_sha256": digest, "documents": n, "bpe_vocab_size": data_cfg.bpe_vocab_size,
            "trainer": TRAINER, "source": data_cfg.source, "max_bytes": data_cfg.max_bytes,
            "val_fraction": data_cfg.val_fraction}


def read_record(cache_dir: str, tokenizer_path: str) -> Optional[dict]:
    """The record of the cached tokenizer, or None if missing, unreadable or not of this file."""
    try:
        with open(os.path.join(cache_dir, RECORD_FILE)) as f:
            rec = json.load(f)
        ok = isinstance(rec, dict) and rec.get("tokenizer_sha256") == _file_sha256(tokenizer_path)
    except (OSError, ValueError, RecursionError):
        return None
    return rec if ok else None


def mismatch(rec: Optional[dict], want: dict) -> Optional[str]:
    """What differs between the cached tokenizer's record and this run, in words; None: same."""
    if rec is None:
        return "it has no record of the corpus and settings it was trained with"
    words = {"corpus_sha256": "on another corpus",
             "bpe_vocab_size": f"with data.bpe_vocab_size={rec.get('bpe_vocab_size')}",
             "trainer": "by another trainer"}
    diff = [words[k] for k in _MATCH if rec.get(k) != want[k]]
    return "it was trained " + " and ".join(diff) if diff else None


def write_record(cache_dir: str, tokenizer_path: str, want: dict) -> None:
    """Atomically, after the tokenizer file: the record names that file's sha256."""
    rec = dict(want, tokenizer_sha256=_file_sha256(tokenizer_path))
    fd, tmp = tempfile.mkstemp(prefix=".record.", suffix=".json", dir=cache_dir)
    with os.fdopen(fd, "w") as f:
        json.dump(rec, f, indent=1, allow_nan=False)
    os.chmod(tmp, file_mode())  # mkstemp's 0600: the mode a new file gets under the umask
    os.replace(tmp, os.path.join(cache_dir, RECORD_FILE))


def checkpoints_use(cache_dir: str) -> bool:
    """Whether the run owning out_dir/tokenizer has checkpoints (out_dir/checkpoints/<step>)."""
    d = os.path.join(os.path.dirname(os.path.abspath(cache_dir)), CHECKPOINTS_DIR)
    try:
        return any(n.isdigit() for n in os.listdir(d))
    except OSError:
        return False


def cached_bpe(data_cfg, texts_fn: Callable[[], Iterable[str]], path: str, load, train):
    """The BPE for this run: the cache at `path` if bound to this corpus and settings (or in
    use by the run's checkpoints), else `train(texts, size, path)` and a new record."""
    cache_dir = os.path.dirname(path)
    texts = list(texts_fn())
    want = wanted(data_cfg, texts)
    if os.path.isfile(path):
        why = mismatch(read_record(cache_dir, path), want)
        if why is None:
            return load(path)
        if checkpoints_use(cache_dir):
            tok = load(path)
            if tok.vocab_size > data_cfg.bpe_vocab_size:
                raise UserError(
                    f"cached BPE {path!r} has {tok.vocab_size} tokens but data.bpe_vocab_size="
                    f"{data_cfg.bpe_vocab_size}, and this run's checkpoints use it ({why}); set "
                    f"data.bpe_vocab_size={tok.vocab_size} or use a fresh out_dir")
            return tok  # the model's ids: a resumed run must see the same ones
    tok = train(texts, data_cfg.bpe_vocab_size, path)
    write_record(cache_dir, path, want)
    return tok
