"""Tokens/s of a streamed corpus (data.sources at parquet shards) against `prepare` and the
prepared .bin; writes benchmarks/results/stream_speed.md (copied into benchmarks/README.md,
section 8).

    python benchmarks/stream_speed.py [--mib 8] [--rounds 2] [--no-write]

The corpus: the Python standard library's files (repeated up to --mib MiB) as 4 parquet shards
and the same documents as a .jsonl for `prepare`. Each figure is the rate at which training
would receive tokens: batches of 64 x 512-token windows drawn from the iterator until it has
given as many tokens as the corpus holds (streaming: tokenized on the way, with data.workers
0, 1 and 2; prepared: the .bin's windows), and prepare's own rate with 1 worker (a .bin costs
prepare once, then the prepared row). Byte tokenizer and a byte-level BPE of 8192 tokens;
medians of the rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
OUT = os.path.join(ROOT, "benchmarks", "results", "stream_speed.md")

from benchmarks.common import load_note, positive_int, write_result  # noqa: E402
from benchmarks.prepare_speed import make_corpus  # noqa: E402

SEQ, BATCH = 512, 64


def make_inputs(tmp: str, mib: int) -> tuple[str, str, str]:
    """(the .jsonl, the folder of 4 parquet shards of the same documents, a BPE's path)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from boost_jax.data.tokenizers import train_bpe

    corpus = os.path.join(tmp, "corpus.jsonl")
    make_corpus(corpus, mib)
    with open(corpus) as f:
        docs = [json.loads(ln)["text"] for ln in f]
    shards = os.path.join(tmp, "shards")
    os.makedirs(shards)
    for k in range(4):
        pq.write_table(pa.table({"text": docs[k::4]}), os.path.join(shards, f"part-{k}.parquet"))
    bpe = os.path.join(tmp, "bpe.json")
    train_bpe(docs[:400], 8192, save_path=bpe)
    return corpus, shards, bpe


def _cfg(path: str, spec: str, workers: int):
    from boost_jax.config import load_config

    return load_config(None, [f"data.sources=[{{path: {path}, weight: 1}}]",
                              f"data.tokenizer={spec}", f"data.seq_len={SEQ}",
                              f"model.max_seq_len={SEQ}", f"train.global_batch={BATCH}",
                              "train.eval_batches=1",
                              "data.max_bytes=null", f"data.workers={workers}",
                              "data.bin_dtype=uint16"])


def drain(cfg, n_tokens: int) -> float:
    """Tokens/s of the training iterator over about n_tokens (its start included)."""
    from boost_jax.data.pipeline import build_data

    t0 = time.perf_counter()
    it = build_data(cfg).train_iter
    got = 0
    while got < n_tokens:
        got += next(it)["inputs"].size
    rate = got / (time.perf_counter() - t0)
    getattr(it, "close", lambda: None)()
    return rate


WORKERS = (0, 1, 2)


def measure(corpus: str, shards: str, tmp: str, spec: str, rounds: int) -> dict:
    """{row name: [tokens/s per round]}, plus "tokens": the corpus's token count."""
    from boost_jax.data.prepare import prepare

    rates: dict = {"prepare (1 worker)": [], "prepared .bin": []}
    rates.update({f"streaming, data.workers={w}": [] for w in WORKERS})
    binary = os.path.join(tmp, "out.bin")
    for _ in range(rounds):
        meta = prepare(corpus, binary, spec, 1, force=True, progress=False)
        rates["prepare (1 worker)"].append(meta["n_tokens"] / meta["seconds"])
        n = meta["n_tokens"]
        rates["prepared .bin"].append(drain(_cfg(binary, spec, 0), n))
        for w in WORKERS:
            rates[f"streaming, data.workers={w}"].append(drain(_cfg(shards, spec, w), n))
    rates["tokens"] = n
    return rates


def report(args, results: dict) -> str:
    table = ["| tokenizer | path | tokens | tokens/s (median) | range over rounds |",
             "|---|---|---|---|---|"]
    for name, rates in results.items():
        n = rates.pop("tokens")
        for path, xs in rates.items():
            table.append(f"| {name} | {path} | {n:,} | {statistics.median(xs):,.0f} | "
                         f"{min(xs):,.0f}–{max(xs):,.0f} |")
    return f"""# Streaming parquet shards against prepare

Reproduce: `python benchmarks/stream_speed.py --mib {args.mib} --rounds {args.rounds}` (writes
`results/stream_speed.md`, copied here).

A {args.mib} MiB corpus of the Python standard library's files, as 4 parquet shards (streamed)
and as a .jsonl (prepared). Rows: `prepare` with 1 worker; the training iterator of the
prepared .bin; the training iterator of the shards, tokenizing as it goes, with data.workers
0 (two threads of the trainer), 1 and 2 (grain worker processes, started after prepare's
process pool in the same process, as they would be in any program). An iterator's rate
counts the tokens of {BATCH} x {SEQ}-token batches drawn until it has given the corpus's token
count, its start included (a worker process's start too); medians of {args.rounds} rounds;
{load_note()} after the run (other processes share the cores).

{chr(10).join(table)}
"""


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mib", type=int, default=8)
    p.add_argument("--rounds", type=positive_int, default=2)
    p.add_argument("--no-write", action="store_true", help="print the table only")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="stream_speed.") as tmp:
        corpus, shards, bpe = make_inputs(tmp, args.mib)
        results = {name: measure(corpus, shards, tmp, spec, args.rounds)
                   for name, spec in (("byte", "byte"), ("BPE 8192", bpe))}
    text = report(args, results)
    print(text)
    if not args.no_write:
        write_result(OUT, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
