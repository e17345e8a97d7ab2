"""Planner's CLI: AOT dry-run on 64 simulated devices (python -m boost_jax.plan), its memory
formula against the compiled step's arguments."""

import json
import os
import subprocess
import sys

import pytest

from plan_tiny import TINY
from train_proc import ROOT


# --------------------------------------------------------------------------- CLI, 64 devices


@pytest.fixture(scope="module")
def plan64():
    cmd = [sys.executable, "-m", "boost_jax.plan", "--topology", "frontier", "--nodes", "8",
           "--cpu-devices", "64", "--json", *TINY, "train.global_batch=64",
           "parallel.plan=hierarchical", "model.param_dtype=bfloat16"]
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout)


def test_plan_cli_compiles_64_devices(plan64):
    d = plan64
    assert d["full_sizes"] == {"pair": 2, "node": 4, "global": 8}
    assert d["compile_sizes"] == d["full_sizes"]  # all 64 compiled, nothing extrapolated
    assert not d["layers_extrapolated"] and not d["global_extrapolated"]
    p = d["prediction"]
    assert p["devices"] == 64 and p["memory"]["fits"] is True
    # hierarchical: traffic on every level; per micro-batch nothing crosses nodes
    assert all(p["comm_bytes"][lv] > 0 for lv in ("pair", "node", "global"))
    assert p["step_time"] > 0 and 0 < p["mfu"] < 1 and p["tokens_per_s"] > 0
    assert d["flops_compiled"] > 0


def test_argument_memory_matches_formula_within_5pct(plan64):
    """Per-device params + fp32 master + Adam (+ the batch) from the placement formula vs
    what XLA's memory analysis says the compiled step takes as arguments."""
    mem = plan64["prediction"]["memory"]
    f, c = mem["arguments_formula"], mem["arguments_compiled"]
    assert abs(c / f - 1) < 0.05, (f, c)
    parts = mem["weights"] + mem["master"] + mem["adam"]
    assert parts > 0.9 * f  # the state, not the batch, dominates the comparison
    assert mem["master"] > 0  # bf16 working weights carry an fp32 master shard
