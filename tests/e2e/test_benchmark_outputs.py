"""Benchmark scripts write where they are told and nothing else: a scratch --out leaves both
READMEs alone, and a file that exists outside benchmarks/results/ is the user's."""

import os
import subprocess
import sys

from benchmarks.common import README
from train_proc import ROOT


def _readmes():
    return [open(p).read() for p in (README, os.path.join(ROOT, "README.md"))]


def test_a_scratch_out_leaves_the_readmes_alone_and_a_users_file_is_kept(tmp_path):
    """A results file written outside benchmarks/results/ is not copied into either README
    (validation.py also writes README.md's constants table), and an existing file there is the
    user's: refused with exit 2 and left as it was, unless --force."""
    from benchmarks.common import write_result

    before = _readmes()
    write_result(str(tmp_path / "cola_vs_full.md"), "## scratch run")
    assert (tmp_path / "cola_vs_full.md").read_text() == "## scratch run\n"
    out = tmp_path / "validation.md"
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "validation.py"), "--out", str(out)]
    assert subprocess.run(cmd, capture_output=True).returncode == 0
    assert _readmes() == before and "validation" in out.read_text().lower()
    out.write_text("the user's notes")
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "--force" in r.stderr
    assert out.read_text() == "the user's notes"
    assert subprocess.run(cmd + ["--force"], capture_output=True).returncode == 0
    assert out.read_text() != "the user's notes" and _readmes() == before

