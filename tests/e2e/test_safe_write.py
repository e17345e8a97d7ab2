"""Nothing lost: every command that writes (export, data.prepare, train.py, plan --emit-config,
launch slurm, analysis.comm --dump-hlo) follows boost_jax/safe_write.py. The module's rules that need a second process
(tests/unit/test_safe_write_api.py: the others), then each command run as a subprocess on the cases that lost data: export --force onto its own run, prepare onto
its source, training into a folder of the user's files, plan/launch/comm onto their own --config,
two prepares of one OUT at once, a full disk, and prepare killed with SIGKILL at random points.
"""

import contextlib
import json
import os
import random
import re
import signal
import stat
import subprocess
import sys
import time

import numpy as np
import pytest

from boost_jax import safe_write as sw
from boost_jax.safe_write import Refused
from file_modes import _mode, _umask
from tmpfs import small_tmpfs
from train_proc import ROOT, train_env

PY = sys.executable


# --------------------------------------------------------------------------- the module


def test_refuse_inputs_is_contains_inside_and_links(tmp_path):
    run = tmp_path / "runs" / "r"
    (run / "checkpoints").mkdir(parents=True)
    (tmp_path / "alias").symlink_to(run)
    inputs = {"the run": str(run)}
    for target, how in ((run, "is"), (tmp_path / "runs", "contains"),
                        (run / "checkpoints" / "x", "lies inside"), (tmp_path / "alias", "is"),
                        (tmp_path / "alias" / "y", "lies inside")):
        with pytest.raises(Refused, match=rf"^--out {how} the run '.*'; .*: pick another$"):
            sw.refuse_inputs(str(target), inputs, "--out", "pick another")
    sw.refuse_inputs(str(tmp_path / "runs" / "r2"), inputs, "--out", "x")  # a sibling is fine
    sw.refuse_inputs(str(tmp_path / "runs" / "r.bak"), inputs, "--out", "x")  # not a prefix
    src = tmp_path / "a.json"
    src.write_text("{}")
    os.link(src, tmp_path / "b.json")  # a hard link is the same file
    with pytest.raises(Refused, match="is SOURCE"):
        sw.refuse_inputs(str(tmp_path / "b.json"), {"SOURCE": str(src)}, "OUT", "x")


HOLD = """
import sys, time
from boost_jax.safe_write import exclusive
with exclusive([sys.argv[1]], "OUT", "x"):
    print("held", flush=True)
    time.sleep(60)
"""


def test_exclusive_one_writer_and_a_killed_holder_is_taken_over(tmp_path):
    target = str(tmp_path / "c.bin")
    p = subprocess.Popen([PY, "-c", HOLD, target], cwd=ROOT, stdout=subprocess.PIPE, text=True,
                         env=dict(os.environ, PYTHONPATH=ROOT))
    try:
        assert p.stdout.readline() == "held\n"
        with pytest.raises(Refused, match=rf"^OUT is being written by another process \(pid "
                                          rf"{p.pid} on host .*\); wait for it to finish, or x"):
            with sw.exclusive([target], "OUT", "x"):
                pass
        open(tmp_path / ".c.bin.dead1234.boost_jax.tmp", "w").close()  # a killed writer left
    finally:
        p.kill()
        p.wait()
    with sw.exclusive([target], "OUT", "x"):
        assert os.listdir(tmp_path) == [".c.bin.lock"]  # stale temp removed, lock taken over
    assert os.listdir(tmp_path) == []


# --------------------------------------------------------------------------- the commands


def _cli(*argv, env=None, timeout=240):
    return subprocess.run([PY, *argv], cwd=ROOT, env=env or dict(os.environ, PYTHONPATH=ROOT),
                          capture_output=True, text=True, timeout=timeout)


def _cli_all(*argvs, env=None):
    """Several commands at once (each imports JAX, the bulk of its time)."""
    env = env or dict(os.environ, PYTHONPATH=ROOT)
    procs = [subprocess.Popen([PY, *a], cwd=ROOT, env=env, text=True, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE) for a in argvs]
    outs = [p.communicate(timeout=240) for p in procs]
    return [subprocess.CompletedProcess(p.args, p.returncode, *o) for p, o in zip(procs, outs)]


def _one_line(r, pattern):
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == 2 and len(lines) == 1, (r.returncode, r.stderr)
    assert re.match(r"error: " + pattern, lines[0]), lines[0]


def _tree(path):
    """{relative path: bytes} of every file under path."""
    out = {}
    for d, _, files in os.walk(path):
        for f in files:
            full = os.path.join(d, f)
            out[os.path.relpath(full, path)] = open(full, "rb").read()
    return out


TINY = ["model.d_model=32", "model.n_layers=2", "model.n_heads=2", "model.d_ff=64",
        "model.rank=8", "model.max_seq_len=32", "data.seq_len=32", "data.max_bytes=100000",
        "train.global_batch=4", "train.eval_batches=1", "train.steps=2", "train.eval_every=2",
        "logging.progress=false", "logging.plot=false"]
USER_FILES = {"config.yaml": "my: notes\n", "metrics.jsonl": "my measurements\n",
              "summary.json": '{"mine": true}\n', "loss.png": "not a plot", "notes.txt": "hi\n"}


@pytest.fixture(scope="module")
def env(jax_cache):
    return train_env(jax_cache)


@pytest.fixture(scope="module")
def run(env, tmp_path_factory):
    """A folder of the user's files: train.py refuses it, then trains there with --force. The
    run it leaves is the input of the export tests."""
    out = tmp_path_factory.mktemp("train") / "runs" / "r"
    out.mkdir(parents=True)
    for name, text in USER_FILES.items():
        (out / name).write_text(text)
    cmd = ["train.py", "--cpu-devices", "1", *TINY, f"out_dir={out}"]
    refused = _cli(*cmd, env=env)
    forced = _cli(*cmd, "--force", env=env)
    return out, refused, forced


def test_exclusive_never_writes_through_or_removes_what_holds_its_lock_name(tmp_path):
    """`.NAME.lock` and `.NAME.*.tmp` may be the user's: a symlink there is never written
    through, a folder, FIFO or file holding anything but a lock record is refused and left,
    and the sweep of a killed writer's temp files takes only names our writers make."""
    target, lock = str(tmp_path / "c.bin"), tmp_path / ".c.bin.lock"
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    theirs = tmp_path / ".c.bin.mine.tmp"
    theirs.write_text("mine")
    cases = {"symlink": lambda: os.symlink(victim, lock), "folder": lambda: lock.mkdir(),
             "FIFO": lambda: os.mkfifo(lock), "file": lambda: lock.write_text("my notes")}
    for name, make in cases.items():
        make()
        with pytest.raises(Refused, match=r"^OUT: '.*\.c\.bin\.lock', the name of its lock "
                                          r"file, is .* this command did not write; move it "
                                          r"away, or x$"):
            with sw.exclusive([target], "OUT", "x"):
                pass
        assert os.path.lexists(lock), name
        (os.rmdir if name == "folder" else os.remove)(lock)
    assert victim.read_text() == "precious" and theirs.read_text() == "mine"
    lock.write_text("pid 1 on host gone")  # a lock file a killed writer left: taken over
    with sw.exclusive([target], "OUT", "x"):
        assert sorted(os.listdir(tmp_path)) == [".c.bin.lock", ".c.bin.mine.tmp", "victim.txt"]
    assert sorted(os.listdir(tmp_path)) == [".c.bin.mine.tmp", "victim.txt"]


def test_failure_3_train_into_a_folder_of_the_users_files_is_refused_unless_forced(run):
    out, refused, forced = run
    _one_line(refused, rf"out_dir '{out}' holds no boost_jax run but files the run would "
                       r"replace \(config\.yaml, loss\.png, metrics\.jsonl, summary\.json\); "
                       r"choose another out_dir=\.\.\., or pass --force to train\.py")
    assert forced.returncode == 0, forced.stderr
    assert (out / "notes.txt").read_text() == "hi\n"  # --force replaces only what a run writes
    assert "steps: 2" in (out / "config.yaml").read_text()
    assert (out / "configs" / "000-earlier.yaml").read_text() == "my: notes\n"


def test_a_bare_configs_folder_is_no_run_and_a_run_never_replaces_its_config(env, tmp_path):
    """A user's project with its own `configs/` and `checkpoints/` folders is not a run of ours;
    with --force the run still never writes over the --config it reads."""
    proj, own = tmp_path / "proj", tmp_path / "own"
    (proj / "configs").mkdir(parents=True)
    (proj / "checkpoints" / "3").mkdir(parents=True)  # no seal: not ours
    (proj / "configs" / "mine.yaml").write_text("x: 1\n")
    (proj / "summary.json").write_text('{"mine": true}\n')
    own.mkdir()
    cfg = own / "config.yaml"
    cfg.write_text(open(os.path.join(ROOT, "configs", "demo.yaml")).read())
    before = cfg.read_text()
    rows = _cli_all(["train.py", "--cpu-devices", "1", *TINY, f"out_dir={proj}"],
                    ["train.py", "--config", str(cfg), "--force", "--cpu-devices", "1", *TINY,
                     f"out_dir={own}"], env=env)
    _one_line(rows[0], rf"out_dir '{proj}' holds no boost_jax run but files the run would "
                       r"replace \(checkpoints, configs, summary\.json\)")
    _one_line(rows[1], rf"the run's config\.yaml '{cfg}' is --config '{cfg}'; writing it would "
                       r"destroy what this command reads \(--force does not change that\)")
    assert (proj / "summary.json").read_text() == '{"mine": true}\n'
    assert sorted(os.listdir(proj)) == ["checkpoints", "configs", "summary.json"]
    assert cfg.read_text() == before and sorted(os.listdir(own)) == ["config.yaml"]


def test_failure_1_export_never_deletes_its_run_even_with_force(run, env, tmp_path):
    out = run[0]
    before = _tree(out.parent)
    for target, how in ((out, "is"), (out.parent, "contains"), (out / "hf", "lies inside")):
        for force in (["--force"], []):
            r = _cli("-m", "boost_jax.export", "--run", str(out), "--out", str(target), *force,
                     env=env)
            _one_line(r, rf"--out '{target}' {how} the run '{out}'; writing it would destroy "
                         r"what this command reads \(--force does not change that\): choose a "
                         r"folder outside the run")
    assert _tree(out.parent) == before


def test_export_refuses_a_file_a_foreign_folder_and_a_read_only_parent(run, env, tmp_path):
    out = run[0]
    (tmp_path / "file").write_text("keep")
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "thesis.tex").write_text("keep")
    look = tmp_path / "lookalike"  # the names an export writes, but the user's files
    look.mkdir()
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        (look / name).write_text("mine")
    os.mkfifo(tmp_path / "fifo")
    ro = tmp_path / "ro"
    ro.mkdir()
    with _read_only(ro):
        rows = (("file", r"--out '.*/file' is a file or a link, not an earlier export"),
                ("fifo", r"--out '.*/fifo' is a FIFO, not a folder"),
                ("mine", r"--out '.*/mine' has no export manifest \(boost_jax_export\.json\); "
                         r"it holds thesis\.tex; --force replaces only an earlier export"),
                ("lookalike", r"--out '.*/lookalike' has no export manifest \(boost_jax_export"
                              r"\.json\); it holds config\.json, model\.safetensors, "
                              r"tokenizer\.json; --force"),
                ("ro/x", r"cannot write --out '.*/ro/x' \((Read-only file system|Permission "
                         r"denied)\); choose a folder in a writable place"))
        done = _cli_all(*(["-m", "boost_jax.export", "--run", str(out), "--out",
                           str(tmp_path / name), "--force"] for name, _ in rows), env=env)
        for r, (_, pattern) in zip(done, rows):
            _one_line(r, pattern)
    assert (tmp_path / "file").read_text() == "keep"
    assert os.listdir(tmp_path / "mine") == ["thesis.tex"]
    assert {n: (look / n).read_text() for n in os.listdir(look)} == \
        dict.fromkeys(("config.json", "model.safetensors", "tokenizer.json"), "mine")
    assert stat.S_ISFIFO(os.lstat(tmp_path / "fifo").st_mode)
    with _umask(0o022):  # an export follows the umask (mkdtemp alone makes it 0700)
        r = _cli("-m", "boost_jax.export", "--run", str(out), "--out", str(tmp_path / "hf"),
                 env=env)
    assert r.returncode == 0, r.stderr
    assert _mode(tmp_path / "hf") == 0o755
    assert {n: _mode(tmp_path / "hf" / n) for n in os.listdir(tmp_path / "hf")} == \
        {n: 0o644 for n in os.listdir(tmp_path / "hf")}, "the weights too"
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".")]  # no temp folder left
    # an earlier export (with its remote code, CoLA) is what --force replaces
    assert "modeling_boost_jax.py" in os.listdir(tmp_path / "hf")
    r = _cli("-m", "boost_jax.export", "--run", str(out), "--out", str(tmp_path / "hf"),
             "--force", env=env)
    assert r.returncode == 0, r.stderr
    with open(tmp_path / "hf" / "config.json", "a") as f:  # edited since: the user's now
        f.write(" ")
    r = _cli("-m", "boost_jax.export", "--run", str(out), "--out", str(tmp_path / "hf"),
             "--force", env=env)
    _one_line(r, r"--out '.*/hf' holds config\.json, changed since export wrote it; --force")
    (tmp_path / "empty").mkdir()  # nothing in it to lose: --force exports into it
    r = _cli("-m", "boost_jax.export", "--run", str(out), "--out", str(tmp_path / "empty"),
             "--force", env=env)
    assert r.returncode == 0 and "config.json" in os.listdir(tmp_path / "empty"), r.stderr


@contextlib.contextmanager
def _read_only(path):
    """A read-only folder: a read-only mount for root (who ignores modes), else mode 0555."""
    if os.geteuid() == 0 and not subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(path)],
            capture_output=True).returncode:
        try:
            yield
        finally:
            subprocess.run(["umount", "-l", str(path)], check=False)
        return
    os.chmod(path, 0o555)
    try:
        yield
    finally:
        os.chmod(path, 0o755)


def _prepare(src, out, *extra, env=None):
    return [PY, "-m", "boost_jax.data.prepare", str(src), str(out), "--tokenizer", "byte",
            "--workers", "1", "--no-progress", *extra]


def test_failure_2_prepare_never_overwrites_its_source_or_unforced_metadata(tmp_path):
    src = tmp_path / "mydata.json"
    src.write_text('{"text": "my data"}\n')
    for force in ([], ["--force"]):
        r = _cli(*_prepare(src, tmp_path / "mydata.bin", *force)[1:])
        _one_line(r, r"the metadata file '.*/mydata\.json' of OUT is SOURCE '.*/mydata\.json'; "
                     r"writing it would destroy what this command reads")
    assert src.read_text() == '{"text": "my data"}\n'
    from boost_jax.data.prepare import prepare

    (tmp_path / "tok.json").write_text("{}")  # OUT's metadata would be the tokenizer
    with pytest.raises(Refused, match=r"the metadata file '.*/tok\.json' of OUT is --tokenizer"):
        prepare(str(src), str(tmp_path / "tok.bin"), str(tmp_path / "tok.json"), force=True)
    (tmp_path / "tok.json").unlink()
    text = tmp_path / "t.txt"
    text.write_text("some text\n")
    (tmp_path / "t.json").write_text("my own t.json\n")
    r = _cli(*_prepare(text, tmp_path / "t.bin")[1:])
    _one_line(r, r"'.*/t\.json' already exists; pass --force to replace it, or choose another "
                 r"OUT")
    assert (tmp_path / "t.json").read_text() == "my own t.json\n"
    assert not (tmp_path / "t.bin").exists()
    with _umask(0o022):
        r = _cli(*_prepare(text, tmp_path / "t.bin", "--force")[1:])
    assert r.returncode == 0, r.stderr
    assert json.loads((tmp_path / "t.json").read_text())["n_tokens"] == 11
    assert _mode(tmp_path / "t.bin") == 0o644 and _mode(tmp_path / "t.json") == 0o644
    assert sorted(os.listdir(tmp_path)) == ["mydata.json", "t.bin", "t.json", "t.txt"]


def test_failure_5_plan_and_launch_never_overwrite_their_config(tmp_path):
    cfg = tmp_path / "c.yaml"
    text = open(os.path.join(ROOT, "configs", "demo.yaml")).read()
    cfg.write_text(text)
    os.chmod(cfg, 0o644)
    plan = ["-m", "boost_jax.plan", "--config", str(cfg), "--topology", "cpu", "--nodes", "1",
            "--no-compile", "--emit-config"]
    launch = ["-m", "boost_jax.launch", "slurm", "--config", str(cfg), "--topology", "cpu",
              "--nodes", "1", "--out"]
    comm = ["-m", "boost_jax.analysis.comm", "--config", str(cfg), "--dump-hlo"]
    for name in ("plan", "job", "hlo"):
        (tmp_path / name).write_text("mine\n")
    rows = _cli_all([*plan, str(cfg), "--force"], [*launch, str(cfg), "--force"],
                    [*comm, str(cfg), "--force"], [*plan, str(tmp_path / "plan")],
                    [*launch, str(tmp_path / "job")], [*comm, str(tmp_path / "hlo")],
                    [*plan, ""], [*launch, ""], [*comm, ""])
    opts = ("--emit-config", "--out", "--dump-hlo")
    for r, opt in zip(rows[6:], opts):  # an empty name is not "no file"
        _one_line(r, rf"{opt} '' is an empty path; .*")
    for r, opt in zip(rows, opts):  # not even with --force
        _one_line(r, rf"{opt} '.*/c\.yaml' is --config '.*/c\.yaml'; writing it would destroy "
                     r"what this command reads \(--force does not change that\)")
    for r, opt, name in zip(rows[3:], opts, ("plan", "job", "hlo")):
        _one_line(r, rf"{opt} '.*/{name}' already exists; pass --force to replace it")
        assert (tmp_path / name).read_text() == "mine\n"
    with _umask(0o022):
        rows = _cli_all([*plan, str(tmp_path / "plan"), "--force"],
                        [*launch, str(tmp_path / "job"), "--force"])
    assert [r.returncode for r in rows] == [0, 0], [r.stderr for r in rows]
    assert _mode(tmp_path / "plan") == 0o644 and _mode(tmp_path / "job") == 0o755
    assert "mesh:" in (tmp_path / "plan").read_text()
    assert (tmp_path / "job").read_text().startswith("#!")
    assert cfg.read_text() == text and _mode(cfg) == 0o644


def test_hostile_names_stay_one_line_in_what_plan_and_launch_write_and_print(tmp_path):
    """A path holding a newline, quotes and $(...): the emitted config's header stays comments
    (the YAML loads, no key injected) and the printed next commands are one line each, whose
    words give back the exact path when pasted into bash (nothing runs)."""
    import yaml

    cfg = tmp_path / "c.yaml"
    cfg.write_text(open(os.path.join(ROOT, "configs", "demo.yaml")).read())
    evil = str(tmp_path / "a'\"$(echo PWNED >&2)`echo PWNED >&2`\nout_dir: EVIL\n#x")
    plan, job = evil + ".yaml", evil + ".sbatch"
    rows = _cli_all(["-m", "boost_jax.plan", "--config", str(cfg), "--topology", "cpu",
                     "--nodes", "1", "--no-compile", "--emit-config", plan],
                    ["-m", "boost_jax.launch", "slurm", "--config", str(cfg), "--topology",
                     "cpu", "--nodes", "1", "--out", job])
    assert [r.returncode for r in rows] == [0, 0], [r.stderr for r in rows]
    text = open(plan).read()
    assert all(ln.startswith("# ") for ln in text.splitlines() if "EVIL" in ln), text[:600]
    assert yaml.safe_load(text)["out_dir"] != "EVIL"
    for r, path, cmd in ((rows[0], plan, "python train.py --config "), (rows[1], job, "sbatch ")):
        line = [ln for ln in r.stderr.splitlines() if ln.startswith("wrote ")]
        assert len(line) == 1 and cmd in line[0], r.stderr
        word = line[0].split(cmd, 1)[1].split(", or ")[0]
        back = subprocess.run(["bash", "-c", "printf %s " + word], capture_output=True, text=True)
        assert back.stdout == path and back.stderr == "", (word, back)


def _corpus(path, mib):
    line = "def f(x):\n    return x * 2  # " + "é" * 20 + "\n"
    path.write_text(line * ((mib << 20) // len(line.encode())))
    return path


def _consistent(out):
    """A published .bin has its metadata and agrees with it; returns what is published."""
    meta_file = out.with_suffix(".json")
    if not out.exists():
        return None
    assert meta_file.exists(), "a .bin without its metadata"
    meta = json.loads(meta_file.read_text())
    assert os.path.getsize(out) == meta["n_tokens"] * 2, meta
    return meta


def test_failure_6_two_prepares_of_one_out_one_wins_the_other_stops(tmp_path):
    src = _corpus(tmp_path / "src.txt", 8)
    outdir = tmp_path / "o"
    outdir.mkdir()
    out = outdir / "c.bin"
    env = dict(os.environ, PYTHONPATH=ROOT)
    first = subprocess.Popen(_prepare(src, out, "--force"), cwd=ROOT, env=env, text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    t0 = time.monotonic()

    def writing():
        """The first holds the lock with its record written (stopped before that, the second
        could name no pid), or has a temp file already."""
        names = os.listdir(outdir)
        if any(n.endswith(".tmp") for n in names):
            return True
        for n in (n for n in names if n.endswith(".lock")):
            with contextlib.suppress(FileNotFoundError):
                if os.path.getsize(outdir / n) > 0:
                    return True
        return False

    while not writing():
        assert first.poll() is None and time.monotonic() - t0 < 60, first.communicate()
        time.sleep(0.005)  # the first has started writing
    os.kill(first.pid, signal.SIGSTOP)  # held mid-write, however fast this machine is
    try:
        second = _cli(*_prepare(src, out, "--force")[1:])
    finally:
        os.kill(first.pid, signal.SIGCONT)
    _, err = first.communicate(timeout=120)
    assert first.returncode == 0, err
    _one_line(second, rf"OUT '{out}' is being written by another process \(pid {first.pid} on "
                      r"host .*\); wait for it to finish, or choose another OUT")
    meta = _consistent(out)
    assert meta["n_tokens"] == len(src.read_bytes()) + 1
    assert np.array_equal(np.fromfile(out, np.uint16)[:-1], np.frombuffer(src.read_bytes(),
                                                                          np.uint8))
    assert sorted(os.listdir(outdir)) == ["c.bin", "c.json"]


ENOSPC_IN_METADATA = """
import errno, json, runpy, sys
real = json.dump
def dump(obj, f, **k):
    if "n_tokens" in obj:
        raise OSError(errno.ENOSPC, "No space left on device")
    return real(obj, f, **k)
json.dump = dump
sys.argv = ["prepare"] + sys.argv[1:]
runpy.run_module("boost_jax.data.prepare", run_name="__main__")
"""


@pytest.fixture
def small_disk(tmp_path):
    """A tmpfs where the system lets us mount one (root), else None."""
    with small_tmpfs(tmp_path, "64k") as mnt:
        yield mnt


def test_failure_7_a_full_disk_publishes_nothing_and_leaves_no_temp(small_disk, tmp_path):
    """A real full disk at every size around the data's (root: a tmpfs resized page by page, so
    the disk fills in the data, in the metadata or not at all), else ENOSPC raised while the
    metadata is written."""
    src = tmp_path / "src.txt"
    src.write_text("x" * 12000)  # 12001 uint16 ids: 6 pages of 4 KiB
    if small_disk is None:
        r = _cli("-c", ENOSPC_IN_METADATA, *_prepare(src, tmp_path / "o" / "c.bin")[2:])
        _one_line(r, r"writing '.*/c\.bin' failed \(No space left on device\); nothing was "
                     r"published and no temp file is left; free space or choose another OUT")
        assert os.listdir(tmp_path / "o") == []
        return
    failed = 0
    for pages in range(5, 10):
        subprocess.run(["mount", "-o", f"remount,size={pages * 4}k", str(small_disk)],
                       check=True)
        r = _cli(*_prepare(src, small_disk / "c.bin")[1:])
        if r.returncode:
            failed += 1
            _one_line(r, r"writing '.*/c\.bin' failed \(No space left on device\); nothing was "
                         r"published and no temp file is left; free space or choose another "
                         r"OUT")
            assert os.listdir(small_disk) == [], pages
        else:
            assert _consistent(small_disk / "c.bin")["n_tokens"] == 12001
            assert sorted(os.listdir(small_disk)) == ["c.bin", "c.json"]
            for name in ("c.bin", "c.json"):
                os.remove(small_disk / name)
    assert 0 < failed < 5  # the sizes cover both outcomes


def test_kill_9_during_prepare_never_leaves_a_bin_without_metadata_or_a_temp(tmp_path):
    """Ten prepares --force of one OUT, each killed with SIGKILL after a random delay across a
    whole run (start, tokenizing, publishing); after each: a published .bin has its metadata and
    agrees with it, and nothing else is there but the lock file a killed run leaves (unlocked:
    the next run takes it over)."""
    src = _corpus(tmp_path / "src.txt", 1)
    outdir = tmp_path / "o"
    outdir.mkdir()
    out = outdir / "c.bin"
    env = dict(os.environ, PYTHONPATH=ROOT)
    t0 = time.monotonic()
    assert _cli(*_prepare(src, out)[1:]).returncode == 0
    whole = time.monotonic() - t0
    rng = random.Random(24)
    for i in range(10):
        p = subprocess.Popen(_prepare(src, out, "--force"), cwd=ROOT, env=env,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                             start_new_session=True)
        time.sleep(rng.uniform(0.2, 1.0) * whole)
        os.killpg(p.pid, 9)  # the workers too
        p.wait()
        left = set(os.listdir(outdir))
        assert left <= {"c.bin", "c.json", ".c.bin.lock"}, (i, left)
        _consistent(out)
    with sw.exclusive([str(out)], "OUT", "x"):  # no killed run still holds it
        pass
    assert _cli(*_prepare(src, out, "--force")[1:]).returncode == 0
    assert _consistent(out)["n_tokens"] == len(src.read_bytes()) + 1
    assert sorted(os.listdir(outdir)) == ["c.bin", "c.json"]


def test_export_onto_a_full_disk_and_a_full_stdout_are_one_line(run, env, small_disk):
    """export's weights fill a 64 KiB disk (safetensors raised its own error type); generate
    and evaluate --json write to /dev/full (an OSError at exit): one line each, nothing left."""
    out = run[0]
    with open("/dev/full", "w") as full:
        procs = [subprocess.Popen([PY, "-m", f"boost_jax.{cmd}", "--run", str(out), *extra],
                                  cwd=ROOT, env=env, text=True, stdout=full,
                                  stderr=subprocess.PIPE)
                 for cmd, extra in (("generate", ["--prompt", "a", "--max-new-tokens", "2"]),
                                    ("evaluate", ["--json"]))]
        errs = [p.communicate(timeout=240)[1] for p in procs]
    for p, err in zip(procs, errs):
        lines = err.strip().splitlines()
        assert p.returncode == 1 and len(lines) == 1, (p.args, err)
        assert lines[0] == ("error: writing the output (stdout) failed (No space left on "
                            "device); free space or write it elsewhere")
    if small_disk is None:
        return
    r = _cli("-m", "boost_jax.export", "--run", str(out), "--out", str(small_disk / "hf"),
             env=env)
    _one_line(r, rf"writing --out '{small_disk}/hf' failed \(.*\); nothing was published: free "
                 r"space or choose another folder")
    assert os.listdir(small_disk) == []


def test_the_printed_training_line_pastes_back_the_exact_path(tmp_path, capsys):
    """OUT with a space, quotes and $(...): the printed `train on it with:` words give back the
    path when pasted into bash (nothing runs); OUT with a newline, which no config value may
    hold, is refused before anything is written."""
    from boost_jax.data.prepare import main

    src = tmp_path / "c.txt"
    src.write_text("def f(x):\n    return x\n" * 200)
    out = str(tmp_path / "my corpus '$(echo PWNED >&2)'.bin")
    assert main([str(src), out, "--tokenizer", "byte", "--workers", "1", "--no-progress"]) == 0
    line = capsys.readouterr().out.split("train on it with: ", 1)[1].splitlines()[0]
    back = subprocess.run(["bash", "-c", f"printf '%s\\n' {line}"], capture_output=True,
                          text=True)
    assert back.stderr == "" and back.stdout.splitlines()[0] == "data.source=" + out
    with pytest.raises(SystemExit) as e:
        main([str(src), str(tmp_path / "nl\nx.bin"), "--tokenizer", "byte", "--workers", "1"])
    assert e.value.code == 2
    assert "holds a control character (\\n), which no config can name" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["c.txt", os.path.basename(out), os.path.basename(out)[:-4] + ".json"])


def test_export_removes_what_a_killed_export_left_and_keeps_what_is_not_its(run, env, tmp_path):
    """A kill -9 mid-export leaves its temp folder beside --out: the next export to that --out
    removes it (and only it: the previous export set aside as .old, a link of that name, and
    the temp folder of a live export to `e1.v2`, which holds its own lock, stay), and leaves no
    lock file behind."""
    user = tmp_path / "user"
    user.mkdir()
    (user / "notes.txt").write_text("keep")
    left = tmp_path / ".e1.k1ll3d00.boost_jax.tmp"
    left.mkdir()
    (left / "model.safetensors").write_bytes(b"\0" * 1024)
    aside = tmp_path / ".e1.k1ll3d00.boost_jax.tmp.old"
    aside.mkdir()
    link = tmp_path / ".e1.l1nk0000.boost_jax.tmp"
    link.symlink_to(user)
    other = tmp_path / ".e1.v2.abcd1234.boost_jax.tmp"  # a live export's to e1.v2 (own lock)
    other.mkdir()
    r = _cli_all(["-m", "boost_jax.export", "--run", str(run[0]), "--out",
                  str(tmp_path / "e1")], env=env)[0]
    assert r.returncode == 0, r.stderr
    assert not left.exists() and aside.is_dir() and link.is_symlink() and other.is_dir()
    assert os.listdir(user) == ["notes.txt"] and (user / "notes.txt").read_text() == "keep"
    assert sorted(os.listdir(tmp_path)) == sorted(
        [".e1.k1ll3d00.boost_jax.tmp.old", ".e1.l1nk0000.boost_jax.tmp",
         ".e1.v2.abcd1234.boost_jax.tmp", "e1", "user"])
