"""A scanned and an unscanned layer stack (`train.scan_layers`) compiled for the A100: the same
gathers and the same memory, on a machine without a GPU.

    make gpu-compile-bench     # .venv-gpuc/bin/python benchmarks/gpu_scan_layers.py

The demo model (configs/demo.yaml, 4 layers) under zero3 with remat=full on 2 Perlmutter nodes,
compiled for compile-only A100 devices (boost_jax.plan.gpu_compile) with its layers in one
scan and as 4 separate layers. Each layer's checkpoint must keep its backward replay (its
weight gathers included) apart from its forward: an unscanned step that merged them would keep
every layer's gathered weights and saved activations until the backward, gather each weight
once, and hold several times the scanned step's temporaries (on XLA:CPU the barriers are
dropped, so only a GPU program shows it). Writes benchmarks/results/gpu_scan_layers.md (copied
into benchmarks/README.md); tests/unit/test_gpu_compile.py holds the same two figures.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from boost_jax.plan import gpu_target  # noqa: E402

gpu_target.prepare_env()  # before JAX starts

from benchmarks.common import add_out, guard_out, load_note, markdown_table, write_result  # noqa: E402
from boost_jax.config import load_config  # noqa: E402
from boost_jax.mesh import get_topology  # noqa: E402
from boost_jax.plan import dryrun  # noqa: E402
from boost_jax.plan.costmodel import Assumptions  # noqa: E402
from boost_jax.plan.gpu_compile import gpu_compile  # noqa: E402

MiB = 2 ** 20
NODES = 2
OVERRIDES = ["parallel.plan=zero3", "train.remat=full"]


def measure(scan: bool) -> dict:
    """Gathered and reduce-scattered bytes per step and memory of the compiled step."""
    topo = get_topology("perlmutter")
    cfg = load_config(os.path.join(ROOT, "configs", "demo.yaml"),
                      OVERRIDES + [f"train.scan_layers={str(scan).lower()}"])
    full = dryrun.full_sizes(cfg, topo, NODES)
    cfg = dataclasses.replace(cfg, mesh=dataclasses.replace(
        cfg.mesh, topology=topo.name, shape=dryrun.mesh_hosts(full), nodes=None))
    t0 = time.perf_counter()
    g = gpu_compile(cfg, topo, full, Assumptions(), 64)
    prog = g.programs[-1]
    moved = {k: sum(c["bytes_per_step"] for c in prog.collectives if c["kind"] == k)
             for k in ("all-gather", "reduce-scatter")}
    return {"scan": scan, "layers": prog.n_layers, "device": g.device_kind, **moved,
            "temp": g.memory["temp"], "total": g.memory["total"],
            "seconds": time.perf_counter() - t0}


def report(rows: list) -> str:
    scanned = rows[0]
    table = markdown_table(
        ["layers", "all-gather MiB / step", "reduce-scatter MiB / step", "temporaries MiB",
         "memory MiB", "temporaries / scanned"],
        [["one scan" if r["scan"] else f"{r['layers']} separate",
          f"{r['all-gather'] / MiB:.2f}", f"{r['reduce-scatter'] / MiB:.2f}",
          f"{r['temp'] / MiB:.2f}", f"{r['total'] / MiB:.2f}",
          f"{r['temp'] / scanned['temp']:.2f}"] for r in rows])
    return "\n".join([
        "## A scanned and an unscanned layer stack compiled for the A100",
        "",
        "Written by `benchmarks/gpu_scan_layers.py` (`make gpu-compile-bench`): "
        f"configs/demo.yaml ({rows[0]['layers']} layers), {' '.join(OVERRIDES)}, on "
        f"{NODES} Perlmutter nodes, compiled for {rows[0]['device']} without a GPU "
        f"({load_note()}; {sum(r['seconds'] for r in rows):.0f} s).",
        "",
        table,
        "",
        "- all-gather: each weight is gathered in the forward and again in the backward's "
        "replay (remat=full), scanned or not.",
        "- temporaries: memory_analysis() of the compiled step; the unscanned step keeps no "
        "layer's gathered weights or activations beyond its own pass.",
    ])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_out(ap, os.path.join(ROOT, "benchmarks", "results", "gpu_scan_layers.md"))
    args = ap.parse_args()
    guard_out(args.out, force=args.force)
    rows = [measure(True), measure(False)]
    text = report(rows)
    write_result(args.out, text)
    print(text)


if __name__ == "__main__":
    main()
