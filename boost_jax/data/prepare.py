"""Tokenize a corpus ahead of time: python -m boost_jax.data.prepare SOURCE OUT --tokenizer T

T is `byte`, a tokenizer.json, or `bpe`: a byte-level BPE (the trainer data.tokenizer=bpe uses,
--bpe-vocab-size tokens) trained on the first --bpe-max-bytes of SOURCE and written next to OUT
as `<OUT without .bin>.tokenizer.json`, published with OUT (the same rules as its metadata).

SOURCE is a text file, a .jsonl (one document per line, in field --field), a .parquet file, a
Hugging Face dataset saved with `save_to_disk` (a folder holding dataset_info.json and .arrow
files), or a folder of such files (recursive, links followed, sorted; a folder holding .parquet
or .arrow files is read without the card or script at its top). OUT receives the token ids (a
.bin that training memory-maps) and `<OUT without .bin>.json`, its metadata (token_bin.py).
Every document is followed by the tokenizer's EOS id; a plain text file is one document.

Streaming with bounded memory: the main process reads the source in pieces (text in about
PIECE bytes cut where a byte-level BPE encodes the pieces as the whole file, _safe_cut;
parquet TABLE_BATCH rows at a time) and hands tasks of about TASK bytes to --workers
processes, each holding its own tokenizer; at most 2 x workers tasks are in flight and their
ids are appended to OUT in order. Memory depends on the worker count, never on the corpus
size (but for a parquet row group's column, which pyarrow holds). OUT and its metadata are written as temp files in
OUT's folder and published when complete, metadata first (boost_jax/safe_write.py): OUT is never
half-written, never without its metadata, and an existing OUT or metadata file is replaced only
with --force (never when it is SOURCE or the tokenizer). Two prepares of one OUT: the second
stops at once.
"""

from __future__ import annotations

import contextlib
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

from boost_jax.cli import Parser, shell_word
from boost_jax.data.shards import check_text_column, list_shards
from boost_jax.data.token_bin import FORMAT, meta_path
from boost_jax.errors import UserError, cli_main, lone_surrogate

BPE_MAX_BYTES = 1 << 30  # text a BPE is trained on by default (the merges settle long before)
PIECE = 1 << 20  # bytes of a text file read at a time
TASK = 1 << 20  # bytes of text per worker task (with the window below, bounds memory)
EXTS = (".txt", ".md", ".py", ".jsonl", ".parquet", ".arrow")
TABLES = (".parquet", ".arrow")
TABLE_BATCH = 64  # parquet rows decoded at a time (books or code files can be MBs each)


# --------------------------------------------------------------------------- reading (main)


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


def _safe_cut(buf: bytes) -> int:
    """Where a piece may end so that encoding the pieces apart gives the whole file's ids: at a
    line break between two characters that are not whitespace, after its \\n (before it in a
    \\r\\n, which a byte-level BPE's pre-tokenizer splits there too); a run of whitespace is one
    token, so no other line break is safe. 0: none (then any line break, else a character
    boundary)."""
    i = buf.rfind(b"\n")
    while i > 0:
        end = i - 1 if buf[i - 1:i] == b"\r" else i
        before = buf[max(0, end - 4):end].decode("utf-8", "ignore")[-1:]
        after = buf[i + 1:i + 5].decode("utf-8", "ignore")[:1]
        if before and after and not before.isspace() and not after.isspace():
            return i if end < i else i + 1
        i = buf.rfind(b"\n", 0, i)
    return 0


def _text_file(path: str) -> Iterator[tuple]:
    """('text', piece, is_last_piece_of_the_document, bytes read); every piece is checked for
    being text (a file may turn binary after its head)."""
    from boost_jax.data.sources import _check_text, reading

    carry, done, unsent = b"", 0, 0
    with reading(path) as f:
        while raw := f.read(PIECE):
            _check_text(raw, f"SOURCE file {path!r}", done)
            done, unsent = done + len(raw), unsent + len(raw)
            buf = carry + raw
            cut = _safe_cut(buf)
            if not cut and len(buf) < 2 * PIECE:  # read on to a safe cut, one more piece at most
                carry = buf
                continue
            cut = cut or buf.rfind(b"\n") + 1 or _char_boundary(buf)
            carry = buf[cut:]
            yield "text", buf[:cut], False, unsent
            unsent = 0
    yield "text", carry, True, unsent


def _jsonl_file(path: str) -> Iterator[tuple]:
    """('jsonl', raw line, line number, bytes): the workers parse the JSON."""
    from boost_jax.data.sources import reading

    with reading(path) as f:
        for i, line in enumerate(f):
            yield "jsonl", line, (path, i + 1), len(line)


def _arrow_batches(path: str, field: str):
    import pyarrow as pa

    if path.endswith(".parquet"):
        import pyarrow.parquet as pq

        pf = pq.ParquetFile(path)
        # small batches: a batch's documents are held as Python strings at once
        return pf.metadata.num_rows, pf.schema_arrow, pf.iter_batches(
            batch_size=TABLE_BATCH, columns=[field])
    try:
        reader = pa.ipc.open_stream(path)  # what datasets' save_to_disk writes
    except pa.ArrowInvalid:
        reader = pa.ipc.open_file(path)
        batches = (reader.get_batch(i) for i in range(reader.num_record_batches))
        return reader.count_rows(), reader.schema, batches
    return None, reader.schema, iter(reader)


def _table_file(path: str, field: str) -> Iterator[tuple]:
    """('doc', text, None, bytes): parquet / arrow rows, one document each. A file that is no
    parquet/arrow file, or a column with bytes that are not UTF-8, is a one-line UserError."""
    try:
        import pyarrow as pa
    except ImportError:
        raise UserError(f"reading {path!r} needs pyarrow; pip install pyarrow "
                        "(or pip install 'boost_jax[corpora]')") from None
    kind = "parquet" if path.endswith(".parquet") else "arrow"
    try:
        rows, schema, batches = _arrow_batches(path, field)
        if field not in schema.names:
            raise UserError(f"{path!r} has no column {field!r} (columns: {schema.names}); pass "
                            "--field")
        check_text_column(path, field, schema, "SOURCE")
        size, row = os.path.getsize(path), 0
        for batch in batches:
            col = batch.column(batch.schema.get_field_index(field)).to_pylist()
            per = size * len(col) // rows if rows else 0
            for j, text in enumerate(col):
                yield "doc", text if isinstance(text, str) else "", None, per if j == 0 else 0
            row += len(col)
    except UnicodeDecodeError:
        raise UserError(f"SOURCE file {path!r} has bytes that are not UTF-8 in column {field!r} "
                        f"(at or after row {row + 1}); re-encode that column as UTF-8") from None
    except (pa.ArrowException, OSError) as e:
        why = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        raise UserError(f"SOURCE file {path!r} is not a readable {kind} file ({why}); pass a "
                        f"real .{kind} file, or rename a text file to .txt") from None


def source_files(source: str) -> list[str]:
    if not os.path.exists(source):
        raise UserError(f"SOURCE {source!r} does not exist; pass a text/.jsonl/.parquet file, a "
                        "saved Hugging Face dataset or a folder of them")
    files = list_shards(source, "SOURCE", EXTS)
    if not files:
        raise UserError(f"SOURCE {source!r} contains no {'/'.join(EXTS)} files")
    if os.path.isdir(source) and any(f.endswith(TABLES) for f in files):
        # a dataset download: its shards and any text, not its card or loading script
        top = {os.path.join(source, n) for n in os.listdir(source) if n.endswith((".md", ".py"))}
        files = [f for f in files if f not in top]
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


def load_tokenizer(spec: str, text: str = None):
    """byte, a tokenizer.json, or (`text`) the JSON of a tokenizer trained here."""
    from boost_jax.data.tokenizers import ByteTokenizer, HFTokenizer

    if text is not None:
        from tokenizers import Tokenizer as _HF

        return HFTokenizer(_HF.from_str(text), name=spec)
    if spec == "byte":
        return ByteTokenizer()
    return HFTokenizer.from_file(spec, setting="--tokenizer")


def bpe_path(out: str) -> str:
    """Where --tokenizer bpe saves the BPE it trains: next to OUT."""
    return os.path.splitext(out)[0] + ".tokenizer.json"


def _bpe_texts(files: list[str], field: str, max_bytes: int) -> Iterator[str]:
    """The documents (text pieces) of the first `max_bytes` of the source, for BPE training."""
    n = 0
    for item in read_items(files, field):
        for text, _ in _documents([item], field):
            if n >= max_bytes:
                return
            raw = text.encode("utf-8", "surrogatepass")[: max_bytes - n]
            n += len(raw)
            yield raw.decode("utf-8", "ignore")  # a character cut at the end is dropped


def train_source_bpe(files: list[str], field: str, vocab_size: int, max_bytes: int) -> str:
    """The JSON of a byte-level BPE trained on the source (tokenizers.train_bpe)."""
    from boost_jax.data.tokenizers import train_bpe

    return train_bpe(_bpe_texts(files, field, max_bytes), vocab_size)._tok.to_str()


_WORKER: dict = {}


def _init_worker(spec: str, field: str, dtype: str, text: str = None) -> None:
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # the worker count is the parallelism
    _tied_to_parent()
    _WORKER.update(tok=load_tokenizer(spec, text), field=field, dtype=np.dtype(dtype))


def _tied_to_parent() -> None:
    """A worker ignores Ctrl-C (the parent stops the pool) and exits as soon as its parent
    process ends, however it ends (SIGKILL included), so no orphan keeps the pool's semaphores:
    a thread waits for the end of the pipe the parent holds open while it lives (the parent
    sentinel of multiprocessing's spawn). Not Linux's PR_SET_PDEATHSIG, which fires when the
    parent *thread* that started the worker ends: grain starts its workers from a prefetch
    thread that ends on close(), so the worker was killed while writing an element into its
    result pipe, and close() then waited forever for the rest of that element."""
    import signal
    import threading
    from multiprocessing.connection import wait

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    parent = multiprocessing.parent_process()
    if parent is None:  # not a multiprocessing child: nothing to watch
        return

    def watch():
        wait([parent.sentinel])  # readable (end of file) once the parent has ended
        os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def _stop_on_signals() -> None:
    """SIGTERM/SIGHUP stop prepare like Ctrl-C: the pool is shut down and its semaphores freed,
    the staged files discarded, the exit code 128 + the signal."""
    import signal

    from boost_jax.errors import Interrupted

    def stop(signum, frame):
        raise Interrupted(signum)

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, stop)


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
            except RecursionError:
                raise UserError(f"{path!r} line {line} nests too deeply to be a document; fix "
                                "or remove it") from None
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


def _check_targets(source: str, linked: list, out: str, spec: str, force: bool) -> None:
    """safe_write's rule for OUT and its metadata: never one of the inputs (SOURCE, the files
    read from it that links take outside it (`linked`), the tokenizer; even with --force),
    never an existing file without --force."""
    from boost_jax.safe_write import refuse_existing, refuse_inputs, refuse_special, \
        refuse_unusable

    inputs = {"SOURCE": source, "--tokenizer": None if spec in ("byte", "bpe") else spec}
    inputs.update((f"a file of SOURCE, {f!r}, linked to", os.path.realpath(f)) for f in linked)
    meta = meta_path(out)
    fix = "choose another OUT (its metadata goes to <OUT without .bin>.json)"
    refuse_unusable(out, f"OUT {out!r}", fix, config_value=True)  # data.source names it
    refuse_inputs(out, inputs, f"OUT {out!r}", fix)
    refuse_inputs(meta, inputs, f"the metadata file {meta!r} of OUT", fix)
    targets = [out, meta]
    if spec == "bpe":
        refuse_inputs(bpe_path(out), inputs, f"the tokenizer {bpe_path(out)!r} of OUT", fix)
        targets.append(bpe_path(out))
    for t in targets:
        refuse_special(t, repr(t), fix)
    refuse_existing(targets, force, "choose another OUT")


def _tokenize(files, field, spec, dtype, workers, progress, task_bytes, total, f,
              tok_text=None) -> tuple:
    """Write the ids of `files` to the binary file `f`: (tokens, documents, largest id)."""
    n_tokens = n_docs = 0
    top = -1
    t0 = time.perf_counter()
    ctx = multiprocessing.get_context("spawn")  # safe whatever the caller has imported
    with _progress(total, progress) as bar, ProcessPoolExecutor(
            workers, ctx, initializer=_init_worker,
            initargs=(spec, field, dtype, tok_text)) as pool:
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


def _stage_bpe(stack, files, out, field, vocab_size, max_bytes) -> tuple:
    """Train the BPE of --tokenizer bpe and stage it as OUT's tokenizer: (tokenizer, JSON,
    staged file)."""
    from boost_jax.safe_write import Staged

    text = train_source_bpe(files, field, vocab_size, max_bytes)
    staged = stack.enter_context(Staged(bpe_path(out), text=True))
    staged.file.write(text)
    return load_tokenizer(bpe_path(out), text), text, staged


def prepare(source: str, out: str, spec: str, workers: int = 1, field: str = "text",
            force: bool = False, progress: bool = True, task_bytes: int = TASK,
            bpe_vocab_size: int = 4096, bpe_max_bytes: int = BPE_MAX_BYTES) -> dict:
    """Tokenize `source` into `out` (+ metadata, + with spec=bpe the tokenizer trained here);
    returns the metadata. The files are written as temp files and published together,
    tokenizer and metadata first (boost_jax/safe_write.py)."""
    from boost_jax.safe_write import Staged, exclusive, leaving, publish

    files = source_files(source)
    linked = leaving(files, source)
    _check_targets(source, linked, out, spec, force)
    if spec == "bpe":
        from boost_jax.data.tokenizers import check_bpe_vocab_size

        check_bpe_vocab_size(bpe_vocab_size, "--bpe-vocab-size ")
    tok = None if spec == "bpe" else load_tokenizer(spec)
    total = sum(os.path.getsize(f) for f in files)
    t0 = time.perf_counter()
    targets = [out, meta_path(out)] + ([bpe_path(out)] if spec == "bpe" else [])
    try:
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        with exclusive(targets, f"OUT {out!r}", "choose another OUT"), \
                contextlib.ExitStack() as stack:
            _check_targets(source, linked, out, spec, force)  # a writer finished meanwhile
            tok_text, first = None, []
            if spec == "bpe":
                tok, tok_text, staged = _stage_bpe(stack, files, out, field, bpe_vocab_size,
                                                   bpe_max_bytes)
                spec, first = bpe_path(out), [staged]
            dtype = "uint16" if tok.vocab_size <= 1 << 16 else "uint32"
            data = stack.enter_context(Staged(out))
            meta_file = stack.enter_context(Staged(meta_path(out), text=True))
            n_tokens, n_docs, top = _tokenize(files, field, spec, dtype, workers, progress,
                                              task_bytes, total, data.file, tok_text)
            meta = {"dtype": dtype, "n_tokens": n_tokens, "n_documents": n_docs,
                    "max_id": top, "eos_id": int(tok.eos_id),
                    "vocab_size": int(tok.vocab_size), "tokenizer": spec,
                    "tokenizer_fingerprint": tok.fingerprint,
                    "source": os.path.abspath(source), "source_bytes": total,
                    "workers": workers, "seconds": round(time.perf_counter() - t0, 3)}
            json.dump(dict(meta, format=FORMAT), meta_file.file, indent=2)
            publish(first + [meta_file, data], replace=force)
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
    p.add_argument("--tokenizer", required=True,
                   help="byte, a tokenizer.json, or bpe: train a byte-level BPE on SOURCE and "
                        "save it as <OUT without .bin>.tokenizer.json")
    p.add_argument("--bpe-vocab-size", type=int, default=4096,
                   help="with --tokenizer bpe: its vocabulary, EOS included (default 4096)")
    p.add_argument("--bpe-max-bytes", type=int, default=BPE_MAX_BYTES,
                   help="with --tokenizer bpe: train on the first N bytes of SOURCE's text "
                        "(default 2^30)")
    p.add_argument("--workers", type=int, default=max(1, (os.cpu_count() or 2) - 1),
                   help="tokenizing processes (default: one per core but one)")
    p.add_argument("--field", default="text", help="the text field of .jsonl/.parquet/arrow")
    p.add_argument("--force", action="store_true", help="replace OUT if it exists")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = p.parse_args(argv)
    if args.workers < 1:
        p.error(f"--workers {args.workers} must be >= 1")
    if args.bpe_max_bytes < 1:
        p.error(f"--bpe-max-bytes {args.bpe_max_bytes} must be >= 1")
    if not args.out.endswith(".bin"):
        p.error(f"OUT {args.out!r} must end in .bin (training recognises token files by it)")
    return args


@cli_main
def main(argv=None):
    args = parse_args(argv)
    _stop_on_signals()
    check_has_text(args.source, args.field)
    meta = prepare(args.source, args.out, args.tokenizer, args.workers, args.field,
                   args.force, not args.no_progress, bpe_vocab_size=args.bpe_vocab_size,
                   bpe_max_bytes=args.bpe_max_bytes)
    rate = meta["n_tokens"] / max(meta["seconds"], 1e-9)
    if args.tokenizer == "bpe":
        print(f"trained a byte-level BPE of {meta['vocab_size']:,} tokens on {args.source}: "
              f"{meta['tokenizer']}")
    print(f"wrote {args.out}: {meta['n_tokens']:,} {meta['dtype']} tokens, "
          f"{meta['n_documents']:,} documents, in {meta['seconds']:.1f} s ({rate:,.0f} tokens/s, "
          f"{args.workers} worker{'s' if args.workers != 1 else ''}); metadata in "
          f"{meta_path(args.out)}\n"
          f"train on it with: {shell_word('data.source=' + args.out)} "
          f"{shell_word('data.tokenizer=' + meta['tokenizer'])} "
          f"data.bin_dtype={meta['dtype']} data.max_bytes=null model.vocab_size=null")
    return 0


if __name__ == "__main__":
    sys.exit(main())
