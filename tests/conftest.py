"""Test setup: 8 simulated CPU devices, set before JAX initialises.

tests/unit holds the tests that run in-process, tests/e2e those that start a process (train.py,
python -m boost_jax..., scripts); the helper modules here (train_proc.py, weights.py, ...) are
importable from both, as pytest puts this folder on sys.path for this conftest."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import pytest  # noqa: E402

from boost_jax.mesh import set_cpu_devices  # noqa: E402

set_cpu_devices(8)

# XLA:CPU fast-compile options for the training loop (tests are compile-bound); subprocesses
# started by tests inherit it, so in-process and subprocess runs compile the same programs and
# their losses compare exactly.
os.environ.setdefault("BOOST_JAX_FAST_COMPILE", "1")
# The `cpu` topology's peak FLOP/s is otherwise measured on the machine: fixed here so plans and
# MFU figures in tests do not depend on the machine's speed or load.
os.environ.setdefault("BOOST_JAX_CPU_PEAK_FLOPS", "5e10")


@pytest.fixture(scope="session")
def _jax_cache_dir(tmp_path_factory):
    """One cache folder per test process (an xdist worker runs its files one after another, so
    no entry is read while another process writes it)."""
    return str(tmp_path_factory.mktemp("jax_cache"))


@pytest.fixture(scope="module")
def jax_cache(_jax_cache_dir):
    """A persistent compilation cache for a module's training runs, in-process and subprocess
    alike (pass it as JAX_COMPILATION_CACHE_DIR): the same tiny programs compile once per test
    process instead of once per run. The in-process settings are restored afterwards."""
    from jax._src import compilation_cache

    path = _jax_cache_dir
    keys = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
            "jax_persistent_cache_min_entry_size_bytes")
    old = {k: getattr(jax.config, k) for k in keys}
    for k, v in zip(keys, (path, 0.0, -1)):
        jax.config.update(k, v)
    compilation_cache.reset_cache()
    yield path
    for k, v in old.items():
        jax.config.update(k, v)
    compilation_cache.reset_cache()


# The longest files first (measured: seconds per file of one full run, `--durations=0`):
# xdist's loadfile hands files out in collection order, so a long file collected last would
# run alone at the end. Basenames, unique across tests/unit and tests/e2e.
LONGEST_FIRST = ("test_tp.py", "test_pipeline.py", "test_plans_hlo.py", "test_readme.py",
                 "test_two_level.py", "test_cross_node_quant_demo.py", "test_multihost.py",
                 "test_ckpt_integrity.py", "test_optim_choices.py", "test_launch.py",
                 "test_plans.py", "test_use_run.py", "test_out_dir.py", "test_flash.py",
                 "test_qgz_demo.py", "test_optim_train.py", "test_safe_write.py", "test_plan.py",
                 "test_pallas.py", "test_pallas_btp.py", "test_bad_input.py", "test_crash.py",
                 "test_stream_train.py", "test_optim_kill.py", "test_benchmark_outputs.py",
                 "test_score.py", "test_decode.py", "test_pipeline_train.py",
                 "test_plan_schedule.py", "test_input_fingerprint.py", "test_train.py",
                 "test_model.py")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda it: rank.get(it.path.name, len(rank)))  # stable: order within a file
