"""Tokenizers: raw UTF-8 bytes (default), a Hugging Face tokenizer.json, or a BPE trained here.

Every tokenizer maps text to int32 ids and has an `eos_id` that separates documents in the
packed token stream. `encode_documents` joins a list of documents with EOS in one call so the
default byte path is a single `np.frombuffer` (8 MB in milliseconds, no Python loop).
"""

from __future__ import annotations

import os
import tempfile
from typing import Callable, Iterable, Optional, Protocol, Sequence, runtime_checkable

import numpy as np

from boost_jax.errors import UserError
from boost_jax.names import TOKENIZER_DIR
from boost_jax.safe_write import file_mode

TOKENIZER_FILE = "tokenizer.json"


def tokenizer_file(tokenizer: str, out_dir: str) -> Optional[str]:
    """The tokenizer file a run of `data.tokenizer` reads: that path, or the BPE the run trains
    in out_dir/tokenizer/; None for bytes."""
    if tokenizer == "byte":
        return None
    return os.path.join(out_dir, TOKENIZER_DIR, TOKENIZER_FILE) if tokenizer == "bpe" else \
        tokenizer
BPE_MIN_VOCAB = 512  # 256 bytes + EOS leave no merges below ~257; 512 is a useful minimum
BPE_MAX_VOCAB = 2**22  # 4M: 16x the largest public BPE vocabularies
BPE_EOS = "<|endoftext|>"
# Special tokens we accept as a user tokenizer's end-of-document marker, in preference order.
_EOS_NAMES = (BPE_EOS, "<|end_of_text|>", "</s>", "<eos>", "<|eos|>", "[SEP]", "<|im_end|>")


@runtime_checkable
class Tokenizer(Protocol):
    vocab_size: int
    eos_id: int

    def encode(self, text: str) -> np.ndarray: ...  # int32 [n]

    def decode(self, ids: Sequence[int] | np.ndarray) -> str: ...

    def encode_documents(self, docs: Sequence[str]) -> np.ndarray: ...  # docs joined by EOS

    def byte_lengths(self) -> Optional[np.ndarray]: ...  # UTF-8 bytes per id, if ids alone have


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255, nothing to download.

    EOS is byte 0x00 (NUL): it fits in the 256-entry vocabulary and never occurs in real text
    files, so documents can be joined with it before one vectorised encode. A NUL inside a
    document would read as a document break, which is harmless. `decode` drops EOS.
    """

    vocab_size = 256
    eos_id = 0
    name = "byte"
    fingerprint = "byte"  # what a prepared .bin records to tell tokenizers apart

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32)

    def decode(self, ids) -> str:
        arr = np.asarray(ids).astype(np.int64)
        if arr.size and (arr.min() < 0 or arr.max() > 255):
            raise ValueError("byte tokenizer ids must be in 0..255")
        arr = arr[arr != self.eos_id].astype(np.uint8)
        return arr.tobytes().decode("utf-8", errors="replace")

    def encode_documents(self, docs: Sequence[str]) -> np.ndarray:
        return self.encode("\x00".join(docs))

    def byte_lengths(self) -> np.ndarray:
        """One byte per id but EOS, which decodes to none."""
        out = np.ones(self.vocab_size, np.int64)
        out[self.eos_id] = 0
        return out


class HFTokenizer:
    """A Hugging Face `tokenizers` tokenizer.json.

    EOS is the first special token found among common end-of-text names; a tokenizer with none
    gets `<|endoftext|>` added in memory (the vocabulary grows by one).
    """

    def __init__(self, tok, name: str = "hf"):
        self._tok = tok
        self.name = name
        eos = next((t for t in _EOS_NAMES if tok.token_to_id(t) is not None), None)
        if eos is None:
            tok.add_special_tokens([BPE_EOS])
            eos = BPE_EOS
        self.eos_id = int(tok.token_to_id(eos))
        # ids need not be contiguous (a WordLevel file may number them freely): the model's
        # embedding needs a row for the largest, not one per token
        ids = tok.get_vocab(with_added_tokens=True).values()
        self.vocab_size = max(int(tok.get_vocab_size(with_added_tokens=True)),
                              max(ids, default=-1) + 1)
        self._byte_lengths = None

    @property
    def fingerprint(self) -> str:
        """sha256 of the tokenizer's canonical JSON: equal exactly when the id mapping is."""
        import hashlib

        return "sha256:" + hashlib.sha256(self._tok.to_str().encode("utf-8")).hexdigest()

    def byte_lengths(self) -> Optional[np.ndarray]:
        """UTF-8 bytes each id decodes to, for a byte-level BPE (each character of a token
        stands for one byte; special tokens decode to none); None for other decoders, whose
        ids need not decode alone to whole characters."""
        import json

        if self._byte_lengths is None:  # False: not byte-level (asked once)
            decoder = json.loads(self._tok.to_str()).get("decoder") or {}
            self._byte_lengths = False
            if decoder.get("type") == "ByteLevel":
                added = self._tok.get_added_tokens_decoder()
                self._byte_lengths = np.array(
                    [(0 if added[i].special else len(added[i].content.encode("utf-8")))
                     if i in added else len(self._tok.id_to_token(i) or "")
                     for i in range(self.vocab_size)], np.int64)
        return None if self._byte_lengths is False else self._byte_lengths

    @classmethod
    def from_file(cls, path: str, setting: str = "data.tokenizer") -> "HFTokenizer":
        """`setting`: what the user typed the path into, named by the errors."""
        from tokenizers import Tokenizer as _HF

        from boost_jax.file_kind import check_input

        check_input(path, "tokenizer file")
        if not os.path.isfile(path):
            what = "is a folder, not a file" if os.path.isdir(path) else "does not exist"
            raise UserError(
                f"tokenizer file {path!r} {what}; set {setting} to byte, bpe, "
                "or an existing tokenizer.json")
        try:
            tok = _HF.from_file(path)
        except Exception as e:  # tokenizers raises a bare Exception on bad JSON / schema
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise UserError(
                f"tokenizer file {path!r} is not a valid tokenizer.json: {first}; "
                f"point {setting} at a Hugging Face tokenizer.json or use byte/bpe") from None
        return cls(tok, name=path)

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._tok.encode(text, add_special_tokens=False).ids, dtype=np.int32)

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in np.asarray(ids).reshape(-1)],
                                skip_special_tokens=True)

    def encode_documents(self, docs: Sequence[str]) -> np.ndarray:
        if not docs:
            return np.zeros((0,), np.int32)
        # encode_batch runs in parallel in Rust; one EOS after every document but the last.
        encs = self._tok.encode_batch(list(docs), add_special_tokens=False)
        parts = []
        eos = np.array([self.eos_id], np.int32)
        for i, e in enumerate(encs):
            if i:
                parts.append(eos)
            parts.append(np.asarray(e.ids, dtype=np.int32))
        return np.concatenate(parts)


def check_bpe_vocab_size(vocab_size: int, option: str = "data.bpe_vocab_size=") -> None:
    """`option`: how the user gave the size (the config key, or prepare's flag)."""
    if vocab_size < BPE_MIN_VOCAB:
        raise UserError(
            f"{option}{vocab_size} is too small for a byte-level BPE (256 bytes + EOS "
            f"+ merges); use at least {BPE_MIN_VOCAB}")
    if vocab_size > BPE_MAX_VOCAB:  # the trainer allocates per entry: far larger aborts it
        raise UserError(f"{option}{vocab_size} is above {BPE_MAX_VOCAB:,} tokens, more than "
                        f"any corpus gives merges for; use at most {BPE_MAX_VOCAB}")


BPE_MAX_WORD = 256  # bytes: no token is longer


def train_bpe(texts: Iterable[str], vocab_size: int, save_path: Optional[str] = None) -> HFTokenizer:
    """Train a byte-level BPE (GPT-2 style) on `texts`; EOS `<|endoftext|>` is id 0.

    The trainer is deterministic for a given corpus, so separate processes that each train
    produce the same file. If `save_path` is given the JSON is written atomically.
    """
    from tokenizers import Regex
    from tokenizers import Tokenizer as _HF
    from tokenizers import decoders, models, pre_tokenizers, trainers

    check_bpe_vocab_size(vocab_size)
    tok = _HF(models.BPE())
    # words are cut into pieces of at most BPE_MAX_WORD bytes (one character each after the
    # byte-level mapping): the trainer's time grows with the square of the longest word, and
    # one long line of CJK or minified text ran for minutes, deaf to Ctrl-C
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.ByteLevel(add_prefix_space=False),
        pre_tokenizers.Split(Regex(f".{{1,{BPE_MAX_WORD}}}"), behavior="isolated")])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[BPE_EOS], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    if save_path is not None:
        d = os.path.dirname(os.path.abspath(save_path))
        os.makedirs(d, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".tokenizer.", suffix=".json", dir=d)
        os.close(fd)
        tok.save(tmp)
        os.chmod(tmp, file_mode())  # mkstemp's 0600: the mode a new file gets under the umask
        os.replace(tmp, save_path)  # atomic: concurrent processes never see a half file
    return HFTokenizer(tok, name="bpe")


def get_tokenizer(data_cfg, corpus_texts_fn: Callable[[], Iterable[str]],
                  cache_dir: Optional[str]) -> Tokenizer:
    """`data.tokenizer`: byte | bpe | path/to/tokenizer.json.

    For `bpe`, a tokenizer.json in `cache_dir` is reused when it was trained on this corpus with
    these settings, or when the run's checkpoints use it (resumed runs must see the same ids);
    otherwise one is trained on `corpus_texts_fn()` and saved there (see bpe_cache.py).
    """
    kind = data_cfg.tokenizer
    if kind == "byte":
        return ByteTokenizer()
    if kind == "bpe":
        if not cache_dir:
            return train_bpe(corpus_texts_fn(), data_cfg.bpe_vocab_size)
        from boost_jax.data.bpe_cache import cached_bpe

        return cached_bpe(data_cfg, corpus_texts_fn, os.path.join(cache_dir, TOKENIZER_FILE),
                          _load_bpe, train_bpe)
    return HFTokenizer.from_file(kind)


def _load_bpe(path: str) -> HFTokenizer:
    tok = HFTokenizer.from_file(path)
    tok.name = "bpe"
    return tok
