"""Corpus readers and the deterministic train/validation split.

`data.source` is one of:
  stdlib          the Python standard library's own *.py files (no download; the default)
  path/file.jsonl one document per line, from its string "text" field
  path/file.bin   pre-tokenized ids, np.memmap with data.bin_dtype (read lazily, zero copy;
                  checked against the metadata `prepare` writes next to it: token_bin.py)
  path/file       any other file: UTF-8 text, cut into line-aligned chunks (<= 16 KiB) as
                  documents
  path/dir        every .txt/.py/.md/.jsonl file below it, recursively

Text sources are read in sorted order and `data.max_bytes` caps the UTF-8 bytes kept (the
last document is truncated), so the corpus is a pure function of the files. Documents go to
validation when a hash of their key (relative path, line or chunk index) falls below
val_fraction: independent of the seed and of how many other documents exist. Tokenized arrays
are cached in this process's memory only.

Cluster jobs refuse stdlib, the demo corpus (a few million tokens a multi-node run would read
hundreds of times over): `plan --emit-config` and `launch slurm` call `refuse_demo_corpus`;
`--allow-demo-data` lifts it (a smoke test of the cluster) and the `cpu` topology is exempt.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import sysconfig
from dataclasses import dataclass
from typing import Optional

import numpy as np

from boost_jax.data.token_bin import open_bin
from boost_jax.data.tokenizers import Tokenizer, get_tokenizer
from boost_jax.errors import UserError, counted, lone_surrogate

TEXT_EXTS = (".txt", ".py", ".md", ".jsonl")
_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
# A single text file has no documents of its own: cut it into ~1/32 of its size, clamped to
# 512 B..16 KiB, so even a small file yields enough pieces to split.
_FILE_CHUNK = (512, 16 * 1024)


@dataclass
class Corpus:
    train: np.ndarray  # int32 ids (or the .bin memmap's dtype), documents joined by EOS
    val: np.ndarray
    tokenizer: Tokenizer
    n_train_docs: int
    n_val_docs: int


_CACHE: dict = {}  # in-memory only: repeated build_data calls in one process skip re-tokenising


def _check_exists(source: str, key: str = "data.source") -> None:
    from boost_jax.file_kind import check_input

    check_input(source, key)
    if not os.path.exists(source):
        stdlib = "stdlib, " if key == "data.source" else ""
        raise UserError(
            f"{key} {source!r} does not exist; use {stdlib}a text/.jsonl/.bin file "
            "or a folder of text files")


class _Budget:
    """Remaining byte allowance under data.max_bytes (None: unlimited)."""

    def __init__(self, max_bytes: Optional[int]):
        self.left = max_bytes

    def take(self, raw: bytes) -> Optional[bytes]:
        if self.left is None:
            return raw
        if self.left <= 0:
            return None
        raw = raw[: self.left]
        self.left -= len(raw)
        return raw

    @property
    def done(self) -> bool:
        return self.left is not None and self.left <= 0


def _decode(raw: bytes) -> str:
    # errors="replace": a cut multi-byte character or stray Latin-1 byte must not abort a run
    return raw.decode("utf-8", errors="replace")


_SNIFF = 64 * 1024  # bytes of a file checked for being text at a time
_MAX_BAD_UTF8 = 0.1  # a Latin-1 text has a few percent; binaries have NULs or far more


def _check_text(raw: bytes, label: str, offset: int = 0) -> None:
    """Refuse a binary file (an executable, an archive, an image renamed .txt), or one that turns
    binary further in: decoded with errors="replace" it would train silently on replacement
    characters. Every 64 KiB window of `raw` (at `offset` in its file) is checked."""
    why = None
    for start in range(0, len(raw), _SNIFF):
        window = raw[start:start + _SNIFF]
        at = "" if start + offset == 0 else f" at byte {start + offset:,}"
        if b"\x00" in window:
            why = f"it holds NUL bytes{at}"
        else:
            bad = window.decode("utf-8", errors="replace").count("\ufffd")
            if bad > _MAX_BAD_UTF8 * len(window):
                first = "first " if not at else ""
                why = (f"{bad / len(window):.0%} of its {first}{len(window) // 1024 or 1} KiB"
                       f"{at} is not UTF-8")
        if why:
            key = label.split(" ", 1)[0]  # the option or key the path came from
            raise UserError(f"{label} is not text ({why}); point {key} at UTF-8 text, or at a "
                            ".bin file of token ids")


@contextlib.contextmanager
def reading(path: str):
    """A source file opened for bytes: failing to open or read it (a dangling link, a disk
    error) is one line naming that file, not the output or a traceback."""
    try:
        with open(path, "rb") as f:
            yield f
    except OSError as e:
        raise UserError(f"reading {path!r} failed ({e.strerror or e}); fix it or move it out "
                        "of the corpus") from None


def _walk(root: str, exts: tuple[str, ...], skip: set[str]) -> list[str]:
    """Relative posix paths of files under root with one of exts, in sorted order."""
    top = os.path.realpath(root)
    out, seen = [], {top}
    for dirpath, dirnames, filenames in os.walk(root, followlinks=True):
        keep = []  # a link to a folder outside root is read, once; one inside is read by its name
        for d in sorted(d for d in dirnames if d not in skip and not d.startswith(".")):
            full = os.path.join(dirpath, d)
            real = os.path.realpath(full)
            if os.path.islink(full) and (real in seen or real.startswith(top + os.sep)):
                continue
            seen.add(real)
            keep.append(d)
        dirnames[:] = keep
        for f in sorted(filenames):
            if f.endswith(exts):
                full = os.path.join(dirpath, f)
                rel = os.path.relpath(full, root).replace(os.sep, "/")
                if lone_surrogate(rel) is not None and f.endswith((".parquet", ".arrow")):
                    raise UserError(f"folder {root!r} holds {rel!r}, a name that is not UTF-8, "
                                    "which pyarrow cannot open; rename it in UTF-8")
                if not os.path.exists(full):
                    raise UserError(f"folder {root!r} holds {rel!r}, a link to "
                                    f"{os.readlink(full)!r}, which does not exist; fix the link "
                                    "or remove it")
                out.append(rel)
    return sorted(out)


def _jsonl_docs(path: str, key: str, budget: _Budget, label: str) -> list[tuple[str, str]]:
    docs = []
    with reading(path) as f:
        for i, line in enumerate(f):
            if budget.done:
                break
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except ValueError as e:
                raise UserError(f"{label} line {i + 1} is not valid JSON ({e}); fix or remove it") from None
            except RecursionError:
                raise UserError(f"{label} line {i + 1} nests too deeply to be a document; fix or "
                                "remove it") from None
            text = obj.get("text") if isinstance(obj, dict) else None
            if not isinstance(text, str):
                raise UserError(
                    f"{label} line {i + 1} has no string \"text\" field; each line must look like "
                    '{"text": "..."}')
            bad = lone_surrogate(text)
            if bad is not None:  # a JSON escape such as \ud800 that no character completes
                raise UserError(f"{label} line {i + 1} holds a lone surrogate ({bad}), which is "
                                "not text; fix or remove that line")
            raw = budget.take(text.encode("utf-8"))
            if raw:
                docs.append((f"{key}:{i}", _decode(raw)))
    return docs


def _file_docs(path: str, key: str, budget: _Budget, label: str,
               chunked: bool = True) -> list[tuple[str, str]]:
    with reading(path) as f:
        raw = f.read() if budget.left is None else f.read(max(budget.left, 0))
    raw = budget.take(raw) or b""
    _check_text(raw, label)
    if not chunked:
        return [(key, _decode(raw))] if raw else []
    docs, start, i = [], 0, 0
    chunk = min(max(len(raw) // 32, _FILE_CHUNK[0]), _FILE_CHUNK[1])
    while start < len(raw):
        end = min(start + chunk, len(raw))
        if end < len(raw):  # end chunks on a line break when there is one
            nl = raw.rfind(b"\n", start, end)
            end = nl + 1 if nl > start else end
        docs.append((f"{key}#{i}", _decode(raw[start:end])))
        start, i = end, i + 1
    return docs


def read_documents(source: str, max_bytes: Optional[int], option: str = "data.source",
                   chunked: bool = True) -> list[tuple[str, str]]:
    """(key, text) pairs of a text source, in deterministic order, capped at max_bytes; errors
    name the source as `option` (the config key or flag it came from). A single text file is
    cut into chunks for training (`chunked`), or kept one document (scoring it whole)."""
    budget = _Budget(max_bytes)
    if source == "stdlib":
        root = sysconfig.get_paths()["stdlib"]
        keys = _walk(root, (".py",), _SKIP_DIRS)
        files = [os.path.join(root, k) for k in keys]
    else:
        _check_exists(source, option)
        if os.path.isfile(source):
            name = os.path.basename(source)
            if source.endswith(".jsonl"):
                return _jsonl_docs(source, name, budget, f"{option} {source!r}")
            return _file_docs(source, name, budget, f"{option} {source!r}", chunked)
        found = _walk(source, TEXT_EXTS + (".parquet", ".arrow"), {"__pycache__"})  # one walk
        rels = [r for r in found if r.endswith(TEXT_EXTS)]
        if len(rels) < len(found):  # shards: its text is a dataset card
            raise UserError(
                f"{option} {source!r} holds parquet/arrow shards, which {option} does not read; "
                f"stream them with data.sources=[{{path: {source}, weight: 1}}] or prepare "
                "them with python -m boost_jax.data.prepare")
        if not rels:
            raise UserError(
                f"{option} {source!r} contains no {'/'.join(TEXT_EXTS)} files; "
                "point it at a folder of text files or a single file")
        files, keys = [os.path.join(source, r) for r in rels], rels
    docs = []
    from boost_jax.file_kind import check_input

    for path, key in zip(files, keys):
        if budget.done:
            break
        check_input(path, f"{option} file")
        if path.endswith(".jsonl"):
            docs += _jsonl_docs(path, key, budget, f"{option} file {path!r}")
            continue
        with reading(path) as f:
            raw = budget.take(f.read() if budget.left is None else f.read(budget.left))
        if raw and raw.strip():
            _check_text(raw, f"{option} file {path!r}")
            docs.append((key, _decode(raw)))
    return docs


def in_val(key: str, val_fraction: float) -> bool:
    """Stable per-document assignment: blake2b of the key, as a fraction of 2**64."""
    h = int.from_bytes(hashlib.blake2b(key.encode("utf-8", "surrogateescape"),  # a name's bytes
                                       digest_size=8).digest(), "little")
    return h / 2.0**64 < val_fraction


def split_documents(docs: list[tuple[str, str]], val_fraction: float):
    """(train_docs, val_docs); with >= 2 documents neither side is left empty."""
    flags = [in_val(k, val_fraction) for k, _ in docs]
    if len(docs) >= 2 and not any(flags):
        flags[0] = True  # too few documents for the hash to pick one: the first goes to val
    if len(docs) >= 2 and all(flags):
        flags[0] = False
    train = [d for d, v in zip(docs, flags) if not v]
    val = [d for d, v in zip(docs, flags) if v]
    return train, val


def _load_bin(data_cfg, tokenizer: Tokenizer):
    """Pre-tokenized ids, memory-mapped (token_bin.py); validation is the contiguous tail (no
    document boundaries to hash)."""
    cap = None
    if data_cfg.max_bytes is not None:
        cap = data_cfg.max_bytes // np.dtype(data_cfg.bin_dtype).itemsize
    arr = open_bin(data_cfg.source, data_cfg, tokenizer, max_tokens=cap)
    n = len(arr)
    n_val = max(1, int(round(n * data_cfg.val_fraction)))
    return arr[: n - n_val], arr[n - n_val:]


def _stamp(source: str) -> Optional[tuple]:
    """What the cache of load_corpus checks for changes: the size and mtime of the source file,
    or of each text file under a source folder (a folder's own mtime misses edits in place)."""
    if source == "stdlib":
        return None
    paths = [source]
    if os.path.isdir(source):
        paths = [os.path.join(source, r) for r in _walk(source, TEXT_EXTS, {"__pycache__"})]
    stats = [os.stat(p) for p in paths]
    return (os.path.abspath(source),) + tuple((p, st.st_mtime_ns, st.st_size)
                                              for p, st in zip(paths, stats))


def load_corpus(data_cfg, cache_dir: Optional[str] = None) -> Corpus:
    """Read, split and tokenize `data.source`; see the module docstring."""
    source = data_cfg.source
    if source != "stdlib":
        _check_exists(source)
    key = (source, _stamp(source), data_cfg.tokenizer, data_cfg.bpe_vocab_size, data_cfg.max_bytes,
           data_cfg.val_fraction, data_cfg.bin_dtype, os.path.abspath(cache_dir or ""))
    if key in _CACHE:
        return _CACHE[key]

    if os.path.isfile(source) and source.endswith(".bin"):
        if data_cfg.tokenizer == "bpe":
            raise UserError(
                f"data.source {source!r} is pre-tokenized, so data.tokenizer=bpe cannot be trained "
                "on it; set data.tokenizer to the tokenizer.json it was made with (or byte)")
        tok = get_tokenizer(data_cfg, list, cache_dir)
        train, val = _load_bin(data_cfg, tok)
        corpus = Corpus(train, val, tok, 1, 1)
    else:
        docs = read_documents(source, data_cfg.max_bytes)
        if not docs:
            raise UserError(f"data.source {source!r} holds no text; point it at a non-empty corpus")
        train_docs, val_docs = split_documents(docs, data_cfg.val_fraction)
        if not val_docs or not train_docs:
            raise UserError(
                f"data.source {source!r} has a single document, too few to split into train and "
                "validation; add documents or use a larger text file")
        train_texts = [t for _, t in train_docs]
        tok = get_tokenizer(data_cfg, lambda: train_texts, cache_dir)  # BPE sees train only
        corpus = Corpus(tok.encode_documents(train_texts),
                        tok.encode_documents([t for _, t in val_docs]), tok,
                        len(train_docs), len(val_docs))
    _CACHE[key] = corpus
    return corpus


# --------------------------------------------------------------------------- the demo corpus

ALLOW_DEMO = "--allow-demo-data"


def demo_tokens(data_cfg) -> int:
    """Training tokens of the demo corpus under this config (its cap and tokenizer)."""
    return int(len(load_corpus(data_cfg).train))


def on_demo_corpus(cfg, nodes: int, topology: str) -> bool:
    """A cluster run (several nodes of a real topology) that would train on the demo corpus."""
    d = cfg.data
    return not d.sources and d.source == "stdlib" and nodes > 1 and topology != "cpu"


def refuse_demo_corpus(cfg, nodes: int, topology: str, allow: bool) -> None:
    """One line naming data.source(s) and the epochs the run would make of the demo corpus."""
    d, t = cfg.data, cfg.train
    if allow or not on_demo_corpus(cfg, nodes, topology):
        return
    tokens = demo_tokens(d)
    epochs = t.steps * t.global_batch * d.seq_len / tokens
    raise UserError(
        f"data.source=stdlib is the embedded demo corpus ({tokens / 1e6:.1f} M training "
        f"tokens): {counted(t.steps, 'step')} x {t.global_batch} sequences x {d.seq_len} "
        f"tokens on {counted(nodes, 'node')} would make "
        f"{epochs:,.{0 if epochs >= 10 else 1}f} epochs of it; prepare a corpus "
        "(python -m boost_jax.data.prepare) and set data.sources=[{path: corpus.bin, weight: "
        f"1}}] (or data.source=corpus.bin), or pass {ALLOW_DEMO} to run on it anyway")
