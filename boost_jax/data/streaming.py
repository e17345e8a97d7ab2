"""A corpus streamed from parquet / arrow shards, tokenized while training (no `prepare`).

`data.sources=[{path: P, weight: 1}]` streams when P is a .parquet or .arrow file, a folder
of them (searched recursively, in sorted order) or a Hugging Face `save_to_disk` folder. Each
row's "text" column is one document, followed by EOS as `prepare` writes it.

Documents are numbered in file order. The last data.val_fraction of them (at least one) are
validation: their first VAL_TOKENS tokens, read once at start, whatever the training position.
The others are cut into pieces (at most PIECE_ROWS rows of one parquet row group or arrow
file); grain shuffles the pieces (seed data.seed, reshuffled every epoch), reads and tokenizes
them in order-preserving workers (data.workers processes, or two threads when 0), and the
tokens are cut into windows of seq_len+1 with stride seq_len, as for a prepared corpus.

Every process computes the same global stream and keeps rows p, p+P, … of each global batch,
so a step's data does not depend on the process count. The iterator position is
{"piece": k, "offset": o}: the k-th piece of the endless stream, o tokens into it. A resume
restarts the readers at piece k, so a killed run continues at the same window.
"""

from __future__ import annotations

import atexit
import os
from collections import deque

import grain
import numpy as np

from boost_jax.data.shards import Shards, is_streaming, list_shards  # noqa: F401
from boost_jax.errors import UserError, counted

PIECE_ROWS = 1024
VAL_TOKENS = 1 << 22  # validation tokens kept in memory (far more than eval needs)


def _pieces(shards: Shards, first: int, last: int) -> list[tuple[int, int, int]]:
    """(file, row, rows) pieces covering documents [first, last) of the file order."""
    out, doc = [], 0
    for f, groups in enumerate(shards.groups):
        file_start = doc
        for n in groups:
            lo, hi = max(first, doc), min(last, doc + n)
            for row in range(lo, hi, PIECE_ROWS):
                out.append((f, row - file_start, min(PIECE_ROWS, hi - row)))
            doc += n
    return out


class _Tokenize:
    """A piece → the bytes of its int32 ids (EOS after every document); picklable for grain's
    worker processes. Bytes, not an array: grain would pass an array through a shared-memory
    segment that an unread prefetched piece leaks at exit."""

    def __init__(self, shards: Shards, tokenizer):
        self.shards, self.tok = shards, tokenizer

    def __call__(self, piece) -> bytes:
        return encode(self.tok, self.shards.texts(*piece)).tobytes()


def encode(tok, texts: list[str]) -> np.ndarray:
    if not texts:
        return np.zeros((0,), np.int32)
    ids = np.asarray(tok.encode_documents(texts), np.int32)
    return np.concatenate([ids, np.array([tok.eos_id], np.int32)])


def _worker_init(index: int, count: int) -> None:
    """A grain worker dies with the trainer, however it ends (SIGKILL included)."""
    from boost_jax.data.prepare import _tied_to_parent

    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # the worker count is the parallelism
    _tied_to_parent()


def _short_worker_join(seconds: float = 2.0) -> None:
    """grain's close() waits up to 25 s for a worker to exit, and a worker whose last piece is
    larger than a pipe holds cannot exit before that piece is read, which nobody does once
    close() has begun: every run with data.workers >= 1 would linger 25 s at exit. A worker
    that has not exited after `seconds` is killed; grain then reads its queue no more, so the
    piece it left half written is never read."""
    from grain._src.python.dataset.transformations import process_prefetch

    if getattr(process_prefetch, "_PROCESS_KILL_TIMEOUT_S", 0) > seconds:
        process_prefetch._PROCESS_KILL_TIMEOUT_S = seconds


class StreamIterator:
    """This process's batches of the global window stream; get_state/set_state resume it."""

    def __init__(self, pieces: list, tokenize: _Tokenize, seq_len: int, global_batch: int,
                 seed: int, workers: int, process_index: int = 0, process_count: int = 1):
        self._pieces, self._tokenize, self._seed, self._workers = pieces, tokenize, seed, workers
        self._s, self._b = seq_len, global_batch
        self._p, self._n = process_index, process_count
        self.set_state({"piece": 0, "offset": 0})

    def get_state(self) -> dict:
        return {"piece": self._piece, "offset": self._offset}

    def set_state(self, state: dict) -> None:
        if set(state) != {"piece", "offset"}:
            raise UserError(f"the checkpoint's data position {state} is not a streaming "
                            "source's; resume with the data.sources it was trained on")
        self._piece, self._offset = int(state["piece"]), int(state["offset"])
        self.close()
        self._buf, self._have = deque(), 0  # the readers restart lazily at the new position

    def close(self) -> None:
        """Stop the readers (grain's worker processes exit)."""
        parent, self._parent = getattr(self, "_parent", None), None
        if parent is not None and hasattr(parent, "close"):
            parent.close()

    def _read(self) -> None:
        """Append the next piece's ids to the buffer (the readers start on first use)."""
        if self._parent is None:  # the buffer is empty: start at piece k, offset o
            ds = (grain.MapDataset.source(self._pieces).shuffle(seed=self._seed % 2**32)
                  .repeat().map(self._tokenize).slice(slice(self._piece, None)))
            ds = ds.to_iter_dataset(grain.ReadOptions(num_threads=2, prefetch_buffer_size=8))
            if self._workers:
                from absl import flags

                if not flags.FLAGS.is_parsed():  # grain's workers read its absl flags
                    flags.FLAGS.mark_as_parsed()
                _short_worker_join()
                ds = ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=self._workers),
                                    worker_init_fn=_worker_init)
                atexit.register(self.close)  # before the interpreter tears grain down
            self._parent = iter(ds)
            self._buf.append(np.frombuffer(next(self._parent), np.int32)[self._offset:])
        else:
            self._buf.append(np.frombuffer(next(self._parent), np.int32))
        self._have += len(self._buf[-1])

    def _window(self) -> np.ndarray:
        """The next seq_len+1 tokens; the position moves on by seq_len."""
        while self._have < self._s + 1:
            self._read()
        parts, need = [], self._s + 1
        for x in self._buf:
            parts.append(x[:need])
            need -= len(parts[-1])
            if not need:
                break
        left = self._s
        self._have -= left
        while left and left >= len(self._buf[0]):
            left -= len(self._buf.popleft())
            self._piece, self._offset = self._piece + 1, 0
        self._buf[0] = self._buf[0][left:]
        self._offset += left
        return np.concatenate(parts)

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        w = np.stack([self._window() for _ in range(self._b)])[self._p::self._n]
        return {"inputs": w[:, :-1], "targets": w[:, 1:]}


class Stream:
    """A streaming source opened for a run: its shards, train pieces and validation ids."""

    def __init__(self, path: str, data_cfg, tokenizer, label: str = "data.sources[0]"):
        files = list_shards(path, label)
        if not files:
            raise UserError(f"{label} {path!r} holds no .parquet or .arrow file; point it at a "
                            "folder of shards or prepare text with python -m boost_jax.data.prepare")
        self.shards, self.tokenizer = Shards(files, label), tokenizer
        n = self.shards.n_docs
        n_val = max(1, int(round(n * data_cfg.val_fraction)))
        if n - n_val < 1:
            raise UserError(f"{label} {path!r} holds {counted(n, 'document')}, too few to "
                            "split into train and validation; add documents")
        self.n_train_docs, self.label = n - n_val, label
        self.pieces = _pieces(self.shards, 0, n - n_val)
        self.val = self._val_ids(n - n_val, n)

    def _val_ids(self, first: int, last: int) -> np.ndarray:
        """The validation documents' first VAL_TOKENS ids, in file order."""
        parts, have = [], 0
        for piece in _pieces(self.shards, first, last):
            parts.append(encode(self.tokenizer, self.shards.texts(*piece)))
            have += len(parts[-1])
            if have >= VAL_TOKENS:
                break
        return np.concatenate(parts)[:VAL_TOKENS]

    def iterator(self, seq_len: int, global_batch: int, seed: int, workers: int,
                 process_index: int = 0, process_count: int = 1) -> StreamIterator:
        tokenize = _Tokenize(self.shards, self.tokenizer)
        return StreamIterator(self.pieces, tokenize, seq_len, global_batch, seed, workers,
                              process_index, process_count)
