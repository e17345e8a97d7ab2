"""CoLA (and svd/lax) vs full rank at the same width: params, FLOPs/token, measured tokens/s.

    python benchmarks/cola_vs_full.py [--d 512] [--layers 4] [--batch 8] [--seq 256]

All architectures are built from the same config except `model.arch`, run with the framework's
training step on one device, and timed in alternating rounds in one process.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.common import early_cpu_devices, interleaved_samples, markdown_table  # noqa: E402

early_cpu_devices(1)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from boost_jax.analysis.flops import flops_per_token, param_count  # noqa: E402
from boost_jax.config import load_config  # noqa: E402
from boost_jax.mesh import get_topology, make_mesh  # noqa: E402
from boost_jax.train.step import build_step  # noqa: E402


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--archs", default="full,cola,svd,lax")
    p.add_argument("--d", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--d-ff", type=int, default=1376)
    p.add_argument("--rank", type=int, default=128)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--topology", default="cpu")
    p.add_argument("--cpu-devices", type=int)
    a = p.parse_args()
    mesh = make_mesh("cpu", shape=[1, 1, 1])
    peak = get_topology(a.topology).peak_flops
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, a.vocab, (a.batch, a.seq + 1), dtype=np.int32)
    batch = {"inputs": jnp.asarray(tokens[:, :-1]), "targets": jnp.asarray(tokens[:, 1:])}
    fns, info = {}, {}
    for arch in a.archs.split(","):
        cfg = load_config(None, [
            f"model.arch={arch}", f"model.d_model={a.d}", f"model.n_layers={a.layers}",
            f"model.n_heads={a.heads}", f"model.d_ff={a.d_ff}", f"model.rank={a.rank}",
            f"model.vocab_size={a.vocab}", f"model.max_seq_len={a.seq}", f"data.seq_len={a.seq}",
            f"model.dtype={a.dtype}", f"train.global_batch={a.batch}", "train.steps=1000"])
        bundle = build_step(cfg, mesh)
        holder = {"s": bundle.init_state()}

        def step(bundle=bundle, holder=holder):
            holder["s"], m = bundle.train_step(holder["s"], batch)
            jax.block_until_ready(m["loss"])

        fns[arch] = step
        info[arch] = (param_count(cfg.model), flops_per_token(cfg.model, a.seq)["train"])
    samples = interleaved_samples(fns, rounds=a.rounds)
    t = {k: statistics.median(v) for k, v in samples.items()}
    tok = a.batch * a.seq
    base = t.get("full")
    rows = []
    for arch, sec in t.items():
        n, fpt = info[arch]
        per_round = [f / x for f, x in zip(samples["full"], samples[arch])] if base else [0]
        rows.append([arch, n / 1e6, fpt / 1e6, sec * 1e3, tok / sec,
                     (base / sec) if base else float("nan"),
                     f"{min(per_round):.2f}–{max(per_round):.2f}", fpt * tok / sec / peak])
    print(f"d={a.d} L={a.layers} H={a.heads} d_ff={a.d_ff} r={a.rank} batch={a.batch} seq={a.seq} "
          f"dtype={a.dtype} backend={jax.default_backend()}")
    print(markdown_table(["arch", "params (M)", "train MFLOP/token", "ms/step", "tokens/s",
                          "speed vs full", "per-round range", "MFU"], rows))


if __name__ == "__main__":
    main()
