"""Crash safety, in-process: a NaN loss stops the run naming the step, before any checkpoint
holds it, and running out of device memory is one line, exit 2 (tests/e2e/test_crash.py:
SIGKILL, SIGTERM, corrupted checkpoints, failed saves)."""

import jax
import numpy as np
import pytest

from boost_jax.config import load_config
from boost_jax.errors import cli_main
from boost_jax.infer.load import open_run
from boost_jax.train.loop import NonFiniteError, run
from crash_run import RUN, nan_at_step  # noqa: F401 (a fixture)
from train_proc import checkpoint_steps

pytestmark = pytest.mark.usefixtures("jax_cache")  # conftest: shared compile cache


# --------------------------------------------------------------------------- NaN injection


def test_nan_loss_stops_the_run_naming_the_step_and_writes_no_bad_checkpoint(nan_at_step,
                                                                             tmp_path):
    nan_at_step(5)
    out = str(tmp_path / "run")
    cfg = load_config(None, RUN + [f"out_dir={out}", "train.log_every=4", "checkpoint.every=2"])
    with pytest.raises(NonFiniteError, match=r"non-finite loss or gradient at step 5;"):
        run(cfg)
    # the check runs before every save: step 6's checkpoint (after the NaN) is never written
    assert checkpoint_steps(out) == [2, 4]
    params = jax.device_get(open_run(out, 4).params)
    assert all(np.isfinite(x).all() for x in jax.tree.leaves(params))


@pytest.mark.parametrize("xla, said", [
    ("INTERNAL: Error dispatching computation: Out of memory allocating 25600000000 bytes.",
     "Out of memory allocating 25600000000 bytes"),
    ("RESOURCE_EXHAUSTED: Failed to allocate request for 1.20GiB (1288490188B) on device "
     "ordinal 0\nBufferAssignment:...", "Failed to allocate request for 1.20GiB (1288490188B) on "
                                        "device ordinal 0")])
def test_running_out_of_device_memory_is_one_line_and_exit_2(capsys, xla, said):
    """XLA's CPU and GPU wordings (raising a real allocation failure would depend on the
    machine's overcommit setting)."""
    @cli_main
    def command():
        raise jax.errors.JaxRuntimeError(xla)

    with pytest.raises(SystemExit) as e:
        command()
    assert e.value.code == 2
    err = capsys.readouterr().err.splitlines()
    assert err == [f"error: the devices ran out of memory ({said}); use a smaller model, batch "
                   "or sequence, more train.micro_batches or train.remat=full, or a layout "
                   "that python -m boost_jax.plan says fits"], err

    @cli_main
    def other():
        raise jax.errors.JaxRuntimeError("INTERNAL: something else")

    with pytest.raises(jax.errors.JaxRuntimeError):
        other()
