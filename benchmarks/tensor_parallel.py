"""Megatron (full rank) vs vanilla low-rank TP vs BTP, side by side, on 8 simulated CPU devices.

    .venv/bin/python benchmarks/tensor_parallel.py [--out benchmarks/results/tensor_parallel.md]

1. Per-layer communication of a 7B-shaped layer (d=4096, d_ff=11008, r=1024, 32 heads; BOOST's
   batch 4 x 4096 tokens, bf16), read from compiled HLO of the decoder stack alone
   (analysis/tp_layers.layers_program: 2 scanned layers, nothing allocated), with XLA's CPU
   all-reduce combiner off so each logical collective is counted. Forward, backward, and what
   remat=full / remat=lowrank replay; per-device memory from memory_analysis() and the saved
   activations per layer from print_saved_residuals.
2. A small model end to end (value_and_grad of the TP loss) on 8 devices, TP 8 and TP 2 x DP 4:
   per-device memory and tokens/s measured on the simulated CPU devices (wall clock there says
   little about a cluster; the HLO numbers are the claim).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.common import (add_out, early_cpu_devices, guard_out, positive_int,  # noqa: E402
                               interleaved_samples, markdown_table, sync_readme)

early_cpu_devices(8)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from boost_jax.analysis import hlo as H  # noqa: E402
from boost_jax.analysis.comm import analyze_compiled  # noqa: E402
from boost_jax.backends.cpu import fast_compile_options  # noqa: E402
from boost_jax.config import Config, ModelConfig, ParallelConfig  # noqa: E402
from boost_jax.mesh import make_mesh  # noqa: E402
from boost_jax.analysis.tp_layers import block_saved_residuals, layers_program  # noqa: E402
from boost_jax.step.build import build_step  # noqa: E402

MODES = (("megatron", "full"), ("vanilla", "cola"), ("btp", "cola"))
AXES = {2: ["pair"], 4: ["pair", "node"], 8: ["pair", "node", "global"]}
MESH_SHAPE = {2: [2, 1, 1], 4: [2, 2, 1], 8: [2, 2, 2]}
GiB, MiB = 2.0 ** 30, 2.0 ** 20


def make_cfg(mode, arch, t, remat="none", dtype="bfloat16", **m) -> Config:
    cfg = Config()
    cfg.model = ModelConfig(arch=arch, dtype=dtype, param_dtype=dtype, **m)
    cfg.parallel = ParallelConfig(tp_mode=mode, tp_axes=AXES[t])
    cfg.train.remat = remat
    cfg.data.seq_len = cfg.model.max_seq_len
    cfg.data.tokenizer = "bpe"
    return cfg.validate()


def layer_comm(cfg, mesh, batch, seq, backward):
    """(logical collectives per layer, elements per token per layer, memory report)."""
    fn, args = layers_program(cfg, mesh, batch, seq, backward=backward)
    opts = {**fast_compile_options(), "xla_disable_hlo_passes": "cpu-all-reduce-combiner"}
    with jax.set_mesh(mesh):
        compiled = fn.lower(*args).compile(compiler_options=opts)
    rep = analyze_compiled(compiled, mesh)
    L, tokens = cfg.model.n_layers, batch * seq
    n = sum((c.trip_count or 1) for c in rep.collectives) / L
    elems = sum((c.trip_count or 1) * sum(H.parse_shape(s)[0].elements for s in c.shapes)
                for c in rep.collectives) / L / tokens
    return n, elems, rep.memory


def layer_mode(mode, arch, t, mesh, b, s, shape):
    """One mode's part-1 figures: (comm row, memory row, saved-activations row,
    (fwd ARs, fwd elements, bwd ARs, bwd elements))."""
    tokens = b * s
    ring = 2 * (t - 1) / t
    cfg = make_cfg(mode, arch, t, dtype="float32", **shape)
    nf, ef, mem_f = layer_comm(cfg, mesh, b, s, False)
    nb, eb, mem_b = layer_comm(cfg, mesh, b, s, True)
    replay = {}
    for remat in ("full", "lowrank"):
        nr, er, mem_r = layer_comm(make_cfg(mode, arch, t, remat, "float32", **shape), mesh,
                                   b, s, True)
        replay[remat] = (nr - nb, er - eb, mem_r)
    row = [f"{mode} ({arch})", int(nf), f"{ef:,.0f}", f"{ef * tokens * 2 / GiB:.3f}",
           int(nb - nf), f"{eb - ef:,.0f}", f"{(eb) * tokens * 2 * ring / GiB:.3f}",
           f"{int(replay['full'][0])} / {replay['full'][1]:,.0f}",
           f"{int(replay['lowrank'][0])} / {replay['lowrank'][1]:,.0f}"]
    mem_row = [f"{mode} ({arch})"] + [
        f"{m['temp'] / GiB:.2f}" for m in (mem_b, replay["full"][2], replay["lowrank"][2])] + [
        f"{mem_b['argument'] / GiB:.2f}"]
    saved = []
    for remat in ("none", "full", "lowrank"):
        res = block_saved_residuals(make_cfg(mode, arch, t, remat, **shape), mesh, b, s)
        saved.append(sum(x[1] for x in res if not x[0].startswith("i32")) / MiB)
    res_row = [f"{mode} ({arch})"] + [f"{v:,.0f}" for v in saved]
    return row, mem_row, res_row, (nf, ef, nb - nf, eb - ef)


def part1(a, lines):
    b, s, t = a.batch, a.seq, a.tp
    mesh = make_mesh("cpu", shape=MESH_SHAPE[t])
    shape = dict(vocab_size=32000, d_model=4096, n_layers=2, n_heads=32, d_ff=11008, rank=1024,
                 max_seq_len=s)
    rows, mem_rows, res_rows = [], [], []
    results = {}
    for mode, arch in MODES:
        t0 = time.time()
        row, mem_row, res_row, results[mode] = layer_mode(mode, arch, t, mesh, b, s, shape)
        rows.append(row)
        mem_rows.append(mem_row)
        res_rows.append(res_row)
        print(f"  {mode}: {time.time() - t0:.0f}s", file=sys.stderr)
    lines += part1_text(a, rows, mem_rows, res_rows, results)


def part1_text(a, rows, mem_rows, res_rows, results) -> list[str]:
    b, s, t = a.batch, a.seq, a.tp
    e_btp, e_van, e_meg = results["btp"][1], results["vanilla"][1], results["megatron"][1]
    return [
        f"## 1. Per layer, 7B-shaped, TP {t}, batch {b} x {s} tokens (from compiled HLO)",
        "",
        "The programs are compiled in fp32 (so a bf16 latent and its fp32 statistic are one "
        "buffer and every count below is exact); collectives are all-reduces over the TP group; "
        "\"elements\" are per token per layer (payload of the all-reduce); GiB = elements x "
        "tokens x 2 bytes (bf16 payload, what BOOST reports per layer); ring bytes = 2(t-1)/t x "
        "payload sent per device, forward + backward. Replays: extra collectives / elements in "
        "backward relative to remat=none.",
        "",
        markdown_table(["mode", "fwd ARs", "fwd elements", "fwd GiB", "bwd ARs", "bwd elements",
                        "fwd+bwd ring GiB/device", "remat=full replays", "remat=lowrank replays"],
                       rows),
        "",
        f"vanilla / btp forward bytes: **{e_van / e_btp:.2f}x**; btp / megatron: "
        f"**{e_btp / e_meg:.3f}x** (BOOST, 7B TP4 bs 4x4096 bf16, per layer: full 0.25, vanilla "
        "1.32, BTP 0.22 GB).",
        "",
        "Formulas (d, d_ff, r; + 2 = the fp32 sum-of-squares of the two Online-RMSNorms, carried "
        "inside the same all-reduce): megatron fwd 2 AR = 2d, bwd 2 AR = 2d; vanilla fwd 7 AR = "
        "5d + 2d_ff, bwd 7 AR = 6d + d_ff; btp fwd 4 AR = 7r + 2, bwd 4 AR = 7r. remat=full "
        "replays the forward all-reduces whose results backward needs (btp: all 4; vanilla: all "
        "but down; megatron: o); remat=lowrank replays nothing under btp.",
        "",
        "Per-device memory of the fp32 forward+backward layer program (memory_analysis, GiB; "
        "2 layers, their params and grads included; dense attention scores, no flash; vanilla "
        "runs attention replicated on all heads):",
        "",
        markdown_table(["mode", "temp, remat=none", "temp, remat=full", "temp, remat=lowrank",
                        "arguments"], mem_rows),
        "",
        "Saved activations per layer per device, bf16 compute (print_saved_residuals of one "
        "block, MiB):",
        "",
        markdown_table(["mode", "remat=none", "remat=full", "remat=lowrank"], res_rows),
        "",
    ]


def part2(a, lines):
    shape = dict(vocab_size=2048, d_model=256, n_layers=4, n_heads=8, d_ff=688, rank=64,
                 max_seq_len=a.small_seq)
    rng = np.random.default_rng(0)
    toks = rng.integers(0, shape["vocab_size"], (a.small_batch, a.small_seq + 1), dtype=np.int32)
    batch = {"inputs": toks[:, :-1], "targets": toks[:, 1:]}
    fns, rows = {}, {}
    for t in (8, 2):
        mesh = make_mesh("cpu", shape=[2, 2, 2])
        for mode, arch in MODES:
            cfg = make_cfg(mode, arch, t, dtype="float32", **shape)
            cfg.train.global_batch, cfg.train.micro_batches = a.small_batch, 1
            bundle = build_step(cfg, mesh)  # ddp: the step engine's loss-and-gradient program
            aparams = bundle.abstract_state["params"]
            sh, bsh = bundle.placement.params_shardings(), bundle.batch_sharding
            params = jax.device_put(jax.tree.map(lambda x: jnp.asarray(
                rng.normal(size=x.shape) / np.sqrt(x.shape[-1]), x.dtype), aparams), sh)
            b = jax.device_put(batch, bsh)
            f = jax.jit(bundle.engine.grads_fn(1), in_shardings=(sh, bsh))
            with jax.set_mesh(mesh):
                compiled = f.lower(params, b).compile()
            rep = analyze_compiled(compiled, mesh)
            tp_bytes = sum(c.bytes_per_step for c in rep.collectives
                           if c.axes and set(c.axes) <= set(AXES[t]))
            name = f"TP {t}{' x DP ' + str(8 // t) if t < 8 else ''} | {mode} ({arch})"

            def run(c=compiled, p=params, bb=b):
                with jax.set_mesh(mesh):
                    return jax.block_until_ready(c(p, bb))

            fns[name] = run
            n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(aparams))
            rows[name] = [n_params, rep.memory["argument"] / MiB, rep.memory["temp"] / MiB,
                          tp_bytes / MiB]
    samples = interleaved_samples(fns, rounds=a.rounds, iters=2, warmup=1)
    times = {k: statistics.median(v) for k, v in samples.items()}
    tokens = a.small_batch * a.small_seq
    out = [[k.split(" | ")[0], k.split(" | ")[1], f"{v[0] / 1e6:.2f}M", f"{v[1]:.2f}",
            f"{v[2]:.2f}", f"{v[3]:.2f}", f"{tokens / times[k]:,.0f}",
            f"{tokens / max(samples[k]):,.0f}–{tokens / min(samples[k]):,.0f}"]
           for k, v in rows.items()]
    lines += [
        "## 2. Small model end to end on 8 simulated CPU devices (fp32, value_and_grad of the "
        "TP loss)",
        "",
        f"d=256, L=4, 8 heads, d_ff=688, r=64, V=2048; batch {a.small_batch} x {a.small_seq}. "
        "Memory per device from memory_analysis(); TP MiB = ring bytes per device per step "
        "over the TP axes (forward + backward, embedding and head included); tokens/s = "
        f"median wall clock on this machine's simulated devices over {a.rounds} alternating "
        "rounds, with the range over the rounds (rows whose ranges overlap show no measurable "
        "difference).",
        "",
        markdown_table(["parallel", "mode", "params", "arguments MiB", "temp MiB",
                        "TP comm MiB/step", "tokens/s", "tokens/s range"], out),
        "",
    ]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--tp", type=int, default=4, choices=(2, 4, 8))
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--small-batch", type=int, default=8)
    p.add_argument("--small-seq", type=int, default=128)
    p.add_argument("--rounds", type=positive_int, default=3)
    p.add_argument("--cpu-devices", type=int, default=8)
    add_out(p, None)
    a = p.parse_args()
    guard_out(a.out, force=a.force)
    cmd = ".venv/bin/python benchmarks/tensor_parallel.py " + " ".join(sys.argv[1:])
    lines = ["# Tensor parallelism: Megatron (full rank) vs vanilla low-rank TP vs BTP", "",
             f"Reproduce: `{cmd.strip()}` (8 simulated CPU devices; a few minutes). Code: "
             "`boost_jax/sharding/tp/` (`specs.py`, `btp.py`, `vanilla.py`, "
             "`megatron.py`, `common.py`); the step engine `boost_jax/step/engine.py`; tests: `tests/unit/test_tp.py`, "
             "`tests/unit/test_tp_hlo.py`.", ""]
    t0 = time.time()
    part1(a, lines)
    part2(a, lines)
    lines += [
        "## Notes", "",
        "- XLA CPU promotes 16-bit all-reduces to fp32; the bf16 byte columns above count 2 "
        "bytes per element as a GPU run moves them (boost_jax/analysis/cpu_lowering.py).",
        "- With bf16 compute, BTP's Online-RMSNorm reduction is one psum of two arrays (the bf16 "
        "latent and the fp32 Σx²): JAX emits two all-reduce ops and XLA's all-reduce combiner "
        "(on by default, CPU and GPU) merges them into one variadic all-reduce. In fp32 it is "
        "one concatenated buffer.",
        "- The combiner is disabled only to count logical collectives; by default XLA CPU merges "
        "independent all-reduces (e.g. vanilla's q, k, v outputs) into one tuple op.",
        "- BTP's head gathers h with one all-gather over the TP axes (once per step), inside "
        "the step's shard_map that is manual over every mesh axis.",
        f"- Generated in {time.time() - t0:.0f} s.", ""]
    text = "\n".join(lines)
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text)
        sync_readme(a.out)


if __name__ == "__main__":
    main()
