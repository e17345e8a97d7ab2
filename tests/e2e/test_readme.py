"""The README's commands run as written.

Every command of every code block after the first (`make train` / `make test`, which CI runs)
is listed in COMMANDS with how this test treats it: run here in README order, in a scratch
folder that sees the repository's files, with overrides appended where the command would train
or plan for long (`extra`) and optional `[...]` parts dropped; or covered by the named test that
runs the same command with its own checks; or not runnable without a cluster or GPU, said why.
A README command missing from COMMANDS, or a COMMANDS entry no longer in the README, fails:
the README cannot drift from what is run. `python` blocks are Python, not commands: the one
there is run by tests/unit/test_hf.py.

Run after `make train` (run here first, tiny), as a reader would: every command that trains
writes an out_dir no earlier command wrote (a command that would resume another's run fails
here before it runs), and trains from step 0 (the overrides appended never set out_dir).
"""

import json
import os
import re
import shlex
import subprocess
import sys

import pytest

from train_proc import ROOT

README = os.path.join(ROOT, "README.md")
# a tiny model for the commands that train: seconds, not minutes
TINY = ["model.d_model=32", "model.n_layers=2", "model.n_heads=2", "model.d_ff=64",
        "model.rank=8", "model.max_seq_len=32", "data.seq_len=32", "data.max_bytes=200000",
        "train.global_batch=8", "train.steps=2", "train.eval_every=2", "train.eval_batches=1",
        "logging.progress=false", "logging.tensorboard=false", "logging.plot=false"]
# 2 stages leave 4 data-parallel devices of 8: 4 micro-batches of 4 sequences
TINY_PP = [x for x in TINY if not x.startswith("train.global_batch")] + ["train.global_batch=16"]
RUN, ELSEWHERE, CLUSTER = "run", "elsewhere", "cluster"


def _c(kind, extra=(), why="", line=None, setup=None):
    """line: what runs instead of the command with `extra` appended (make's ARGS); setup: files
    the command reads that a reader brings (a corpus folder)."""
    return {"kind": kind, "extra": list(extra), "why": why, "line": line, "setup": setup}


def _corpus(tmp_path):
    (tmp_path / "corpus").mkdir()
    for i in range(3):
        (tmp_path / "corpus" / f"part{i}.txt").write_text(f"document {i}: " + "some text " * 500)


def downloads(d):
    """What the walk-through's download step leaves: hf's local-dir layout with a parquet shard
    and a save_to_disk folder, both small."""
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


COMMANDS = {
    "python train.py --config configs/demo.yaml out_dir=runs/mine [key=value ...] "
    "[--cpu-devices N]": _c(RUN, TINY),
    "python train.py --config configs/demo.yaml --cpu-devices 8 parallel.tp_mode=btp "
    "parallel.tp_axes=[pair] parallel.plan=hierarchical train.micro_batches=4 "
    "train.remat=lowrank out_dir=runs/demo-btp": _c(RUN, TINY + ["train.global_batch=16"]),
    "python train.py --config configs/cola-1b.yaml parallel.tp_mode=btp parallel.tp_axes=[pair] "
    "parallel.plan=hierarchical train.micro_batches=4 train.remat=lowrank out_dir=runs/1b":
        _c(RUN, TINY + ["model.n_heads=4", "train.global_batch=16", "--cpu-devices", "8"]),
    'make train ARGS="train.steps=50 out_dir=runs/x"':
        # -o: the environment this test runs in is the one make would build
        _c(RUN, line='make -o .venv/.installed train ARGS="train.steps=50 out_dir=runs/x '
                     + " ".join(TINY) + '"'),
    "python scripts/launch_local.py -n 2 --cpu-devices-per-process 4 -- --config "
    "configs/demo.yaml train.steps=50 out_dir=runs/mh":
        _c(ELSEWHERE, why="tests/e2e/test_multihost.py::test_two_processes_train_like_one_"
                          "including_save_and_restore"),
    "pip install -e '.[cuda]'": _c(CLUSTER, why="installs the CUDA plugin (GPU machine)"),
    "module load rocm/7.0.2 && pip install -e '.[rocm]'": _c(CLUSTER, why="a ROCm module"),
    'python -c "import jax; print(jax.default_backend(), jax.device_count(), jax.devices())"':
        _c(RUN),
    'hf download HuggingFaceFW/fineweb-edu --repo-type dataset --include '
    '"sample/10BT/000_*.parquet" --local-dir downloads/fineweb-edu':
        _c(CLUSTER, why="downloads from the Hugging Face Hub; step 2 runs on files like these"),
    'python -c "from datasets import load_dataset; load_dataset(\'roneneldan/TinyStories\', '
    'split=\'train\').save_to_disk(\'downloads/tinystories\')"':
        _c(CLUSTER, why="downloads from the Hugging Face Hub; step 2 runs on files like these"),
    "python -m boost_jax.data.prepare downloads/fineweb-edu data/fineweb.bin --tokenizer bpe "
    "--bpe-vocab-size 32000": _c(RUN, setup=downloads),
    "python -m boost_jax.data.prepare downloads/tinystories data/tinystories.bin --tokenizer "
    "data/fineweb.tokenizer.json": _c(RUN),
    'python train.py --config configs/demo.yaml "data.sources=[{path: data/fineweb.bin, weight: '
    '0.7}, {path: data/tinystories.bin, weight: 0.3}]" data.tokenizer=data/fineweb.tokenizer.json '
    "data.max_bytes=null model.vocab_size=null out_dir=runs/mix": _c(RUN, TINY),
    "python -m boost_jax.evaluate --run runs/mix": _c(RUN),
    "python -m boost_jax.plan --config configs/cola-7b.yaml --topology frontier --nodes 48 "
    "train.global_batch=768 --search --emit-config cola-7b-f48.yaml "
    '"data.sources=[{path: $PWD/data/fineweb.bin, weight: 0.7}, {path: '
    '$PWD/data/tinystories.bin, weight: 0.3}]" data.tokenizer=$PWD/data/fineweb.tokenizer.json '
    "data.max_bytes=null": _c(RUN, ["--no-compile"]),
    "python -m boost_jax.launch slurm --config cola-7b-f48.yaml --account abc123 --time "
    "02:00:00 --out cola-7b-f48.sbatch": _c(RUN),
    "sbatch cola-7b-f48.sbatch": _c(CLUSTER, why="48 Frontier nodes"),
    "pip install -e '.[gpu-compile]'":
        _c(ELSEWHERE, why="4.4 GB of CUDA wheels; `make gpu-compile-test` installs them into "
                          ".venv-gpuc and runs tests/unit/test_gpu_compile.py there"),
    "python -m boost_jax.plan --config configs/cola-1b.yaml --topology perlmutter --nodes 4 "
    "parallel.tp_mode=btp parallel.tp_axes=[pair] model.d_ff=5462 --gpu-compile [--json]":
        _c(ELSEWHERE, why="tests/unit/test_gpu_compile.py::test_step_compiles_for_a100_with_our_"
                          "kernels"),
    "python -m boost_jax.launch slurm --config configs/demo.yaml --topology cpu --nodes 2 "
    "train.steps=50 out_dir=$PWD/runs/slurm-local --out runs/local.sbatch": _c(RUN),
    "PATH=$PWD/scripts/local_slurm:$PATH sbatch runs/local.sbatch":
        _c(ELSEWHERE, why="tests/e2e/test_launch.py::test_local_job_trains_and_resumes_after_"
                          "requeue_like_one_process"),
    "PATH=$PWD/scripts/local_slurm:$PATH scancel --signal=TERM JOBID":
        _c(ELSEWHERE, why="tests/e2e/test_launch.py::test_local_job_trains_and_resumes_after_"
                          "requeue_like_one_process"),
    "python train.py --config configs/demo.yaml --cpu-devices 8 parallel.pp_stages=2 "
    "train.micro_batches=4 out_dir=runs/pp": _c(RUN, TINY_PP),
    "python train.py --config configs/demo.yaml --cpu-devices 8 parallel.pp_stages=2 "
    "parallel.pp_virtual=2 train.micro_batches=4 out_dir=runs/ppv":
        _c(RUN, TINY_PP + ["model.n_layers=4"]),
    "python -m boost_jax.plan --config configs/cola-7b.yaml --topology frontier --nodes 48 "
    "parallel.tp_mode=btp parallel.tp_axes=[pair,node] parallel.plan=hierarchical "
    "train.global_batch=768":
        _c(RUN, ["--no-compile"]),
    "python -m boost_jax.plan --config configs/cola-1b.yaml --topology frontier --nodes 8 "
    "--search": _c(RUN, ["--no-compile"]),
    "python -m boost_jax.analysis.comm --config configs/demo.yaml --cpu-devices 8 [--json]":
        _c(RUN, ["model.n_layers=1"]),
    "python -m boost_jax.analysis.comm --config configs/demo.yaml --cpu-devices 8 "
    "parallel.plan=zero3 parallel.collectives=two_level": _c(RUN, ["model.n_layers=1"]),
    'python -m boost_jax.generate --run runs/demo --prompt "def "': _c(RUN),
    "python -m boost_jax.evaluate --run runs/demo [--data corpus.txt]": _c(RUN),
    "python -m boost_jax.export --run runs/demo --out hf/demo": _c(RUN),
    "python train.py --config configs/demo.yaml model.init_from=hf/demo out_dir=runs/next":
        _c(RUN, TINY),
    "python train.py --config configs/demo.yaml model.family=gpt_neox out_dir=runs/neox":
        _c(RUN, TINY),
    "python train.py --config configs/demo.yaml model.family=gpt2 model.tie_embeddings=true "
    "out_dir=runs/gpt2": _c(RUN, TINY),
    "python benchmarks/attention.py --lengths 64,256 --reps 3": _c(RUN),
    "python -m boost_jax.analysis.comm --config configs/demo.yaml --cpu-devices 8 "
    "data.seq_len=4096 model.max_seq_len=4096 model.attention=flash":
        _c(RUN, ["data.seq_len=256", "model.max_seq_len=256", "model.n_layers=1"]),
    "python -m boost_jax.data.prepare corpus/ data/corpus.bin --tokenizer byte":
        _c(RUN, setup=_corpus),
}


def readme_blocks(text: str) -> list[tuple[str, str]]:
    """(language, body) of every code block after the first."""
    return re.findall(r"^```([^\n]*)\n(.*?)^```", text, flags=re.S | re.M)[1:]


def readme_commands(text: str) -> list[str]:
    """Commands of the shell code blocks after the first: continuation lines joined, comments
    and surrounding blanks dropped."""
    out = []
    for lang, block in readme_blocks(text):
        if lang == "python":
            continue
        for cmd in re.sub(r"\\\n\s*", "", block).splitlines():
            cmd = re.sub(r"\s+#.*$", "", cmd).strip()
            if cmd:
                out.append(re.sub(r"\s+", " ", cmd))
    return out


def as_run(cmd: str, extra: list) -> str:
    """The command with its optional [...] parts dropped and `extra` appended (shell-quoted)."""
    cmd = re.sub(r"\s*\[[^\]]*\.\.\.\]|\s*\[--[^\]]*\]", "", cmd)
    return cmd + "".join(" " + shlex.quote(x) for x in extra)


def test_every_readme_command_is_accounted_for():
    cmds = readme_commands(open(README).read())
    assert len(cmds) == len(set(cmds))
    missing = [c for c in cmds if c not in COMMANDS]
    stale = [c for c in COMMANDS if c not in cmds]
    assert not missing, f"README commands this test does not run or name: {missing}"
    assert not stale, f"COMMANDS entries no longer in the README: {stale}"
    assert [lang for lang, _ in readme_blocks(open(README).read()) if lang] == ["python"]
    assert "def test_readme_transformers_example(" in open(
        os.path.join(ROOT, "tests", "unit", "test_hf.py")).read()
    for cmd, how in COMMANDS.items():
        assert not any(x.startswith("out_dir=") for x in how["extra"]), cmd
        if how["kind"] == ELSEWHERE and how["why"].startswith("tests/"):
            path, name = how["why"].split("::")
            assert f"def {name}(" in open(os.path.join(ROOT, path)).read(), (cmd, how)


def _scratch(tmp_path):
    """A folder that sees the repository's files (train.py, configs/, scripts/) as the README's
    reader does from the clone, while everything the commands write stays in tmp_path."""
    for name in ("train.py", "configs", "scripts", "boost_jax", "benchmarks", "Makefile",
                 "pyproject.toml", ".venv"):
        if os.path.exists(os.path.join(ROOT, name)):
            os.symlink(os.path.join(ROOT, name), tmp_path / name)
    bindir = os.path.dirname(sys.executable)  # what `source .venv/bin/activate` puts first
    return dict(os.environ, PATH=f"{bindir}:{os.environ['PATH']}", JAX_PLATFORMS="cpu",
                VIRTUAL_ENV=os.path.dirname(bindir), PYTHONPATH=ROOT, PWD=str(tmp_path))


MAKE_TRAIN = 'make -o .venv/.installed train ARGS="' + " ".join(TINY) + '"'


def out_dir_of(line: str):
    """The out_dir a command line writes (its last out_dir=, else its --config's, for train.py
    and make train), relative to the scratch folder; None for a command that trains nothing."""
    found = re.findall(r"(?:^|[\s\"])out_dir=([^\s\"]+)", line)
    if found:
        return found[-1].replace("$PWD/", "")
    if "train.py" in line or line.startswith("make "):
        config = re.search(r"--config (\S+)", line)
        config = config.group(1) if config else "configs/demo.yaml"  # make train's
        return re.search(r"^out_dir: (\S+)", open(os.path.join(ROOT, config)).read(),
                         re.M).group(1)
    return None


def _run_one(line, tmp_path, env, written, who):
    """Run a command line; one that trains must write an out_dir of its own and start at 0."""
    out_dir = out_dir_of(line)
    if out_dir:
        assert out_dir not in written, (f"$ {who}\nwrites out_dir={out_dir}, which "
                                        f"$ {written.get(out_dir)}\nwrote before it")
        written[out_dir] = who
    r = subprocess.run(["bash", "-c", line], cwd=tmp_path, env=env, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, f"$ {line}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    if out_dir and os.path.isfile(tmp_path / out_dir / "metrics.jsonl"):
        assert "resumed from step" not in r.stdout + r.stderr, f"$ {line} resumed a run"
        rows = [json.loads(x) for x in open(tmp_path / out_dir / "metrics.jsonl")]
        assert rows and rows[-1]["step"] > 0, f"$ {line} trained nothing"


def test_readme_commands_run_as_written(tmp_path, jax_cache):
    env = _scratch(tmp_path)
    env.update(JAX_COMPILATION_CACHE_DIR=jax_cache,
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
    env.pop("XLA_FLAGS", None)
    written = {}
    _run_one(MAKE_TRAIN, tmp_path, env, written, "make train")
    ran = 0
    for cmd in readme_commands(open(README).read()):
        how = COMMANDS[cmd]
        if how["kind"] != RUN:
            continue
        if how["setup"]:
            how["setup"](tmp_path)
        _run_one(how["line"] or as_run(cmd, how["extra"]), tmp_path, env, written, cmd)
        ran += 1
    assert ran >= 16
    # the walk-through's two corpora share the tokenizer the first one trained
    metas = [json.load(open(tmp_path / "data" / f"{n}.json")) for n in ("fineweb", "tinystories")]
    assert metas[0]["tokenizer_fingerprint"] == metas[1]["tokenizer_fingerprint"]


def test_a_readme_command_that_reuses_an_out_dir_fails(tmp_path):
    """What the walk above does when a README command would resume another's run: it fails
    before running it."""
    written = {"runs/demo": "make train"}
    assert out_dir_of("python train.py --config configs/demo.yaml model.family=gpt2") == \
        "runs/demo"
    with pytest.raises(AssertionError, match="writes out_dir=runs/demo, which"):
        _run_one("python train.py --config configs/demo.yaml model.family=gpt2", tmp_path, {},
                 written, "python train.py --config configs/demo.yaml model.family=gpt2")
    assert out_dir_of('make train ARGS="train.steps=50 out_dir=runs/x"') == "runs/x"
    assert out_dir_of("python -m boost_jax.launch slurm --config c.yaml "
                      "out_dir=$PWD/runs/slurm-local --out j.sbatch") == "runs/slurm-local"
    assert out_dir_of("python -m boost_jax.evaluate --run runs/mix") is None
