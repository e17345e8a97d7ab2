"""Tokens/s of python -m boost_jax.data.prepare with 1 and 2 worker processes; writes
benchmarks/results/prepare_speed.md (copied into benchmarks/README.md, section 8).

    python benchmarks/prepare_speed.py [--mib 16] [--rounds 3] [--no-write]

The corpus is a .jsonl of the Python standard library's files (repeated up to --mib MiB), with
the byte tokenizer and a byte-level BPE of 8192 tokens trained on its first 400 files. Rounds
alternate the worker counts; the table shows medians.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
OUT = os.path.join(ROOT, "benchmarks", "results", "prepare_speed.md")

from benchmarks.common import load_note, positive_int, spread_verdict, write_result  # noqa: E402


def make_corpus(path: str, mib: int) -> None:
    from boost_jax.data.sources import read_documents

    docs = read_documents("stdlib", 8 << 20)
    written = 0
    with open(path, "w") as f:
        while written < mib << 20:
            for _, text in docs:
                line = json.dumps({"text": text}) + "\n"
                f.write(line)
                written += len(line)
                if written >= mib << 20:
                    break


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mib", type=int, default=16)
    p.add_argument("--rounds", type=positive_int, default=3)
    p.add_argument("--no-write", action="store_true", help="print the table only")
    return p.parse_args(argv)


def make_inputs(tmp: str, mib: int) -> tuple[str, str]:
    """The corpus and a BPE of 8192 tokens trained on its first 400 files: their paths."""
    from boost_jax.data.tokenizers import train_bpe

    corpus = os.path.join(tmp, "corpus.jsonl")
    make_corpus(corpus, mib)
    with open(corpus) as f:
        sample = [json.loads(ln)["text"] for ln, _ in zip(f, range(400))]
    bpe = os.path.join(tmp, "bpe.json")
    train_bpe(sample, 8192, save_path=bpe)
    return corpus, bpe


def time_workers(corpus: str, tmp: str, spec: str, rounds: int) -> tuple[dict, int]:
    """{workers: [(tokens/s, MiB/s)] per round}, 1 and 2 workers alternating; the token count."""
    from boost_jax.data.prepare import prepare

    rates = {1: [], 2: []}
    for r in range(rounds):
        for w in (1, 2) if r % 2 == 0 else (2, 1):
            meta = prepare(corpus, os.path.join(tmp, "out.bin"), spec, w, force=True,
                           progress=False)
            rates[w].append((meta["n_tokens"] / meta["seconds"],
                             meta["source_bytes"] / meta["seconds"] / (1 << 20)))
    return rates, meta["n_tokens"]


def summarize(name: str, rates: dict, n_tokens: int) -> tuple[list[tuple], str]:
    """Table rows (one per worker count) and the verdict line of one tokenizer."""
    rows = []
    for w in (1, 2):
        tok_s = statistics.median(x for x, _ in rates[w])
        mib_s = statistics.median(y for _, y in rates[w])
        lo, hi = min(x for x, _ in rates[w]), max(x for x, _ in rates[w])
        rows.append((name, w, n_tokens, tok_s, lo, hi, mib_s))
    # time with 2 workers over time with 1, round by round
    ratios = [a[0] / b[0] for a, b in zip(rates[1], rates[2])]
    return rows, f"- {name}: " + spread_verdict(ratios, "2 workers", "1 worker")


def report(args, rows: list[tuple], verdicts: list[str]) -> str:
    table = ["| tokenizer | workers | tokens | tokens/s (median) | tokens/s range over rounds | "
             "MiB/s of source |", "|---|---|---|---|---|---|"]
    for name, w, n, tok_s, lo, hi, mib_s in rows:
        table.append(f"| {name} | {w} | {n:,} | {tok_s:,.0f} | {lo:,.0f}–{hi:,.0f} | "
                     f"{mib_s:.1f} |")
    return f"""# Preparing a corpus with 1 and 2 workers

Reproduce: `python benchmarks/prepare_speed.py --mib {args.mib} --rounds {args.rounds}` (writes
`results/prepare_speed.md`, copied here).

A {args.mib} MiB `.jsonl` of the Python standard library's files, tokenized into a `.bin` by 1
and 2 worker processes (the reading, ordering and writing stay in the main process), with the
byte tokenizer and with a byte-level BPE of 8192 tokens trained on the corpus's first 400
files; medians of {args.rounds} alternating rounds; {load_note()} after the run (other
processes share the cores).

{chr(10).join(table)}

{chr(10).join(verdicts)}
"""


def main(argv=None) -> int:
    args = parse_args(argv)
    rows, verdicts = [], []
    with tempfile.TemporaryDirectory(prefix="prepare_speed.") as tmp:
        corpus, bpe = make_inputs(tmp, args.mib)
        for name, spec in (("byte", "byte"), ("BPE 8192", bpe)):
            rates, n_tokens = time_workers(corpus, tmp, spec, args.rounds)
            name_rows, verdict = summarize(name, rates, n_tokens)
            rows += name_rows
            verdicts.append(verdict)
    text = report(args, rows, verdicts)
    print(text)
    if not args.no_write:
        write_result(OUT, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
