"""Weights & Biases sink (logging.wandb): the missing-package error, and in offline mode (where
wandb is installed) the W&B history equals metrics.jsonl row for row, across a resume."""

import glob
import json
import os
import struct
import subprocess
import sys

import pytest

from train_proc import ROOT, TINY, train_env

WANDB_OFF = ["logging.wandb=true", "logging.wandb_mode=offline", "train.steps=4",
             "train.eval_every=2", "checkpoint.every=2", "logging.progress=false"]


@pytest.fixture(scope="module")
def env(jax_cache, tmp_path_factory):
    e = train_env(jax_cache)
    home = str(tmp_path_factory.mktemp("wandb_home"))  # W&B settings and caches, not ~
    e.update(WANDB_CONFIG_DIR=home, WANDB_CACHE_DIR=home, WANDB_DATA_DIR=home,
             WANDB_ARTIFACT_DIR=home)
    return e


def _train(env, out_dir, *extra, hide_wandb=False):
    """train.py; with hide_wandb the wandb package cannot be imported (as when not installed)."""
    pre = (["-c", "import runpy, sys; sys.modules['wandb'] = None; sys.argv = sys.argv[1:]; "
            "runpy.run_path(sys.argv[0], run_name='__main__')"] if hide_wandb else [])
    return subprocess.run([sys.executable, *pre, os.path.join(ROOT, "train.py"),
                           "--cpu-devices", "8", *TINY, f"out_dir={out_dir}", *extra],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def test_wandb_missing_is_one_line_exit_2(env, tmp_path):
    p = _train(env, tmp_path / "run", *WANDB_OFF, hide_wandb=True)
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert p.returncode == 2, p.stderr
    assert lines == ["error: logging.wandb=true but the wandb package is not installed; install "
                     "the extra (pip install -e '.[wandb]') or set logging.wandb=false"], p.stderr
    assert not os.path.exists(tmp_path / "run" / "metrics.jsonl")  # failed before training


def _records(path):
    """Records of a .wandb file: a 7-byte header, then LevelDB-log framing (32 KiB blocks;
    chunks of crc32, length, type 1 full / 2 first / 3 middle / 4 last) of protobuf Records."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = open(path, "rb").read()
    assert data[:4] == b":W&B"
    pos, block, buf = 7, 32768, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        _, n, kind = struct.unpack("<IHB", data[pos:pos + 7]) if left >= 7 else (0, 0, 0)
        if kind == 0:  # block trailer
            pos += left
            continue
        buf += data[pos + 7:pos + 7 + n]
        pos += 7 + n
        if kind in (1, 4):
            rec = pb.Record()
            rec.ParseFromString(buf)
            buf = b""
            yield rec


def _history(wandb_file):
    rows = []
    for rec in _records(wandb_file):
        if rec.WhichOneof("record_type") == "history":
            row = {i.key or "/".join(i.nested_key): json.loads(i.value_json)
                   for i in rec.history.item}
            rows.append({k: v for k, v in row.items() if not k.startswith("_")})
    return rows


def test_wandb_offline_rows_equal_metrics_jsonl(env, tmp_path):
    pytest.importorskip("wandb")
    out = tmp_path / "run"
    first = _train(env, out, *WANDB_OFF, "train.log_every=1", "train.stop_after=2")
    assert first.returncode == 0, first.stderr
    run_id = open(out / "wandb_run_id").read().strip()
    second = _train(env, out, *WANDB_OFF, "train.log_every=1")
    assert second.returncode == 0, second.stderr
    assert open(out / "wandb_run_id").read().strip() == run_id

    files = sorted(glob.glob(str(out / "wandb" / "offline-run-*" / "run-*.wandb")))
    assert [os.path.basename(f) for f in files] == [f"run-{run_id}.wandb"] * 2  # one W&B run
    history = [row for f in files for row in _history(f)]
    metrics = [json.loads(ln) for ln in open(out / "metrics.jsonl")]
    assert [r["step"] for r in metrics] == [0, 1, 2, 3, 4]
    assert history == metrics


def test_wandb_online_without_login_is_one_line_exit_2(env, tmp_path):
    pytest.importorskip("wandb")
    e = {k: v for k, v in env.items() if k != "WANDB_API_KEY"}
    argv = [a.replace("offline", "online") for a in WANDB_OFF]
    p = _train(e, tmp_path / "run", *argv)
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert p.returncode == 2, p.stderr
    assert len(lines) == 1 and lines[0].startswith(
        "error: logging.wandb=true but W&B did not start (No API key configured"), p.stderr
    assert lines[0].endswith("run wandb login, or set logging.wandb_mode=offline (no "
                             "network; wandb sync later)")
    # an input mistake: nothing of the run is written (the lock file may stay)
    left = set(os.listdir(tmp_path / "run")) if os.path.isdir(tmp_path / "run") else set()
    assert not left & {"config.yaml", "configs", "wandb_run_id", "wandb", "metrics.jsonl"}, left
