"""Failures a user can cause end in one line, not a traceback: a .parquet/.arrow that is not
one or holds bytes that are not UTF-8, a JSONL line nested 100,000 deep, stdout on a full disk
(/dev/full), a tracker package whose import fails (before config.yaml is written)."""

import os
import re
import subprocess
import sys

import pytest

from boost_jax.errors import UserError
from train_proc import ROOT

PY = sys.executable
ENV = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")


def _run_all(*argvs, env=ENV, stdout=subprocess.PIPE):
    procs = [subprocess.Popen([PY, *a], cwd=ROOT, env=env, text=True, stdout=stdout,
                              stderr=subprocess.PIPE) for a in argvs]
    outs = [p.communicate(timeout=240) for p in procs]
    return [subprocess.CompletedProcess(p.args, p.returncode, *o) for p, o in zip(procs, outs)]


def _one_line(r, pattern, code=2):
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == code and len(lines) == 1, (r.args, r.returncode, r.stderr)
    assert re.match(r"error: " + pattern, lines[0]), lines[0]


def _tables(d):
    import pyarrow as pa
    import pyarrow.parquet as pq

    bad = pa.array([b"good text " * 20, b"\xff\xfe not UTF-8"], type=pa.binary()).view(pa.string())
    pq.write_table(pa.table({"text": bad}), d / "bad.parquet")
    with pa.ipc.new_stream(str(d / "bad.arrow"), pa.schema([("text", pa.string())])) as w:
        w.write_table(pa.table({"text": bad}))
    (d / "fake.parquet").write_text("a text file, not parquet\n")
    (d / "fake.arrow").write_bytes(b"ARROW1" + b"\0" * 40)
    (d / "deep.jsonl").write_text('{"text": "ok"}\n' + "[" * 100_000 + "]" * 100_000 + "\n")


def test_prepare_bad_tables_and_deep_jsonl_are_one_line(tmp_path):
    pytest.importorskip("pyarrow")
    _tables(tmp_path)
    cases = {"bad.parquet": r"has bytes that are not UTF-8 in column 'text' \(at or after row 1\)",
             "bad.arrow": r"has bytes that are not UTF-8 in column 'text'",
             "fake.parquet": r"is not a readable parquet file \(.*\); pass a real \.parquet file",
             "fake.arrow": r"is not a readable arrow file \(.*\); pass a real \.arrow file",
             "deep.jsonl": r"line 2 nests too deeply to be a document; fix or remove it"}
    rows = _run_all(*(["-m", "boost_jax.data.prepare", str(tmp_path / name),
                       str(tmp_path / f"{name}.bin"), "--tokenizer", "byte", "--no-progress"]
                      for name in cases))
    for r, (name, why) in zip(rows, cases.items()):
        _one_line(r, rf"(SOURCE file )?'{tmp_path}/{re.escape(name)}' {why}")
    assert not [n for n in os.listdir(tmp_path) if ".bin" in n]


def test_training_and_evaluate_read_deep_jsonl_as_one_line(tmp_path):
    """train.py's and evaluate's reader (read_documents) of a JSONL line nested 100,000 deep."""
    from boost_jax.data.sources import read_documents

    _tables(tmp_path)
    for option in ("data.source", "--data"):
        with pytest.raises(UserError, match=rf"^{re.escape(option)} '.*deep\.jsonl' line 2 nests "
                                            r"too deeply to be a document"):
            read_documents(str(tmp_path / "deep.jsonl"), None, option)


def test_stdout_on_a_full_disk_is_one_line(tmp_path):
    cfg = os.path.join(ROOT, "configs", "demo.yaml")
    with open("/dev/full", "w") as full:
        rows = _run_all(["-m", "boost_jax.launch", "slurm", "--config", cfg, "--topology", "cpu",
                         "--nodes", "1"],
                        ["-m", "boost_jax.plan", "--config", cfg, "--topology", "cpu", "--nodes",
                         "1", "--no-compile", "--json"], stdout=full)
    for r in rows:
        _one_line(r, r"writing the output \(stdout\) failed \(No space left on device\); free "
                     r"space or write it elsewhere", code=1)


def test_a_tracker_that_fails_to_import_stops_before_config_yaml(tmp_path):
    broken = tmp_path / "site" / "tensorboardX"
    broken.mkdir(parents=True)
    (broken / "__init__.py").write_text("raise RuntimeError('half installed')\n")
    env = dict(ENV, PYTHONPATH=f"{tmp_path / 'site'}:{ROOT}")
    out = tmp_path / "run"
    r, = _run_all(["train.py", "--cpu-devices", "1", "train.steps=1", f"out_dir={out}"], env=env)
    _one_line(r, r"logging\.tensorboard=true but the tensorboardX package fails to import "
                 r"\(RuntimeError: half installed\); reinstall tensorboardX or set "
                 r"logging\.tensorboard=false")
    assert not (out / "config.yaml").exists()


def test_stdout_whose_reader_left_ends_quietly():
    """`... | head -1` that exits first: no traceback, the exit code a shell gives SIGPIPE."""
    r, w = os.pipe()
    os.close(r)  # the reader is gone before anything is written
    cfg = os.path.join(ROOT, "configs", "demo.yaml")
    p = subprocess.run([PY, "-m", "boost_jax.launch", "slurm", "--config", cfg, "--topology",
                        "cpu", "--nodes", "1"], cwd=ROOT, env=ENV, stdout=w,
                       stderr=subprocess.PIPE, text=True, timeout=120)
    os.close(w)
    assert p.returncode == 141 and p.stderr == "", (p.returncode, p.stderr)
