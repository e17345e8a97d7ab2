"""`make clean` removes what tests and imports leave behind and nothing of the user's: a trained
run under runs/ and the virtual environments stay."""

import os
import shutil
import subprocess

from train_proc import ROOT


def test_make_clean_keeps_the_users_runs(tmp_path):
    shutil.copy(os.path.join(ROOT, "Makefile"), tmp_path / "Makefile")
    run = tmp_path / "runs" / "demo" / "checkpoints"
    run.mkdir(parents=True)
    (run / "state").write_text("a week of training")
    (tmp_path / ".venv" / "bin").mkdir(parents=True)
    (tmp_path / ".pytest_cache").mkdir()
    cache = tmp_path / "boost_jax" / "sharding" / "__pycache__"
    cache.mkdir(parents=True)
    (cache / "gather.cpython-311.pyc").write_bytes(b"\0")
    (tmp_path / "boost_jax" / "sharding" / "gather.py").write_text("")
    r = subprocess.run(["make", "clean"], cwd=tmp_path, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    assert (run / "state").read_text() == "a week of training"
    assert (tmp_path / ".venv" / "bin").is_dir()
    assert (tmp_path / "boost_jax" / "sharding" / "gather.py").exists()
    assert not (tmp_path / ".pytest_cache").exists() and not cache.exists()
