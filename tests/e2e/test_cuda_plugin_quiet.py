"""With the CUDA plugin installed (the gpu-compile extra) on a machine without an NVIDIA GPU,
commands start quietly (boost_jax/backends/cuda_plugin.py).

The 4.4 GB extra is not installed here; a stand-in `jax_plugins.xla_cuda12` does what the real
plugin's initialize() does before it registers (jax-cuda12-pjrt 0.10.2): unless JAX_PLATFORMS
leaves CUDA out or JAX_SKIP_CUDA_CONSTRAINTS_CHECK is set, it checks CUDA against the driver,
which raises (cuInit) without one; JAX logs that as a traceback.
"""

import os
import subprocess
import sys

import pytest

from train_proc import ROOT, TINY

PLUGIN = '''
import os


def initialize():
    from jax._src import config

    platforms = config.jax_platforms.value
    if platforms and not {"cuda", "gpu"} & set(platforms.split(",")):
        return
    if os.getenv("JAX_SKIP_CUDA_CONSTRAINTS_CHECK"):
        return
    raise RuntimeError("cuInit(0) failed: CUDA_ERROR_NO_DEVICE (stand-in)")
'''


@pytest.fixture
def env(tmp_path, jax_cache):
    if any(os.path.exists(d) for d in ("/dev/nvidia0", "/dev/nvidiactl", "/dev/dxg")):
        pytest.fail("this test needs a machine without an NVIDIA GPU (CI's)")
    pkg = tmp_path / "plugin" / "jax_plugins" / "xla_cuda12"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(PLUGIN)
    e = dict(os.environ, PYTHONPATH=f"{tmp_path / 'plugin'}{os.pathsep}{ROOT}",
             JAX_COMPILATION_CACHE_DIR=jax_cache, JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
    for k in ("JAX_PLATFORMS", "JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "XLA_FLAGS"):
        e.pop(k, None)
    return e


def test_the_stand_in_plugin_prints_the_traceback_without_us(env):
    r = subprocess.run([sys.executable, "-c", "import jax; print(jax.devices())"], env=env,
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "Traceback" in r.stderr and "cuInit" in r.stderr


def test_train_with_the_plugin_and_no_gpu_prints_no_traceback(env, tmp_path):
    r = subprocess.run([sys.executable, "train.py", "--config", "configs/demo.yaml", *TINY,
                        "train.steps=2", "train.eval_every=2", "train.eval_batches=1",
                        "logging.progress=false", f"out_dir={tmp_path / 'run'}"],
                       env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "Traceback" not in r.stderr and "cuInit" not in r.stderr, r.stderr[-2000:]
    assert "ERROR" not in r.stderr
