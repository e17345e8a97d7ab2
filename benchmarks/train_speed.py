"""Training speed of config variants on this machine's devices, timed side by side.

    python benchmarks/train_speed.py --config configs/cola-1b.yaml \\
        --set train.global_batch=64 train.micro_batches=1 mesh.topology=dgx-h100 \\
        --variant pallas parallel.tp_mode=btp "parallel.tp_axes=[pair]" parallel.kernels=pallas \\
        --variant xla parallel.tp_mode=btp "parallel.tp_axes=[pair]" parallel.kernels=xla \\
        --variant full model.arch=full --json speed.json

Every variant is the config plus `--set` plus its own overrides, run with the framework's
training step (build_step; the data pipeline is left out: one fixed batch of random tokens).
All variants are compiled first, then timed in alternating rounds of `--iters` steps each, so
drift hits all alike; every variant takes the same steps on the same batch from the same init,
so their losses compare too. Per variant: tokens/s as median, min and max over the rounds;
MFU = model FLOPs per token (3x forward, no recompute; analysis/flops.py) x tokens/s over
devices x the topology's peak; compile seconds; compiled temporaries (and, in the header, the
process's peak device memory where the backend reports it). A variant that fails to build or
compile is reported and skipped; --deadline-s keeps the whole run inside a time box.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import (add_json, early_cpu_devices, guard_out,  # noqa: E402
                               interleaved_samples, markdown_table, positive_int)

early_cpu_devices()

import jax  # noqa: E402
import numpy as np  # noqa: E402

from boost_jax.analysis.flops import flops_per_token  # noqa: E402
from boost_jax.config import load_config  # noqa: E402
from boost_jax.layers.forward import compiled_impl  # noqa: E402
from boost_jax.mesh import get_topology, mesh_from_config  # noqa: E402
from boost_jax.step.build import build_step  # noqa: E402


def prepare(name: str, cfg):
    """Build, initialise and compile one variant -> (step thunk, info dict)."""
    t0 = time.perf_counter()
    bundle = build_step(cfg, mesh_from_config(cfg))
    b, s = cfg.train.global_batch, cfg.data.seq_len
    tokens = np.random.default_rng(0).integers(0, cfg.model.vocab_size, (b, s + 1), np.int32)
    batch = jax.device_put({"inputs": tokens[:, :-1], "targets": tokens[:, 1:]},
                           bundle.batch_sharding)
    compiled = bundle.train_step.lower(bundle.abstract_state, batch).compile()
    holder = {"state": bundle.init_state(), "loss": None}

    def step():
        holder["state"], m = compiled(holder["state"], batch)
        holder["loss"] = m["loss"]
        return m["loss"]

    mem = compiled.memory_analysis()
    attn = compiled_impl(cfg.model, s)  # MFU counts the attention FLOPs of what was compiled
    info = dict(variant=name, arch=cfg.model.arch, tp_mode=cfg.parallel.tp_mode,
                kernels=cfg.parallel.kernels, n_params=bundle.n_params,
                tokens_per_step=b * s, compile_s=time.perf_counter() - t0,
                temp_gib=getattr(mem, "temp_size_in_bytes", 0) / 2**30,
                attention=attn, flops_per_token=flops_per_token(cfg.model, s, attn)["train"])
    print(f"{name}: built and compiled in {info['compile_s']:.1f} s "
          f"({bundle.n_params / 1e6:.1f}M params)", flush=True)
    return step, holder, info


def build_all(a, deadline):
    """prepare() each variant, in order, until the deadline -> (fns, holders, rows, peak)."""
    fns, holders, rows = {}, {}, {}
    peak = None  # FLOP/s of all devices, from the (shared) topology of a built variant
    for name, *overrides in a.variant:
        if deadline is not None and time.perf_counter() > deadline:
            rows[name] = dict(variant=name, error=f"skipped: past --deadline-s {a.deadline_s:g}")
            continue
        try:
            cfg = load_config(a.config, [*a.set, "train.steps=1000000", *overrides])
            fns[name], holders[name], rows[name] = prepare(name, cfg)
            peak = get_topology(cfg.mesh.topology).peak_flops * jax.device_count()
        except Exception as e:  # one broken variant must not cost the others' figures
            traceback.print_exc()
            rows[name] = dict(variant=name, error=f"{type(e).__name__}: {e}"[:500])
    return fns, holders, rows, peak


def report(a, rows: dict) -> None:
    """Print the table (and failures); write --json."""
    # all variants live in one process: the peak is theirs together
    peak_mem = (jax.devices()[0].memory_stats() or {}).get("peak_bytes_in_use")
    header = (f"backend={jax.default_backend()} device={jax.devices()[0].device_kind} "
              f"x{jax.device_count()} jax={jax.__version__} config={a.config} "
              f"set={' '.join(a.set)} rounds={a.rounds}, {a.iters} steps each, peak_mem="
              + (f"{peak_mem / 2**30:.1f}GiB" if peak_mem else "n/a"))
    table = [[r["variant"], f"{r['n_params'] / 1e6:.1f}", f"{r['ms_per_step']:.1f}",
              f"{r['tokens_per_s']:,.0f}",
              f"{r['tokens_per_s_min']:,.0f} - {r['tokens_per_s_max']:,.0f}",
              f"{100 * r['mfu']:.1f}%", f"{r['final_loss']:.4f}", f"{r['compile_s']:.0f}",
              f"{r['temp_gib']:.2f}"] for r in rows.values() if "tokens_per_s" in r]
    print(header)
    print(markdown_table(["variant", "params (M)", "ms/step", "tokens/s (median)",
                          "tokens/s (min - max)", "MFU", "loss", "compile s", "temp GiB"], table))
    for r in rows.values():
        if "error" in r:
            print(f"{r['variant']}: FAILED: {r['error']}")
    if a.json:
        Path(a.json).write_text(json.dumps(dict(header=header, rows=list(rows.values())),
                                           indent=1))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="configs/cola-1b.yaml")
    p.add_argument("--set", nargs="*", default=[], metavar="K=V", help="overrides for all")
    p.add_argument("--variant", nargs="+", action="append", required=True,
                   metavar=("NAME", "K=V"), help="a variant: its name and its own overrides")
    p.add_argument("--rounds", type=positive_int, default=5)
    p.add_argument("--iters", type=int, default=3, help="steps per round")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps after compiling")
    add_json(p)
    p.add_argument("--deadline-s", type=float, default=None,
                   help="past this many seconds compile no further variant and start no "
                        "new round (report what was measured within a time box)")
    p.add_argument("--cpu-devices", type=int, help="simulate N CPU devices")
    a = p.parse_args(argv)
    guard_out(a.json, force=a.force, inputs={"--config": a.config})
    deadline = None if a.deadline_s is None else time.perf_counter() + a.deadline_s
    fns, holders, rows, peak = build_all(a, deadline)
    samples = interleaved_samples({k: (lambda f=f: jax.block_until_ready(f())) for k, f in
                                   fns.items()}, a.rounds, a.iters, a.warmup, deadline)
    for name, secs in samples.items():
        r = rows[name]
        tps = [r["tokens_per_step"] / s for s in secs]
        r.update(tokens_per_s=statistics.median(tps), tokens_per_s_min=min(tps),
                 tokens_per_s_max=max(tps), ms_per_step=1e3 * statistics.median(secs),
                 rounds=len(secs), steps=a.warmup + len(secs) * a.iters,
                 final_loss=float(holders[name]["loss"]))
        r["mfu"] = r["flops_per_token"] * r["tokens_per_s"] / peak
    report(a, rows)
    return 1 if any("error" in r for r in rows.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
