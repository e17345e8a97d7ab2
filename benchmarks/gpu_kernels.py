"""Kernels per block as XLA emits them for the GPU, per arch × family × TP mode × remat mode: the
table the cost model counts launches with (boost_jax/plan/gpu_kernels.json).

    .venv-gpuc/bin/python benchmarks/gpu_kernels.py      # the gpu-compile extra's venv

For each cell, the training step of CoLA-1B (24 layers, 64 sequences in 8 micro-batches; plan
ddp, TP over the GPU pair where a TP mode is set) on 2 Perlmutter nodes of 80 GB A100s is
compiled for compile-only devices with the launcher's XLA flags (boost_jax.plan.gpu_compile)
with 23 and with 24 layers; kernels per layer = the difference of their kernel launches over
the micro-batches. Megatron TP is for the full-rank model, vanilla
and BTP for the low-rank ones; remat=lowrank is remat=full for a full-rank block. Writes
boost_jax/plan/gpu_kernels.json and benchmarks/results/gpu_kernels.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
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
from boost_jax.plan.gpu_compile import gpu_compile, roofline_kernels_per_layer  # noqa: E402
from boost_jax.plan.gpu_kernels import TABLE_PATH, key  # noqa: E402

ARCHS = ("full", "cola")
FAMILIES = ("llama", "gpt_neox")
MODES = {"full": ("none", "megatron"), "cola": ("none", "vanilla", "btp")}
REMATS = {"full": ("none", "full"), "cola": ("none", "full", "lowrank")}
# CoLA-1B's depth, batch and 8 micro-batches, as configured: the count depends on the shape
# compiled (cola/btp/full: 119.5 with 3 layers and 2 micro-batches, 125 with 6, 158 here)
# (64 sequences, 80 GB A100s: where the step does not fit, XLA's own rematerialization changes
# the program: the full-rank model without TP needs 35 GiB and counted 711 kernels a layer)
BASE = ["model.d_ff=5462", "train.global_batch=64"]


def cells():
    for arch in ARCHS:
        for family in FAMILIES:
            for mode in MODES[arch]:
                for remat in REMATS[arch]:
                    yield arch, family, mode, remat


def measure(arch: str, family: str, mode: str, remat: str, topo) -> dict:
    ov = [*BASE, f"model.arch={arch}", f"model.family={family}", f"train.remat={remat}"]
    if mode != "none":
        ov += [f"parallel.tp_mode={mode}", "parallel.tp_axes=[pair]"]
    cfg = load_config(os.path.join(ROOT, "configs", "cola-1b.yaml"), ov)
    full = dryrun.full_sizes(cfg, topo, 2)
    cfg = dataclasses.replace(cfg, mesh=dataclasses.replace(
        cfg.mesh, topology=topo.name, shape=dryrun.mesh_hosts(full), nodes=None))
    t0 = time.perf_counter()
    g = gpu_compile(cfg, topo, full, Assumptions(), 512)
    return {"kernels_per_layer": g.kernels_per_layer,
            "analytic_kernels_per_layer": roofline_kernels_per_layer(cfg, full, Assumptions(
                attention="flash")),
            "device": g.device_kind, "compile_s": round(time.perf_counter() - t0, 1)}


def report(table: dict) -> str:
    body = [[k, f"{v['analytic_kernels_per_layer']:.0f}", f"{v['kernels_per_layer']:.0f}",
             f"{v['kernels_per_layer'] / v['analytic_kernels_per_layer']:.2f}",
             f"{v['compile_s']:.0f}"] for k, v in table["layouts"].items()]
    head = ["arch / family / TP mode / remat", "kernels per layer (roofline)",
            "kernels per layer (GPU)", "GPU / roofline", "compile s"]
    return "\n".join([
        "## Kernels per block as XLA emits them for the GPU",
        "",
        "Written by `benchmarks/gpu_kernels.py` (the gpu-compile extra's venv): the step of a "
        f"CoLA-1B on {table['devices']} ({table['mesh']}), plan ddp, 64 sequences in 8 "
        "micro-batches, compiled for compile-only GPUs with the launcher's XLA flags with 23 "
        f"and 24 layers, on a machine without a GPU ({load_note()}). Kernels per layer: per "
        "micro-batch, forward + backward + remat replay (the 24-layer program's launches "
        "less the 23-layer one's); roofline = "
        "roofline.block_kernels. The cost model charges the difference at 4 us a launch "
        "(boost_jax/plan/gpu_kernels.json, read by plan/overlap.py gpu_launch_seconds).",
        "",
        markdown_table(head, body), ""])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_out(ap, os.path.join(ROOT, "benchmarks", "results", "gpu_kernels.md"))
    ap.add_argument("--table", default=TABLE_PATH)
    args = ap.parse_args()
    guard_out(args.out, args.table, force=args.force, own=[TABLE_PATH])
    topo = get_topology("perlmutter-80")  # the full-rank model without TP needs > 40 GB
    layouts = {}
    for arch, family, mode, remat in cells():
        m = measure(arch, family, mode, remat, topo)
        layouts[key(arch, family, mode, remat)] = m
        print(key(arch, family, mode, remat), m, flush=True)
    first = next(iter(layouts.values()))
    table = {"written_by": "benchmarks/gpu_kernels.py", "target": "perlmutter-80",
             "devices": f"8 x {first['device']}", "mesh": "pair 2 x node 2 x global 2",
             "model": "configs/cola-1b.yaml " + " ".join(BASE), "layouts": layouts}
    with open(args.table, "w") as f:
        json.dump(table, f, indent=1)
        f.write("\n")
    text = report(table)
    write_result(args.out, text)
    print(text)


if __name__ == "__main__":
    main()
