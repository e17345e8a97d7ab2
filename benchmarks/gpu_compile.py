"""CoLA-1B and CoLA-7B on Perlmutter: the analytic model against the training step compiled for
the A100 (python -m boost_jax.plan --gpu-compile), on a machine without a GPU.

    make gpu-compile-bench     # .venv-gpuc/bin/python benchmarks/gpu_compile.py

Each layout's step is compiled for compile-only A100-SXM4-40GB devices (XLA's target config,
the launcher's GPU_XLA_FLAGS) by the CUDA plugin of the gpu-compile extra; the figures are read
off the scheduled GPU program (boost_jax.plan.gpu_compile) and the analytic model
(boost_jax.plan.costmodel). Writes benchmarks/results/gpu_compile.md and copies it into
benchmarks/README.md.
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

from benchmarks.common import load_note, markdown_table, write_result  # noqa: E402
from boost_jax.config import load_config  # noqa: E402
from boost_jax.mesh import get_topology  # noqa: E402
from boost_jax.plan import dryrun  # noqa: E402
from boost_jax.plan.costmodel import Assumptions  # noqa: E402
from boost_jax.plan.gpu_compile import gpu_compile  # noqa: E402

GiB = 2 ** 30
# (config, nodes, overrides): the planner's example layout for each model
LAYOUTS = [
    ("cola-1b", 4, ["parallel.tp_mode=btp", "parallel.tp_axes=[pair]", "model.d_ff=5462"]),
    ("cola-1b", 4, ["parallel.plan=hierarchical", "parallel.tp_mode=btp",
                    "parallel.tp_axes=[pair]", "model.d_ff=5462", "train.global_batch=64",
                    "train.micro_batches=4"]),
    ("cola-7b", 8, ["parallel.plan=hierarchical", "parallel.tp_mode=btp",
                    "parallel.tp_axes=[pair]"]),
]


def one(name: str, nodes: int, overrides: list, topo):
    cfg = load_config(os.path.join(ROOT, "configs", f"{name}.yaml"), overrides)
    full = dryrun.full_sizes(cfg, topo, nodes)
    cfg = dataclasses.replace(cfg, mesh=dataclasses.replace(
        cfg.mesh, topology=topo.name, shape=dryrun.mesh_hosts(full), nodes=None))
    t0 = time.perf_counter()
    g = gpu_compile(cfg, topo, full, Assumptions(), 512)
    return cfg, g, time.perf_counter() - t0


def row(name, nodes, overrides, cfg, g, secs) -> list:
    r = {x["what"]: x for x in g.comparison}
    e = g.exposed
    lay = f"{cfg.parallel.plan}, {cfg.parallel.tp_mode} {'+'.join(cfg.parallel.tp_axes)}, " \
          f"{cfg.train.micro_batches} micro"
    mem, tmp = r["memory total"], r["memory temporaries"]
    kl, ex = r["kernels per layer"], r["exposed collective time"]
    flags = [w for w, x in r.items() if x["differs"]]
    return [name, f"{nodes} x 4", lay,
            f"{mem['analytic'] / GiB:.2f} / {mem['gpu'] / GiB:.2f}",
            f"{tmp['analytic'] / GiB:.2f} / {tmp['gpu'] / GiB:.2f}",
            f"{kl['analytic']:.0f} / {kl['gpu']:.0f}",
            f"{e['of'] - e['count']} ({e['overlap_gemm']}) of {e['of']}",
            f"{ex['analytic'] * 1e3:.1f} / {ex['gpu'] * 1e3:.1f}",
            ", ".join(flags) or "-", f"{secs:.0f}"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results",
                                                   "gpu_compile.md"))
    args = ap.parse_args()
    topo = get_topology("perlmutter")
    rows = []
    for name, nodes, ov in LAYOUTS:
        cfg, g, secs = one(name, nodes, ov, topo)
        rows.append(row(name, nodes, ov, cfg, g, secs))
        print(rows[-1], flush=True)
    head = ["model", "nodes x GPUs", "layout", "memory GiB (analytic / GPU)",
            "temporaries GiB (analytic / GPU)", "kernels per layer (analytic / GPU)",
            "collectives overlapping compute (GPU)", "exposed collective ms (analytic / GPU)",
            "differ by > 25%", "compile s"]
    text = "\n".join([
        "## CoLA-1B and CoLA-7B on Perlmutter: analytic model vs the step compiled for the A100",
        "",
        "Written by `benchmarks/gpu_compile.py` (`make gpu-compile-bench`): each layout's "
        "training step compiled for compile-only A100-SXM4-40GB devices (the CUDA plugin of "
        "the gpu-compile extra, XLA's target config, the launcher's GPU_XLA_FLAGS) on a "
        f"machine without a GPU ({load_note()}).",
        "",
        markdown_table(head, rows),
        "",
        "- memory: analytic = the cost model's total per device; GPU = memory_analysis() of "
        "the program compiled with all the model's layers (arguments + temporaries + "
        "unaliased outputs).",
        "- kernels per layer: per micro-batch, forward + backward + remat replay; analytic = "
        "the roofline's kernel list; GPU = kernel launches per step (fusions, Triton GEMMs, "
        "our Pallas kernels, copies) of the L-layer program minus the (L-1)-layer one, over "
        "the micro-batches.",
        "- collectives overlapping compute: collectives with a kernel scheduled between start "
        "and done and not synchronous (in brackets: with a GEMM among those kernels).",
        "- exposed collective ms: analytic = TP + exposed DP + once-per-step collective time; "
        "GPU = each collective's α–β time less the compute scheduled under it (its GEMM FLOPs "
        "at 70% of peak plus 4 us per kernel), per step.",
    ]) + "\n"
    write_result(args.out, text)
    print(text)


if __name__ == "__main__":
    main()
