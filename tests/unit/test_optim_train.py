"""optim.name × optim.schedule on a tiny run: 100 steps with falling validation loss, then a
resume from what a SIGKILL at step 73 leaves (the checkpoint of step 50, metrics rows up to 73,
no summary) trains steps 51-100 to the same losses, bit for bit. The kill itself (a process
dying mid-step or mid-save) is tests/e2e/test_crash.py's; this checks each optimizer's state
and schedule survive the checkpoint round trip. Adafactor runs under zero3 (its state sharded,
its factored statistics replicated). Resuming with another optim.name is a one-line error."""

import json
import os
import re
import shutil

import pytest

from boost_jax.config import load_config
from boost_jax.errors import UserError
from boost_jax.train.loop import run
from crash_run import TINY

pytestmark = pytest.mark.usefixtures("jax_cache")  # conftest: shared compile cache

RUN = TINY + ["train.steps=100", "train.eval_every=50", "checkpoint.every=50",
              "checkpoint.keep=2", "train.log_every=1"]
KILLED_AT = 73


def _rows(out):
    return [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]


def _by_step(rows, key):
    return {r["step"]: r[key] for r in rows if key in r}


@pytest.mark.parametrize("name, schedule, lr, extra", [
    ("lion", "wsd", 0.003, []),
    ("adafactor", "linear", 0.01, ["parallel.plan=zero3"]),
    ("sgd-momentum", "constant", 0.1, []),
    ("sgd", "cosine", 0.3, [])])
def test_trains_and_resumes_bit_exactly(tmp_path, name, schedule, lr, extra):
    args = RUN + extra + [f"optim.name={name}", f"optim.schedule={schedule}", f"optim.lr={lr}"]
    ref = str(tmp_path / "ref")
    run(load_config(None, args + [f"out_dir={ref}"]))
    want = _rows(ref)
    val = _by_step(want, "val_loss")
    assert sorted(val) == [0, 50, 100] and val[0] > val[50] > val[100], val

    killed = str(tmp_path / "killed")
    shutil.copytree(ref, killed)
    shutil.rmtree(os.path.join(killed, "checkpoints", "100"))
    os.remove(os.path.join(killed, "summary.json"))
    with open(os.path.join(killed, "metrics.jsonl"), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in want if r["step"] <= KILLED_AT)
    summary = run(load_config(None, args + [f"out_dir={killed}"]))
    assert summary["start_step"] == 50
    got = _rows(killed)
    for key in ("loss", "val_loss", "lr"):
        assert _by_step(got, key) == _by_step(want, key), key

    # another optimizer cannot take this state: one line, before anything is touched
    with pytest.raises(UserError, match=rf"^checkpoint step 100 in {re.escape(killed)} holds the optimizer "
                                        rf"state of optim.name={name}, not adamw: set "
                                        rf"optim.name={name} to resume, or use a new out_dir$"):
        run(load_config(None, args + [f"out_dir={killed}", "optim.name=adamw",
                                      "train.steps=120"]))
    assert _rows(killed) == got
