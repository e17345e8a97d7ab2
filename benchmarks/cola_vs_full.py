"""CoLA (and svd/lax) vs full rank at the same width: params, FLOPs/token, measured tokens/s.

    python benchmarks/cola_vs_full.py [--d 512] [--layers 4] [--batch 8] [--seq 256] [--rounds 5]
                                      [--out benchmarks/results/cola_vs_full.md]

All architectures are built from the same config except `model.arch`, run with the framework's
training step on one device, and timed in alternating rounds in one process.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.common import (RESULTS, add_out, positive_int, early_cpu_devices, guard_out, interleaved_samples,  # noqa: E402
                               load_note, markdown_table, reproduce_command, spread_verdict,
                               write_result)

early_cpu_devices(1)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from boost_jax.analysis.flops import flops_per_token, param_count  # noqa: E402
from boost_jax.config import load_config  # noqa: E402
from boost_jax.mesh import get_topology, make_mesh  # noqa: E402
from boost_jax.step.build import build_step  # noqa: E402


def parse_args() -> argparse.Namespace:
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
    p.add_argument("--rounds", type=positive_int, default=5)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--topology", default="cpu")
    p.add_argument("--cpu-devices", type=int)
    add_out(p, os.path.join(RESULTS, "cola_vs_full.md"))
    a = p.parse_args()
    guard_out(a.out, force=a.force)
    if "full" not in a.archs.split(","):
        p.error("--archs must include full (the reference the speeds are relative to)")
    return a


def build_steps(a, mesh):
    """{arch: one blocking training step}, {arch: (params, train FLOPs/token)}."""
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
    return fns, info


def compare(a, samples, info, peak):
    """Table rows and one verdict line per arch other than full, from the round samples."""
    t = {k: statistics.median(v) for k, v in samples.items()}
    tok = a.batch * a.seq
    rows, verdicts = [], []
    for arch, sec in t.items():
        n, fpt = info[arch]
        per_round = [f / x for f, x in zip(samples["full"], samples[arch])]
        rows.append([arch, n / 1e6, fpt / 1e6, sec * 1e3, tok / sec, t["full"] / sec,
                     f"{min(per_round):.2f}–{max(per_round):.2f}", fpt * tok / sec / peak])
        if arch != "full":
            flop_gain = info["full"][1] / fpt
            step_ratios = [x / f for f, x in zip(samples["full"], samples[arch])]
            gain = t["full"] / sec
            verdicts.append(
                f"- {arch}: {fpt / info['full'][1]:.2f}x full rank's FLOPs per token; "
                + spread_verdict(step_ratios, "its step", "full rank's")
                + (f"; {gain:.2f}x the speed, {'less' if gain < flop_gain else 'more'} than "
                   f"the FLOP ratio ({flop_gain:.2f}x)" if min(step_ratios) > 1.0
                   or max(step_ratios) < 1.0 else ""))
    return rows, verdicts


def report(a, rows, verdicts, peak, load_before) -> str:
    cmd = reproduce_command("cola_vs_full.py")
    return f"""# CoLA vs full rank at the same width

Reproduce: `{cmd.strip()}` (writes `results/cola_vs_full.md`, copied here).

d={a.d}, L={a.layers}, H={a.heads}, d_ff={a.d_ff}, r={a.rank}, vocab {a.vocab}, batch
{a.batch} × {a.seq} tokens, {a.dtype}, one {jax.default_backend().upper()} device, the
framework's training step, all architectures timed in {a.rounds} alternating rounds;
"per-round range" is the speed vs full rank in each round. MFU is against the `{a.topology}`
profile's peak, {peak / 1e9:.1f} GFLOP/s ({'measured on this machine by the GEMM probe'
if a.topology == 'cpu' else 'nominal'}). {load_before} before the rounds, {load_note()} after.

{markdown_table(["arch", "params (M)", "train MFLOP/token", "ms/step", "tokens/s",
                 "speed vs full", "per-round range", "MFU"], rows)}

{chr(10).join(verdicts)}

The embedding and head stay full rank, so the FLOP ratio is above r/d; where an arch gains less
than its FLOP ratio, its rank-{a.rank} GEMMs run at a lower FLOP rate than full rank's wide ones
(the MFU column).
"""


def main():
    a = parse_args()
    mesh = make_mesh("cpu", shape=[1, 1, 1])
    peak = get_topology(a.topology).peak_flops
    fns, info = build_steps(a, mesh)
    load_before = load_note()
    samples = interleaved_samples(fns, rounds=a.rounds)
    rows, verdicts = compare(a, samples, info, peak)
    doc = report(a, rows, verdicts, peak, load_before)
    print(doc)
    write_result(a.out, doc)


if __name__ == "__main__":
    main()
