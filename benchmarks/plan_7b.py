"""CoLA-7B, BTP TP4 over `node` + `hierarchical`, 48 Frontier nodes (384 GCDs): what the step
compiles to, against the formulas, and the best layouts `--search` finds.

    .venv/bin/python benchmarks/plan_7b.py [--out benchmarks/results/plan_7b_frontier.md]

Every figure below comes from compiling the real training step (boost_jax.plan.dryrun: the
step lowered with abstract shapes on 384 simulated CPU devices, 2 and 3 layers compiled and
extrapolated to 32) or from the formulas (boost_jax.sharding.formulas.comm_per_step,
boost_jax.plan.costmodel); nothing is typed by hand.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from boost_jax.mesh import set_cpu_devices  # noqa: E402

set_cpu_devices(384, compile_only=True)

import jax  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.common import add_out, guard_out, markdown_table, sync_readme  # noqa: E402
from boost_jax.analysis.flops import param_count  # noqa: E402
from boost_jax.config import load_config  # noqa: E402
from boost_jax.mesh import get_topology, make_mesh  # noqa: E402
from boost_jax.plan.dryrun import dry_run  # noqa: E402
from boost_jax.plan.memory import TERMS  # noqa: E402
from boost_jax.plan.search import search  # noqa: E402
from boost_jax.sharding.formulas import comm_per_step  # noqa: E402
from boost_jax.sharding.placement import make_placement  # noqa: E402
from boost_jax.step.build import abstract_params  # noqa: E402

GiB = 2 ** 30
LAYOUT = ["parallel.plan=hierarchical", "parallel.tp_mode=btp", "parallel.tp_axes=[node]"]


def config(*extra):
    return load_config(os.path.join(ROOT, "configs", "cola-7b.yaml"),
                       ["mesh.topology=frontier", "mesh.nodes=48", *extra])


def formula_global(cfg, mesh) -> float:
    """Cross-node bytes per device per step of the plan's collectives (formulas.py)."""
    pl = make_placement(cfg, mesh, abstract_params(cfg.model, cfg.train)[1])
    return comm_per_step(pl, cfg.train.micro_batches, tied=cfg.model.tie_embeddings)["global"]


def run(cfg, topo):
    t0 = time.perf_counter()
    dr = dry_run(cfg, topo, None, jax.device_count())
    return dr, time.perf_counter() - t0


TEMP_PARTS = {k: v for k, v in TERMS.items() if k not in ("secondary", "stage_inputs")}


def tp_local_bytes(cfg, p) -> float:
    """The whole model's parameters one TP rank holds, in the working dtype (param_dtype)."""
    return param_count(cfg.model) / p.layout["tp"] * np.dtype(cfg.model.param_dtype).itemsize


def temp_formula(p) -> tuple[float, dict]:
    """Temporaries of the step by the cost model (plan/memory.py): the step's gradient
    buffers, two layers' gathered weights, activations, embedding/head, logits."""
    parts = {k: p.memory[k] for k in TEMP_PARTS if p.memory.get(k)}
    return sum(parts.values()), parts


def section_layout(topo, mesh, lines):
    rows, k_rows = [], []
    cases = [(768, 8, "float32"), (768, 8, "bfloat16"), (1536, 4, "float32"),
             (1536, 8, "float32"), (1536, 16, "float32")]
    for gb, micro, wdt in cases:
        cfg = config(*LAYOUT, f"train.global_batch={gb}", f"train.micro_batches={micro}",
                     f"model.param_dtype={wdt}")
        dr, secs = run(cfg, topo)
        p = dr.prediction
        meas, form = p.comm_bytes["global"], formula_global(cfg, mesh)
        seq = gb // (micro * 96)
        row = [gb, micro, seq, wdt, f"{meas / GiB:.3f}", f"{form / GiB:.3f}",
               f"{meas / form - 1:+.1%}", f"{p.mfu:.1%}", f"{p.step_time * 1e3:,.0f}",
               f"{dr.memory['total'] / GiB:.2f}", f"{secs:.0f}"]
        (rows if gb == 768 else k_rows).append(row)
        if gb == 768 and wdt == "float32":
            main = (cfg, dr)
    head = ["global batch", "micro-batches", "seq/GCD/micro", "working weights",
            "global GiB/GCD/step (compiled)",
            "formula", "compiled vs formula", "predicted MFU", "step ms", "GiB/GCD", "compile s"]
    cfg, dr = main
    p = dr.prediction
    tf, parts = temp_formula(p)
    tc = dr.memory["temp_compiled"]
    lines += [
        "## 1. The layout at the batch it was first planned at (768 sequences)", "",
        "`configs/cola-7b.yaml` (fp32 working weights — and bf16 working weights with an fp32 "
        "master copy, `model.param_dtype=bfloat16` — remat full, seq 256) with "
        "`parallel.plan=hierarchical parallel.tp_mode=btp parallel.tp_axes=[node]`: TP4 over the "
        "4 MI250X packages of a node, weights over the GCD pair, gradients over the pair, "
        "optimizer state over pair × global = 96.", "",
        markdown_table(head, rows), "",
        f"Predicted MFU {p.mfu:.1%} (fp32 weights): the gradient reduction across nodes is "
        "deferred to once per step under TP as well. What crosses nodes is the plan's once-per-"
        "step pair: the reduce-scatter of the fp32 gradient shard over `global` and the "
        "all-gather of the updated weights (fp32 or bf16 working weights), each Ψₜ/|pair| "
        "elements × (G−1)/G, Ψₜ the TP-local parameters (formulas.py).", "",
        "Memory per GCD (compiled): arguments "
        f"{dr.memory['arguments_compiled'] / GiB:.2f} GiB, temporaries {tc / GiB:.2f} GiB "
        f"against the formula's {tf / GiB:.2f} GiB ({tc / tf - 1:+.0%}). Weights are gathered "
        "per layer under TP too, so the gathered weights in the temporaries are two layers', "
        f"{parts['gathered_weights'] / GiB:.2f} GiB, not the whole TP-local model "
        f"({tp_local_bytes(cfg, p) / GiB:.2f} GiB in the working dtype); the temporaries "
        "are dominated by the step's gradient buffers. The formula is the GPU program's "
        "(benchmarks/README.md section 11: the launcher's flags double-buffer the "
        "micro-batch loop, so the next micro-batch's zero slots are live too); the CPU "
        "program compiled here has no such flags:", "",
        markdown_table(["part of the temporaries (formula)", "GiB"],
                       [[TEMP_PARTS[k], f"{v / GiB:.3f}"] for k, v in parts.items()]
                       + [["total (formula)", f"{tf / GiB:.3f}"],
                          ["compiled (memory_analysis temp)", f"{tc / GiB:.3f}"]]), "",
        "## 2. Cross-node bytes do not grow with the micro-batches (global batch 1536)", "",
        markdown_table(head, k_rows), "",
    ]
    return p


def section_search(topo, lines, top: int):
    cfg = config("train.global_batch=1536")
    res = search(cfg, topo, {"pair": 2, "node": 4, "global": 48}, compile_top=0)
    cands = [c for c in res.fitting if c.micro_size >= 4][:top]
    rows = []
    for c in cands:
        dr, secs = run(c.config(cfg), topo)
        p = dr.prediction
        ana = p.memory["analytic_comm_bytes"]
        tp = f"{c.tp_mode} x{p.layout['tp']} [{','.join(c.tp_axes)}]" if c.tp_axes else "-"
        pp = (f"{c.pp_stages}" + (f" x{c.pp_virtual} virtual" if c.pp_virtual > 1 else "")
              if c.pp_stages > 1 else "-")
        cells = [c.key(), tp, pp, c.micro_size, c.micro_batches,
                 c.remat]
        for lv in ("pair", "node", "global"):
            m, a = p.comm_bytes[lv], ana[lv]
            cells.append(f"{m / GiB:.2f} / {a / GiB:.2f} ({(a / m - 1) if m else 0:+.0%})")
        eg = sum(p.node_egress.values())
        cells += [f"{eg / GiB:.2f} / {p.memory['analytic_node_egress'] / GiB:.2f}",
                  f"{p.mfu:.1%}", f"{dr.memory['total'] / GiB:.1f}",
                  "yes" if dr.memory["fits"] else "no", f"{secs:.0f}"]
        rows.append(cells)
    lines += [
        "## 3. The best layouts `--search` finds at ≥ 4 sequences per GCD (global batch 1536)",
        "",
        f"{len(res.fitting)} layouts fit of {res.n_evaluated - res.n_invalid - res.n_unlisted} "
        f"valid and ranked ({res.n_unlisted} hierarchical layouts with pipeline stages are not "
        "ranked: their cross-node legs stay once per step); the best "
        f"{len(cands)} with at least 4 sequences per GCD per micro-batch, each compiled. Bytes "
        "per GCD per step, compiled / analytic (cost model), by level; bytes leaving each node "
        "per step, compiled / analytic; MFU from the compiled collectives.", "",
        markdown_table(["layout (search key)", "TP", "stages", "seq/GCD/micro", "micro-batches", "remat", "pair GiB",
                        "node GiB", "global GiB", "node egress GiB", "MFU", "GiB/GCD", "fits",
                        "compile s"], rows),
        ""]


def section_batches(topo, lines, top: int = 3):
    """The analytic search at 768, 1536 and 3072 sequences: the best layouts' MFU and where
    their step goes (critical path)."""
    from boost_jax.plan.critical_path import critical_path, floor

    rows, ceilings, by_plan, bound = [], [], [], []
    for batch in (768, 1536, 3072):
        cfg = config(f"train.global_batch={batch}")
        res = search(cfg, topo, {"pair": 2, "node": 4, "global": 48}, compile_top=0)
        for plan, i, c in res.best_by_plan:
            p, cp = c.prediction, critical_path(c.prediction)
            if plan == "hierarchical":
                bound.append(once_bound(batch, c.key(), p, cp["once-per-step"]))
            by_plan.append([batch, plan, i, c.key(), f"{p.mfu:.1%}", f"{p.step_time * 1e3:.0f}",
                            *[f"{v * 1e3:.0f}" for v in cp.values()],
                            f"{sum(p.node_egress.values()) / 1e9:.2f}"])
        for i, c in enumerate(res.fitting[:top], 1):
            p = c.prediction
            cp, f = critical_path(p), floor(p)
            rows.append([batch, i, c.key(), f"{p.mfu:.1%}", f"{p.step_time * 1e3:.0f}",
                         *[f"{v * 1e3:.0f}" for v in cp.values()],
                         f"{sum(p.node_egress.values()) / 1e9:.2f}",
                         f"{f['by']} {f[f['by']] * 1e3:.0f}", f"{f['mfu_ceiling']:.1%}"])
        ceil = res.ceiling
        t = res.ceiling_layout.prediction.time
        ceilings.append([batch, ceil["key"], f"{ceil['mfu']:.1%}", ceil["by"],
                         f"{ceil['mfu_now']:.1%}", f"{t['dp'] * 1e3:.0f}",
                         f"{t['dp_latency'] * 1e3:.0f}", f"{t['dp_exposed'] * 1e3:.0f}"])
    lines += [
        "## 4. Where the best layouts' step goes, by global batch (cost model)", "",
        "`python -m boost_jax.plan --config configs/cola-7b.yaml --topology frontier --nodes 48 "
        "train.global_batch=B --search` (analytic; `/bf16` = bf16 working weights and gradient "
        "reduction; `/keep` = the backward uses the forward's gathered weights, "
        "`parallel.secondary_axes=[]`; `/xq` = hierarchical's cross-node legs in int8 weights "
        "and int4 gradients, `parallel.quantize_cross_node_*`). Critical path in ms per step: compute (with (de)quantization kernels), "
        "exposed tensor-parallel collectives and pipeline sends, exposed data-parallel "
        "traffic, pipeline bubble, once-per-step collectives + optimizer. The data-parallel "
        "bytes that leave each node per step do not shrink with the batch, the compute does: at "
        "768 sequences they bound the step. Floor: what no overlap of data-parallel traffic "
        "takes the step below, the larger of compute + TP (the critical path's compute, "
        "(de)quantization, bubble, TP collectives and pipeline sends) and node egress (the "
        "node's bytes through its NICs at the model's efficiency); MFU ceiling: the MFU of a "
        "step that takes only its floor.", "",
        markdown_table(["sequences", "#", "layout", "MFU", "step ms", "compute", "exposed TP",
                        "exposed DP", "bubble", "once-per-step", "node egress GB", "floor ms",
                        "MFU ceiling"], rows), "",
        "The fitting layout with the highest MFU ceiling at each batch (every data-parallel "
        "collective hidden), its predicted MFU, and its data-parallel collectives in ms per "
        "step: all of them, their per-call latency (α per call, the calls as the GPU program "
        "runs them: about one per layer and pass), and what is exposed:", "",
        markdown_table(["sequences", "layout", "MFU ceiling", "floor", "MFU", "DP ms",
                        "of it latency", "exposed"], ceilings), "",
        "The best layout of each plan at each batch (`best_by_plan` of `--search --json`), its "
        "rank among all fitting layouts and its critical path in ms per step:", "",
        markdown_table(["sequences", "plan", "rank", "layout", "MFU", "step ms", "compute",
                        "exposed TP", "exposed DP", "bubble", "once-per-step",
                        "node egress GB"], by_plan), "",
        "What bounds hierarchical's once-per-step share (its best layout at each batch, ms per "
        "step): the data-parallel collectives run one after another (XLA's latency-hiding "
        "scheduler keeps one collective in flight, xla_gpu_experimental_parallel_collective_"
        "overlap_limit's default 1, which the launcher leaves; `--gpu-compile` reports it "
        "from the scheduled program, and the A100 programs of tests/unit/test_gpu_compile.py "
        "hold 1), behind the compute (bubble excluded), so at least their time "
        "less that compute stays exposed, whichever pass the cross-node legs run in. Where "
        "that floor is over 5% of the step, no schedule of the legs brings the once-per-step "
        "share to 5%:", "",
        markdown_table(["sequences", "layout", "step", "DP collectives", "compute they hide "
                        "behind", "exposed DP, floor", "floor / step", "exposed DP",
                        "once-per-step (legs, step-end, optimizer)", "once-per-step / step"],
                       bound), ""]


def once_bound(batch: int, key: str, p, once: float) -> list:
    """A row of the once-per-step bound: max(0, DP − compute) exposed on one stream."""
    t = p.time
    busy = t["compute"] - t["bubble"]
    floor_ms = max(0.0, t["dp"] - busy)
    return [batch, key, f"{p.step_time * 1e3:.0f}", f"{t['dp'] * 1e3:.0f}",
            f"{busy * 1e3:.0f}", f"{floor_ms * 1e3:.0f}", f"{floor_ms / p.step_time:.1%}",
            f"{t['dp_exposed'] * 1e3:.0f}", f"{once * 1e3:.0f}", f"{once / p.step_time:.1%}"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_out(ap, os.path.join(ROOT, "benchmarks", "results", "plan_7b_frontier.md"))
    ap.add_argument("--top", type=int, default=5)
    a = ap.parse_args()
    guard_out(a.out, force=a.force)
    t0 = time.time()
    topo = get_topology("frontier")
    mesh = make_mesh(topo, [2, 4, 48])
    lines = ["# CoLA-7B, BTP TP4 + `hierarchical`, 48 Frontier nodes", "",
             "Reproduce: `.venv/bin/python benchmarks/plan_7b.py` (384 simulated CPU devices; "
             "compiles the step about 18 times).", ""]
    section_layout(topo, mesh, lines)
    section_search(topo, lines, a.top)
    section_batches(topo, lines)
    lines += [f"Generated in {time.time() - t0:.0f} s.", ""]
    text = "\n".join(lines)
    print(text)
    with open(a.out, "w") as f:
        f.write(text)
    sync_readme(a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
