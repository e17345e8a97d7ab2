"""hierarchical's quantized cross-node legs against unquantized ones: 20 steps of the demo.

    .venv/bin/python benchmarks/cross_node_quant_demo.py [--out benchmarks/results/cross_node_quant_demo.md]

Runs `train.py --config configs/demo.yaml` three times on 8 simulated CPU devices with
`parallel.plan=hierarchical` in bf16 (weights and compute), two micro-batches: unquantized, then
with the deferred update's cross-node gather in int8 and the gradient's cross-node
reduce-scatter in int8, then in int4 (parallel.quantize_cross_node_{weights,grads}); same data,
same initialisation. tests/e2e/test_cross_node_quant_demo.py runs the same commands and holds
the differences to the tolerances stated here (those of the qgZ study, benchmarks/qgz_demo.py).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.common import add_out, guard_out, markdown_table, write_result  # noqa: E402
from benchmarks.qgz_demo import STEP_TOL, STEPS, VAL_TOL, train  # noqa: E402

OVERRIDES = ["--cpu-devices", "8", "parallel.plan=hierarchical", "train.micro_batches=2",
             f"train.steps={STEPS}", "train.log_every=1", f"train.eval_every={STEPS}",
             "train.eval_batches=2", "data.max_bytes=1000000", "model.param_dtype=bfloat16",
             "model.dtype=bfloat16", "logging.tensorboard=false", "logging.plot=false",
             "logging.progress=false"]
RUNS = {"unquantized": [],
        "int8 weights, int8 grads": ["parallel.quantize_cross_node_weights=int8",
                                     "parallel.quantize_cross_node_grads=int8"],
        "int8 weights, int4 grads": ["parallel.quantize_cross_node_weights=int8",
                                     "parallel.quantize_cross_node_grads=int4"]}


def run_all(root: str) -> dict:
    """Every run and its differences (relative, against the unquantized one)."""
    t0 = time.perf_counter()
    runs = {name: train(os.path.join(root, str(i)), [*OVERRIDES, *extra])
            for i, (name, extra) in enumerate(RUNS.items())}
    base = runs["unquantized"]
    diffs = {name: {s: r["loss"][s] / base["loss"][s] - 1 for s in base["loss"]}
             for name, r in runs.items() if name != "unquantized"}
    return {"runs": runs, "step_diff": diffs,
            "max_step_diff": {n: max(abs(x) for x in d.values()) for n, d in diffs.items()},
            "val_diff": {n: runs[n]["val_loss"] / base["val_loss"] - 1 for n in diffs},
            "seconds": time.perf_counter() - t0}


def report(r: dict) -> str:
    runs, names = r["runs"], list(RUNS)
    rows = [(s, *(f"{runs[n]['loss'][s]:.4f}" for n in names),
             *(f"{r['step_diff'][n][s]:+.2%}" for n in names[1:]))
            for s in sorted(runs["unquantized"]["loss"])]
    verdict = "; ".join(
        f"{n}: largest training-loss difference {r['max_step_diff'][n]:.2%}, validation "
        f"{runs[n]['val_loss']:.4f} ({r['val_diff'][n]:+.2%}), "
        f"{'within' if r['max_step_diff'][n] <= STEP_TOL and abs(r['val_diff'][n]) <= VAL_TOL else '**outside**'}"
        for n in names[1:])
    return f"""# hierarchical's quantized cross-node legs against unquantized, 20 steps of the demo

Reproduce: `.venv/bin/python benchmarks/cross_node_quant_demo.py` (three `train.py` runs,
{r['seconds']:.0f} s here); the same runs are tests/e2e/test_cross_node_quant_demo.py.

`train.py --config configs/demo.yaml {' '.join(OVERRIDES)}`, as is (validation loss
{runs['unquantized']['val_loss']:.4f}) and with `parallel.quantize_cross_node_weights=int8`
(the deferred update's gather across nodes in int8 blocks with fp32 scales) and
`parallel.quantize_cross_node_grads` int8 or int4 (the gradient's reduce-scatter across nodes
as an all-to-all of int8 / int4 blocks), same data and initialisation. The fp32 master weights
and the optimizer never see a quantized value; the working weights and the gradient do.

Tolerance (the qgZ study's): the training loss within {STEP_TOL:.0%} of the unquantized run
at every step and the validation loss after step {STEPS} within {VAL_TOL:.0%}. Measured:
{verdict}.

{markdown_table(["step", *names, *(f"difference, {n}" for n in names[1:])], rows)}
"""


def main() -> int:
    p = argparse.ArgumentParser()
    add_out(p, os.path.join(ROOT, "benchmarks", "results", "cross_node_quant_demo.md"))
    args = p.parse_args()
    guard_out(args.out, force=args.force)
    with tempfile.TemporaryDirectory() as tmp:
        doc = report(run_all(tmp))
    write_result(args.out, doc)
    print(doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
