"""Tokenize a corpus ahead of time: python -m boost_jax.data.prepare SOURCE OUT --tokenizer T

SOURCE is a text file, a .jsonl (one document per line, in field --field), a .parquet file, a
Hugging Face dataset saved with `save_to_disk` (a folder holding dataset_info.json and .arrow
files), or a folder of such files (searched recursively, in sorted order). OUT receives the
token ids (a .bin that training memory-maps) and `<OUT without .bin>.json`, its metadata
(token_bin.py). Every document is followed by the tokenizer's EOS id; a plain text file is one
document.

Streaming with bounded memory: the main process reads the source in pieces (a text file in
pieces of about PIECE bytes cut after a line break) and hands tasks of about TASK bytes to
--workers processes, each holding its own tokenizer; at most 2 x workers tasks are in flight
and their ids are appended to OUT in order as they come back. Memory therefore depends on the
worker count, never on the corpus size. OUT and its metadata are written as temp files in
OUT's folder and published when complete, metadata first (boost_jax/safe_write.py): OUT is never
half-written, never without its metadata, and an existing OUT or metadata file is replaced only
with --force (never when it is SOURCE or the tokenizer). Two prepares of one OUT: the second
stops at once.
"""

from __future__ import annotations

import errno
import json
import multiprocessing
import os
import sys
import time
from collections import deque
from concurrent.futures import ProcessPoolExecutor
from typing import Iterator

import numpy as np

from boost_jax.cli import Parser
from boost_jax.data.token_bin import FORMAT, meta_path
from boost_jax.errors import UserError, cli_main
from boost_jax.plain_text import lone_surrogate

PIECE = 1 << 20  # bytes of a text file read at a time
TASK = 1 << 20  # bytes of text per worker task (with the window below, bounds memory)
EXTS = (".txt", ".md", ".py", ".jsonl", ".parquet", ".arrow")


# --------------------------------------------------------------------------- reading (main)


def _check_text_head(path: str) -> None:
    from boost_jax.data.sources import _SNIFF, _check_text

    with open(path, "rb") as f:
        _check_text(f.read(_SNIFF), f"SOURCE file {path!r}")


def _char_boundary(buf: bytes) -> int:
    """Length of the longest prefix of buf ending on a UTF-8 character boundary (for a piece
    with no line break in it)."""
    j = len(buf)
    while j > 0 and len(buf) - j < 3 and (buf[j - 1] & 0xC0) == 0x80:  # continuation bytes
        j -= 1
    if j > 0 and buf[j - 1] >= 0xC0:  # a lead byte: is its character complete?
        need = 2 if buf[j - 1] < 0xE0 else 3 if buf[j - 1] < 0xF0 else 4
        if len(buf) - (j - 1) < need:
            return j - 1
    return len(buf)


def _text_file(path: str) -> Iterator[tuple]:
    """('text', piece, is_last_piece_of_the_document, bytes read)."""
    _check_text_head(path)
    carry = b""
    with open(path, "rb") as f:
        while raw := f.read(PIECE):
            buf = carry + raw
            cut = buf.rfind(b"\n") + 1 or _char_boundary(buf)
            carry = buf[cut:]
            yield "text", buf[:cut], False, len(raw)
    yield "text", carry, True, 0


def _jsonl_file(path: str) -> Iterator[tuple]:
    """('jsonl', raw line, line number, bytes): the workers parse the JSON."""
    with open(path, "rb") as f:
        for i, line in enumerate(f):
            yield "jsonl", line, (path, i + 1), len(line)


def _arrow_batches(path: str, field: str):
    import pyarrow as pa

    if path.endswith(".parquet"):
        import pyarrow.parquet as pq

        pf = pq.ParquetFile(path)
        return pf.metadata.num_rows, pf.schema_arrow.names, pf.iter_batches(columns=[field])
    try:
        reader = pa.ipc.open_stream(path)  # what datasets' save_to_disk writes
    except pa.ArrowInvalid:
        reader = pa.ipc.open_file(path)
        batches = (reader.get_batch(i) for i in range(reader.num_record_batches))
        return reader.count_rows(), reader.schema.names, batches
    return None, reader.schema.names, iter(reader)


def _table_file(path: str, field: str) -> Iterator[tuple]:
    """('doc', text, None, bytes): parquet / arrow rows, one document each."""
    try:
        import pyarrow  # noqa: F401
    except ImportError:
        raise UserError(f"reading {path!r} needs pyarrow; pip install pyarrow "
                        "(or pip install 'boost_jax[corpora]')") from None
    rows, names, batches = _arrow_batches(path, field)
    if field not in names:
        raise UserError(f"{path!r} has no column {field!r} (columns: {names}); pass --field")
    size = os.path.getsize(path)
    for batch in batches:
        col = batch.column(batch.schema.get_field_index(field)).to_pylist()
        per = size * len(col) // rows if rows else 0
        for j, text in enumerate(col):
            yield "doc", text if isinstance(text, str) else "", None, per if j == 0 else 0


def source_files(source: str) -> list[str]:
    if not os.path.exists(source):
        raise UserError(f"SOURCE {source!r} does not exist; pass a text/.jsonl/.parquet file, a "
                        "saved Hugging Face dataset or a folder of them")
    if os.path.isfile(source):
        return [source]
    if os.path.exists(os.path.join(source, "dataset_dict.json")):
        raise UserError(f"{source!r} is a Hugging Face DatasetDict; pass one split, e.g. "
                        f"{os.path.join(source, 'train')}")
    from boost_jax.data.sources import _walk

    files = [os.path.join(source, r) for r in _walk(source, EXTS, {"__pycache__"})]
    if not files:
        raise UserError(f"SOURCE {source!r} contains no {'/'.join(EXTS)} files")
    return files


def read_items(files: list[str], field: str) -> Iterator[tuple]:
    for path in files:
        if path.endswith(".jsonl"):
            yield from _jsonl_file(path)
        elif path.endswith((".parquet", ".arrow")):
            yield from _table_file(path, field)
        else:
            yield from _text_file(path)


def check_has_text(source: str, field: str) -> None:
    """Refuse a SOURCE without a document holding text (read up to the first one: a real
    corpus's first item), instead of writing an empty token file."""
    for item in read_items(source_files(source), field):
        kind, payload = item[0], item[1]
        if kind == "jsonl":
            payload = _documents([item], field)[0][0] if payload.strip() else ""
        if payload.strip():
            return
    raise UserError(f"SOURCE {source!r} holds no text; point it at a non-empty corpus")


def tasks(items: Iterator[tuple], size: int = TASK) -> Iterator[list]:
    task, n = [], 0
    for item in items:
        task.append(item)
        n += len(item[1])
        if n >= size:
            yield task
            task, n = [], 0
    if task:
        yield task


# --------------------------------------------------------------------------- tokenizing (workers)


def load_tokenizer(spec: str):
    from boost_jax.data.tokenizers import ByteTokenizer, HFTokenizer

    if spec == "byte":
        return ByteTokenizer()
    if spec == "bpe":
        raise UserError("--tokenizer bpe would need a BPE trained on the corpus first; train a "
                        "run with data.tokenizer=bpe and pass its out_dir/tokenizer/"
                        "tokenizer.json, or pass any tokenizer.json (or byte)")
    return HFTokenizer.from_file(spec)


_WORKER: dict = {}


def _init_worker(spec: str, field: str, dtype: str) -> None:
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # the worker count is the parallelism
    _WORKER.update(tok=load_tokenizer(spec), field=field, dtype=np.dtype(dtype))


def _documents(task: list, field: str) -> list[tuple[str, bool]]:
    """(text, ends a document) for each item of a task."""
    out = []
    for kind, payload, extra, _ in task:
        if kind == "text":
            out.append((payload.decode("utf-8", errors="replace"), extra))
        elif kind == "doc":
            out.append((payload, True))
        elif payload.strip():  # jsonl; blank lines are skipped as in training
            path, line = extra
            try:
                obj = json.loads(payload)
            except ValueError as e:
                raise UserError(f"{path!r} line {line} is not valid JSON ({e}); fix or remove "
                                "it") from None
            text = obj.get(field) if isinstance(obj, dict) else None
            if not isinstance(text, str):
                raise UserError(f"{path!r} line {line} has no string {field!r} field; pass "
                                "--field NAME of the text field")
            bad = lone_surrogate(text)
            if bad is not None:  # a JSON escape such as \ud800 that no character completes
                raise UserError(f"{path!r} line {line} holds a lone surrogate ({bad}), which is "
                                "not text; fix or remove that line")
            out.append((text, True))
    return out


def encode_task(task: list) -> tuple[np.ndarray, int, int, int]:
    """(ids in the output dtype, documents ended, largest id, source bytes consumed)."""
    tok, dtype = _WORKER["tok"], _WORKER["dtype"]
    docs = _documents(task, _WORKER["field"])
    texts = [t for t, _ in docs]
    if hasattr(tok, "_tok"):  # a Hugging Face tokenizer: one batched call
        encs = tok._tok.encode_batch(texts, add_special_tokens=False) if texts else []
        seqs = [np.asarray(e.ids, np.int32) for e in encs]
    else:
        seqs = [tok.encode(t) for t in texts]
    eos = np.array([tok.eos_id], np.int32)
    parts = []
    for ids, (_, end) in zip(seqs, docs):
        parts += [ids, eos] if end else [ids]
    ids = np.concatenate(parts) if parts else np.zeros((0,), np.int32)
    top = int(ids.max()) if ids.size else -1
    return ids.astype(dtype), sum(end for _, end in docs), top, sum(x[3] for x in task)


# --------------------------------------------------------------------------- the command


def _progress(total: int, enabled: bool):
    from rich.console import Console
    from rich.progress import (BarColumn, DownloadColumn, Progress, TextColumn,
                               TimeRemainingColumn)

    cols = [TextColumn("tokenizing"), BarColumn(), DownloadColumn(), TextColumn(
        "{task.fields[tokens]:,} tokens {task.fields[rate]}"), TimeRemainingColumn()]
    return Progress(*cols, transient=True, disable=not enabled, console=Console(stderr=True))


def _check_targets(source: str, out: str, spec: str, force: bool) -> None:
    """safe_write's rule for OUT and its metadata: never one of the inputs (even with --force),
    never an existing file without --force."""
    from boost_jax.safe_write import refuse_existing, refuse_inputs

    inputs = {"SOURCE": source, "--tokenizer": None if spec in ("byte", "bpe") else spec}
    meta = meta_path(out)
    fix = "choose another OUT (its metadata goes to <OUT without .bin>.json)"
    refuse_inputs(out, inputs, f"OUT {out!r}", fix)
    refuse_inputs(meta, inputs, f"the metadata file {meta!r} of OUT", fix)
    refuse_existing([out, meta], force, "choose another OUT")


def _tokenize(files, field, spec, dtype, workers, progress, task_bytes, total, f) -> tuple:
    """Write the ids of `files` to the binary file `f`: (tokens, documents, largest id)."""
    n_tokens = n_docs = 0
    top = -1
    t0 = time.perf_counter()
    ctx = multiprocessing.get_context("spawn")  # safe whatever the caller has imported
    with _progress(total, progress) as bar, ProcessPoolExecutor(
            workers, ctx, initializer=_init_worker, initargs=(spec, field, dtype)) as pool:
        task_id = bar.add_task("", total=total, tokens=0, rate="")
        pending: deque = deque()

        def collect():
            nonlocal n_tokens, n_docs, top
            ids, docs, high, consumed = pending.popleft().result()
            f.write(ids.tobytes())
            n_tokens, n_docs, top = n_tokens + len(ids), n_docs + docs, max(top, high)
            rate = f"({n_tokens / (time.perf_counter() - t0):,.0f}/s)"
            bar.update(task_id, advance=consumed, tokens=n_tokens, rate=rate)

        for task in tasks(read_items(files, field), task_bytes):
            pending.append(pool.submit(encode_task, task))
            if len(pending) >= 2 * workers:
                collect()
        while pending:
            collect()
    return n_tokens, n_docs, top


def prepare(source: str, out: str, spec: str, workers: int = 1, field: str = "text",
            force: bool = False, progress: bool = True, task_bytes: int = TASK) -> dict:
    """Tokenize `source` into `out` (+ metadata); returns the metadata. Both files are written
    as temp files and published together, metadata first (boost_jax/safe_write.py)."""
    from boost_jax.safe_write import Staged, exclusive, publish

    files = source_files(source)
    _check_targets(source, out, spec, force)
    tok = load_tokenizer(spec)
    dtype = "uint16" if tok.vocab_size <= 1 << 16 else "uint32"
    total = sum(os.path.getsize(f) for f in files)
    t0 = time.perf_counter()
    try:
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        with exclusive([out, meta_path(out)], f"OUT {out!r}", "choose another OUT"):
            _check_targets(source, out, spec, force)  # a writer that finished meanwhile
            with Staged(out) as data, Staged(meta_path(out), text=True) as meta_file:
                n_tokens, n_docs, top = _tokenize(files, field, spec, dtype, workers, progress,
                                                  task_bytes, total, data.file)
                meta = {"dtype": dtype, "n_tokens": n_tokens, "n_documents": n_docs,
                        "max_id": top, "eos_id": int(tok.eos_id),
                        "vocab_size": int(tok.vocab_size), "tokenizer": spec,
                        "tokenizer_fingerprint": tok.fingerprint,
                        "source": os.path.abspath(source), "source_bytes": total,
                        "workers": workers, "seconds": round(time.perf_counter() - t0, 3)}
                json.dump(dict(meta, format=FORMAT), meta_file.file, indent=2)
                publish([meta_file, data], replace=force)
    except OSError as e:
        full = e.errno in (errno.ENOSPC, errno.EDQUOT)
        raise UserError(f"writing {out!r} failed ({e.strerror or e}); nothing was published "
                        f"and no temp file is left; {'free space' if full else 'fix that'} or "
                        "choose another OUT") from None
    return meta


def parse_args(argv=None):
    p = Parser(prog="python -m boost_jax.data.prepare", description=__doc__)
    p.add_argument("source", metavar="SOURCE", help="text/.jsonl/.parquet file, saved HF "
                   "dataset, or a folder of them")
    p.add_argument("out", metavar="OUT", help="the .bin to write, e.g. data/corpus.bin")
    p.add_argument("--tokenizer", required=True, help="byte, or a tokenizer.json")
    p.add_argument("--workers", type=int, default=max(1, (os.cpu_count() or 2) - 1),
                   help="tokenizing processes (default: one per core but one)")
    p.add_argument("--field", default="text", help="the text field of .jsonl/.parquet/arrow")
    p.add_argument("--force", action="store_true", help="replace OUT if it exists")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = p.parse_args(argv)
    if args.workers < 1:
        p.error(f"--workers {args.workers} must be >= 1")
    if not args.out.endswith(".bin"):
        p.error(f"OUT {args.out!r} must end in .bin (training recognises token files by it)")
    return args


@cli_main
def main(argv=None):
    args = parse_args(argv)
    check_has_text(args.source, args.field)
    meta = prepare(args.source, args.out, args.tokenizer, args.workers, args.field,
                   args.force, not args.no_progress)
    rate = meta["n_tokens"] / max(meta["seconds"], 1e-9)
    print(f"wrote {args.out}: {meta['n_tokens']:,} {meta['dtype']} tokens, "
          f"{meta['n_documents']:,} documents, in {meta['seconds']:.1f} s ({rate:,.0f} tokens/s, "
          f"{args.workers} workers); metadata in {meta_path(args.out)}\n"
          f"train on it with: data.source={args.out} data.tokenizer={args.tokenizer} "
          f"data.bin_dtype={meta['dtype']} data.max_bytes=null")
    return 0


if __name__ == "__main__":
    sys.exit(main())
