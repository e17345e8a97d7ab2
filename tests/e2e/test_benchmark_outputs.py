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



def test_a_json_file_that_exists_is_refused_before_any_work(tmp_path):
    """kernels.py, train_speed.py and attention.py keep a user's file named by --json (exit 2,
    one line, file unchanged) unless --force; gpu.sh passes --force in its own run folder."""
    mine = tmp_path / "rows.json"
    mine.write_text("the user's rows")
    for script, args in (("kernels.py", ["--quick"]),
                         ("train_speed.py", ["--variant", "a", "--rounds", "1"]),
                         ("attention.py", ["--lengths", "16"])):
        cmd = [sys.executable, os.path.join(ROOT, "benchmarks", script), *args, "--json",
               str(mine)]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        assert r.returncode == 2, (script, r.stderr[-2000:])
        assert r.stderr.count("\n") == 1 and "--force" in r.stderr, (script, r.stderr)
        assert mine.read_text() == "the user's rows", script
    r = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "attention.py"),
                        "--lengths", "16", "--reps", "1", "--json", str(mine), "--force"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert '"impl"' in mine.read_text()


def test_an_output_that_is_no_file_of_ours_or_an_input_is_refused_even_with_force(tmp_path):
    """A link (to the user's file), a FIFO, a device, a folder, the script's own --config: one
    line, exit 2, before any work, --force or not, and nothing changed; and --work of
    convergence.py that holds the user's files (a run folder) is never written into."""
    user = tmp_path / "user.md"
    user.write_text("the user's notes")
    (tmp_path / "link.md").symlink_to(user)
    os.mkfifo(tmp_path / "fifo.md")
    (tmp_path / "folder").mkdir()
    bench = os.path.join(ROOT, "benchmarks")
    for out in ("link.md", "fifo.md", "/dev/null", "folder"):
        r = subprocess.run([sys.executable, os.path.join(bench, "bench_time.py"), "--since", "0",
                            "--out", out, "--force"], cwd=tmp_path, capture_output=True,
                           text=True, timeout=60)
        assert r.returncode == 2 and r.stderr.count("\n") == 1, (out, r.stderr)
        assert "not a regular file" in r.stderr and "--force does not change" in r.stderr, out
    assert user.read_text() == "the user's notes" and (tmp_path / "link.md").is_symlink()
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(open(os.path.join(ROOT, "configs", "demo.yaml")).read())
    r = subprocess.run([sys.executable, os.path.join(bench, "partitioning.py"), "--config",
                        str(cfg), "--json-out", str(cfg), "--force"], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "is --config" in r.stderr
    assert cfg.read_text() == open(os.path.join(ROOT, "configs", "demo.yaml")).read()
    run = tmp_path / "run"
    (run / "tokenizer").mkdir(parents=True)
    (run / "tokenizer" / "tokenizer.json").write_text("the run's tokenizer")
    r = subprocess.run([sys.executable, os.path.join(bench, "convergence.py"), "--work",
                        str(run), "--out", str(tmp_path / "c.md"), "--archs", "full,cola"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "holds files this script did not write" in r.stderr, r.stderr
    assert sorted(os.listdir(run)) == ["tokenizer"]
    assert (run / "tokenizer" / "tokenizer.json").read_text() == "the run's tokenizer"
