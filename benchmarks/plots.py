"""PNG figures from the cost model (analytic; no compile).

    .venv/bin/python benchmarks/plots.py --out benchmarks/results

plan_bytes_per_level.png     collective bytes per device per step, by plan and topology level
                             (CoLA-7B on 48 Frontier nodes)
plan_weak_scaling.png        predicted weak-scaling efficiency vs nodes, by plan (CoLA-7B, and
                             the 20B GPT of the LBP validation), fixed per-device batch
plan_boost_iteration.png     predicted vs published iteration time, full-rank / vanilla TP / BTP
                             by model size (the BOOST validation setup on Perlmutter)
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import published  # noqa: E402
from benchmarks.common import RESULTS, guard_out  # noqa: E402
from boost_jax.config import load_config  # noqa: E402
from boost_jax.mesh import get_topology  # noqa: E402
from boost_jax.plan.costmodel import Assumptions, predict  # noqa: E402

PLANS = ("ddp", "zero1", "zero3", "zeropp", "hierarchical")
NODES = (1, 2, 4, 8, 16, 32, 48, 64)


def _cola7b(plan: str, nodes: int, per_device: int = 1, micro: int = 8, extra=()):
    return load_config("configs/cola-7b.yaml", [
        f"parallel.plan={plan}", f"train.global_batch={nodes * 8 * per_device * micro}",
        f"train.micro_batches={micro}", "mesh.topology=frontier", *extra])


PNGS = ("plan_bytes_per_level.png", "plan_weak_scaling.png", "plan_boost_iteration.png")


def bytes_per_level(out: str, a: Assumptions) -> str:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    topo = get_topology("frontier")
    sizes = {"pair": 2, "node": 4, "global": 48}
    rows = {p: predict(_cola7b(p, 48), topo, sizes, a).comm_bytes for p in PLANS}
    fig, ax = plt.subplots(figsize=(6.4, 3.6), dpi=100)
    x = np.arange(len(PLANS))
    for i, lv in enumerate(("pair", "node", "global")):
        ax.bar(x + (i - 1) * 0.27, [rows[p][lv] / 1e9 for p in PLANS], 0.27, label=lv)
    ax.set_xticks(x, PLANS)
    ax.set_yscale("log")
    ax.set_ylabel("GB sent per device per step")
    ax.set_title("CoLA-7B, 384 GCDs (48 Frontier nodes), 8 micro-batches x 1 seq x 256",
                 fontsize=9)
    ax.legend(title="level", fontsize=8)
    fig.tight_layout()
    path = os.path.join(out, "plan_bytes_per_level.png")
    fig.savefig(path)
    plt.close(fig)
    return path


def weak_scaling(out: str, a: Assumptions) -> str:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    topo = get_topology("frontier")
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.6), dpi=100, sharey=True)
    panels = (("CoLA-7B (fp32 weights), 8 micro-batches x 1 x 256 per GCD",
               lambda p, n: _cola7b(p, n)),
              ("20B GPT (LBP validation), 1 x 2048 per GCD", lambda p, n: published.lbp_config(p, n)))
    for ax, (title, make) in zip(axes, panels):
        for k, plan in enumerate(PLANS):
            pts = []
            for n in NODES:
                pr = predict(make(plan, n), topo, {"pair": 2, "node": 4, "global": n}, a)
                if pr.fits:
                    pts.append((n, pr.tflops_per_device))
            if not pts:
                continue
            base = pts[0][1]
            # one colour per plan in both panels, whichever plans fit
            ax.plot([n for n, _ in pts], [t / base for _, t in pts], marker="o", ms=3,
                    color=f"C{k}", label=f"{plan} (base {pts[0][0]} node{'s' if pts[0][0] > 1 else ''})")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("nodes (8 GCDs each)")
        ax.set_title(title, fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    axes[0].set_ylabel("TFLOP/s per GCD / TFLOP/s at base")
    fig.suptitle("predicted weak-scaling efficiency (only node counts where the plan fits)",
                 fontsize=10)
    fig.tight_layout()
    path = os.path.join(out, "plan_weak_scaling.png")
    fig.savefig(path)
    plt.close(fig)
    return path


def boost_iteration(out: str) -> str:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    V = published
    preds = V.boost_predictions(V.VALIDATION_ASSUMPTIONS)
    sizes = list(preds)
    fig, ax = plt.subplots(figsize=(6.4, 3.6), dpi=100)
    x = np.arange(len(sizes))
    for i, m in enumerate(("full", "vanilla", "btp")):
        ax.bar(x + (i - 1) * 0.27, [preds[s][m].step_time for s in sizes], 0.27,
               label=f"{m} predicted", color=f"C{i}")
        ax.scatter(x + (i - 1) * 0.27, [V.BOOST_PUBLISHED[s][i] for s in sizes], marker="_",
                   s=300, color="k", zorder=3, label="published" if i == 0 else None)
    ax.set_xticks(x, [f"{s} TP{V.BOOST_SHAPES[s]['tp']}" + (" PP2*" if V.BOOST_SHAPES[s]["pp"] > 1
                                                              else "") for s in sizes])
    ax.set_ylabel("iteration seconds (batch 4 x 4096)")
    ax.set_title("Perlmutter A100: full-rank (Megatron) / CoLA vanilla TP / CoLA BTP\n"
                 "* pipeline modelled analytically", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = os.path.join(out, "plan_boost_iteration.png")
    fig.savefig(path)
    plt.close(fig)
    return path


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="benchmarks/plots.py")
    p.add_argument("--out", default=RESULTS, help="the folder the three PNGs go into")
    p.add_argument("--force", action="store_true",
                   help="replace PNGs of these names in a folder outside benchmarks/results/")
    args = p.parse_args(argv)
    guard_out(*(os.path.join(args.out, n) for n in PNGS), force=args.force)
    os.makedirs(args.out, exist_ok=True)
    a = Assumptions()
    for path in (bytes_per_level(args.out, a), weak_scaling(args.out, a),
                 boost_iteration(args.out)):
        print(path, os.path.getsize(path), "bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
