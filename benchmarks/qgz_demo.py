"""ZeRO++'s int4 gradients (qgZ) against unquantized gradients: 20 steps of the demo, side by side.

    .venv/bin/python benchmarks/qgz_demo.py [--out benchmarks/results/qgz_demo.md]

Runs `train.py --config configs/demo.yaml` twice on 8 simulated CPU devices with
`parallel.plan=zeropp` in bf16 (weights and compute), once as the preset (qgZ on) and once with
`parallel.quantize_grads=false` (the gradient reduce-scattered in the fp32 accumulator dtype),
same data, same initialisation. tests/e2e/test_qgz_demo.py runs the same two commands and holds the
difference to the tolerances stated here.
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

from benchmarks.common import add_out, guard_out, markdown_table, write_result  # noqa: E402

STEPS = 20
# the demo config, shortened: 20 steps, a 1 MB slice of the corpus, validation at the end
OVERRIDES = ["--cpu-devices", "8", "parallel.plan=zeropp", f"train.steps={STEPS}",
             "train.log_every=1", f"train.eval_every={STEPS}", "train.eval_batches=2",
             "data.max_bytes=1000000", "model.param_dtype=bfloat16", "model.dtype=bfloat16",
             "logging.tensorboard=false", "logging.plot=false", "logging.progress=false"]
STEP_TOL = 0.02  # |int4 / bf16 − 1| of the training loss at every step
VAL_TOL = 0.01  # the same for the validation loss after the last step


def demo_env(out_dir: str) -> dict:
    """train.py's environment for one run of a study whose runs share out_dir's parent folder."""
    # optimised XLA code even under the tests' BOOST_JAX_FAST_COMPILE: -O0 compiles this step
    # 6 s faster but runs each of the 20 steps 3x slower. The runs share a compile cache: the
    # init, evaluation and checksum programs a setting leaves unchanged compile once.
    cache = os.path.join(os.path.dirname(os.path.abspath(out_dir)), "jax_cache")
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1", BOOST_JAX_FAST_COMPILE="0",
               JAX_COMPILATION_CACHE_DIR=cache, JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
               JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="-1")
    env.pop("XLA_FLAGS", None)
    return env


def train(out_dir: str, overrides: list, timeout: int = 900) -> dict:
    """Run train.py on the demo config with `overrides`; {"loss": {step: loss}, "val_loss":
    last validation loss}."""
    cmd = [sys.executable, os.path.join(ROOT, "train.py"), "--config",
           os.path.join(ROOT, "configs", "demo.yaml"), *overrides, f"out_dir={out_dir}"]
    p = subprocess.run(cmd, cwd=ROOT, env=demo_env(out_dir), capture_output=True, text=True,
                       timeout=timeout)
    if p.returncode != 0:
        raise RuntimeError(f"train.py exited {p.returncode}:\n{p.stderr[-3000:]}")
    rows = [json.loads(line) for line in open(os.path.join(out_dir, "metrics.jsonl"))]
    return {"loss": {r["step"]: r["loss"] for r in rows if "loss" in r},
            "val_loss": [r["val_loss"] for r in rows if "val_loss" in r][-1]}


def run_pair(root: str) -> dict:
    """Both runs and their differences (relative, int4 against bf16)."""
    t0 = time.perf_counter()
    q = train(os.path.join(root, "int4"), [*OVERRIDES, "parallel.quantize_grads=true"], 600)
    b = train(os.path.join(root, "bf16"), [*OVERRIDES, "parallel.quantize_grads=false"], 600)
    diff = {s: q["loss"][s] / b["loss"][s] - 1 for s in b["loss"]}
    return {"int4": q, "bf16": b, "step_diff": diff,
            "max_step_diff": max(abs(d) for d in diff.values()),
            "val_diff": q["val_loss"] / b["val_loss"] - 1, "seconds": time.perf_counter() - t0}


def report(r: dict) -> str:
    b, q, d = r["bf16"]["loss"], r["int4"]["loss"], r["step_diff"]
    rows = [(s, f"{b[s]:.4f}", f"{q[s]:.4f}", f"{d[s]:+.2%}") for s in sorted(b)]
    ok = r["max_step_diff"] <= STEP_TOL and abs(r["val_diff"]) <= VAL_TOL
    cmd = " ".join(OVERRIDES)
    return f"""# qgZ (int4 gradients) against unquantized gradients, 20 steps of the demo

Reproduce: `.venv/bin/python benchmarks/qgz_demo.py` (two `train.py` runs, {r['seconds']:.0f} s
here); the same two runs are tests/e2e/test_qgz_demo.py.

`train.py --config configs/demo.yaml {cmd}`, with `parallel.quantize_grads` true (the zeropp
preset: each micro-batch's gradient reduced by int4 all-to-alls, inside the node then across)
and false (reduce-scattered in fp32), same data and initialisation.

Tolerance: the training loss within {STEP_TOL:.0%} of the unquantized run at every step and
the validation loss after step {STEPS} within {VAL_TOL:.0%}. Measured: largest difference
{r['max_step_diff']:.2%} (training loss), validation loss {r['bf16']['val_loss']:.4f} against
{r['int4']['val_loss']:.4f} ({r['val_diff']:+.2%}): {'within' if ok else '**outside**'} the
tolerance.

{markdown_table(["step", "loss, unquantized", "loss, qgZ int4", "difference"], rows)}
"""


def main() -> int:
    p = argparse.ArgumentParser()
    add_out(p, os.path.join(ROOT, "benchmarks", "results", "qgz_demo.md"))
    args = p.parse_args()
    guard_out(args.out, force=args.force)
    with tempfile.TemporaryDirectory() as tmp:
        doc = report(run_pair(tmp))
    write_result(args.out, doc)
    print(doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
