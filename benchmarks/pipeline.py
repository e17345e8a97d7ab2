"""Pipeline stages (parallel.pp_stages): what the step compiles to, and the 13B/40B layouts.

    .venv/bin/python benchmarks/pipeline.py [--out benchmarks/results/pipeline.md]

1. train.py on the demo config, 8 simulated devices, with and without 2 stages: the losses.
2. From compiled HLO: the sends across stages per step against 2(m+P−1)−1, and temporaries per
   device as micro-batches grow (1f1b flat, gpipe one stage input more per micro-batch).
3. CoLA-13B (LLaMA-2-13B shape, r = d/4) TP4 × PP2 on Perlmutter: compiled memory and predicted
   step time next to BOOST's published 13B seconds.
4. A CoLA-40B layout on 8 Perlmutter nodes found by `--search` and compiled.
Nothing is typed by hand: every figure is read from a run, a compiled program or the planner.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from boost_jax.mesh import set_cpu_devices  # noqa: E402

set_cpu_devices(16, compile_only=True)  # compiles only; its train.py runs set their own

import jax  # noqa: E402

from benchmarks.common import add_out, guard_out, markdown_table, write_result  # noqa: E402
from boost_jax.analysis.comm import analyze_compiled  # noqa: E402
from boost_jax.backends.cpu import fast_compile_options  # noqa: E402
from boost_jax.config import load_config  # noqa: E402
from boost_jax.mesh import make_mesh  # noqa: E402
from benchmarks.published import BOOST_PUBLISHED, boost_predictions  # noqa: E402
from boost_jax.sharding.stages import Schedule  # noqa: E402
from boost_jax.step.build import build_step  # noqa: E402

PY = sys.executable
GiB = 2 ** 30
DEMO_STEPS = 30


def _train(out_dir: str, extra: list[str]) -> list[dict]:
    cmd = [PY, "train.py", "--config", "configs/demo.yaml", "--cpu-devices", "8",
           f"train.steps={DEMO_STEPS}", "train.eval_every=10", "logging.progress=false",
           "logging.tensorboard=false", "logging.plot=false", f"out_dir={out_dir}", *extra]
    subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, text=True)
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def section_demo(lines: list[str]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        flat = _train(os.path.join(tmp, "flat"), ["train.micro_batches=2"])
        pipe = _train(os.path.join(tmp, "pp2"), ["train.micro_batches=4",
                                                 "parallel.pp_stages=2"])
        virt = _train(os.path.join(tmp, "pp2v2"), ["train.micro_batches=4",
                                                   "parallel.pp_stages=2",
                                                   "parallel.pp_virtual=2"])
    rows, worst = [], 0.0
    for a, b, c in zip(flat, pipe, virt):
        for key in ("loss", "val_loss"):
            if key in a:
                rel = max(abs(x[key] - a[key]) / abs(a[key]) for x in (b, c))
                worst = max(worst, rel)
                rows.append([a["step"], key, f"{a[key]:.6f}", f"{b[key]:.6f}", f"{c[key]:.6f}",
                             f"{rel:.1e}"])
    lines += ["## 1. train.py on the demo config, with and without stages", "",
              f"`python train.py --config configs/demo.yaml --cpu-devices 8 train.steps="
              f"{DEMO_STEPS}` with `train.micro_batches=2` (8 data-parallel devices), with "
              "`parallel.pp_stages=2 train.micro_batches=4` (2 stages x 4 data-parallel devices, "
              "1f1b) and with `parallel.pp_virtual=2` added (each device runs 2 chunks of 1 "
              "layer): the same 16 sequences per step, split differently.", "",
              markdown_table(["step", "metric", "no stages", "2 stages", "2 x 2 virtual",
                              "largest relative difference"], rows), "",
              f"Largest relative difference: {worst:.1e} (fp32 summation order).", ""]


def _compiled(stages: int, schedule: str, micro: int, shape: list[int], virtual: int = 1):
    cfg = load_config("configs/demo.yaml", [
        f"parallel.pp_stages={stages}", f"parallel.pp_schedule={schedule}",
        f"parallel.pp_virtual={virtual}",
        f"train.micro_batches={micro}", f"train.global_batch={micro * 8 // stages}",
        "model.d_model=256", "model.d_ff=688", "model.rank=64", "model.n_layers=4",
        "data.seq_len=128"])
    mesh = make_mesh("cpu", shape, stages=stages)
    bundle = build_step(cfg, mesh, fast_compile_options())
    fn = jax.jit(bundle.engine.grads_fn(micro))
    with jax.set_mesh(mesh):
        compiled = fn.lower(bundle.abstract_state["params"], bundle.abstract_batch()).compile(
            compiler_options=fast_compile_options())
    return cfg, mesh, compiled


def section_hlo(lines: list[str]) -> None:
    rows = []
    for stages, virtual, shape in ((2, 1, [2, 2, 2]), (4, 1, [2, 1, 4]), (2, 2, [2, 2, 2])):
        for schedule in ("1f1b", "gpipe"):
            for micro in (4, 8, 16):
                cfg, mesh, compiled = _compiled(stages, schedule, micro, shape, virtual)
                rep = analyze_compiled(compiled, mesh)
                crossing = [c for c in rep.collectives if "stage" in c.axes]
                sends = [c for c in crossing if c.kind == "collective-permute"]
                other = [c for c in crossing if c.kind != "collective-permute"]
                sch = Schedule(schedule, stages, micro, virtual)
                rows_dp = cfg.train.global_batch // micro // (8 // stages)
                act = rows_dp * cfg.data.seq_len * cfg.model.d_model * 4
                temp = rep.memory["temp"]
                rows.append([stages, virtual, schedule, micro, f"{sch.bubble:.3f}",
                             sum(c.trip_count for c in sends),
                             sch.sends, f"{sorted({c.payload_bytes for c in sends})}",
                             act, max((c.result_bytes for c in other), default=0),
                             f"{temp / 2**20:.2f}", sch.depth + 1,
                             f"{(sch.depth + 1) * act / 2**20:.2f}"])
    lines += ["## 2. What crosses stages, and temporaries per device", "",
              "The demo model widened to d=256 (4 layers, 128 tokens, 1 sequence per device per "
              "micro-batch, fp32), 8 simulated devices: 2 stages on pair 2 x node 2, 4 stages on "
              "pair 2; `grads_fn` compiled per row. Sends are every collective whose group spans "
              "the `stage` axis and is a collective-permute; \"other\" is the largest anything "
              "else crossing stages moves (the scalar loss).", "",
              markdown_table(["stages", "virtual", "schedule", "micro-batches", "bubble",
                              "sends/step compiled", "2(Vm+P-1)-1", "bytes per send", "rows x s x d x 4",
                              "other crossing (bytes)", "temp MiB", "stage inputs kept",
                              "stage inputs MiB"], rows), "",
              "Formula: temp(m) = C + (depth(m)+1) x A, A = one stage input (rows x s x d x "
              "bytes), C = one micro-batch's stage forward and backward; depth = min(Vm, 2VP-1) "
              "for 1f1b (flat in m), Vm for gpipe; the +1 is the slot masked writes land in. "
              "Bubble (P-1)/(Vm+P-1): V = 2 interleaved virtual stages (2 chunks of 1 layer per "
              "device) halve it for twice the sends and, with 1f1b, up to 2VP-1 chunk inputs "
              "kept.", ""]


def _plan_json(args: list[str]) -> dict:
    out = subprocess.run([PY, "-m", "boost_jax.plan", *args, "--json"], cwd=ROOT, check=True,
                         capture_output=True, text=True).stdout
    return json.loads(out)


def section_13b(lines: list[str]) -> None:
    d = _plan_json(["--config", "configs/cola-13b.yaml"])
    p, mem = d["prediction"], d["prediction"]["memory"]
    boost = boost_predictions(sizes=("13B",))["13B"]
    pub = dict(zip(("full", "vanilla", "btp"), BOOST_PUBLISHED["13B"]))
    rows = [[m, f"{pub[m]:.2f}", f"{boost[m].step_time:.2f}"] for m in ("full", "vanilla", "btp")]
    lines += ["## 3. CoLA-13B, BTP TP4 x PP2 on Perlmutter", "",
              "`python -m boost_jax.plan --config configs/cola-13b.yaml` (LLaMA-2-13B shape: "
              "d=5120, 40 layers, 40 heads, d_ff=13824, CoLA r=1280; 2 nodes of 4 x A100-40GB; "
              "BTP over each node's 4 GPUs, 2 stages across the nodes, 1f1b over 4 micro-batches "
              "of 1 sequence of 4096 tokens, bf16, remat full). The step compiled on 8 simulated "
              "devices (2 and 3 layers per stage, extrapolated to 20):", "",
              markdown_table(["", "GiB per GPU"], [
                  ["persistent (weights, master, Adam)", f"{mem['arguments_formula'] / GiB:.2f}"],
                  ["temporaries (compiled)", f"{mem['temp_compiled'] / GiB:.2f}"],
                  ["total", f"{mem['total'] / GiB:.2f}"],
                  ["usable (90% of 40 GB)", f"{0.9 * mem['hbm'] / GiB:.2f}"]]), "",
              f"Fits: {'yes' if mem['fits'] else 'no'}. Predicted step from the compiled "
              f"collectives: {p['step_time']:.2f} s (MFU {p['mfu']:.1%}; cross-node "
              f"{p['comm_bytes']['global'] / 2**20:.0f} MiB per GPU per step: the sends).", "",
              "BOOST's published 13B TP4 PP2 iteration seconds next to the cost model's "
              "(benchmarks/validation.py's 13B rows, the same pipelined step, analytic "
              "collectives, validation assumptions):", "",
              markdown_table(["method", "published s", "predicted s"], rows), ""]


def section_40b(lines: list[str]) -> None:
    args = ["--config", "configs/cola-40b.yaml", "--nodes", "8", "train.global_batch=32",
            "--search", "--compile-top", "8"]
    d = _plan_json(args)
    best = d["ranked"][0]
    staged = [(i + 1, r) for i, r in enumerate(d["ranked"]) if r["pp_stages"] > 1]
    lines += ["## 4. A CoLA-40B layout on 8 Perlmutter nodes", "",
              "Shape: d=8192, 48 layers, 64 heads, d_ff=22016 (LLaMA-like: the width of "
              "LLaMA-2-70B at 48 layers; 39.4B parameters full rank), CoLA r=2048 (15.9B), "
              "32 sequences of 4096 tokens per step, bf16. `python -m boost_jax.plan "
              + " ".join(args) + "`: every layout (plans x TP x stages x micro-batching x "
              "remat) costed analytically, the best 8 compiled on 32 simulated devices and "
              f"re-costed from the compiled program; best five of {d['n_fitting']} that fit "
              f"({d['n_unlisted']} hierarchical layouts with pipeline stages not ranked):", "",
              markdown_table(["rank", "layout", "GiB/GPU", "step s", "MFU", "compiled"], [
                  [i + 1, r["key"], f"{r['memory'] / GiB:.1f}", f"{r['step_time']:.2f}",
                   f"{r['mfu']:.1%}", "yes" if r["compiled"] else "no"]
                  for i, r in enumerate(d["ranked"][:5])]), ""]
    if d["compiled_not_fitting"]:
        lines += ["Compiled and found not to fit 90% of 40 GB (the analytic estimate in "
                  "brackets): " + "; ".join(
                      f"{r['key']} {r['memory'] / GiB:.1f} GiB ({r['analytic_memory'] / GiB:.1f})"
                      for r in d["compiled_not_fitting"]) + ".", ""]
    lines += [f"The layout to run: {best['key']} "
              f"({'compiled' if best['compiled'] else 'analytic only'}), "
              f"{best['memory'] / GiB:.1f} GiB per GPU, {best['step_time']:.2f} s per step. "
              + (f"The best layout with pipeline stages ranks {staged[0][0]} "
                 f"({staged[0][1]['key']}, {staged[0][1]['step_time']:.2f} s analytic): with "
                 f"8 nodes {best['key'].split('/')[0]} shards the state far enough, and stages "
                 "pay a bubble and a re-run forward per backward tick." if staged else
                 "No layout with pipeline stages fits."), ""]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_out(ap, os.path.join(ROOT, "benchmarks", "results", "pipeline.md"))
    a = ap.parse_args()
    guard_out(a.out, force=a.force)
    t0 = time.time()
    lines = ["# Pipeline stages", "",
             "Reproduce: `.venv/bin/python benchmarks/pipeline.py` (CPU; trains the demo three times, "
             "compiles 18 small steps, the 13B step and 8 CoLA-40B layouts).", ""]
    section_demo(lines)
    section_hlo(lines)
    section_13b(lines)
    section_40b(lines)
    lines += [f"Generated in {time.time() - t0:.0f} s.", ""]
    text = "\n".join(lines)
    print(text)
    write_result(a.out, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
