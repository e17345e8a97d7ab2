"""README "Real data, from a download to a cluster job": every command of steps 2 to 4 runs as
written (but `sbatch`), in a scratch folder holding what step 1 downloads (a parquet shard under
hf's layout and a dataset saved with save_to_disk, both small), with a few training steps."""

import json
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SECTION = ("### Real data, from a download to a cluster job", "### A cluster job, from the")
TINY = ["model.d_model=32", "model.n_layers=2", "model.n_heads=2", "model.d_ff=64",
        "model.rank=8", "model.max_seq_len=32", "data.seq_len=32", "train.global_batch=8",
        "train.eval_batches=2", "train.steps=3", "train.eval_every=3", "checkpoint.every=3",
        "logging.progress=false", "logging.tensorboard=false", "logging.plot=false"]


def _blocks():
    text = open(os.path.join(ROOT, "README.md")).read()
    start, end = (text.index(h) for h in SECTION)
    return [b.strip().splitlines() for b in re.findall(r"```\n(.*?)```", text[start:end], re.S)]


def downloads(d):
    """What step 1 leaves: hf's local-dir layout with a parquet shard, a save_to_disk folder
    (tests/test_readme.py may use it as the setup of step 2)."""
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    import argparse
    import json as json_mod

    def docs(module, n):
        lines = open(module.__file__, encoding="utf-8").read().splitlines()
        return ["\n".join(lines[i::n]) for i in range(n)]

    shard = d / "downloads" / "fineweb-edu" / "sample" / "10BT"
    shard.mkdir(parents=True)
    pq.write_table(pa.table({"text": docs(argparse, 200), "id": list(range(200))}),
                   shard / "000_00000.parquet")
    (d / "downloads" / "fineweb-edu" / ".cache" / "huggingface").mkdir(parents=True)
    saved = d / "downloads" / "tinystories"
    saved.mkdir()
    (saved / "dataset_info.json").write_text("{}")
    (saved / "state.json").write_text("{}")
    table = pa.table({"text": docs(json_mod.decoder, 100)})
    with pa.ipc.new_stream(str(saved / "data-00000-of-00001.arrow"), table.schema) as w:
        w.write_table(table)


def _run(line, cwd, env):
    if line.startswith("sbatch "):
        return None
    if line.startswith("python train.py"):
        line += " " + " ".join(TINY)
    line = re.sub(r"^python ", f"{sys.executable} ", line)
    r = subprocess.run(["bash", "-c", line], cwd=cwd, env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, f"{line}\n{r.stdout}\n{r.stderr}"
    return r


def test_walkthrough_commands_run_as_written(tmp_path):
    blocks = _blocks()
    assert len(blocks) == 4 and blocks[0][0].startswith("hf download")
    downloads(tmp_path)
    for name in ("configs", "train.py"):
        os.symlink(os.path.join(ROOT, name), tmp_path / name)
    env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    out = {}
    for block in blocks[1:]:
        for line in block:
            out[line.split()[2 if line.startswith("python -m") else 1]] = _run(line, tmp_path, env)
    tok = tmp_path / "data" / "fineweb.tokenizer.json"
    metas = [json.load(open(tmp_path / "data" / f"{n}.json")) for n in ("fineweb", "tinystories")]
    assert tok.exists() and metas[0]["tokenizer_fingerprint"] == metas[1]["tokenizer_fingerprint"]
    assert f"data.tokenizer={os.path.join('data', 'fineweb.tokenizer.json')}" in \
        out["boost_jax.data.prepare"].stdout
    rows = [json.loads(x) for x in open(tmp_path / "runs" / "mix" / "metrics.jsonl")]
    assert max(r["step"] for r in rows) == 3 and "val_loss" in rows[-1]
    job = open(tmp_path / "cola-7b-f48.sbatch").read()
    assert f"path: {tmp_path}/data/tinystories.bin" in job and "weight: 0.3" in job
