"""A SIGKILLed train.py with Adafactor and the wsd schedule (zero3 on 8 devices: its moments
sharded, its factored statistics replicated) resumes to the uninterrupted run's losses.
tests/unit/test_optim_train.py runs every optimizer through the same resume in-process."""

import numpy as np
import pytest

from boost_jax.config import load_config
from boost_jax.train.loop import run
from crash_run import TINY
from train_proc import TrainProcess, checkpoint_steps, metric_losses, train_env

pytestmark = pytest.mark.usefixtures("jax_cache")  # conftest: shared compile cache

RUN = TINY + ["train.steps=100", "train.eval_every=50", "checkpoint.every=50",
              "parallel.plan=zero3", "optim.name=adafactor", "optim.schedule=wsd",
              "logging.progress=false"]


class Train(TrainProcess):
    base = RUN


def test_adafactor_wsd_resumes_after_sigkill_with_identical_losses(tmp_path, jax_cache):
    ref = str(tmp_path / "ref")
    run(load_config(None, RUN + [f"out_dir={ref}"]))
    want = metric_losses(ref)
    env = train_env(jax_cache)
    out = tmp_path / "run"
    t = Train(out, env)
    t.until(lambda: checkpoint_steps(out) == [50] and t.trained_to() >= 60)
    t.kill()
    assert checkpoint_steps(out) == [50]
    t = Train(out, env)
    assert t.wait() == 0, t.output
    got = metric_losses(out)
    assert sorted(got) == list(range(1, 101))
    np.testing.assert_array_equal([got[s] for s in sorted(want)], [want[s] for s in sorted(want)])
