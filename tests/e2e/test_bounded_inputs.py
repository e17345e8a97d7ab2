"""Inputs that used to hang or exhaust the machine end in one line, fast and small: a config
that is a device, a FIFO or 1 GB (file_kind.read_regular), a FIFO as a corpus or inside a
data folder, a run name of megabytes (config_read.MAX_NAME), and prepare stopped by a signal
(its pool shut down, its workers gone, nothing published)."""

import os
import re
import resource
import signal
import subprocess
import sys
import time

import pytest

from boost_jax.config import load_config
from boost_jax.errors import UserError
from train_proc import ROOT

PY = sys.executable
ENV = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")


def _measured(argv, timeout=30):
    """(completed process, seconds, peak resident MB) of one command; run from a fresh
    interpreter so the peak is this command's alone."""
    probe = ("import resource, subprocess, sys, time\n"
             "t = time.monotonic()\n"
             "r = subprocess.run(sys.argv[1:], capture_output=True, text=True)\n"
             "print(r.returncode, time.monotonic() - t, "
             "resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss // 1024)\n"
             "sys.stderr.write(r.stderr)\n")
    r = subprocess.run([PY, "-c", probe, PY, *argv], cwd=ROOT, env=ENV, capture_output=True,
                       text=True, timeout=timeout)
    rc, secs, mb = r.stdout.split()
    return int(rc), float(secs), int(mb), r.stderr


def test_a_config_that_is_a_device_fifo_or_huge_is_one_line_fast_and_small(tmp_path):
    fifo, huge = tmp_path / "fifo.yaml", tmp_path / "huge.yaml"
    os.mkfifo(fifo)
    with open(huge, "wb") as f:  # sparse: 1 GB long, no disk used
        f.truncate(1 << 30)
    cases = (("/dev/zero", "is a character device, not a regular file"),
             (str(fifo), "is a FIFO, not a regular file"),
             (str(huge), r"is 1,073,741,824 bytes, more than the 16,777,216 a config file may "
                         r"have"))
    for cmd in (["train.py"], ["-m", "boost_jax.launch", "slurm", "--nodes", "1"]):
        for path, why in cases:
            rc, secs, mb, err = _measured([*cmd, "--config", path])
            lines = err.strip().splitlines()
            assert rc == 2 and len(lines) == 1, (cmd, path, err)
            assert re.match(rf"error: config file '{re.escape(path)}' {why}", lines[0]), lines[0]
            assert secs < 5 and mb < 200, (cmd, path, secs, mb)


def test_a_fifo_as_corpus_or_inside_a_data_folder_is_named(tmp_path):
    folder = tmp_path / "corpus"
    folder.mkdir()
    (folder / "a.txt").write_text("hello\n" * 100)
    os.mkfifo(folder / "b.txt")
    os.mkfifo(tmp_path / "c.bin")
    os.mkfifo(tmp_path / "d.json")
    (tmp_path / "d.bin").write_bytes(b"\0" * 64)
    from boost_jax.data.sources import read_documents

    with pytest.raises(UserError, match=r"^data\.source file '.*/corpus/b\.txt' is a FIFO"):
        read_documents(str(folder), None)
    with pytest.raises(UserError, match=r"^data\.source '.*/c\.bin' is a FIFO"):
        load_config(None, [f"data.source={tmp_path}/c.bin"])
    with pytest.raises(UserError, match=r"^the metadata of data\.sources\[0\]\.path '.*/d\.json' "
                                        r"is a FIFO"):
        load_config(None, [f"data.sources=[{{path: {tmp_path}/d.bin, weight: 1}}]"])
    r = subprocess.run([PY, "-m", "boost_jax.data.prepare", str(folder), str(tmp_path / "o.bin"),
                        "--tokenizer", "byte"], cwd=ROOT, env=ENV, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2 and re.match(r"error: SOURCE file '.*/corpus/b\.txt' is a FIFO",
                                          r.stderr), r.stderr
    assert not (tmp_path / "o.bin").exists()


def test_text_keys_are_bounded_and_never_echoed_whole():
    for key, cap in (("name", 256), ("out_dir", 4096), ("data.source", 4096)):
        with pytest.raises(UserError, match=rf"^{re.escape(key)} is {cap + 1:,} characters long, "
                                            rf"more than the {cap:,} it may have; shorten it"):
            load_config(None, [f"{key}={'x' * (cap + 1)}"])
    t = time.monotonic()
    with pytest.raises(UserError) as e:
        load_config(None, ["name=" + "n" * (20 << 20)])
    assert len(str(e.value)) < 300 and time.monotonic() - t < 5


def _children(pid):
    kids = []
    for t in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{t}/children") as f:
            kids += [int(c) for c in f.read().split()]
    return kids


def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"
    except OSError:
        return False


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_prepare_stopped_by_a_signal_leaves_no_worker_and_no_file(tmp_path, sig):
    """SIGTERM: the pool is shut down (exit 143, one line); SIGKILL: the workers die with it
    (they used to stay, blocked, holding the pool's semaphores)."""
    src = tmp_path / "src.txt"
    src.write_text(("def f(x):\n    return x * 2  # " + "é" * 20 + "\n") * 300000)
    out = tmp_path / "o.bin"
    p = subprocess.Popen([PY, "-m", "boost_jax.data.prepare", str(src), str(out), "--tokenizer",
                          "byte", "--workers", "2", "--no-progress"], cwd=ROOT, env=ENV,
                         stderr=subprocess.PIPE, text=True)
    workers, t0 = [], time.monotonic()
    while len(workers) < 2 and time.monotonic() - t0 < 60 and p.poll() is None:
        workers = [k for k in _children(p.pid) if _alive(k)
                   and b"resource_tracker" not in open(f"/proc/{k}/cmdline", "rb").read()]
        time.sleep(0.05)
    assert len(workers) == 2, "the pool never started"
    p.send_signal(sig)
    err = p.communicate(timeout=60)[1]
    if sig == signal.SIGTERM:
        assert p.returncode == 143 and err == "interrupted (signal 15)\n", err
    deadline = time.monotonic() + 10
    while any(_alive(w) for w in workers) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [w for w in workers if _alive(w)]
    assert sorted(os.listdir(tmp_path)) in (["src.txt"], [".o.bin.lock", "src.txt"])


def test_a_prompt_file_or_tokenizer_that_is_a_device_or_fifo_is_named(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    src = tmp_path / "t.txt"
    src.write_text("hello\n" * 100)
    for argv, pattern in (
            (["-m", "boost_jax.generate", "--run", str(tmp_path / "none"), "--prompt-file",
              "/dev/zero"], r"--prompt-file '/dev/zero' is a character device"),
            (["-m", "boost_jax.generate", "--run", str(tmp_path / "none"), "--prompt-file",
              str(fifo)], r"--prompt-file '.*/fifo' is a FIFO"),
            (["-m", "boost_jax.generate", "--run", str(tmp_path / "none"), "--prompt-file",
              str(tmp_path)], r"--prompt-file '.*' is a folder, not a regular file"),
            (["-m", "boost_jax.data.prepare", str(src), str(tmp_path / "o.bin"), "--tokenizer",
              str(fifo)], r"tokenizer file '.*/fifo' is a FIFO")):
        rc, secs, mb, err = _measured(argv)
        lines = err.strip().splitlines()
        assert rc == 2 and len(lines) == 1 and re.match("error: " + pattern, lines[0]), err
    assert sorted(os.listdir(tmp_path)) == ["fifo", "t.txt"]


def test_a_billion_laughs_config_is_one_short_line(tmp_path):
    """YAML aliases nest a list of 9^9 items in a few hundred bytes: the error never writes it
    out (config_read.shown)."""
    expr = "&a0 [1, 1, 1, 1, 1, 1, 1, 1, 1]"
    for i in range(1, 9):
        expr = f"&a{i} [{expr}, " + ", ".join([f"*a{i - 1}"] * 8) + "]"
    cfg = tmp_path / "laughs.yaml"
    cfg.write_text(f"train:\n  profile_steps: {expr}\n")
    rc, secs, mb, err = _measured(["train.py", "--config", str(cfg), "--print-config"])
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and len(lines[0]) < 400, err[:2000]
    assert lines[0].startswith("error: train.profile_steps=[[[") and "has the wrong type" in err
    assert secs < 5 and mb < 200, (secs, mb)


def test_a_run_config_yaml_that_is_a_fifo_or_device_reads_as_unreadable(tmp_path):
    """Resume, generate and evaluate read out_dir/config.yaml (load_saved): never blocked on a
    FIFO, never fed /dev/zero."""
    from boost_jax.checkpoints.run_config import load_saved

    os.mkfifo(tmp_path / "config.yaml")
    t = time.monotonic()
    assert load_saved(str(tmp_path / "config.yaml")) is None
    assert load_saved("/dev/zero") is None
    assert time.monotonic() - t < 5
