"""tools/step_path.py, run as a reader runs it: the boost_jax modules one training step (the
hierarchical plan with BTP, 8 simulated devices) runs code from, one a line, then their count;
the README's copy of the list is that output."""

import importlib.util
import os
import re
import subprocess
import sys

from train_proc import ROOT

TOOL = os.path.join(ROOT, "tools", "step_path.py")
# modules the step cannot run without: the engine, the layer gathers, the model's forward, the
# BTP projections and the step's builder
CERTAIN = {"boost_jax.step.engine", "boost_jax.sharding.gather", "boost_jax.layers.forward",
           "boost_jax.sharding.tp.btp", "boost_jax.step.build"}


def _tool():
    spec = importlib.util.spec_from_file_location("step_path", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_step_path_lists_the_modules_the_step_runs():
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
    r = subprocess.run([sys.executable, TOOL], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    *modules, last = r.stdout.strip().splitlines()
    assert last == f"{len(modules)} modules"
    assert modules == sorted(set(modules))
    for m in modules:  # each a module of the package, named as it is imported
        assert re.fullmatch(r"boost_jax(\.\w+)+", m), m
        assert importlib.util.find_spec(m) is not None, m
    missing = CERTAIN - set(modules)
    assert not missing, f"the step ran no code from {sorted(missing)}:\n{r.stdout}"
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        readme = f.read()
    assert _tool().readme_modules(readme) == modules, (
        "README.md's list is stale: run python tools/step_path.py --readme")
    assert f"({len(modules)} modules)" in readme
