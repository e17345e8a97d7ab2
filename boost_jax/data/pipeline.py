"""grain input pipeline: packed sequences → shuffle → repeat → per-process shard → batch.

The token stream is cut into windows of seq_len+1 tokens with stride seq_len (consecutive
windows share one token, so every token is a target exactly once per epoch). The training
order is a pure function of (tokens, seq_len, seed): a global stream of windows, reshuffled
every epoch by grain (per-epoch seed = seed + epoch). Process p of P takes stream positions
p, p+P, p+2P, …, so at step k the P per-process batches together are exactly global positions
[k·B, (k+1)·B) with B = P·b: the data of a step does not depend on the process count.

Iterator state is `{"windows": n}`, the global stream's windows taken (plain JSON, the same on
every process at the same step), so a resume under another train.global_batch continues at
window n (an older step's `{"next_index": k}` counts batches of this run's global_batch).
`data.sources` mixes several corpora into that one global stream before the per-process shard
(data/mixture.py), so all of the above holds for a mixture.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import grain
import numpy as np

from boost_jax.data.sources import load_corpus
from boost_jax.data.streaming import Stream
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


def _windows(tokens: np.ndarray, seq_len: int, seed: int) -> grain.MapDataset:
    """The corpus's windows, shuffled, repeated without end (reshuffled each epoch: seed+epoch)."""
    return (grain.MapDataset.source(PackedSequences(tokens, seq_len))
            .shuffle(seed=seed % 2**32)
            .repeat())


class WindowBatches:
    """This process's batches of a global window stream (grain's iterator from window n on),
    resumable by the count of windows taken: get_state() / set_state({"windows": n})."""

    def __init__(self, ds: grain.MapDataset, batch_size_per_process: int, process_index: int,
                 process_count: int):
        self._ds, self._b, self._p, self._n = ds, batch_size_per_process, process_index, \
            process_count
        self.set_state({"windows": 0})

    def get_state(self) -> dict:
        return {"windows": self._start + self._taken * self._b * self._n}

    def set_state(self, state: dict) -> None:
        if set(state) == {"windows"}:
            start = int(state["windows"])
        elif set(state) == {"next_index"}:  # an older step's: batches of this global_batch
            start = int(state["next_index"]) * self._b * self._n
        else:
            raise UserError(f"the checkpoint's data position {state} is not a packed corpus's "
                            "or a mixture's; resume with the data.source(s) it was trained on")
        ds = (self._ds.slice(slice(start, None)).slice(slice(self._p, None, self._n))
              .batch(self._b, drop_remainder=True).map(_to_example))
        self._start, self._taken, self._it = start, 0, iter(ds.to_iter_dataset(_READ))

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        batch = next(self._it)
        self._taken += 1
        return batch


def _check_process(process_index: int, process_count: int) -> None:
    if not 0 <= process_index < process_count:
        raise ValueError(f"process_index={process_index} not in [0, {process_count})")


def make_train_iterator(tokens: np.ndarray, seq_len: int, batch_size_per_process: int,
                        seed: int, process_index: int = 0, process_count: int = 1):
    """Infinite iterator of {"inputs","targets"}: int32[batch_size_per_process, seq_len].

    Returns a WindowBatches: `get_state()` (JSON-serialisable dict) and `set_state(state)`
    resume exactly.
    """
    _check_process(process_index, process_count)
    n = len(PackedSequences(tokens, seq_len))
    need = batch_size_per_process * process_count
    if n < need:
        raise UserError(
            f"the training split has {len(tokens)} tokens = {n} sequences of "
            f"data.seq_len+1={seq_len + 1}, fewer than one global batch of {need}; use a larger "
            "corpus (data.source / data.max_bytes) or lower data.seq_len or train.global_batch")
    return WindowBatches(_windows(tokens, seq_len, seed), batch_size_per_process, process_index,
                         process_count)


def make_mixture_iterator(tokens: list, weights: list, seq_len: int,
                          batch_size_per_process: int, seed: int, process_index: int = 0,
                          process_count: int = 1):
    """make_train_iterator over several corpora mixed by weight (data/mixture.py)."""
    from boost_jax.data.mixture import source_seed

    _check_process(process_index, process_count)
    for i, t in enumerate(tokens):
        if len(PackedSequences(t, seq_len)) == 0:
            raise UserError(
                f"the training split of data.sources[{i}] has {len(t)} tokens, fewer than one "
                f"sequence of data.seq_len+1={seq_len + 1}; use a larger corpus or lower "
                "data.seq_len")
    parts = [_windows(t, seq_len, source_seed(seed, j)) for j, t in enumerate(tokens)]
    return WindowBatches(grain.MapDataset.mix(parts, list(weights)), batch_size_per_process,
                         process_index, process_count)


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
    n_streamed_docs: int = 0  # a streaming source: its train documents (tokens not counted)

    @property
    def size(self) -> str:
        if self.n_streamed_docs:
            return f"streaming {self.n_streamed_docs:,} train documents"
        return f"{self.n_train_tokens / 1e6:.2f}M train tokens"


def load_splits(cfg, cache_dir: Optional[str] = None):
    """(tokenizer, train arrays, val arrays, weights): one corpus (`data.source`) or the
    mixture `data.sources`."""
    d = cfg.data
    if not d.sources:
        corpus = load_corpus(d, cache_dir)
        return corpus.tokenizer, [corpus.train], [corpus.val], [1.0]
    from boost_jax.data.mixture import load_sources
    from boost_jax.data.shards import is_streaming
    from boost_jax.data.tokenizers import get_tokenizer

    tok = get_tokenizer(d, list, cache_dir)
    if is_streaming(d.sources[0].path):  # the train side is a Stream (data/streaming.py)
        stream = Stream(d.sources[0].path, d, tok)
        return tok, [stream], [stream.val], [1.0]
    trains, vals = load_sources(d, tok)
    return tok, trains, vals, [s.weight for s in d.sources]


def eval_batches(vals: list, weights: list, seq_len: int, batch: int,
                 n_batches: int) -> list[dict]:
    """The run's fixed eval batches: make_eval_batches, or the mixture's (data/mixture.py)."""
    if len(vals) == 1:
        return make_eval_batches(vals[0], seq_len, batch, n_batches)
    from boost_jax.data.mixture import mixture_eval_windows

    windows = mixture_eval_windows(vals, weights, seq_len, batch * n_batches)
    return [_to_example(w) for w in windows.reshape(n_batches, batch, seq_len + 1)]


def build_data(cfg, process_index: int = 0, process_count: int = 1,
               cache_dir: Optional[str] = None) -> DataBundle:
    """Everything train.py needs from `cfg.data` (+ train.global_batch / eval_batches).

    process_index / process_count: this process's row group among the groups of processes
    that feed distinct rows (sharding/placement.process_rows; the process and the process
    count where the batch splits over every process). Per-group train batch =
    train.global_batch / process_count. Validation batches hold global_batch rows in total;
    a group keeps rows p, p+P, … (the same interleave as training), so concatenating the
    groups' rows gives the global eval batch.
    """
    d, t = cfg.data, cfg.train
    if t.global_batch % process_count:
        raise UserError(
            f"train.global_batch={t.global_batch} is not divisible by the {process_count} "
            "processes (row groups) that feed it; choose a multiple of that count")
    tok, trains, vals, weights = load_splits(cfg, cache_dir)
    if cfg.model.vocab_size is not None and cfg.model.vocab_size < tok.vocab_size:
        raise UserError(
            f"model.vocab_size={cfg.model.vocab_size} is smaller than the tokenizer's "
            f"{tok.vocab_size} tokens; set model.vocab_size={tok.vocab_size} or leave it unset "
            "to follow the tokenizer")
    per = t.global_batch // process_count
    streamed = isinstance(trains[0], Stream)
    if streamed:
        train_iter = trains[0].iterator(d.seq_len, t.global_batch, d.seed, d.workers,
                                        process_index, process_count)
    elif len(trains) == 1:
        train_iter = make_train_iterator(trains[0], d.seq_len, per, d.seed, process_index,
                                         process_count)
    else:
        train_iter = make_mixture_iterator(trains, weights, d.seq_len, per, d.seed,
                                           process_index, process_count)
    evals = eval_batches(vals, weights, d.seq_len, t.global_batch, t.eval_batches)
    local = [{k: v[process_index::process_count] for k, v in b.items()} for b in evals]
    if streamed:
        return DataBundle(train_iter, local, tok, tok.vocab_size, 0, len(vals[0]),
                          n_streamed_docs=trains[0].n_train_docs)
    return DataBundle(train_iter, local, tok, tok.vocab_size, sum(len(x) for x in trains),
                      sum(len(x) for x in vals),
                      sum(len(PackedSequences(x, d.seq_len)) for x in trains))
