"""Crash safety: SIGKILL mid-step and mid-save, SIGTERM, corrupted checkpoints, NaN, failed saves.

The reference is one uninterrupted in-process run on 8 simulated devices; interrupted runs are
train.py subprocesses on the same 8-device mesh (the same compiled programs, so the losses of a
correctly resumed run match the reference exactly). All runs compile their step with XLA's fast
options and share a persistent JAX compilation cache, so compiling is paid for about once.
tests/unit/test_crash_nonfinite.py: a NaN loss stops an in-process run.
"""

import errno
import json
import os
import random
import re
import shutil
import signal
import time

import numpy as np
import pytest

from boost_jax.config import load_config
from boost_jax.errors import UserError
from boost_jax.checkpoints.store import TMP_MARK, CheckpointSaveError, UNUSABLE_DIR
from boost_jax.train.loop import run
from boost_jax.checkpoints.seal import write_seal
from crash_run import RUN, STEPS, nan_at_step  # noqa: F401 (a fixture)
from train_proc import checkpoint_steps, metric_losses, TrainProcess, train_env

pytestmark = pytest.mark.usefixtures("jax_cache")  # conftest: shared compile cache


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("reference"))
    run(load_config(None, RUN + [f"out_dir={out}"]))
    losses = metric_losses(out)
    assert sorted(losses) == list(range(1, STEPS + 1))
    return out, losses


@pytest.fixture(scope="module")
def env(jax_cache):
    return train_env(jax_cache)


class Train(TrainProcess):
    base = RUN


def _tmp_dirs(out_dir):
    d = os.path.join(out_dir, "checkpoints")
    return sorted(n for n in os.listdir(d) if TMP_MARK in n) if os.path.isdir(d) else []


def test_sigkill_mid_save_and_mid_step_resumes_with_identical_losses(reference, env, tmp_path):
    _, ref = reference
    out = tmp_path / "run"
    rng = random.Random(1234)
    killed_mid_save = False

    # 1. SIGKILL while a checkpoint is being written: the moment orbax's tmp directory exists.
    for attempt in range(2):
        t = Train(out, env)
        t.until(lambda: _tmp_dirs(out), poll=0.001)
        t.kill()
        if _tmp_dirs(out):
            killed_mid_save = True
            break
    assert killed_mid_save, "never caught a save in progress"
    left = _tmp_dirs(out)
    finalised = checkpoint_steps(out)

    # 2. Resume; SIGKILL again at a random moment once it trained a step past its checkpoint
    #    (mid-step, between steps, or during the next async save).
    t = Train(out, env)
    t.until_trained(max(finalised, default=0) + 1 + rng.randrange(3))
    time.sleep(rng.uniform(0.0, 0.3))
    t.kill()
    assert f"checkpoint step {left[0].split('.')[0]} in" in t.output
    assert "is incomplete (its save was interrupted" in t.output

    # 3. Resume and finish: every step's loss equals the uninterrupted run's.
    t = Train(out, env)
    assert t.wait() == 0, t.output
    losses = metric_losses(out)
    assert sorted(losses) == list(range(1, STEPS + 1))
    np.testing.assert_allclose([losses[s] for s in sorted(ref)], [ref[s] for s in sorted(ref)],
                               rtol=1e-6)
    assert checkpoint_steps(out)[-1] == STEPS and not _tmp_dirs(out)


def test_sigterm_saves_a_checkpoint_then_exits(env, tmp_path):
    out = tmp_path / "run"
    # only the signal makes a checkpoint; progress on for the final line
    t = Train(out, env, "checkpoint.every=100", "logging.progress=true")
    t.until_trained(2)
    t.p.send_signal(signal.SIGTERM)
    code = t.wait()
    assert code == 128 + signal.SIGTERM, t.output
    saved = checkpoint_steps(out)
    assert len(saved) == 1 and 2 <= saved[0] < STEPS
    assert f"signal {int(signal.SIGTERM)}: saved step {saved[0]}, exiting" in t.output
    assert re.search(r"^\S+: llama cola d=\d+ ", t.output, re.M)  # the header names the family
    # the step it stopped at was not evaluated, and the final line says so
    assert f"done: step {saved[0]} (not evaluated; the last evaluation was at step " in t.output
    meta = json.load(open(os.path.join(out, "checkpoints", str(saved[0]), "data", "metadata")))
    assert meta == {"windows": saved[0] * 8}  # the data position (8 windows a step)


def _corrupt_arrays(step_dir):
    """Truncate every array data file of a finalised checkpoint (what a bad disk or an
    interrupted copy leaves)."""
    files = [os.path.join(d, f) for d, _, fs in os.walk(os.path.join(step_dir, "state"))
             for f in fs if os.sep + "d" + os.sep in os.path.join(d, f)]
    assert files
    for p in files:
        data = open(p, "rb").read()
        open(p, "wb").write(data[: len(data) // 2])


def _tamper_digest(step_dir):
    """Change a recorded array checksum and re-seal the files: what arrays written wrong before
    they reached the disk would look like (the files match their seal, the values do not)."""
    path = os.path.join(step_dir, "meta", "metadata")
    meta = json.load(open(path))
    arrays = meta["checksums"]["arrays"]
    weight = next(k for k in sorted(arrays) if k.startswith("['params']"))
    arrays[weight][0] ^= 1
    json.dump(meta, open(path, "w"))
    write_seal(step_dir)


# tensorstore completes reads still in flight after the failed one into orbax's closed event loop
CLOSED_LOOP = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")


@CLOSED_LOOP
def test_corrupted_latest_checkpoint_falls_back_to_the_previous_one(reference, tmp_path, capfd):
    ref_dir, ref = reference
    out = str(tmp_path / "run")
    shutil.copytree(ref_dir, out)
    assert checkpoint_steps(out) == [6, 9, 12]
    _corrupt_arrays(os.path.join(out, "checkpoints", "12"))
    _tamper_digest(os.path.join(out, "checkpoints", "9"))
    capfd.readouterr()
    summary = run(load_config(None, RUN + [f"out_dir={out}"]))
    err = capfd.readouterr().err
    assert summary["start_step"] == 6
    assert "warning: checkpoint step 12 in" in err and "is unusable (file state/" in err
    assert "warning: checkpoint step 9 in" in err and "does not match the checksum saved" in err
    assert "falling back to step 6" in err
    # set aside, not deleted; training redid 7..12 with the reference's losses and saved anew
    assert sorted(os.listdir(os.path.join(out, UNUSABLE_DIR))) == ["12", "9"]
    assert checkpoint_steps(out) == [6, 9, 12]
    losses = metric_losses(out)
    np.testing.assert_allclose([losses[s] for s in range(1, 13)], [ref[s] for s in range(1, 13)],
                               rtol=1e-6)


@CLOSED_LOOP
def test_no_usable_checkpoint_is_an_error_that_moves_nothing(reference, tmp_path):
    ref_dir, _ = reference
    out = str(tmp_path / "run")
    shutil.copytree(os.path.join(ref_dir, "checkpoints"), os.path.join(out, "checkpoints"))
    for s in (6, 9, 12):
        _tamper_digest(os.path.join(out, "checkpoints", str(s)))
    with pytest.raises(UserError, match=r"no usable checkpoint in .*step 12: .*step 6: "):
        run(load_config(None, RUN + [f"out_dir={out}"]))
    assert checkpoint_steps(out) == [6, 9, 12] and not os.path.exists(os.path.join(out, UNUSABLE_DIR))


# --------------------------------------------------------------------------- NaN injection


def test_skip_nonfinite_skips_the_update_and_carries_on(nan_at_step, reference, tmp_path):
    _, ref = reference
    nan_at_step(5)
    out = str(tmp_path / "run")
    summary = run(load_config(None, RUN + [f"out_dir={out}", "train.skip_nonfinite=true"]))
    assert summary["final_step"] == STEPS
    losses = metric_losses(out)
    assert losses[5] is None  # null plus a flag in metrics.jsonl: bare NaN is not JSON
    np.testing.assert_allclose([losses[s] for s in range(1, 5)], [ref[s] for s in range(1, 5)],
                               rtol=1e-6)
    assert all(np.isfinite(losses[s]) for s in range(6, STEPS + 1))
    assert checkpoint_steps(out)[-1] == STEPS


# --------------------------------------------------------------------------- failed save


def test_failed_save_keeps_earlier_checkpoints_and_says_so(reference, monkeypatch, tmp_path):
    """The disk fills up while step 9 is being written (after its arrays, at a metadata file)."""
    from etils import epath

    _, ref = reference
    out = str(tmp_path / "run")
    real_write = epath.Path.write_text

    def write_text(self, *a, **k):
        if f"{os.sep}9{TMP_MARK}" in str(self):
            raise OSError(errno.ENOSPC, "No space left on device", str(self))
        return real_write(self, *a, **k)

    monkeypatch.setattr(epath.Path, "write_text", write_text)
    with pytest.raises(CheckpointSaveError) as e:
        run(load_config(None, RUN + [f"out_dir={out}"]))
    msg = str(e.value)
    assert msg.startswith("saving checkpoint step 9 failed (No space left on device")
    assert "the earlier checkpoints (steps 3, 6) in" in msg and "resume from step 6" in msg
    assert checkpoint_steps(out) == [3, 6] and not _tmp_dirs(out)  # the partial step 9 is removed at once

    monkeypatch.setattr(epath.Path, "write_text", real_write)  # space freed: resume works
    summary = run(load_config(None, RUN + [f"out_dir={out}", "train.stop_after=3"]))
    assert not _tmp_dirs(out)
    assert summary["start_step"] == 6 and summary["final_step"] == 9
    losses = metric_losses(out)
    np.testing.assert_allclose([losses[s] for s in range(1, 10)], [ref[s] for s in range(1, 10)],
                               rtol=1e-6)


def test_skip_nonfinite_stops_a_diverged_run(tmp_path):
    """lr 1e6: the first update ruins the weights, and every step after it is non-finite and
    skipped; skip_nonfinite_limit=4 of them in a row stop the run at the next save (step 6),
    with the last checkpoint the one before them."""
    from boost_jax.train.loop import NonFiniteError

    out = str(tmp_path / "run")
    cfg = load_config(None, RUN + [f"out_dir={out}", "train.skip_nonfinite=true", "optim.lr=1e6",
                                   "optim.warmup_frac=0", "train.skip_nonfinite_limit=4"])
    with pytest.raises(NonFiniteError, match=r"^4 steps in a row were non-finite and skipped "
                                             r"\(steps 2-5, train\.skip_nonfinite_limit=4\): "
                                             r"the run has diverged"):
        run(cfg)
    assert checkpoint_steps(out) == [3]
