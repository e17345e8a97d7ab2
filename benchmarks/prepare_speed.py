"""Tokens/s of python -m boost_jax.data.prepare with 1 and 2 worker processes; writes its table
into benchmarks/README.md (section 8).

    python benchmarks/prepare_speed.py [--mib 16] [--rounds 3] [--no-write]

The corpus is a .jsonl of the Python standard library's files (repeated up to --mib MiB), with
the byte tokenizer and a byte-level BPE of 8192 tokens trained on its first 2 MiB. Rounds
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
README = os.path.join(ROOT, "benchmarks", "README.md")
BEGIN, END = "<!-- prepare_speed: begin -->", "<!-- prepare_speed: end -->"


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


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mib", type=int, default=16)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--no-write", action="store_true", help="print the table only")
    args = p.parse_args(argv)
    from boost_jax.data.prepare import prepare
    from boost_jax.data.tokenizers import train_bpe

    tmp = tempfile.mkdtemp(prefix="prepare_speed.")
    corpus = os.path.join(tmp, "corpus.jsonl")
    make_corpus(corpus, args.mib)
    with open(corpus) as f:
        sample = [json.loads(ln)["text"] for ln, _ in zip(f, range(400))]
    bpe = os.path.join(tmp, "bpe.json")
    train_bpe(sample, 8192, save_path=bpe)
    rows = []
    for name, spec in (("byte", "byte"), ("BPE 8192", bpe)):
        rates = {1: [], 2: []}
        for r in range(args.rounds):
            for w in (1, 2) if r % 2 == 0 else (2, 1):
                meta = prepare(corpus, os.path.join(tmp, "out.bin"), spec, w, force=True,
                               progress=False)
                rates[w].append((meta["n_tokens"] / meta["seconds"],
                                 meta["source_bytes"] / meta["seconds"] / (1 << 20)))
        for w in (1, 2):
            tok_s = statistics.median(x for x, _ in rates[w])
            mib_s = statistics.median(y for _, y in rates[w])
            rows.append((name, w, meta["n_tokens"], tok_s, mib_s))
    table = ["| tokenizer | workers | tokens | tokens/s | MiB/s of source |", "|---|---|---|---|---|"]
    for name, w, n, tok_s, mib_s in rows:
        table.append(f"| {name} | {w} | {n:,} | {tok_s:,.0f} | {mib_s:.1f} |")
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    table.append(f"\n{os.cpu_count()} cores; load average after the run {load} (other "
                 "processes on the machine share the cores)")
    text = "\n".join(table)
    print(text)
    if not args.no_write:
        with open(README) as f:
            doc = f.read()
        head, rest = doc.split(BEGIN)
        _, tail = rest.split(END)
        with open(README, "w") as f:
            f.write(f"{head}{BEGIN}\n{text}\n{END}{tail}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
