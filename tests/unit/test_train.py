"""End-to-end training runs on 8 simulated devices: loss falls, outputs exist, resume is exact."""

import glob
import gzip
import json
import os

import numpy as np
import pytest

from boost_jax.config import load_config
from boost_jax.train.loop import run

TINY = ["model.d_model=32", "model.n_layers=2", "model.n_heads=2", "model.d_ff=64",
        "model.rank=8", "model.max_seq_len=32", "data.seq_len=32", "data.max_bytes=300000",
        "train.global_batch=8", "train.eval_batches=2", "train.log_every=1",
        "logging.progress=false", "optim.lr=0.01", "optim.warmup_frac=0.1"]


def _cfg(out_dir, *extra):
    return load_config(None, TINY + [f"out_dir={out_dir}", *extra])


def _losses(out_dir):
    rows = [json.loads(line) for line in open(os.path.join(out_dir, "metrics.jsonl"))]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("straight"))
    summary = run(_cfg(out, "train.steps=20", "train.eval_every=10", "checkpoint.every=10",
                       "train.profile_steps=[3,5]"))
    return out, summary


def test_short_run_lowers_loss_and_writes_outputs(straight):
    out, summary = straight
    assert summary["final_val_loss"] < 0.8 * summary["initial_val_loss"]
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    train_rows = [r for r in rows if "loss" in r]
    assert [r["step"] for r in train_rows] == list(range(1, 21))
    assert all({"loss", "tokens_per_s", "grad_norm", "lr"} <= set(r) for r in train_rows[1:])
    assert "tokens_per_s" not in train_rows[0]  # the first step is mostly compilation
    assert summary["first_step_s"] > 0
    # warmup over 2 of 20 updates: the first trains at half the lr; the last ends the decay
    lrs = [r["lr"] for r in train_rows]
    assert lrs[:2] == pytest.approx([0.005, 0.01])
    assert lrs[-1] == pytest.approx(0.01 * _cfg(out).optim.min_lr_ratio)
    assert {r["step"] for r in rows if "val_loss" in r} == {0, 10, 20}
    assert os.listdir(os.path.join(out, "tb"))
    assert os.path.getsize(os.path.join(out, "loss.png")) > 1000
    assert sorted(int(s) for s in os.listdir(os.path.join(out, "checkpoints")) if s.isdigit()) == [10, 20]


def test_profile_steps_write_a_trace_of_those_steps(straight):
    out, _ = straight
    traces = glob.glob(os.path.join(out, "profile", "**", "*.trace.json.gz"), recursive=True)
    assert len(traces) == 1, traces
    with gzip.open(traces[0]) as f:
        events = json.load(f)["traceEvents"]
    # steps 3, 4, 5: three executions of the compiled train step (XLA's host-side events)
    names = [e.get("name", "") for e in events if e.get("ph") == "X"]
    runs = [n for n in names if n.endswith("Execute (jit_step_fn)") and not n.startswith("[")]
    assert len(runs) == 3, sorted(set(names))[:50]


def test_resume_gives_the_same_losses(straight, tmp_path):
    out_a, _ = straight
    out_b = str(tmp_path / "resumed")
    first = run(_cfg(out_b, "train.steps=20", "train.eval_every=10", "checkpoint.every=10",
                     "train.stop_after=10"))
    assert first["final_step"] == 10
    second = run(_cfg(out_b, "train.steps=20", "train.eval_every=10", "checkpoint.every=10"))
    assert second["start_step"] == 10 and second["final_step"] == 20
    a, b = _losses(out_a), _losses(out_b)
    assert sorted(b) == list(range(1, 21))
    np.testing.assert_allclose([b[s] for s in range(1, 21)], [a[s] for s in range(1, 21)],
                               rtol=1e-6)


def test_resume_with_other_model_shape_is_refused(straight):
    from boost_jax.errors import UserError

    out_a, _ = straight
    with pytest.raises(UserError, match="different model"):
        run(_cfg(out_a, "train.steps=30", "model.d_model=64"))


def test_a_full_disk_while_metrics_are_trimmed_is_one_line_and_loses_nothing(straight,
                                                                             tmp_path,
                                                                             monkeypatch):
    """A resume drops metrics.jsonl rows past the restored step: a failed write of it is
    the run-output error (what failed, what is intact), the file as it was, no temp left."""
    import errno
    import shutil

    from boost_jax.train import loop
    from boost_jax.train.loop import OutputWriteError

    out = str(tmp_path / "run")
    shutil.copytree(straight[0], out)
    metrics = os.path.join(out, "metrics.jsonl")
    with open(metrics, "a") as f:
        f.write('{"step": 25, "loss": 1.0}\n')  # a row a killed run wrote past its last save
    before = open(metrics).read()

    def full(path, text, force):
        raise OSError(errno.ENOSPC, "No space left on device", path)

    monkeypatch.setattr(loop, "write_text", full)
    with pytest.raises(OutputWriteError, match=r"^writing .*/metrics\.jsonl failed \(No space "
                                               r"left on device\); checkpoints up to step 20 in "
                                               r".* are intact; free space and rerun"):
        run(_cfg(out, "train.steps=30", "train.eval_every=10", "checkpoint.every=10"))
    assert open(metrics).read() == before
    assert not [n for n in os.listdir(out) if "tmp" in n]


def test_the_done_line_says_when_the_final_step_was_not_evaluated():
    from boost_jax.train.loop import _done_line

    done = {"final_step": 100, "last_val_loss": 1.5, "last_val_step": 100}
    assert _done_line("r", done) == "done: step 100, val_loss 1.5000; summary in r/summary.json"
    stopped = dict(done, final_step=23, last_val_step=0)  # a signal stopped it at step 23
    assert _done_line("r", stopped).startswith(
        "done: step 23 (not evaluated; the last evaluation was at step 0: val_loss 1.5000)")


def test_a_gpu_topology_on_cpu_devices_is_said():
    from boost_jax.mesh import get_topology
    from boost_jax.train.loop import foreign_topology

    assert foreign_topology(get_topology("dgx-h100"), "cpu") == (
        "mesh.topology=dgx-h100 describes NVIDIA H100 SXM devices but this run has CPU devices: "
        "MFU is against the NVIDIA H100 SXM's peak")
    assert foreign_topology(get_topology("dgx-h100"), "gpu") is None
    assert foreign_topology(get_topology("cpu"), "cpu") is None


def test_an_out_dir_that_is_a_file_is_named_as_one(tmp_path):
    from boost_jax.errors import UserError
    from boost_jax.train.loop import _check_writable

    (tmp_path / "f").write_text("mine")
    with pytest.raises(UserError, match=r"^out_dir '.*/f' is a file, not a folder; choose "
                                        r"another out_dir=\.\.\.$"):
        _check_writable(str(tmp_path / "f"))
    assert (tmp_path / "f").read_text() == "mine"


def test_out_dir_checks_at_the_start_leave_the_users_files(tmp_path, monkeypatch):
    """A dangling link and a read-only checkpoints/ are named before any step; the probe's
    name is unique, so a user's file of the old probe's name is left alone."""
    import errno
    import tempfile

    from boost_jax.errors import UserError
    from boost_jax.train.loop import _check_writable

    os.symlink(tmp_path / "gone", tmp_path / "link")
    with pytest.raises(UserError, match=r"^out_dir '.*/link' is a link to '.*/gone', which does "
                                        r"not exist; create that folder or choose another"):
        _check_writable(str(tmp_path / "link"))
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints").mkdir(parents=True)
    (run_dir / ".write_test.0").write_text("mine")
    _check_writable(str(run_dir))
    assert sorted(os.listdir(run_dir)) == [".write_test.0", "checkpoints"]
    assert (run_dir / ".write_test.0").read_text() == "mine"
    real = tempfile.mkstemp

    def read_only_checkpoints(prefix, dir):  # a read-only mount (this test may run as root)
        if dir.endswith("checkpoints"):
            raise PermissionError(errno.EACCES, "Permission denied", dir)
        return real(prefix=prefix, dir=dir)

    monkeypatch.setattr(tempfile, "mkstemp", read_only_checkpoints)
    with pytest.raises(UserError, match=r"^the checkpoint folder '.*/run/checkpoints' is not "
                                        r"writable \(Permission denied\); choose another"):
        _check_writable(str(run_dir))


@pytest.mark.parametrize("name", ["lr[3e-4]", "a\\b", "x[]y"])
def test_an_out_dir_the_checkpoint_library_would_glob_is_refused_before_anything(tmp_path,
                                                                                  name):
    """orbax's merge of a step's files globs under its path: a bracket pair or a backslash
    there leaves the step unreadable; `*`, `?` and a lone bracket match themselves."""
    from boost_jax.checkpoints.run_config import refuse_pattern
    from boost_jax.errors import UserError

    with pytest.raises(UserError, match=r"^out_dir '.*' holds (\[.*\]|a backslash), which the "
                                        r"checkpoint library reads as a file pattern: .*; choose "
                                        r"an out_dir without brackets around text or "
                                        r"backslashes$"):
        run(_cfg(str(tmp_path / name)))
    assert os.listdir(tmp_path) == []
    for fine in ("a*b", "a?b", "a[b", "a]b"):
        refuse_pattern(str(tmp_path / fine))


def test_a_finished_run_killed_in_its_final_outputs_gets_them_on_a_rerun(straight, tmp_path,
                                                                          capsys):
    """A kill after the last save but before summary.json / loss.png: the same command again
    has nothing to train, and writes them from metrics.jsonl (the same validation losses)."""
    import shutil

    out = str(tmp_path / "run")
    shutil.copytree(straight[0], out)
    want = json.load(open(os.path.join(out, "summary.json")))
    os.remove(os.path.join(out, "summary.json"))
    os.remove(os.path.join(out, "loss.png"))
    run(_cfg(out, "train.steps=20", "train.eval_every=10", "checkpoint.every=10"))
    got = json.load(open(os.path.join(out, "summary.json")))
    keys = ("initial_val_loss", "final_val_loss", "last_val_loss", "last_val_step",
            "final_step", "params")
    assert {k: got[k] for k in keys} == {k: want[k] for k in keys}
    assert os.path.getsize(os.path.join(out, "loss.png")) > 1000
    assert "wrote the missing" in capsys.readouterr().err
    run(_cfg(out, "train.steps=20", "train.eval_every=10", "checkpoint.every=10"))  # kept
    assert json.load(open(os.path.join(out, "summary.json"))) == got
