"""Communication analyzer's CLI (python -m boost_jax.analysis.comm) on the real training step."""

import sys

import jax
import pytest

from train_proc import ROOT

COMM_TINY = ["model.d_model=32", "model.n_layers=2", "model.n_heads=2", "model.d_ff=64",
             "model.rank=8", "model.max_seq_len=32", "data.seq_len=32", "train.global_batch=8",
             "parallel.plan=ddp"]


def test_cli_analyzes_the_real_training_step():
    import json
    import os
    import subprocess

    import numpy as np

    from boost_jax.analysis.flops import flops_per_token
    from boost_jax.config import load_config
    from boost_jax.mesh import mesh_from_config
    from boost_jax.step.build import build_step

    root = ROOT
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)  # --cpu-devices must make the 8 devices itself
    p = subprocess.run([sys.executable, "-m", "boost_jax.analysis.comm", "--config",
                        "configs/demo.yaml", "--cpu-devices", "8", "--json", *COMM_TINY],
                       cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    d = json.loads(p.stdout)
    cfg = load_config(os.path.join(root, "configs", "demo.yaml"), COMM_TINY)
    params = build_step(cfg, mesh_from_config(cfg)).abstract_state["params"]
    n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
    # ddp over all 8 devices, one micro-batch: each layer's fp32 gradient is all-reduced in
    # the backward (inside the layer loop), the other weights' after it: every gradient once
    assert d["mesh"] == {"pair": 2, "node": 2, "global": 2}
    colls = d["collectives"]
    assert {(c["kind"], c["level"], c["group_size"]) for c in colls} == {
        ("all-reduce", "global", 8)}
    assert all(set(c["dtypes"]) == {"f32"} for c in colls)
    assert any(c["in_loop"] for c in colls) and not all(c["in_loop"] for c in colls)
    total = sum(c["payload_bytes"] * c["trip_count"] for c in colls)
    assert 4 * n_params <= total < 4 * n_params + 64  # + the loss
    assert d["per_level"]["global"]["bytes"] == pytest.approx(2 * 7 / 8 * total)
    assert d["per_level"]["pair"]["count"] == d["per_level"]["node"]["count"] == 0
    assert d["memory"]
    # FLOPs per device per step: the analytic model's (3x forward) for this device's 1 sequence
    fpt = flops_per_token(cfg.model, cfg.data.seq_len)["train"]
    assert d["flops"] == pytest.approx(fpt * cfg.data.seq_len, rel=0.02)
    assert d["flops_trips_known"] and d["xla_cost_analysis_flops"] < d["flops"]
