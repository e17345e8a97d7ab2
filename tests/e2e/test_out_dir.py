"""Nothing lost, nothing silent: one run per out_dir, resume that refuses a changed run, outputs
that survive kill -9 and signals, and a full disk reported in one line.

Every test runs train.py as a subprocess (exit code and stderr) on 8 simulated devices with a
shared compile cache.
"""

import errno
import json
import os
import re
import shutil
import signal
import struct
import subprocess

import pytest

from tmpfs import small_tmpfs
from train_proc import ROOT, TrainProcess, train_env

TINY = ["model.d_model=32", "model.n_layers=2", "model.n_heads=2", "model.d_ff=64",
        "model.rank=8", "model.max_seq_len=32", "data.seq_len=32", "data.max_bytes=300000",
        "train.global_batch=8", "train.eval_batches=2", "train.log_every=1",
        "logging.progress=false", "logging.plot=false", "optim.lr=0.01",
        "train.eval_every=6", "checkpoint.every=3"]


class Train(TrainProcess):
    base = TINY


@pytest.fixture(scope="module")
def env(jax_cache):
    return train_env(jax_cache)


def _rows(out_dir):
    return [json.loads(line) for line in open(os.path.join(out_dir, "metrics.jsonl"))]


def _summary(out_dir):
    return json.load(open(os.path.join(out_dir, "summary.json")))


def _tb_scalars(out_dir):
    """{(tag, step): value} from every TensorBoard event file under out_dir/tb (TFRecord frames
    of Event protos), in file order."""
    from tensorboardX.proto.event_pb2 import Event

    out = {}
    d = os.path.join(out_dir, "tb")
    for name in sorted(os.listdir(d)):
        data = open(os.path.join(d, name), "rb").read()
        pos = 0
        while pos + 12 <= len(data):
            (n,) = struct.unpack("<Q", data[pos:pos + 8])
            ev = Event.FromString(data[pos + 12:pos + 12 + n])
            pos += 12 + n + 4
            for v in ev.summary.value:
                out[(v.tag, ev.step)] = v.simple_value
    return out


def test_a_second_run_on_the_same_out_dir_stops_and_the_first_keeps_every_row(env, tmp_path):
    out = tmp_path / "run"
    first = Train(out, env, "train.steps=100000", "train.eval_every=100000",
                  "checkpoint.every=100000")  # runs until the signal below
    first.until_trained(2)
    second = subprocess.run(first.p.args, cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=240)
    lines = [ln for ln in second.stderr.splitlines() if ln.strip()]
    assert second.returncode == 2 and len(lines) == 1, second.stderr
    assert re.match(rf"error: out_dir '{out}' is in use by another run \(pid {first.p.pid} on "
                    r"host .*, started .*train\.py .*\); wait for it to finish", lines[0]), lines
    assert first.p.poll() is None  # the second run did not wait for the first to end

    first.p.send_signal(signal.SIGTERM)
    assert first.wait() == 128 + signal.SIGTERM, first.output
    stopped = _summary(out)["final_step"]
    steps = [r["step"] for r in _rows(out) if "loss" in r]
    assert steps == list(range(1, stopped + 1))  # every row of the first run, once
    # a signal stop evaluates nothing: the step-0 loss is initial, not final
    s = _summary(out)
    step0 = next(r["val_loss"] for r in _rows(out) if r["step"] == 0)
    assert s["initial_val_loss"] == step0 and s["final_val_loss"] is None
    assert s["last_val_step"] == 0

    # resuming with a harmless change (steps) is accepted, said and recorded
    t = Train(out, env, f"train.steps={stopped + 2}", "train.eval_every=100000",
              "checkpoint.every=100000")
    assert t.wait() == 0, t.output
    assert f"resumed from step {stopped} in {out} with changed settings: train.steps 100000 -> " \
           f"{stopped + 2}" in t.output
    assert sorted(os.listdir(out / "configs")) == ["000-step0.yaml", f"001-step{stopped}.yaml"]
    assert "steps: 100000" in (out / "configs" / "000-step0.yaml").read_text()
    s = _summary(out)
    assert s["initial_val_loss"] == step0  # kept across the resume
    assert s["final_val_loss"] == _rows(out)[-1]["val_loss"] and s["last_val_step"] == stopped + 2


def test_kill_9_keeps_tensorboard_rows_and_the_next_run_takes_the_lock_over(env, tmp_path):
    out = tmp_path / "run"
    t = Train(out, env, "train.steps=12")
    t.until_trained(4)
    t.kill()
    logged = {r["step"]: r["loss"] for r in _rows(out) if "loss" in r}
    tb = _tb_scalars(out)
    assert all(tb[("loss", s)] == pytest.approx(v) for s, v in logged.items()), (logged, tb)

    again = Train(out, env, "train.steps=12")
    assert again.wait() == 0, again.output
    assert re.search(rf"warning: out_dir '{out}' was held by a run that died without releasing "
                     rf"it \(pid {t.p.pid} on host ", again.output), again.output
    assert {s for _, s in _tb_scalars(out)} >= set(range(1, 13))


@pytest.fixture(scope="module")
def saved(env, tmp_path_factory):
    """A run stopped at step 3 with its checkpoint."""
    out = tmp_path_factory.mktemp("saved") / "run"
    t = Train(out, env, "train.steps=12", "train.stop_after=3", "logging.tensorboard=false")
    assert t.wait() == 0, t.output
    return out


def _copy(saved, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(saved, out)
    return out


def test_resume_with_another_data_stream_is_refused_until_accepted(env, saved, tmp_path):
    out = _copy(saved, tmp_path)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(f"line {i}: the quick brown fox jumps over {i % 97} dogs\n"
                              for i in range(4000)))
    config_before = (out / "config.yaml").read_text()
    change = [f"data.source={corpus}", "data.seed=1", "train.steps=12",
              "logging.tensorboard=false"]
    t = Train(out, env, *change)
    assert t.wait() == 2
    assert len(t.lines) == 1, t.output
    assert re.match(rf"error: checkpoint step 3 in {out} was trained with other settings that "
                    r"define the model or the data stream \(data\.source 'stdlib' -> '.*corpus"
                    r"\.txt', data\.seed 0 -> 1\); resuming would mix them silently: .*"
                    r"checkpoint\.accept_changes=\[data\.source,data\.seed\]$", t.lines[0])
    assert (out / "config.yaml").read_text() == config_before  # nothing of the old run lost

    t = Train(out, env, *change, "checkpoint.accept_changes=[data]")
    assert t.wait() == 0, t.output
    assert "resumed from step 3" in t.output and "data.seed 0 -> 1" in t.output
    history = sorted(os.listdir(out / "configs"))
    assert history == ["000-step0.yaml", "001-step3.yaml"]
    assert "source: stdlib" in (out / "configs" / history[0]).read_text()
    assert f"source: {corpus}" in (out / "config.yaml").read_text()


def _files(out):
    """Every file of a run but its lock, with its size and modification time."""
    return {str(p.relative_to(out)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in out.rglob("*") if p.is_file() and p.name != ".lock"}


def test_a_finished_run_given_no_more_steps_says_so_and_writes_nothing(env, saved, tmp_path):
    out = _copy(saved, tmp_path)
    before = _files(out)
    t = Train(out, env, "train.steps=3", "logging.tensorboard=false")
    assert t.wait() == 0, t.output
    line = (f"{out} holds step 3 of train.steps=3: nothing to train; raise train.steps to "
            "continue it, or choose another out_dir=...")
    assert line in t.lines and not any("resumed" in x for x in t.lines), t.output
    assert _files(out) == before  # summary.json, config.yaml, configs/, tb/ left as they were
    t = Train(out, env, "train.steps=2", "logging.tensorboard=false")
    assert t.wait() == 2, t.output
    assert t.lines[-1] == (f"error: {out} holds step 3, past train.steps=2; use train.steps=3 "
                           "or more to continue it, or another out_dir=..."), t.output
    assert _files(out) == before


# --------------------------------------------------------------------------- disk full

_ENOSPC_AT_STEP_6 = (
    "import errno, os, runpy, sys; from etils import epath; real = epath.Path.write_text\n"
    "def write_text(self, *a, **k):\n"
    "    if os.sep + '6.orbax-checkpoint-tmp' in str(self):\n"
    "        raise OSError(errno.ENOSPC, 'No space left on device', str(self))\n"
    "    return real(self, *a, **k)\n"
    "epath.Path.write_text = write_text; sys.argv = sys.argv[1:]\n"
    "runpy.run_path(sys.argv[0], run_name='__main__')\n")


def _fill(directory, leave):
    """Fill the filesystem of `directory` up to `leave` free bytes."""
    st = os.statvfs(directory)
    with open(os.path.join(directory, "filler"), "wb") as f:
        left = st.f_bavail * st.f_frsize - leave
        while left > 0:
            try:
                left -= f.write(b"\0" * min(left, 1 << 20))
                f.flush()
            except OSError as e:
                assert e.errno == errno.ENOSPC
                break


@pytest.fixture
def small_disk(tmp_path):
    """A 16 MiB tmpfs where the system lets us mount one (root), else None."""
    with small_tmpfs(tmp_path, "16m") as mnt:
        yield mnt


def test_disk_full_is_reported_in_at_most_three_lines_with_details_in_the_run_log(
        env, saved, small_disk, tmp_path):
    """A real full disk where a tmpfs can be mounted, else ENOSPC raised inside orbax's writer
    (the same background-thread failure path); the earlier checkpoint stays intact."""
    root = small_disk or tmp_path
    out = root / "run"
    shutil.copytree(saved, out)
    if small_disk:
        _fill(small_disk, leave=100 * 1024)  # metrics rows fit, a checkpoint does not
        t = Train(out, env, "train.steps=12")
    else:
        t = Train(out, env, "train.steps=12", python_prefix=("-c", _ENOSPC_AT_STEP_6))
    assert t.wait() == 2
    lines = t.lines
    assert 1 <= len(lines) <= 3, t.output
    log = out / "run.log"
    assert re.match(r"error: saving checkpoint step 6 failed \(no space left on device", lines[-1],
                    re.I), t.output
    assert "the earlier checkpoint (step 3)" in lines[-1]
    assert lines[-1].endswith(f"; details in {log}")
    assert "Traceback" in log.read_text()  # the details went to the log
    assert sorted(n for n in os.listdir(out / "checkpoints")) == ["3"]
