"""Checkpoint integrity: any changed byte is caught on every read path, a failed save leaves no
partial directory, and SIGKILL at random moments of frequent saves loses nothing.

The reference is one uninterrupted in-process run on 8 simulated devices; the killed runs are
train.py subprocesses on the same mesh (the same compiled programs, so a correctly resumed run's
losses equal the reference's exactly). tests/unit/test_ckpt_checksums.py: the checksums.
"""

import errno
import os
import random
import shutil
import time

import numpy as np
import pytest

from boost_jax import evaluate, export, generate
from boost_jax.config import load_config
from boost_jax.errors import UserError
from boost_jax.checkpoints import seal
from boost_jax.checkpoints.store import TMP_MARK, UNUSABLE_DIR, CheckpointSaveError, Checkpointer
from boost_jax.train.loop import run
from train_proc import checkpoint_steps, metric_losses, TINY, TrainProcess, train_env

STEPS = 30  # room for 5 kills, each after at least one newly saved step
RUN = TINY + ["logging.progress=false", f"train.steps={STEPS}", "train.eval_every=4",
              "checkpoint.every=2", "checkpoint.keep=2"]

pytestmark = pytest.mark.usefixtures("jax_cache")  # conftest: shared compile cache


def _tmp_dirs(out_dir):
    d = os.path.join(out_dir, "checkpoints")
    return sorted(n for n in os.listdir(d) if TMP_MARK in n) if os.path.isdir(d) else []


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("reference") / "run")
    run(load_config(None, RUN + [f"out_dir={out}"]))
    assert checkpoint_steps(out) == [STEPS - 2, STEPS] and sorted(metric_losses(out)) == list(range(1, STEPS + 1))
    return out


def _flip(path, rng):
    """Change one byte of the file at a random position (to another random value)."""
    data = bytearray(open(path, "rb").read())
    pos = rng.randrange(len(data))
    data[pos] ^= rng.randrange(1, 256)
    open(path, "wb").write(bytes(data))
    return pos


def _refused(main, argv, capsys):
    """Run a command's entry point in-process: exit code and its stderr."""
    with pytest.raises(SystemExit) as e:
        main(argv)
    return e.value.code, capsys.readouterr().err


def test_any_changed_byte_of_the_latest_checkpoint_is_caught(reference, tmp_path, capsys):
    """One byte changed in each file of the latest step (every array data file orbax wrote, its
    metadata, the data and meta items): generate, evaluate and export refuse it in one line
    (exit 2) and resume falls back to the previous step with a warning."""
    from boost_jax.mesh import mesh_from_config
    from boost_jax.step.build import build_step

    cfg = load_config(None, RUN + [f"out_dir={reference}"])
    abstract_state = build_step(cfg, mesh_from_config(cfg)).abstract_state
    latest, previous = STEPS, STEPS - 2
    files = seal.step_files(os.path.join(reference, "checkpoints", str(latest)))
    data_files = [f for f in files if "/d/" in f]
    assert len(data_files) >= 2 and len(files) >= 8, files
    rng = random.Random(24)
    for i, name in enumerate(files):
        out = str(tmp_path / f"r{i}")
        shutil.copytree(reference, out)
        ckpt_dir = os.path.join(out, "checkpoints")
        pos = _flip(os.path.join(ckpt_dir, str(latest), name), rng)
        what = f"{name} byte {pos}"
        for main, argv in ((generate.main, ["--prompt", "a", "--max-new-tokens", "2"]),
                           (evaluate.main, []),
                           (export.main, ["--out", str(tmp_path / f"x{i}")])):
            code, err = _refused(main, ["--run", out, *argv], capsys)
            assert code == 2 and err.count("\n") == 1, (what, err)
            assert err.startswith(f"error: checkpoint step {latest} in {ckpt_dir} is corrupted "
                                  f"(file {name} "), (what, err)
        assert not os.path.exists(tmp_path / f"x{i}")
        warnings = []
        found = Checkpointer(ckpt_dir, cfg.checkpoint, warn=warnings.append).restore_latest(
            abstract_state)
        assert found[0] == previous, what
        assert len(warnings) == 1 and warnings[0].startswith(
            f"checkpoint step {latest} in {ckpt_dir} is unusable (file {name} "), (what, warnings)
        assert warnings[0].endswith(f"and falling back to step {previous}"), warnings
        assert os.listdir(os.path.join(out, UNUSABLE_DIR)) == [str(latest)]
        shutil.rmtree(out)


def test_a_changed_metadata_item_is_caught_before_its_config_is_compared(reference, tmp_path):
    """The latest step's metadata edited but still JSON (its model's d_model): the seal finds
    the changed file before resume compares the saved config with the run's, so the step is
    set aside and the previous one restored, rather than the run refused as another model."""
    from boost_jax.mesh import mesh_from_config
    from boost_jax.step.build import build_step

    out = str(tmp_path / "run")
    shutil.copytree(reference, out)
    ckpt_dir = os.path.join(out, "checkpoints")
    path = os.path.join(ckpt_dir, str(STEPS), "meta", "metadata")
    text = open(path).read()
    assert text.count('"d_model": 32,') == 2
    open(path, "w").write(text.replace('"d_model": 32,', '"d_model": 64,'))

    def check_meta(step, meta):
        if meta["model"]["d_model"] != 32:
            raise UserError("another model")

    cfg = load_config(None, RUN + [f"out_dir={out}"])
    warnings = []
    found = Checkpointer(ckpt_dir, cfg.checkpoint, warn=warnings.append).restore_latest(
        build_step(cfg, mesh_from_config(cfg)).abstract_state, check_meta)
    assert found[0] == STEPS - 2
    assert len(warnings) == 1 and "(file meta/metadata " in warnings[0], warnings


def test_a_step_folder_copied_to_another_number_or_with_odd_metadata_is_set_aside(reference,
                                                                                  tmp_path):
    """A step copied under a newer number is not that step (its schedule and data position
    are the old one's); metadata that is JSON but no object, and a file where the unusable
    steps are moved, are each one line, never a traceback."""
    from boost_jax.mesh import mesh_from_config
    from boost_jax.step.build import build_step

    out = str(tmp_path / "run")
    shutil.copytree(reference, out)
    ckpt_dir = os.path.join(out, "checkpoints")
    shutil.copytree(os.path.join(ckpt_dir, str(STEPS - 2)), os.path.join(ckpt_dir, "99"))
    cfg = load_config(None, RUN + [f"out_dir={out}"])
    abstract = build_step(cfg, mesh_from_config(cfg)).abstract_state
    warnings = []
    found = Checkpointer(ckpt_dir, cfg.checkpoint, warn=warnings.append).restore_latest(abstract)
    assert found[0] == STEPS and len(warnings) == 1, warnings
    assert warnings[0].startswith(f"checkpoint step 99 in {ckpt_dir} is unusable (it holds step "
                                  f"{STEPS - 2} (its folder was renamed or copied)); moved it")
    open(os.path.join(ckpt_dir, str(STEPS), "meta", "metadata"), "w").write("[1]")
    warnings.clear()
    found = Checkpointer(ckpt_dir, cfg.checkpoint, warn=warnings.append).restore_latest(abstract)
    assert found[0] == STEPS - 2 and len(warnings) == 1, warnings
    assert "is unusable (file meta/metadata " in warnings[0], warnings
    shutil.rmtree(os.path.join(out, UNUSABLE_DIR))
    open(os.path.join(out, UNUSABLE_DIR), "w").write("mine")
    shutil.copytree(os.path.join(ckpt_dir, str(STEPS - 2)), os.path.join(ckpt_dir, "99"))
    with pytest.raises(UserError, match=rf"^checkpoint step 99 in {ckpt_dir} is unusable \(it "
                                        r"holds step .*\) and could not be moved to .* \(.*\); "
                                        r"move it away yourself and rerun$"):
        Checkpointer(ckpt_dir, cfg.checkpoint).restore_latest(abstract)
    assert open(os.path.join(out, UNUSABLE_DIR)).read() == "mine"


def test_resume_past_a_changed_byte_trains_on_like_the_reference(reference, tmp_path, capfd):
    """The real resume: a byte changed in the largest array data file of the latest step; the
    run warns, restarts from the previous step and its losses equal the uninterrupted run's."""
    out = str(tmp_path / "run")
    shutil.copytree(reference, out)
    step_dir = os.path.join(out, "checkpoints", str(STEPS))
    name = max((f for f in seal.step_files(step_dir) if "/d/" in f),
               key=lambda f: os.path.getsize(os.path.join(step_dir, f)))
    _flip(os.path.join(step_dir, name), random.Random(7))
    capfd.readouterr()
    summary = run(load_config(None, RUN + [f"out_dir={out}"]))
    err = capfd.readouterr().err
    assert summary["start_step"] == STEPS - 2 and summary["final_step"] == STEPS
    assert (f"warning: checkpoint step {STEPS} in {os.path.dirname(step_dir)} is unusable (file "
            f"{name} does not match the CRC-32 recorded when it was written)") in err
    ref, got = metric_losses(reference), metric_losses(out)
    assert sorted(got) == sorted(ref)
    np.testing.assert_allclose([got[s] for s in sorted(ref)], [ref[s] for s in sorted(ref)],
                               rtol=1e-6)


def test_init_from_a_changed_export_is_refused(reference, tmp_path):
    exported = str(tmp_path / "exp")
    export.export(reference, exported)
    _flip(os.path.join(exported, "model.safetensors"), random.Random(3))
    with pytest.raises(UserError, match=r"^model\.init_from '.*exp' is corrupted \(file "
                       r"model\.safetensors does not match the CRC-32 recorded when it was "
                       r"exported\); export the run again"):
        run(load_config(None, RUN + [f"out_dir={tmp_path / 'new'}", "train.steps=1",
                                     f"model.init_from={exported}"]))


# --------------------------------------------------------------------------- failed saves


@pytest.mark.parametrize("where,async_save", [("orbax", True), ("seal", True), ("orbax", False)])
def test_a_failed_last_save_leaves_no_partial_directory(reference, monkeypatch, tmp_path, where,
                                                        async_save):
    """The disk fills up while the last step is written: at one of orbax's metadata files (an
    async save fails at the end of the run, a sync one at once) or at the seal."""
    from etils import epath

    from boost_jax.checkpoints import store as checkpoint

    out = str(tmp_path / "run")
    last_tmp = f"{os.sep}{STEPS}{TMP_MARK}"
    real_write, real_seal = epath.Path.write_text, checkpoint.write_seal

    def write_text(self, *a, **k):
        if last_tmp in str(self):
            raise OSError(errno.ENOSPC, "No space left on device", str(self))
        return real_write(self, *a, **k)

    def write_seal(step_dir):
        if last_tmp in step_dir:
            raise OSError(errno.ENOSPC, "No space left on device", step_dir)
        return real_seal(step_dir)

    if where == "orbax":
        monkeypatch.setattr(epath.Path, "write_text", write_text)
    else:
        monkeypatch.setattr(checkpoint, "write_seal", write_seal)
    with pytest.raises(CheckpointSaveError) as e:
        run(load_config(None, RUN + [f"out_dir={out}", f"checkpoint.async_save={async_save}"]))
    assert str(e.value).startswith(f"saving checkpoint step {STEPS} failed (No space left on "
                                   "device")
    assert checkpoint_steps(out) == [STEPS - 4, STEPS - 2] and not _tmp_dirs(out)


# --------------------------------------------------------------------------- SIGKILL loop


class Train(TrainProcess):
    base = RUN


def test_sigkill_at_random_moments_of_frequent_saves(reference, jax_cache, tmp_path):
    """A save after every step (async, keep 2); the run is SIGKILLed 5 times, each at a random
    moment once it has saved a step past the one it resumed from (mid-step, mid-save, between
    saves, mid-removal of the oldest step), and resumed from its latest step each time. No
    unusable step is ever left, nor a temp directory at the end, and the finished run's losses
    equal the uninterrupted run's."""
    env = train_env(jax_cache)
    out = tmp_path / "run"
    rng = random.Random(2024)
    for _ in range(5):
        start = max(checkpoint_steps(str(out)), default=0)
        t = Train(out, env, "checkpoint.every=1")
        t.until(lambda: max(checkpoint_steps(str(out)), default=0) > start)
        time.sleep(rng.uniform(0.0, 0.2))
        assert t.p.poll() is None, "the run finished before it was killed"
        t.kill()
        assert not start or f"resumed from step {start} " in t.output, t.output
        assert not os.path.exists(out / UNUSABLE_DIR), t.output
    t = Train(out, env, "checkpoint.every=1")
    assert t.wait() == 0, t.output
    ref, got = metric_losses(reference), metric_losses(str(out))
    assert sorted(got) == sorted(ref)
    np.testing.assert_allclose([got[s] for s in sorted(ref)], [ref[s] for s in sorted(ref)],
                               rtol=1e-6)
    assert not _tmp_dirs(str(out)) and not os.path.exists(out / UNUSABLE_DIR)
    assert checkpoint_steps(str(out)) == [STEPS - 1, STEPS]
