"""Placement plans on a CoLA-1B-shaped model: bytes per level per step and memory per device.

    python benchmarks/partitioning.py                     # 8 and 64 simulated devices, all plans
    python benchmarks/partitioning.py --devices 8 --plans zero3,hierarchical --micro 4

Each device count runs in its own subprocess (`--cpu-devices N` must precede JAX's start).
The whole training step (micro-batch scan, per-layer gathers, backward, AdamW) is lowered with
abstract shapes (jax.ShapeDtypeStruct: no arrays are allocated) and compiled for CPU; the
collectives are read from the compiled HLO by boost_jax.analysis.comm. All 24 layers are
compiled (the layer loop is a scan, so compile time does not grow with depth).

Columns: `measured` = comm.py's bytes, which undo two XLA:CPU artifacts (bf16 reductions
promoted to fp32; reduce-scatter lowered as all-reduce + dynamic-slice); `comm.py raw` = the
bytes read off the CPU program (`per_level(raw=True)`); `formula` = formulas.comm_per_step.
Memory: `state` = weights + fp32 master + Adam moments per device as predicted by the plan and
as measured (compiled argument bytes minus the token batch); `grads` = the fp32 micro-batch
accumulator; `secondary` = saved hpZ/LBP partitions (all layers); `temp` = compiled temp bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.common import add_out, guard_out  # noqa: E402

PLANS = ("ddp", "zero1", "zero3", "zeropp", "zeropp-no-qgz", "hierarchical")
VARIANTS = {"zeropp-no-qgz": ["parallel.plan=zeropp", "parallel.quantize_grads=false"]}
MB = 1e6


def worker(args) -> None:
    from boost_jax.mesh import set_cpu_devices

    set_cpu_devices(args.cpu_devices, compile_only=True)
    import jax

    from boost_jax.analysis.comm import analyze_compiled, host_egress
    from boost_jax.plan.costmodel import dp_collectives
    from boost_jax.config import load_config
    from boost_jax.backends.cpu import fast_compile_options
    from boost_jax.mesh import mesh_from_config
    from boost_jax.sharding.formulas import comm_per_step
    from boost_jax.step.build import build_step

    n = args.cpu_devices
    topo = "cpu" if n <= 8 else "frontier"  # 8 → (2,2,2); 64 → (2,4,8)
    rows = []
    for tp, plan in [(t, p) for t in args.tp.split(",") for p in args.plans.split(",")]:
        # d_ff 5461 does not split over TP 2: the TP rows use 5462 (still padded for the plans)
        tp_over = [] if tp == "none" else [f"parallel.tp_mode={tp}", "parallel.tp_axes=[pair]",
                                           "model.d_ff=5462"]
        overrides = ["model.param_dtype=bfloat16", "model.dtype=bfloat16",
                     f"train.micro_batches={args.micro}", f"train.global_batch={args.batch}",
                     f"data.seq_len={args.seq}", f"mesh.topology={topo}",
                     *VARIANTS.get(plan, [f"parallel.plan={plan}"])] + tp_over + list(args.overrides)
        cfg = load_config(args.config, overrides)
        mesh = mesh_from_config(cfg)
        t0 = time.perf_counter()
        bundle = build_step(cfg, mesh, fast_compile_options())
        with jax.set_mesh(mesh):
            compiled = bundle.train_step.lower(bundle.abstract_state,
                                               bundle.abstract_batch()).compile()
        secs = time.perf_counter() - t0
        rep = analyze_compiled(compiled, mesh)
        meas = {lv: row["bytes"] for lv, row in rep.per_level().items()}
        pred = comm_per_step(bundle.placement, args.micro)
        sizes = {a: int(v) for a, v in mesh.shape.items()}
        # bytes leaving one node per step: the compiled step's and the schedule's (TP's
        # activation collectives stay inside the node: TP is over `pair`)
        egress_meas = sum(host_egress(c, sizes) for c in rep.collectives)
        egress_list = sum(c.egress_per_step(None) for c in
                          dp_collectives(cfg, sizes, bundle.placement))
        mem = bundle.placement.memory()
        batch_bytes = 2 * args.batch * args.seq * 4 / n  # inputs + targets, int32
        rows.append({
            "plan": plan, "tp": tp, "devices": n, "mesh": dict(mesh.shape), "micro_batches": args.micro,
            "roles": bundle.placement.describe(), "compile_s": round(secs, 1),
            "raw": {lv: rep.per_level(raw=True)[lv]["bytes"] for lv in ("pair", "node", "global")},
            "measured": {lv: meas[lv] for lv in ("pair", "node", "global")},
            "formula": {lv: pred[lv] for lv in ("pair", "node", "global")},
            "node_egress": {"measured": egress_meas, "schedule": egress_list},
            "memory_pred": {k: v for k, v in mem.items() if k != "padding_by_role"},
            "memory_measured": rep.memory, "batch_bytes": batch_bytes,
            "params": bundle.n_params,
        })
        print(f"[{n} devices] {plan} tp={tp}: compiled in {secs:.1f}s, global "
              f"{meas['global'] / MB:.1f} MB/step", file=sys.stderr, flush=True)
    with open(args.json_out, "w") as f:
        json.dump(rows, f, indent=1)


def _roles(r) -> str:
    def ax(a):
        if a is None:
            return "-"
        return "+".join(a) if a else "rep"
    sec = ax(r["secondary"])
    if r["secondary"] is not None:
        sec += " int8" if r["int8_secondary"] else " bf16"
    q = " qwZ" if r["quantize_gather"] else ""
    q += " qgZ" if r.get("quantize_grads") else ""
    return f"{ax(r['params'])} / {ax(r['grads'])} / {ax(r['opt_state'])} / {sec}{q}"


def table(rows) -> str:
    from benchmarks.common import markdown_table

    out = []
    for n, tp in sorted({(r["devices"], r.get("tp", "none")) for r in rows},
                        key=lambda k: (k[0], k[1] != "none")):
        rs = [r for r in rows if r["devices"] == n and r.get("tp", "none") == tp]
        hier = next((r for r in rs if r["plan"] == "hierarchical"), None)
        mesh = rs[0]["mesh"]
        tp_txt = "no TP" if tp == "none" else f"{tp} TP over `pair` (data-parallel roles on " \
                                               "node × global)"
        out.append(f"\n**{n} devices, {tp_txt}**, mesh pair={mesh['pair']} × node="
                   f"{mesh['node']} × global={mesh['global']}, {rs[0]['micro_batches']} "
                   f"micro-batches, Ψ = {rs[0]['params'] / 1e6:.1f} M parameters (bf16 "
                   "weights)\n")
        head = ["plan", "params / grads / opt / secondary", "pair MB", "node MB",
                "global MB", "global MB formula", "global MB comm.py raw",
                "global ÷ hierarchical (formula)", "node egress MB meas / schedule",
                "state MB pred / meas", "grads MB",
                "secondary MB", "temp MB", "compile s"]
        body = []
        for r in rs:
            m, f, raw, eg = r["measured"], r["formula"], r["raw"], r["node_egress"]
            mp, mm = r["memory_pred"], r["memory_measured"] or {}
            state_pred = mp["weights"] + mp["master"] + mp["adam"]
            state_meas = (mm.get("argument", 0) - r["batch_bytes"]) if mm else float("nan")
            ratio = (m["global"] / hier["measured"]["global"]) if hier and \
                hier["measured"]["global"] else float("nan")
            fratio = (f["global"] / hier["formula"]["global"]) if hier and \
                hier["formula"]["global"] else float("nan")
            body.append([r["plan"], _roles(r["roles"]), m["pair"] / MB, m["node"] / MB,
                         m["global"] / MB, f["global"] / MB, raw["global"] / MB,
                         f"{ratio:.1f}× ({fratio:.1f}×)",
                         f"{eg['measured'] / MB:,.0f} / {eg['schedule'] / MB:,.0f}",
                         f"{state_pred / MB:,.0f} / {state_meas / MB:,.0f}",
                         mp["grads"] / MB, mp["secondary"] / MB,
                         (mm.get("temp", 0)) / MB, r["compile_s"]])
        out.append(markdown_table(head, body))
    return "\n".join(out)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default=os.path.join(ROOT, "configs", "cola-1b.yaml"))
    p.add_argument("--devices", default="8,64")
    p.add_argument("--plans", default=",".join(PLANS))
    p.add_argument("--tp", default="none,btp", help="TP modes (btp: over `pair`)")
    p.add_argument("--micro", type=int, default=4)
    p.add_argument("--batch", type=int, default=256, help="global batch (sequences)")
    p.add_argument("--seq", type=int, default=256)
    add_out(p, os.path.join(ROOT, "benchmarks", "results", "partitioning.md"))
    p.add_argument("--json-out", default=None)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--cpu-devices", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("overrides", nargs="*", help="extra key=value config overrides")
    args = p.parse_args()
    if args.worker:
        worker(args)
        return 0
    guard_out(args.out, args.json_out, force=args.force, inputs={"--config": args.config})
    rows, t0 = [], time.perf_counter()
    for n in [int(x) for x in args.devices.split(",")]:
        js = f"/tmp/partitioning_{os.getpid()}_{n}.json"
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--cpu-devices", str(n),
               "--json-out", js, "--config", args.config, "--plans", args.plans,
               "--micro", str(args.micro), "--batch", str(args.batch), "--seq", str(args.seq),
               "--tp", args.tp,
               *args.overrides]
        env = dict(os.environ, JAX_PLATFORMS="cpu")
        subprocess.run(cmd, check=True, env=env)
        with open(js) as f:
            rows += json.load(f)
        os.remove(js)
    text = table(rows)
    print(text)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(rows, f, indent=1)
    if args.out:
        from benchmarks.common import reproduce_command, sync_readme

        cmdline = reproduce_command("partitioning.py")
        with open(args.out, "w") as f:
            f.write(HEADER.format(cmd=cmdline.strip(), micro=args.micro, batch=args.batch,
                                  seq=args.seq, secs=time.perf_counter() - t0)
                    + text + "\n" + FOOTER)
        sync_readme(args.out)
    return 0


HEADER = """# Placement plans on a CoLA-1B-shaped model: traffic per level and memory per device

Reproduce: `{cmd}` ({secs:.0f} s here, on 2 CPU cores).

CoLA-1B (configs/cola-1b.yaml: d=2048, 24 layers, r=512, d_ff=5461, vocab 32000, remat=full)
in bf16 with fp32 master weights and Adam moments; global batch {batch} × {seq} tokens in
{micro} micro-batches. The whole step is lowered with abstract shapes and compiled for simulated
CPU devices; bytes are what one device sends per optimizer step (ring costs), by the slowest
level its collective spans. Roles are `params / grads / opt_state / secondary` axes
(`rep` = replicated).
"""

FOOTER = """
Reading the table:
- `measured` is comm.py's bytes, which undo two XLA:CPU artifacts in the raw numbers (bf16
  reductions run in fp32; reduce-scatter lowered as all-reduce + dynamic-slice), see
  boost_jax/analysis/cpu_lowering.py. `formula` is formulas.comm_per_step (ring costs, derived in
  its docstring); it matches the measured inter-node bytes of every plan.
- `node egress` is what leaves one node per step through its NICs (a ring whose members on a
  node are contiguous leaves it once; every group leaving the node at once shares the NICs):
  from the compiled step's collectives (analysis/comm.py host_egress) and from the step's
  collective list as the planner times it (plan/collectives.py); per-device `global MB`
  overstates it for groups with several members per node.
- hierarchical crosses nodes with one step's worth (fp32 reduce-scatter of the node's gradient
  shard, per layer in the last micro-batch's backward; bf16 all-gather of the updated node
  shard, per layer in the next step's first forward): 6Ψ(G−1)/(G·D) bytes, independent of the
  number of micro-batches; ZeRO-3 moves k·(2+2+4)Ψ(N−1)/N (gradients reduced in fp32,
  parallel.grad_accum_dtype). ZeRO++ (`zeropp`: qwZ int8 forward gather, hpZ backward gather
  inside the node, qgZ int4 gradients) moves k·(q₈(Ψ)(N−1)/N + q₄(Ψ)/D·(G−1)/G) across nodes:
  each micro-batch's gradient is reduced by two all-to-alls of int4 blocks, inside the node
  (q₄(Ψ)(D−1)/D on the node level), then across nodes (the node-reduced 1/D);
  q₈(Ψ) = Ψ + 4·blocks, q₄(Ψ) = Ψ/2 + 4·blocks (boost_jax/sharding/step_collectives.py).
- zeropp-no-qgz is zeropp with `parallel.quantize_grads=false`: the gradient is
  reduce-scattered in fp32 over all devices, k·(q₈(Ψ)+4Ψ)(N−1)/N across nodes.
- The BTP rows use d_ff = 5462 (5461 does not divide by the TP degree 2).
- With BTP over `pair` the same formulas hold for Ψₜ (one device's TP shard) with the
  data-parallel roles on node × global: one engine runs every plan × TP layout
  (boost_jax/step/engine.py), so hierarchical+btp also reduces across nodes once per step;
  TP took `pair` from its weights, which re-home to `node`.
- state = bf16 weights over `params` + fp32 master and m, v over `opt_state`: predicted by the
  plan, measured as the compiled program's argument bytes minus the token batch.
- The backward of the gathered plans recomputes each layer (remat=full) and re-gathers its
  weights: over all devices for zero3, inside the node from the int8/bf16 secondary
  partition for zeropp and hierarchical.
"""


if __name__ == "__main__":
    sys.exit(main())
