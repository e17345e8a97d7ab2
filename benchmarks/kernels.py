"""Time each Pallas kernel against its XLA twin on the current backend.

Reports median time, achieved GB/s (compulsory traffic: every input read once, every output
written once) as % of the measured copy bandwidth (an elementwise x*2 — the target is >=80%
for the memory-bound kernels), and TFLOP/s as % of the topology's peak.
  python benchmarks/kernels.py                  # GPU: 1B-CoLA-shaped BTP layers
  python benchmarks/kernels.py --quick          # CPU: tiny shapes, Pallas in interpret mode
  python benchmarks/kernels.py --json out.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.common import add_json, guard_out  # noqa: E402
from boost_jax.mesh import get_topology  # noqa: E402
from boost_jax.pallas import dispatch, grouped, rmsnorm  # noqa: E402


def _nbytes(tree) -> int:
    return sum(int(np.prod(x.shape)) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def bench(fn, args, warmup: int, reps: int, inner: int) -> float:
    """Median seconds per call: `inner` async launches per sample, then block."""
    f = jax.jit(fn)
    for _ in range(warmup):
        jax.block_until_ready(f(*args))
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(inner):
            out = f(*args)
        jax.block_until_ready(out)
        samples.append((time.perf_counter() - t0) / inner)
    return statistics.median(samples)


def _rel_err(got, want) -> float:
    """max over leaves of ||got - want|| / ||want|| (GPU sanity check of the kernels)."""
    errs = [float(jnp.linalg.norm((p.astype(jnp.float32) - q.astype(jnp.float32)).ravel())
                  / jnp.maximum(jnp.linalg.norm(q.astype(jnp.float32).ravel()), 1e-30))
            for p, q in zip(jax.tree.leaves(got), jax.tree.leaves(want))]
    return max(errs)


def _with_bwd(fn):
    """fwd + VJP with a ones cotangent: what a training step runs."""
    def run(*args):
        out, vjp = jax.vjp(fn, *args)
        return out, vjp(jax.tree.map(jnp.ones_like, out))
    return run


def cases(T: int, d: int, r: int, n: int, dt):
    """(name, flops, args, pallas_fn, xla_fn); interpret flag is bound by the caller."""
    k = jax.random.split(jax.random.key(0), 6)
    x = jax.random.normal(k[0], (T, d), dt)
    g = jnp.ones((d,), dt)
    a_qkv = (jax.random.normal(k[1], (d, 3 * r)) * d ** -0.5).astype(dt)
    z3 = jax.random.normal(k[2], (3, T, r), dt)
    b3 = (jax.random.normal(k[3], (3, r, n)) * r ** -0.5).astype(dt)
    a_gu = [a_qkv[:, :r], a_qkv[:, r:2 * r]]
    return [
        ("online_rmsnorm", 4 * T * d, (x, g),
         lambda it: lambda x, g: rmsnorm.local_rmsnorm(x, g, interpret=it),
         lambda it: lambda x, g: rmsnorm.local_rmsnorm_ref(x, g)),
        ("norm_matmul(qkv)", 2 * T * d * 3 * r, (x, g, a_qkv),
         lambda it: lambda x, g, a: grouped.norm_matmul(x, g, a, interpret=it),
         lambda it: lambda x, g, a: rmsnorm.norm_matmul_ref(x, g, a)),
        ("grouped_up(qkv)", 2 * 3 * T * r * n, (z3, b3),
         lambda it: lambda z, b: grouped.grouped_up(z, b, interpret=it),
         lambda it: grouped.grouped_up_ref),
        ("concat_down(g|u)", 2 * T * d * 2 * r, (x, a_gu),
         lambda it: lambda x, a: grouped.concat_down(x, a, interpret=it),
         lambda it: grouped.concat_down_ref),
    ]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--quick", action="store_true", help="tiny shapes, few reps (CPU check)")
    p.add_argument("--topology", default="auto",
                   help="peak FLOP/s source (auto: dgx-h100 on CUDA, frontier on ROCm, else cpu)")
    p.add_argument("--tokens", type=int, default=8192, help="T = batch*seq per device")
    p.add_argument("--d", type=int, default=2048, help="local hidden size d_i")
    p.add_argument("--r", type=int, default=512, help="rank r")
    p.add_argument("--n", type=int, default=2048, help="up-projection width per group")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--reps", type=int, default=None)
    add_json(p)
    return p.parse_args(argv)


def measure(args, dt, interp, peak_flops, copy_bw, timing) -> list[dict]:
    """One row per kernel, pass (fwd, fwd+bwd) and impl (xla first, then pallas)."""
    rows = []
    for name, flops, cargs, mk_pallas, mk_xla in cases(args.tokens, args.d, args.r, args.n, dt):
        for pas, mult in (("fwd", 1), ("fwd+bwd", 3)):
            times, outs = {}, {}
            for impl, mk in (("xla", mk_xla), ("pallas", mk_pallas)):
                fn = mk(interp)
                fn = fn if pas == "fwd" else _with_bwd(fn)
                out_shapes = jax.eval_shape(fn, *cargs)
                nbytes = _nbytes(cargs) + _nbytes(out_shapes) + (
                    0 if pas == "fwd" else _nbytes(jax.eval_shape(mk(interp), *cargs)))
                t = bench(fn, cargs, *timing)
                times[impl] = t
                outs[impl] = jax.jit(fn)(*cargs)
                fl = flops * mult
                rows.append(dict(
                    kernel=name, pass_=pas, impl=impl, time_us=t * 1e6,
                    gb_s=nbytes / t / 1e9, pct_copy_bw=100 * nbytes / t / copy_bw,
                    tflop_s=fl / t / 1e12, pct_peak=100 * fl / t / peak_flops,
                    speedup_vs_xla=times["xla"] / t,
                    rel_err_vs_xla=_rel_err(outs[impl], outs["xla"])))
    return rows


def print_table(hdr: str, rows: list[dict]) -> None:
    print(hdr)
    cols = ["kernel", "pass_", "impl", "time_us", "gb_s", "pct_copy_bw", "tflop_s", "pct_peak",
            "speedup_vs_xla", "rel_err_vs_xla"]
    print(" | ".join(f"{c:>16}" if i < 3 else f"{c:>12}" for i, c in enumerate(cols)))
    for r in rows:
        print(" | ".join(f"{r[c]:>16}" if i < 3 else f"{r[c]:>12.2e}" if c.startswith("rel")
                         else f"{r[c]:>12.2f}" for i, c in enumerate(cols)))


def main(argv=None) -> int:
    args = parse_args(argv)
    guard_out(args.json, force=args.force)
    plat = dispatch._platform()
    topo_name = args.topology if args.topology != "auto" else {
        "cuda": "dgx-h100", "rocm": "frontier"}.get(plat, "cpu")
    topo = get_topology(topo_name)
    interp = dispatch.interpret_mode()
    if args.quick:
        args.tokens, args.d, args.r, args.n = 64, 128, 32, 64
    # bench's (warmup, reps, inner)
    timing = (1, args.reps or 3, 1) if (args.quick or interp) else (3, args.reps or 20, 10)
    dt = jnp.dtype(args.dtype)

    big = jnp.ones((args.tokens, 4 * args.d), dt)  # copy reference: read + write
    t_copy = bench(lambda x: x * 2, (big,), *timing)
    copy_bw = 2 * _nbytes(big) / t_copy

    rows = measure(args, dt, interp, topo.peak_flops, copy_bw, timing)
    hdr = (f"backend={jax.default_backend()} ({plat}) device={jax.devices()[0].device_kind} "
           f"topology={topo.name} peak={topo.peak_flops / 1e12:.3g} TFLOP/s "
           f"copy_bw={copy_bw / 1e9:.1f} GB/s interpret={interp} T={args.tokens} d={args.d} "
           f"r={args.r} n={args.n} {dt.name}")
    print_table(hdr, rows)
    if args.json:
        Path(args.json).write_text(json.dumps(dict(header=hdr, copy_gb_s=copy_bw / 1e9,
                                                   rows=rows), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
