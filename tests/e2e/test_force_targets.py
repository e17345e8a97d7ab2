"""--force never destroys what the command did not make (safe_write.refuse_special, the export
manifest, the inputs' companion files): every command that writes refuses a character device,
a FIFO, a socket or a folder of the user's files as its target, with and without --force, and a
run's outputs never land on a corpus's metadata, through data.source or data.sources."""

import os
import re
import socket
import stat
import subprocess
import sys

import pytest

from boost_jax import safe_write as sw
from boost_jax.safe_write import Refused
from train_proc import ROOT

PY = sys.executable
ENV = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")


def _run_all(*argvs):
    procs = [subprocess.Popen([PY, *a], cwd=ROOT, env=ENV, text=True, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE) for a in argvs]
    outs = [p.communicate(timeout=240) for p in procs]
    return [subprocess.CompletedProcess(p.args, p.returncode, *o) for p, o in zip(procs, outs)]


def _one_line(r, pattern):
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == 2 and len(lines) == 1, (r.args, r.returncode, r.stderr)
    assert re.match(r"error: " + pattern, lines[0]), lines[0]


def _nodes(d, ext=""):
    """{kind: path} of the machine's things a command must never replace, made in `d`."""
    d.mkdir(exist_ok=True)
    nodes = {"a FIFO": d / f"fifo{ext}"}
    os.mkfifo(nodes["a FIFO"])
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(d / f"sock{ext}"))
    sock.close()
    nodes["a socket"] = d / f"sock{ext}"
    if os.geteuid() == 0:  # a copy of /dev/full's node (1, 7): replacing it is what went wrong
        os.mknod(d / f"chr{ext}", stat.S_IFCHR | 0o666, os.makedev(1, 7))
        nodes["a character device"] = d / f"chr{ext}"
    (d / f"folder{ext}").mkdir()
    (d / f"folder{ext}" / "thesis.tex").write_text("keep")
    nodes["a folder"] = d / f"folder{ext}"
    return nodes


def _intact(nodes):
    for kind, p in nodes.items():
        st = os.lstat(p)
        want = {"a FIFO": stat.S_ISFIFO, "a socket": stat.S_ISSOCK,
                "a character device": stat.S_ISCHR, "a folder": stat.S_ISDIR}[kind]
        assert want(st.st_mode), (kind, p)
        if kind == "a character device":
            assert st.st_rdev == os.makedev(1, 7)
    assert os.listdir(nodes["a folder"]) == ["thesis.tex"]


def test_the_module_never_replaces_a_device_fifo_or_socket(tmp_path):
    nodes = _nodes(tmp_path)
    for kind, p in nodes.items():
        with pytest.raises(Refused, match=rf"^X is {kind}, not a regular file; .*--force does "
                                          r"not change that\): pick$"):
            sw.check_target(str(p), {}, True, "X", "pick")
        if kind != "a folder":
            with pytest.raises(Refused, match=f"is {kind}"):
                sw.write_text(str(p), "x", force=True)
            with pytest.raises(Refused, match=f"is {kind}"):
                sw.publish_dir(sw.staged_dir(str(p)), str(p), replace=True)
    _intact(nodes)


def test_every_writer_refuses_a_device_fifo_socket_or_folder_even_forced(tmp_path):
    nodes, bins = _nodes(tmp_path / "n"), _nodes(tmp_path / "b", ".bin")
    os.mkfifo(tmp_path / "m.json")  # the metadata of OUT m.bin
    cfg = os.path.join(ROOT, "configs", "demo.yaml")
    src = tmp_path / "t.txt"
    src.write_text("hello\n" * 100)
    cmds = {"--emit-config": ["-m", "boost_jax.plan", "--config", cfg, "--topology", "cpu",
                              "--nodes", "1", "--no-compile", "--emit-config"],
            "--out": ["-m", "boost_jax.launch", "slurm", "--config", cfg, "--topology", "cpu",
                      "--nodes", "1", "--out"],
            "--dump-hlo": ["-m", "boost_jax.analysis.comm", "--config", cfg, "--dump-hlo"],
            "OUT": ["-m", "boost_jax.data.prepare", str(src), "--tokenizer", "byte", "--force",
                    "--workers", "1"]}
    argvs, want = [], []
    for i, (opt, cmd) in enumerate(cmds.items()):
        for j, (kind, p) in enumerate((bins if opt == "OUT" else nodes).items()):
            if opt == "OUT":
                argvs.append(cmd[:3] + [str(p)] + cmd[3:])
            else:
                argvs.append([*cmd, str(p)] + (["--force"] if (i + j) % 2 == 0 else []))
            want.append(rf".*'{re.escape(str(p))}'.* is {kind}, not a regular file")
    argvs.append(cmds["OUT"][:3] + [str(tmp_path / "m.bin")] + cmds["OUT"][3:])
    want.append(r"'.*/m\.json' is a FIFO, not a regular file")
    for k in range(0, len(argvs), 4):
        for r, pattern in zip(_run_all(*argvs[k:k + 4]), want[k:k + 4]):
            _one_line(r, pattern)
    _intact(nodes)
    _intact(bins)
    assert stat.S_ISFIFO(os.lstat(tmp_path / "m.json").st_mode)
    assert not (tmp_path / "m.bin").exists()


def test_a_run_never_writes_onto_a_corpus_metadata_or_a_fifo_in_out_dir(tmp_path):
    """data.source=OUT/summary.bin out_dir=OUT: the run's summary.json would be the corpus's
    metadata; the same through data.sources; a FIFO where the run keeps metrics.jsonl."""
    from boost_jax.data.prepare import prepare

    out = tmp_path / "out"
    out.mkdir()
    src = tmp_path / "t.txt"
    src.write_text("def f(x):\n    return x\n" * 2000)
    prepare(str(src), str(out / "summary.bin"), "byte", workers=1, progress=False)
    before = {n: (out / n).read_bytes() for n in os.listdir(out)}
    fifo_dir = tmp_path / "fifo_run"
    fifo_dir.mkdir()
    os.mkfifo(fifo_dir / "metrics.jsonl")
    train = ["train.py", "--cpu-devices", "1", "--force", "train.steps=1"]
    rows = _run_all([*train, f"data.source={out}/summary.bin", f"out_dir={out}"],
                    [*train, f"data.sources=[{{path: {out}/summary.bin, weight: 1}}]",
                     f"out_dir={out}"],
                    [*train, f"out_dir={fifo_dir}"],
                    [*train, f"out_dir={fifo_dir}/metrics.jsonl"])
    for r, label in zip(rows, ("data.source", r"data.sources\[0\]")):
        _one_line(r, rf"the run's summary\.json '{out}/summary\.json' is the metadata of "
                     rf"{label} '{out}/summary\.json'; writing it would destroy")
    _one_line(rows[2], rf"the run's metrics\.jsonl '{fifo_dir}/metrics\.jsonl' is a FIFO, not "
                       r"a regular file")
    _one_line(rows[3], rf"out_dir '{fifo_dir}/metrics\.jsonl' is a FIFO, not a folder")
    assert {n: (out / n).read_bytes() for n in os.listdir(out)} == before
    assert os.listdir(fifo_dir) == ["metrics.jsonl"]
    assert stat.S_ISFIFO(os.lstat(fifo_dir / "metrics.jsonl").st_mode)


def test_hf_fixture_keeps_a_folder_it_did_not_write(tmp_path):
    """scripts/hf_fixture.py replaces --out/NAME only when it holds a fixture it wrote: a user's
    folder, or a link to one, is refused (exit 2, one line) and left as it was."""
    mine = tmp_path / "elsewhere"
    mine.mkdir()
    (mine / "model.safetensors").write_text("the user's model")
    (tmp_path / "out").mkdir()
    os.symlink(mine, tmp_path / "out" / "svd")
    (tmp_path / "out" / "full").mkdir()
    (tmp_path / "out" / "full" / "notes.txt").write_text("mine")
    for name in ("full", "svd"):
        r = subprocess.run([PY, os.path.join(ROOT, "scripts", "hf_fixture.py"), "--out",
                            str(tmp_path / "out"), name], env=ENV, capture_output=True,
                           text=True, timeout=120)
        _one_line(r, rf".*{name} exists and is not a fixture this script wrote")
    assert (tmp_path / "out" / "full" / "notes.txt").read_text() == "mine"
    assert (mine / "model.safetensors").read_text() == "the user's model"
