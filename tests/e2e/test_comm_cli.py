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
    # ddp over all 8 devices: one combined fp32 all-reduce of every gradient (and the loss)
    assert d["mesh"] == {"pair": 2, "node": 2, "global": 2}
    [c] = d["collectives"]
    assert (c["kind"], c["level"], c["group_size"]) == ("all-reduce", "global", 8)
    assert set(c["dtypes"]) == {"f32"} and len(c["dtypes"]) > len(jax.tree.leaves(params))
    assert 4 * n_params <= c["payload_bytes"] < 4 * n_params + 64
    assert c["bytes_per_step"] == pytest.approx(2 * 7 / 8 * c["payload_bytes"])
    assert d["per_level"]["global"]["bytes"] == pytest.approx(c["bytes_per_step"])
    assert d["per_level"]["pair"]["count"] == d["per_level"]["node"]["count"] == 0
    assert d["time_estimate_s"]["global"] > 0 and d["memory"]
