"""Signals and non-finite numbers end a real train.py run in the documented state.

- A second SIGTERM (a scheduler signalling twice before the time limit) stops the run at once
  with exit 143, as a shell reports a process SIGTERM killed, never Ctrl-C's 130: the batch
  script requeues only on 143.
- With train.skip_nonfinite=true a validation loss that is not finite is recorded as such:
  metrics.jsonl and summary.json hold JSON null plus a `*_nonfinite` flag, never a bare NaN (not
  valid JSON) and never dropped.
- A signal that lands after the last step (during its evaluation) ends a finished run: exit 0,
  no "rerun to resume" (a batch script would requeue a 143).
"""

import json
import os
import signal
import time

import pytest

from strict_json import _no_constant
from train_proc import TINY, TrainProcess, train_env

pytestmark = pytest.mark.usefixtures("jax_cache")


class Train(TrainProcess):
    base = TINY + ["logging.progress=false", "train.steps=40", "train.eval_every=20",
                   "checkpoint.every=100"]


@pytest.fixture(scope="module")
def env(jax_cache):
    return train_env(jax_cache)


def test_second_sigterm_exits_143(env, tmp_path):
    t = Train(tmp_path / "run", env)
    t.until_trained(2)
    t.p.send_signal(signal.SIGTERM)
    time.sleep(0.05)  # the first one is seen; the second lands while the run saves or steps
    t.p.send_signal(signal.SIGTERM)
    code = t.wait()
    # 143: train.py's own exit; -15: SIGTERM killed it after the handlers were put back (a
    # shell and SLURM report both as 143)
    assert code in (128 + signal.SIGTERM, -signal.SIGTERM), t.output
    assert "Traceback" not in t.output, t.output


def _rows(out_dir):
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [json.loads(line, parse_constant=_no_constant) for line in f]


# train.py whose validation loss is NaN from the second evaluation on (a diverged model's)
_NAN_VAL_AFTER_STEP_0 = (
    "import runpy, sys; import boost_jax.train.loop as loop; real = loop.evaluate; calls = []\n"
    "def evaluate(*a, **k):\n"
    "    calls.append(1)\n"
    "    return real(*a, **k) if len(calls) == 1 else float('nan')\n"
    "loop.evaluate = evaluate; sys.argv = sys.argv[1:]\n"
    "runpy.run_path(sys.argv[0], run_name='__main__')\n")


def test_nonfinite_val_loss_is_recorded_as_null_with_a_flag(env, tmp_path):
    out = tmp_path / "run"
    t = Train(out, env, "train.steps=4", "train.eval_every=2", "train.skip_nonfinite=true",
              python_prefix=("-c", _NAN_VAL_AFTER_STEP_0))
    assert t.wait() == 0, t.output
    vals = {r["step"]: r for r in _rows(out) if "val_loss" in r}
    assert sorted(vals) == [0, 2, 4], vals
    assert isinstance(vals[0]["val_loss"], float) and "val_loss_nonfinite" not in vals[0]
    for s in (2, 4):
        assert vals[s]["val_loss"] is None and vals[s]["val_loss_nonfinite"] is True, vals[s]
        assert vals[s]["val_ppl"] is None and vals[s]["val_ppl_nonfinite"] is True, vals[s]
    with open(out / "summary.json") as f:
        summary = json.load(f, parse_constant=_no_constant)
    for k in ("final_val_loss", "last_val_loss"):
        assert summary[k] is None and summary[k + "_nonfinite"] is True, summary
    assert summary["last_val_step"] == 4 and summary["initial_val_loss"] == vals[0]["val_loss"]


# train.py that receives SIGTERM during its third evaluation: the last step's (steps 0, 2, 4)
_SIGTERM_IN_LAST_EVAL = (
    "import os, runpy, signal, sys; import boost_jax.train.loop as loop; real = loop.evaluate\n"
    "calls = []\n"
    "def evaluate(*a, **k):\n"
    "    calls.append(1)\n"
    "    if len(calls) == 3:\n"
    "        os.kill(os.getpid(), signal.SIGTERM)\n"
    "    return real(*a, **k)\n"
    "loop.evaluate = evaluate; sys.argv = sys.argv[1:]\n"
    "runpy.run_path(sys.argv[0], run_name='__main__')\n")


# ... and during the plot of the finished run's losses (after the loop and its last save)
_SIGTERM_IN_PLOT = (
    "import os, runpy, signal, sys; import boost_jax.train.loop as loop; real = loop.plot_losses\n"
    "def plot_losses(*a, **k):\n"
    "    os.kill(os.getpid(), signal.SIGTERM)\n"
    "    return real(*a, **k)\n"
    "loop.plot_losses = plot_losses; sys.argv = sys.argv[1:]\n"
    "runpy.run_path(sys.argv[0], run_name='__main__')\n")


@pytest.mark.parametrize("prefix", [_SIGTERM_IN_LAST_EVAL, _SIGTERM_IN_PLOT],
                         ids=["in_last_eval", "in_final_outputs"])
def test_a_signal_after_the_last_step_ends_a_finished_run(env, tmp_path, prefix):
    out = tmp_path / "run"
    t = Train(out, env, "train.steps=4", "train.eval_every=2", "logging.plot=true",
              python_prefix=("-c", prefix))
    assert t.wait() == 0, t.output
    assert (out / "loss.png").is_file()
    assert "signal 15 after the last step: the run is finished" in t.lines, t.output
    assert "rerun" not in t.output, t.output
    with open(out / "summary.json") as f:
        summary = json.load(f, parse_constant=_no_constant)
    assert "stopped_by_signal" not in summary and summary["final_step"] == 4, summary
    assert isinstance(summary["final_val_loss"], float), summary
