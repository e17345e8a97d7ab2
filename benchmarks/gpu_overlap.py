"""What the GPU schedule hides, per plan × TP mode: the table `--overlap gpu` costs with.

    .venv-gpuc/bin/python benchmarks/gpu_overlap.py      # the gpu-compile extra's venv

For every preset plan and TP mode (none, Megatron on the full-rank model, vanilla and BTP on
CoLA), at 2 and at 4 micro-batches of 16 sequences, the training step of a 4-layer
CoLA-1B-shaped model on 2 Perlmutter nodes (8 x A100-SXM4-40GB, TP over the GPU pair) is
compiled for compile-only devices with the launcher's XLA flags (boost_jax.plan.gpu_compile).
(At one micro-batch there is no micro-batch loop: every collective is once per step.) From the scheduled program, per phase of the step
(tensor-parallel, per micro-batch data-parallel, once per step): the share of its collective
time the compute scheduled between start and done hides, and the kernels per layer. Writes
boost_jax/plan/gpu_overlap.json (read by the cost model) and benchmarks/results/gpu_overlap.md.
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
from boost_jax.plan.overlap import TABLE_PATH, key  # noqa: E402

PLANS = ("ddp", "zero1", "zero3", "zeropp", "hierarchical")
MODES = ("none", "megatron", "vanilla", "btp")
# 4 layers: the counts are the 3- and 4-layer programs' difference, both real (double-buffered)
# layer loops; with 2 layers XLA unrolls the 1- and 2-trip loops and fuses across layers, and
# hierarchical/btp's measured 194 kernels per layer where the 24-layer CoLA-1B runs 332
BASE = ["model.n_layers=4", "model.d_ff=5462"]
MICRO = (2, 4)  # micro-batches of 16 sequences (2 per device) each
SEQS_PER_MICRO = 16


def measure(plan: str, mode: str, topo, micro: int) -> dict:
    ov = [*BASE, f"train.global_batch={SEQS_PER_MICRO * micro}", f"train.micro_batches={micro}",
          f"parallel.plan={plan}"]
    if mode != "none":
        ov += [f"parallel.tp_mode={mode}", "parallel.tp_axes=[pair]"]
    if mode == "megatron":
        ov.append("model.arch=full")
    cfg = load_config(os.path.join(ROOT, "configs", "cola-1b.yaml"), ov)
    full = dryrun.full_sizes(cfg, topo, 2)
    cfg = dataclasses.replace(cfg, mesh=dataclasses.replace(
        cfg.mesh, topology=topo.name, shape=dryrun.mesh_hosts(full), nodes=None))
    t0 = time.perf_counter()
    g = gpu_compile(cfg, topo, full, Assumptions(), 512)
    prog = next(p for p in g.programs if p.kernels == g.kernels_per_step)
    total, exposed = {}, {}
    for c in prog.collectives:
        ph = c["phase"]
        total[ph] = total.get(ph, 0.0) + c["comm_s_per_call"] * c["trips"]
        exposed[ph] = exposed.get(ph, 0.0) + c["exposed_s_per_call"] * c["trips"]
    hidden = {ph: round(1.0 - exposed[ph] / total[ph], 3) for ph in total if total[ph] > 0}
    return {"hidden": hidden, "kernels_per_layer": g.kernels_per_layer,
            "analytic_kernels_per_layer": roofline_kernels_per_layer(cfg, full, Assumptions()),
            "device": g.device_kind, "compile_s": round(time.perf_counter() - t0, 1)}


def report(table: dict) -> str:
    def pct(x):
        return "-" if x is None else f"{x:.0%}"

    body = [[k, mb, pct(v["hidden"].get("tp")), pct(v["hidden"].get("dp")),
             pct(v["hidden"].get("step")),
             f"{v['analytic_kernels_per_layer']:.0f} / {v['kernels_per_layer']:.0f}",
             f"{v['compile_s']:.0f}"]
            for k, by_micro in table["layouts"].items() for mb, v in by_micro.items()]
    head = ["plan / TP mode", "micro-batches", "TP hidden", "per-micro-batch DP hidden", "once-per-step hidden",
            "kernels per layer (analytic / GPU)", "compile s"]
    return "\n".join([
        "## What the GPU schedule hides, per plan × TP mode",
        "",
        "Written by `benchmarks/gpu_overlap.py` (the gpu-compile extra's venv): the step of a "
        f"4-layer CoLA-1B-shaped model on {table['devices']} ({table['mesh']}), "
        f"{SEQS_PER_MICRO} sequences per micro-batch, compiled for "
        f"compile-only GPUs with the launcher's XLA flags, on a machine without a GPU "
        f"({load_note()}). `hidden` = the share of a phase's collective time (α–β, at the "
        "full mesh) covered by the compute XLA scheduled between the collective's start and "
        "done (its GEMM FLOPs at 70% of peak plus 4 us per kernel); `-` = no collective of "
        "that phase. `python -m boost_jax.plan ... --overlap gpu` costs each phase's exposed "
        "time with these shares (boost_jax/plan/gpu_overlap.json), taken at the measured "
        "micro-batch count nearest the layout's; the default `--overlap "
        "xla` keeps the assumption the validation rows were checked with.",
        "",
        markdown_table(head, body), ""])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_out(ap, os.path.join(ROOT, "benchmarks", "results", "gpu_overlap.md"))
    ap.add_argument("--table", default=TABLE_PATH)
    args = ap.parse_args()
    guard_out(args.out, args.table, force=args.force, own=[TABLE_PATH])
    topo = get_topology("perlmutter")
    layouts = {}
    for plan in PLANS:
        for mode in MODES:
            for micro in MICRO:
                m = measure(plan, mode, topo, micro)
                layouts.setdefault(key(plan, mode), {})[str(micro)] = m
                print(key(plan, mode), micro, m, flush=True)
    first = next(iter(next(iter(layouts.values())).values()))
    table = {"written_by": "benchmarks/gpu_overlap.py", "target": "perlmutter",
             "devices": f"8 x {first['device']}", "mesh": "pair 2 x node 2 x global 2",
             "model": "configs/cola-1b.yaml " + " ".join(BASE),
             "sequences_per_micro_batch": SEQS_PER_MICRO, "layouts": layouts}
    with open(args.table, "w") as f:
        json.dump(table, f, indent=1)
        f.write("\n")
    text = report(table)
    write_result(args.out, text)
    print(text)


if __name__ == "__main__":
    main()
