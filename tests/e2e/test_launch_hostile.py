"""A generated batch script is data, never code: hostile values in every field that reaches it.

Each value (newlines, quotes, $(...), backticks, heredoc terminators) goes into one field at a
time: every string key of the config (written to a YAML file, so the value arrives exactly),
every option of the launcher and the config file's name. The launcher either refuses with one
line, exit 2, writing nothing, or writes a script that `bash -n` accepts and that, run with stub
`srun` / `scontrol` / `module` on PATH, creates no marker file and hands train.py the value
unchanged.
"""

import dataclasses
import os
import re
import stat
import subprocess
import sys
import typing

import pytest
import yaml

from boost_jax.config import Config
from boost_jax.launch.__main__ import main as launch_main
from boost_jax.launch.script_values import heredoc
from train_proc import ROOT
HOSTILE = {  # id -> value; {m} is the marker file an injected command would create
    "newline": "x\ntouch {m}",
    "carriage_return": "x\rtouch {m}",
    "single_quote": "x'; touch {m}; '",
    "double_quote": 'x"; touch {m}; "',
    "dollar_paren": "$(touch {m})",
    "backticks": "`touch {m}`",
    "semicolon_ifs": "x;touch${{IFS}}{m}",
    "heredoc_end": "BOOST_JAX_CONFIG\ntouch {m}",
    "trailing_newline": "abc\n",
    "leading_newline": "\n02:00:00",
    "not_utf8": "x\udcff$(touch {m})",  # a byte of the command line that is not UTF-8
}
OPTIONS = ("--partition", "--qos", "--account", "--time", "--module", "--python", "--topology",
           "--nodes")
# Values of these fields are paths: everything but control characters and bytes that are not
# UTF-8 is a valid path, so the script must carry them (quoted), not refuse them.
PATHS = {"out_dir", "data.source", "--python"}


def _string_keys(cls=Config, prefix=""):
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            yield from _string_keys(tp, prefix + f.name + ".")
        elif str in (tp, *typing.get_args(tp)):
            yield prefix + f.name


CONFIG_KEYS = sorted(_string_keys())
FIELDS = CONFIG_KEYS + list(OPTIONS) + ["--config"]


def _stubs(d):
    """srun records its words (NUL-separated), saves step 1 into the out_dir it is given (as
    train.py would before exiting 143) and exits $SRUN_EXIT (the node check step: its words to
    srun_check, exit 0); scontrol and module record."""
    os.makedirs(d)
    srun = ('case "$*" in *node_check.py*) printf "%s\\0" "$@" > "$STUB_LOG/srun_check"; '
            'exit 0;; esac\nprintf "%s\\0" "$@" > "$STUB_LOG/srun"\n'
            'for a in "$@"; do case "$a" in out_dir=*) mkdir -p -- "${a#out_dir=}/checkpoints/1"'
            ';; esac; done\nexit "${SRUN_EXIT:-0}"')
    for name, body in (("srun", srun),
                       ("scontrol", 'printf "%s " "$@" > "$STUB_LOG/scontrol"'),
                       ("module", 'printf "%s\\n" "$*" >> "$STUB_LOG/module"')):
        p = os.path.join(d, name)
        with open(p, "w") as f:
            f.write(f"#!/bin/bash\n{body}\n")
        os.chmod(p, stat.S_IRWXU)
    return d


def _launch(capsys, argv):
    try:
        code = launch_main(argv)
    except SystemExit as e:
        code = e.code
    return code, capsys.readouterr().err


def _argv(field, value, tmp):
    """Launcher argv with `value` in `field` (a config key via a YAML file, or an option)."""
    cfg = {"train": {"steps": 2}, "model": {"vocab_size": 256}}
    cfg_path = str(tmp / "job.yaml")
    if field == "--config":
        cfg_path = str(tmp / f"{value}.yaml")
    elif field not in OPTIONS:
        node = cfg
        *parents, leaf = field.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    with open(cfg_path, "w") as f:
        yaml.safe_dump(cfg, f)
    topology = [] if field == "mesh.topology" else ["--topology", "cpu"]  # it would win
    argv = ["slurm", "--config", cfg_path, *topology, "--nodes", "2",
            "--out", str(tmp / "job.sbatch")]
    if field in OPTIONS:
        argv += [field, value]
    return argv


def _check_runs_as_data(field, value, job, tmp):
    text = open(job).read()
    for line in text.splitlines():  # sbatch reads these lines itself: one bare word each
        if line.startswith("#SBATCH"):
            assert re.fullmatch(r"#SBATCH --[a-z-]+(=[\w.,:@%+-]+)?", line), line
    assert subprocess.run(["bash", "-n", job], capture_output=True).returncode == 0
    log = tmp / "log"
    log.mkdir()
    env = dict(os.environ, PATH=_stubs(str(tmp / "bin")) + os.pathsep + os.environ["PATH"],
               STUB_LOG=str(log), SRUN_EXIT="143", SLURM_JOB_ID="77")
    run_dir = tmp / "submit"
    run_dir.mkdir()
    r = subprocess.run(["bash", job], cwd=run_dir, env=env, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    assert (log / "scontrol").read_text() == "requeue 77 "  # exit 143 requeues the job
    words = (log / "srun").read_text().split("\0")[:-1]
    train = words[words.index("-u") - 1:]
    with open(os.path.join(run_dir, train[train.index("--config") + 1])) as f:
        embedded = yaml.safe_load(f)
    if field in OPTIONS or field == "--config":
        assert field != "--python" or train[0] == value
        return
    node = embedded
    for p in field.split("."):
        node = node[p]
    assert node == value  # the embedded config holds the value unchanged
    if field == "out_dir":
        assert train[train.index("--config") + 2] == f"out_dir={value}"
        assert os.path.isdir(run_dir / value)


@pytest.mark.parametrize("field", FIELDS)
def test_hostile_values_stay_data(field, tmp_path, capsys):
    for vid, raw in HOSTILE.items():
        tmp = tmp_path / vid
        tmp.mkdir()
        marker = tmp / "pwned"
        value = raw.format(m=marker)
        if field == "--config" and "/" in value:
            value = value.replace(str(marker), "pwned")  # a file name: no folders
        argv = _argv(field, value, tmp)
        code, err = _launch(capsys, argv)
        job = str(tmp / "job.sbatch")
        if code == 2:
            assert len(err.strip().splitlines()) == 1 and err.startswith("error: "), (vid, err)
            assert not os.path.exists(job)
            assert field not in PATHS or re.search(r"[\r\n\udc80-\udcff]", value), (vid, err)
        else:
            assert code == 0, (vid, err)
            _check_runs_as_data(field, value, job, tmp)
        assert not marker.exists(), (field, vid)


def test_bad_option_values_are_one_line_from_the_command(tmp_path):
    """The real command: --time with a leading newline, --account with a trailing one, an
    empty --qos (once quietly the profile's)."""
    env = dict(os.environ, PYTHONPATH=ROOT)
    for opt, value, msg in (("--time", "\n02:00:00", "--time '\\n02:00:00' is not a SLURM time"),
                            ("--account", "abc\n", "--account 'abc\\n' is not a project id"),
                            ("--qos", "q\ntouch x", "--qos 'q\\ntouch x' is not valid in a"),
                            ("--qos", "", "--qos '' is not valid in a batch script")):
        out = tmp_path / "job.sbatch"
        r = subprocess.run([sys.executable, "-m", "boost_jax.launch", "slurm", "--config",
                            "configs/demo.yaml", "--topology", "cpu", "--nodes", "2", opt, value,
                            "--out", str(out)], cwd=ROOT, env=env, capture_output=True,
                           text=True, timeout=120)
        assert r.returncode == 2 and r.stderr.startswith("error: " + msg), r.stderr
        assert len(r.stderr.strip().splitlines()) == 1 and not out.exists()


def test_heredoc_delimiter_never_occurs_in_the_text(tmp_path):
    """Text holding the delimiter on a line of its own still arrives whole and runs nothing."""
    first = heredoc('"$F"', "a: 1\n", "STEM")[-1]
    marker = tmp_path / "pwned"
    text = f"a: 1\n{first}\ntouch {marker}\n"
    lines = heredoc('"$F"', text, "STEM")
    assert lines[-1] != first
    script = tmp_path / "s.sh"
    script.write_text('F="$1"\n' + "\n".join(lines) + "\n")
    out = tmp_path / "out.txt"
    assert subprocess.run(["bash", str(script), str(out)]).returncode == 0
    assert out.read_text() == text and not marker.exists()


@pytest.mark.parametrize("value", ["p #q", "yes", "-v", "'q'", " sp ", "null", "{a: b}", "[a"])
def test_out_dir_reaches_train_py_as_the_same_folder(value, tmp_path, capsys):
    """The job hands train.py `out_dir=...` as an override: read back, it names the folder the
    script made (a YAML reading would cut `#q`, turn `yes` into true, `null` into None; a
    leading `-` would be an option of mkdir)."""
    from boost_jax.config import load_config

    code, err = _launch(capsys, _argv("out_dir", value, tmp_path))
    assert code == 0, err
    _stubs(str(tmp_path / "bin"))
    (tmp_path / "log").mkdir()
    env = dict(os.environ, PATH=str(tmp_path / "bin") + os.pathsep + os.environ["PATH"],
               STUB_LOG=str(tmp_path / "log"), SLURM_JOB_ID="77")
    run_dir = tmp_path / "submit"
    run_dir.mkdir()
    r = subprocess.run(["bash", str(tmp_path / "job.sbatch")], cwd=run_dir, env=env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    words = (tmp_path / "log" / "srun").read_text().split("\0")[:-1]
    override = next(w for w in words if w.startswith("out_dir="))
    got = load_config(os.path.join(ROOT, "configs", "demo.yaml"), [override]).out_dir
    assert os.path.samefile(run_dir / got, run_dir / value)
    assert os.listdir(run_dir) == [value]


def test_launch_never_writes_over_what_the_job_runs_or_reads(tmp_path, capsys):
    """--out is never the job's --python, train.py or a file the run reads (its data.source),
    not even with --force: one line, exit 2, the file unchanged."""
    py = tmp_path / "mypy"
    py.write_text(f'#!/bin/sh\nexec {sys.executable} "$@"\n')
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("some text\n" * 100)
    cfg = tmp_path / "job.yaml"
    yaml.safe_dump({"data": {"source": str(corpus)}}, open(cfg, "w"))
    base = ["slurm", "--config", str(cfg), "--topology", "cpu", "--nodes", "1", "--force"]
    for out, extra, label in ((py, ["--python", str(py)], r"the job's --python"),
                              (os.path.join(ROOT, "train.py"), [], "train.py"),
                              (corpus, [], r"data\.source")):
        before = open(out, "rb").read()
        code, err = _launch(capsys, [*base, *extra, "--out", str(out)])
        assert code == 2 and re.fullmatch(rf"error: --out '.*' is {label} '.*'; writing it "
                                          r"would destroy what this command reads .*\n", err), err
        assert open(out, "rb").read() == before


def test_the_job_never_writes_its_config_through_a_link(tmp_path, capsys):
    """The script publishes job_config.yaml whole (a temp file renamed onto it): a link there is
    refused before anything is written, the linked file unchanged; a regular file a job wrote
    is replaced."""
    out_dir = tmp_path / "run"
    out_dir.mkdir()
    cfg = tmp_path / "job.yaml"
    yaml.safe_dump({"out_dir": str(out_dir)}, open(cfg, "w"))
    job = tmp_path / "job.sbatch"
    assert _launch(capsys, ["slurm", "--config", str(cfg), "--topology", "cpu", "--nodes", "1",
                            "--out", str(job)])[0] == 0
    env = dict(os.environ, PATH=_stubs(str(tmp_path / "bin")) + os.pathsep + os.environ["PATH"],
               STUB_LOG=str(tmp_path), SLURM_JOB_ID="7")
    notes = tmp_path / "notes.txt"
    notes.write_text("precious\n")
    os.symlink(notes, out_dir / "job_config.yaml")
    r = subprocess.run(["bash", str(job)], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "is a link or not a regular file" in r.stderr, r.stderr
    assert notes.read_text() == "precious\n" and not (tmp_path / "srun").exists()
    os.remove(out_dir / "job_config.yaml")
    from boost_jax.launch.slurm import JOB_CONFIG_MARK

    (out_dir / "job_config.yaml").write_text(f"{JOB_CONFIG_MARK}\nan older job's config\n")
    r = subprocess.run(["bash", "-c", f"umask 027 && bash {job}"], env=env, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert stat.S_IMODE(os.stat(out_dir / "job_config.yaml").st_mode) == 0o640  # the umask's
    written = yaml.safe_load((out_dir / "job_config.yaml").read_text())
    assert written["out_dir"] == str(out_dir) and sorted(os.listdir(out_dir)) == [
        "checkpoints", "job_config.yaml"]  # the stand-in srun's saved step, and the config
