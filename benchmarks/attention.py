"""Dense vs flash attention on the current backend: forward+backward time and compiled memory
per implementation and length, and what model.attention=auto picks.

On CPU this measures the crossover the `auto` rule uses (layers/forward.py CPU_FLASH_FROM):
`make bench` writes benchmarks/results/attention_cpu.md (--out); on a GPU, benchmarks/gpu.sh
runs it at the training shapes.
  python benchmarks/attention.py --lengths 256,512,1024,2048 --json out.json
  python benchmarks/attention.py --lengths 4096 --heads 16 --head-dim 128 --dtype bfloat16
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

from benchmarks.common import (add_json, add_out, guard_out, load_note,  # noqa: E402
                               markdown_table, positive_int, write_result)
from boost_jax.layers.forward import CPU_FLASH_FROM, attention_impl, dense_attention  # noqa: E402
from boost_jax.layers.flash import flash_attention as blockwise  # noqa: E402
from boost_jax.pallas.dispatch import platform  # noqa: E402
from boost_jax.pallas.flash import flash_attention as pallas_flash  # noqa: E402


def impls(plat: str) -> dict:
    out = {"dense": dense_attention, "blockwise": blockwise}
    if plat == "cuda":
        out["cudnn"] = lambda q, k, v: jax.nn.dot_product_attention(
            q, k, v, is_causal=True, implementation="cudnn")
    if plat in ("cuda", "rocm"):
        out["pallas"] = pallas_flash
    return out


def measure(fn, q, k, v, reps: int) -> dict:
    """Median seconds of one jitted forward+backward, and its compiled temporaries."""
    step = jax.jit(jax.grad(lambda q, k, v: jnp.sum(fn(q, k, v).astype(jnp.float32) ** 2),
                            (0, 1, 2)))
    compiled = step.lower(q, k, v).compile()
    jax.block_until_ready(compiled(q, k, v))
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(compiled(q, k, v))
        times.append(time.perf_counter() - t)
    mem = compiled.memory_analysis()
    return {"ms": 1e3 * statistics.median(times),
            "temp_bytes": int(getattr(mem, "temp_size_in_bytes", 0)) if mem else None}


def report(rows: list, a, argv: list) -> str:
    """The Markdown table of a run: ms and temporaries per implementation and length, the
    lengths each implementation was fastest at, and what `auto` picked."""
    lengths = sorted({r["seq"] for r in rows})
    names = list(dict.fromkeys(r["impl"] for r in rows))
    at = {(r["impl"], r["seq"]): r for r in rows}
    fastest = {s: min(names, key=lambda n: at[n, s]["ms"]) for s in lengths}
    body = [[f"{n} (ms)"] + [f"{at[n, s]['ms']:.3g}" for s in lengths] for n in names]
    body.append(["temporaries, " + " / ".join(names) + " (MiB)"] + [
        " / ".join(f"{(at[n, s]['temp_bytes'] or 0) / 2**20:.3g}" for n in names)
        for s in lengths])
    body.append(["fastest"] + [fastest[s] for s in lengths])
    body.append(["`auto` picks"] + [next(r["impl"] for r in rows if r["seq"] == s and r["auto"])
                                    for s in lengths])
    return "\n".join([
        f"# Dense vs flash attention on {rows[0]['platform']}: where `model.attention=auto` "
        "switches", "",
        f"Written by `python benchmarks/attention.py {' '.join(argv)}`: one attention's "
        f"forward+backward (jitted), batch {a.batch}, {a.heads} heads of {a.head_dim}, "
        f"{a.dtype}, median of {a.reps} runs after one; temporaries from "
        f"`memory_analysis()`; {load_note()} at the end. On CPU `auto` picks flash (blockwise "
        f"tiles) from `CPU_FLASH_FROM` = {CPU_FLASH_FROM} keys up.", "",
        markdown_table(["keys"] + [str(s) for s in lengths], body), ""])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--lengths", default="256,512,1024,2048")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=None)
    p.add_argument("--head-dim", type=int, default=32)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--reps", type=positive_int, default=5)
    add_json(p, force=False)  # add_out gives --force
    add_out(p, None, "the Markdown table (make bench: benchmarks/results/attention_cpu.md)")
    p.add_argument("--require-auto", default=None, metavar="IMPL",
                   help="exit 1 unless model.attention=auto picks IMPL here (gpu.sh: cudnn)")
    a = p.parse_args(argv)
    guard_out(a.out, a.json, force=a.force)
    plat, rows = platform(), []
    for s in map(int, a.lengths.split(",")):
        ks = jax.random.split(jax.random.key(0), 3)
        q = jax.random.normal(ks[0], (a.batch, s, a.heads, a.head_dim), a.dtype)
        k, v = (jax.random.normal(x, (a.batch, s, a.kv_heads or a.heads, a.head_dim), a.dtype)
                for x in ks[1:])
        auto = attention_impl("auto", s, plat, a.dtype, a.head_dim)
        for name, fn in impls(plat).items():
            r = {"platform": plat, "seq": s, "impl": name, "auto": name == auto}
            try:  # one implementation failing (a kernel the GPU rejects) keeps the others' rows
                r.update(measure(fn, q, k, v, a.reps))
            except Exception as e:  # noqa: BLE001
                r.update(ms=None, temp_bytes=None, error=f"{type(e).__name__}: {e}"[:300])
                print(f"{plat} s={s:5d} {name:9s} FAILED {r['error']}", flush=True)
                rows.append(r)
                continue
            rows.append(r)
            print(f"{plat} s={s:5d} {name:9s} {r['ms']:9.2f} ms  temp "
                  f"{(r['temp_bytes'] or 0) / 2**20:8.1f} MiB{'  <- auto' if r['auto'] else ''}",
                  flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))
    if a.out and not any(r.get("error") for r in rows):
        write_result(a.out, report(rows, a, sys.argv[1:] if argv is None else argv))
    picked = {r["impl"] for r in rows if r["auto"]}
    failed = [f"{r['impl']} at {r['seq']}" for r in rows if r.get("error")]
    if failed:
        print(f"error: {', '.join(failed)} failed (see above)", file=sys.stderr)
        return 1
    if a.require_auto and picked != {a.require_auto}:
        print(f"error: model.attention=auto picked {sorted(picked)} on {plat}, not "
              f"{a.require_auto}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
