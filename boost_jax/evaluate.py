"""Measure a trained run on text: python -m boost_jax.evaluate --run runs/demo [--data SOURCE]

Loss (mean next-token cross-entropy, nats), perplexity (e^loss) and bits per byte (total nats /
ln 2 / UTF-8 bytes of the predicted text; comparable across tokenizers) of one checkpoint.

--data val (the default) scores exactly the windows the run scores at every eval step (the
run's validation split, train.eval_batches batches of train.global_batch windows), so it
reproduces the logged val_loss of that step (a plan whose forward gathers the weights in
int8, zeropp or hierarchical with an int8 pair copy, logs the quantized forward's loss; evaluate
reads the exact weights, which moved tiny demo runs by 2e-5 to 9e-4 relative). Any other
SOURCE (a text file, a folder, a .jsonl, or a .bin of token ids, read in the dtype its
metadata records) is tokenized with the run's tokenizer and scored whole, in non-overlapping
windows of data.seq_len (+1 for the last target), up to --max-tokens.
"""

from __future__ import annotations

import math
import sys

import numpy as np

from boost_jax.cli import Parser, json_dumps
from boost_jax.errors import UserError, cli_main, counted


MAX_TOKENS = 2**40  # its byte budget (16 per token) must stay an index-sized integer


def parse_args(argv=None):
    p = Parser(prog="python -m boost_jax.evaluate", description=__doc__)
    p.add_argument("--run", required=True, help="the training run's out_dir, e.g. runs/demo")
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: latest)")
    p.add_argument("--data", default="val",
                   help="val (the run's validation windows), or a text/.jsonl/.bin source")
    p.add_argument("--batch-size", type=int, default=8, help="windows per forward pass")
    p.add_argument("--max-tokens", type=int, default=None,
                   help="score at most this many tokens of SOURCE (default: all)")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")
    args = p.parse_args(argv)
    if args.batch_size < 1:
        p.error(f"--batch-size {args.batch_size} must be >= 1")
    if args.max_tokens is not None and args.max_tokens < 2:
        p.error(f"--max-tokens {args.max_tokens} must be >= 2")
    if args.max_tokens is not None and args.data == "val":
        p.error("--max-tokens caps a --data SOURCE; --data val scores the run's validation "
                "windows whole, as each eval step does (leave --max-tokens out)")
    if args.max_tokens is not None and args.max_tokens > MAX_TOKENS:
        p.error(f"--max-tokens {args.max_tokens} is above {MAX_TOKENS} (2^40); leave it out to "
                "score the whole source")
    return args


def run_val_windows(run) -> np.ndarray:
    """The run's own eval windows [n, seq_len + 1] (as train/loop.py evaluates them)."""
    import os

    from boost_jax.data.fingerprint import input_files
    from boost_jax.data.pipeline import eval_batches, load_splits
    from boost_jax.names import TOKENIZER_DIR

    cfg = run.cfg
    paths = [cfg.data.source] + [x.path for x in cfg.data.sources or []]
    lost = [p for p in paths if p != "stdlib" and not os.path.isabs(p) and not os.path.exists(p)]
    if lost:  # the run saved the path as typed, relative to where it was trained
        raise UserError(f"the run's data source {lost[0]!r} is a relative path that does not "
                        "exist from here; run from the folder the run was trained in, or pass "
                        "--data FILE")
    for key, path in input_files(cfg).items():
        if key != "data.tokenizer":
            run.check_input(key, path, "its validation split would be other data: restore "
                            "it, or pass --data FILE")
    _, _, vals, weights = load_splits(cfg, os.path.join(run.path, TOKENIZER_DIR))
    batches = eval_batches(vals, weights, cfg.data.seq_len, cfg.train.global_batch,
                           cfg.train.eval_batches)
    return np.concatenate([np.concatenate([b["inputs"], b["targets"][:, -1:]], axis=1)
                           for b in batches])


def source_tokens(run, source: str, max_tokens):
    """Token ids of a whole source under the run's tokenizer (a .bin is memory-mapped)."""
    from boost_jax.data.sources import read_documents
    from boost_jax.data.token_bin import open_bin

    if source.endswith(".bin"):  # in the dtype its metadata records: no flag to set it here
        import dataclasses

        from boost_jax.data.token_bin import read_meta

        dtype = (read_meta(source) or {}).get("dtype")
        data = run.cfg.data if dtype not in ("uint16", "uint32", "int32") else \
            dataclasses.replace(run.cfg.data, bin_dtype=dtype)
        return open_bin(source, data, run.tokenizer, "--data")
    budget = None if max_tokens is None else max_tokens * 16  # bytes enough for the tokens
    docs = read_documents(source, budget, "--data", chunked=False)  # a file is one text
    if not docs:
        raise UserError(f"--data {source!r} holds no text; point it at a non-empty corpus")
    return run.tokenizer.encode_documents([t for _, t in docs])


def windows_of(tokens, seq_len: int, max_tokens) -> list:
    """Every token scored once: whole windows of seq_len+1, then the rest as one shorter window
    (a text shorter than one window is that one window). Returns groups of equal-length windows."""
    from boost_jax.data.pipeline import PackedSequences

    if max_tokens is not None:
        tokens = tokens[:max_tokens + 1]
    if len(tokens) < 2:
        raise UserError(f"the data holds {counted(len(tokens), 'token')}; scoring needs at least 2 "
                        "(one to predict from, one to predict); use more text")
    full = PackedSequences(tokens, seq_len)
    groups = [full] if len(full) else []
    rest = tokens[len(full) * seq_len:]
    if len(rest) >= 2:
        groups.append([np.asarray(rest, dtype=np.int32)])
    return groups


def target_bytes(tokenizer, targets: np.ndarray) -> int:
    """UTF-8 bytes of the text the targets spell (document breaks count none). Counted per id
    where ids are bytes or byte-level BPE tokens: a character split between two windows counts
    its bytes once (decoded, each half would count as a 3-byte U+FFFD)."""
    table = tokenizer.byte_lengths()
    if table is not None:
        return int(table[np.asarray(targets)].sum())
    return sum(len(tokenizer.decode(row).encode("utf-8")) for row in targets)


def window_losses(cfg):
    """jit: (params, windows [b, s+1]) → summed cross-entropy per window [b] (fp32)."""
    import jax
    import jax.numpy as jnp

    from boost_jax.layers import forward

    ops = forward.Local(cfg)

    def fn(params, windows):
        logits = forward.logits(ops, cfg, params, windows[:, :-1])
        logz = jax.nn.logsumexp(logits, axis=-1)
        gold = jnp.take_along_axis(logits, windows[:, 1:, None], axis=-1)[..., 0]
        return jnp.sum(logz - gold, axis=-1)

    return jax.jit(fn)


def score(run, groups, batch_size: int, label: str) -> dict:
    """Loss, perplexity and bits per byte over `groups` (sequences of equal-length id windows)."""
    from rich.console import Console
    from rich.progress import Progress

    fn = window_losses(run.cfg.model)
    n = sum(len(g) for g in groups)
    sums = [0.0, 0, 0]  # nats, tokens, bytes
    with Progress(transient=True, console=Console(stderr=True)) as bar:
        task = bar.add_task(f"scoring {label}", total=n)
        for windows in groups:
            _score_group(run, fn, windows, batch_size, sums, lambda k: bar.advance(task, k))
    nats, tokens, nbytes = sums
    loss = nats / tokens
    return {"loss": loss, "perplexity": math.exp(min(loss, 700)),
            "bits_per_byte": nats / math.log(2) / nbytes if nbytes else float("nan"),
            "tokens": tokens, "bytes": nbytes, "windows": n}


def _score_group(run, fn, windows, batch_size: int, sums: list, advance) -> None:
    n = len(windows)
    batch_size = min(batch_size, n)  # never pad past the windows there are
    for start in range(0, n, batch_size):
        rows = np.stack([np.asarray(windows[i], np.int32)
                         for i in range(start, min(start + batch_size, n))])
        real = len(rows)
        if real < batch_size:  # one compiled shape per group: pad the last batch, drop its rows
            rows = np.concatenate([rows, np.repeat(rows[-1:], batch_size - real, 0)])
        sums[0] += float(np.sum(np.asarray(fn(run.params, rows))[:real], dtype=np.float64))
        sums[1] += real * (rows.shape[1] - 1)
        sums[2] += target_bytes(run.tokenizer, rows[:real, 1:])
        advance(real)


@cli_main
def main(argv=None):
    args = parse_args(argv)
    from boost_jax.infer.load import open_run, quiet_libraries

    quiet_libraries()
    run = open_run(args.run, args.step)
    if args.data == "val":
        windows, label = [run_val_windows(run)], "the run's validation windows"
    else:
        tokens = source_tokens(run, args.data, args.max_tokens)
        windows, label = windows_of(tokens, run.cfg.data.seq_len, args.max_tokens), args.data
    result = score(run, windows, args.batch_size, label)
    result.update(run=args.run, step=run.step, data=args.data)
    if args.json:
        print(json_dumps(result))
    else:
        print(f"{args.run} step {run.step} on {label}: loss {result['loss']:.4f} | perplexity "
              f"{result['perplexity']:.3f} | bits/byte {result['bits_per_byte']:.4f} | "
              f"{counted(result['tokens'], 'token')} in {counted(result['windows'], 'window')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
