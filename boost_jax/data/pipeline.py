"""grain input pipeline: packed sequences → shuffle → repeat → per-process shard → batch.

The token stream is cut into windows of seq_len+1 tokens with stride seq_len (consecutive
windows share one token, so every token is a target exactly once per epoch). The training
order is a pure function of (tokens, seq_len, seed): a global stream of windows, reshuffled
every epoch by grain (per-epoch seed = seed + epoch). Process p of P takes stream positions
p, p+P, p+2P, …, so at step k the P per-process batches together are exactly global positions
[k·B, (k+1)·B) with B = P·b: the data of a step does not depend on the process count.

Iterator state is grain's `{"next_index": k}` (k = batches taken), plain JSON, and the same on
every process at the same step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import grain
import numpy as np

from boost_jax.data.sources import load_corpus
from boost_jax.data.tokenizers import Tokenizer
from boost_jax.errors import UserError

# Batches are built inside the MapDataset, so each prefetched element is a whole batch:
# keep the buffer small (a 16-thread, 500-deep default would hold GBs at large batch sizes).
_READ = grain.ReadOptions(num_threads=2, prefetch_buffer_size=4)


class PackedSequences:
    """Random-access view of windows tokens[i·s : i·s+s+1] as int32 (a grain data source)."""

    def __init__(self, tokens: np.ndarray, seq_len: int):
        self.tokens, self.seq_len = tokens, seq_len
        self._n = max(0, (len(tokens) - 1) // seq_len)

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, i: int) -> np.ndarray:
        if not 0 <= i < self._n:
            raise IndexError(i)
        s = self.seq_len
        return np.asarray(self.tokens[i * s: i * s + s + 1], dtype=np.int32)


def _to_example(window: np.ndarray) -> dict:
    # [b, s+1] → next-token prediction pair
    return {"inputs": window[:, :-1], "targets": window[:, 1:]}


def make_train_iterator(tokens: np.ndarray, seq_len: int, batch_size_per_process: int,
                        seed: int, process_index: int = 0, process_count: int = 1):
    """Infinite iterator of {"inputs","targets"}: int32[batch_size_per_process, seq_len].

    Returns grain's DatasetIterator: `get_state()` (JSON-serialisable dict) and
    `set_state(state)` resume exactly.
    """
    if not 0 <= process_index < process_count:
        raise ValueError(f"process_index={process_index} not in [0, {process_count})")
    src = PackedSequences(tokens, seq_len)
    need = batch_size_per_process * process_count
    if len(src) < need:
        raise UserError(
            f"the training split has {len(tokens)} tokens = {len(src)} sequences of "
            f"data.seq_len+1={seq_len + 1}, fewer than one global batch of {need}; use a larger "
            "corpus (data.source / data.max_bytes) or lower data.seq_len or train.global_batch")
    ds = (grain.MapDataset.source(src)
          .shuffle(seed=seed % 2**32)
          .repeat()  # infinite; ShuffleMapDataset reshuffles each epoch (seed + epoch)
          .slice(slice(process_index, None, process_count))
          .batch(batch_size_per_process, drop_remainder=True)
          .map(_to_example))
    return iter(ds.to_iter_dataset(_READ))


def make_eval_batches(tokens: np.ndarray, seq_len: int, batch: int, n_batches: int) -> list[dict]:
    """n_batches fixed batches of validation windows, evenly spaced over the split.

    If the split has fewer than batch·n_batches windows they are reused cyclically.
    """
    n = max(0, (len(tokens) - 1) // seq_len)
    if n == 0:
        raise UserError(
            f"the validation split has {len(tokens)} tokens, fewer than data.seq_len+1="
            f"{seq_len + 1}; raise data.val_fraction, use a larger corpus or lower data.seq_len")
    count = batch * n_batches
    idx = (np.arange(count) * n) // count if n >= count else np.arange(count) % n
    windows = np.asarray(tokens[(idx * seq_len)[:, None] + np.arange(seq_len + 1)], dtype=np.int32)
    windows = windows.reshape(n_batches, batch, seq_len + 1)
    return [_to_example(w) for w in windows]


@dataclass
class DataBundle:
    train_iter: Any  # grain DatasetIterator with get_state/set_state
    val_batches: list  # this process's rows of each global eval batch
    tokenizer: Tokenizer
    vocab_size: int
    n_train_tokens: int
    n_val_tokens: int
    n_train_sequences: int = 0  # windows per epoch, all processes together


def build_data(cfg, process_index: int = 0, process_count: int = 1,
               cache_dir: Optional[str] = None) -> DataBundle:
    """Everything train.py needs from `cfg.data` (+ train.global_batch / eval_batches).

    Per-process train batch = train.global_batch / process_count. Validation batches hold
    global_batch rows in total; this process keeps rows p, p+P, … (the same interleave as
    training), so concatenating all processes' rows gives the global eval batch.
    """
    d, t = cfg.data, cfg.train
    if t.global_batch % process_count:
        raise UserError(
            f"train.global_batch={t.global_batch} is not divisible by the {process_count} "
            "processes; choose a multiple of the process count")
    corpus = load_corpus(d, cache_dir)
    tok = corpus.tokenizer
    if cfg.model.vocab_size is not None and cfg.model.vocab_size < tok.vocab_size:
        raise UserError(
            f"model.vocab_size={cfg.model.vocab_size} is smaller than the tokenizer's "
            f"{tok.vocab_size} tokens; set model.vocab_size={tok.vocab_size} or leave it unset "
            "to follow the tokenizer")
    per = t.global_batch // process_count
    train_iter = make_train_iterator(corpus.train, d.seq_len, per, d.seed,
                                     process_index, process_count)
    evals = make_eval_batches(corpus.val, d.seq_len, t.global_batch, t.eval_batches)
    local = [{k: v[process_index::process_count] for k, v in b.items()} for b in evals]
    return DataBundle(train_iter, local, tok, tok.vocab_size, int(len(corpus.train)),
                      int(len(corpus.val)), len(PackedSequences(corpus.train, d.seq_len)))
