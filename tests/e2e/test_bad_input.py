"""Every user mistake in README.md ("When something is wrong"): train.py prints one line
`error: ...` on stderr, exits 2,
and leaves what was already saved in out_dir untouched.

All rows run as train.py subprocesses, started together (they are independent) so the module
costs about as much as its slowest rows.
"""

import hashlib
import os
import re
import shutil
import subprocess
import sys

import pytest

from readme_errors import check_readme_table
from train_proc import ROOT
TINY = ["model.d_model=32", "model.n_layers=2", "model.n_heads=2", "model.d_ff=64",
        "model.rank=8", "model.max_seq_len=32", "data.seq_len=32", "data.max_bytes=300000",
        "train.global_batch=8", "train.eval_batches=2", "train.steps=4",
        "logging.progress=false", "logging.tensorboard=false", "logging.plot=false"]


# id -> (extra argv, expected message regex after "error: ")
ROWS = {
    "unknown_key": (["train.stesp=5"],
                    r"unknown config key 'train\.stesp'; did you mean 'train\.steps'\?"),
    "wrong_type": (["train.steps=abc"], r"train\.steps='abc' has the wrong type: expected int"),
    "missing_config_file": (["--config", "{tmp}/nope.yaml"],
                            r"config file '.*/nope\.yaml' does not exist"),
    "invalid_yaml": (["--config", "{tmp}/broken.yaml"],
                     r"config file '.*/broken\.yaml' is not valid YAML \(line \d+\); "
                     r"fix the syntax"),
    "unknown_family": (["model.family=gpt3"],
                       r"model\.family='gpt3' is not valid: expected one of 'llama', "
                       r"'gpt_neox', 'gpt2'"),
    "odd_rotary_dims": (["model.family=gpt_neox", "model.rotary_pct=0.1"],
                        r"RoPE rotates head_dim·rotary_pct=1 dims, which must be even; change "
                        r"model\.rotary_pct or model\.n_heads"),
    "tp_not_dividing_heads": (
        ["parallel.tp_mode=btp", "parallel.tp_axes=[pair]", "model.n_heads=3",
         "model.d_model=48"],
        r"model\.n_heads=3 is not divisible by the tensor-parallel degree 2 "
        r"\(parallel\.tp_axes=\['pair'\], tp_mode=btp\)"),
    "mesh_larger_than_devices": (
        ["mesh.shape=[2,2,4]"],
        r"mesh \(pair=2, node=2, global=4\) needs 16 devices but only 8 are present; use "
        r"--cpu-devices 16"),
    "pp_more_stages_than_layers": (
        ["model.n_layers=1", "parallel.pp_stages=2", "train.micro_batches=2"],
        r"parallel\.pp_stages=2 is more stages than the model's 1 layer "),
    "pp_1f1b_too_few_micro_batches": (
        ["parallel.pp_stages=2"],
        r"parallel\.pp_schedule=1f1b needs at least as many micro-batches as stages: "
        r"train\.micro_batches=1 < parallel\.pp_stages=2; set train\.micro_batches>=2"),
    "pp_stages_not_dividing_global": (
        ["model.n_layers=3", "parallel.pp_stages=3", "train.micro_batches=4"],
        r"parallel\.pp_stages=3 does not divide the 2 host groups of the global axis"),
    "pp_stage_without_layer": (
        ["model.n_layers=5", "parallel.pp_stages=4", "mesh.shape=[2,1,4]",
         "train.micro_batches=4"],
        r"parallel\.pp_stages=4 splits 5 layers into runs of 2, which leaves stage 3 without "
        r"a layer"),
    "pp_virtual_without_stages": (
        ["parallel.pp_virtual=2"],
        r"parallel\.pp_virtual=2 needs pipeline stages; set parallel\.pp_stages>1"),
    "pp_virtual_micro_batches": (
        ["model.n_layers=4", "parallel.pp_stages=2", "parallel.pp_virtual=2",
         "train.micro_batches=1", "parallel.pp_schedule=gpipe"],
        r"parallel\.pp_virtual=2 runs micro-batches in groups of the 2 stages: "
        r"train\.micro_batches=1 is not a multiple of parallel\.pp_stages=2"),
    "pp_virtual_too_many": (
        ["parallel.pp_stages=2", "parallel.pp_virtual=2", "train.micro_batches=2"],
        r"parallel\.pp_stages=2 x parallel\.pp_virtual=2 is more stages than the model's 2 "
        r"layers \(model\.n_layers\); use at most 2 stages x virtual stages$"),
    "pp_tied_embeddings": (
        ["model.tie_embeddings=true", "parallel.pp_stages=2", "train.micro_batches=2"],
        r"model\.tie_embeddings=true with parallel\.pp_stages>1"),
    "missing_data_path": (["data.source={tmp}/no/such/corpus.txt"],
                          r"data\.source '.*/no/such/corpus\.txt' does not exist"),
    "empty_data_file": (["data.source={tmp}/empty.txt"],
                        r"data\.source '.*/empty\.txt' holds no text"),
    "stream_not_shards": (["data.sources=[{{path: {tmp}/emptydir, weight: 1}}]"],
                          r"data\.sources\[0\]\.path='.*/emptydir' is neither a \.bin nor "
                          r"parquet/arrow shards; prepare it with python -m boost_jax\.data\.prepare "
                          r"SOURCE OUT\.bin"),
    "stream_too_few_documents": (["data.sources=[{{path: {tmp}/one_doc.parquet, weight: 1}}]",
                                  "data.tokenizer=byte"],
                                 r"data\.sources\[0\] '.*/one_doc\.parquet' holds 1 document, "
                                 r"too few to split into train and validation; add documents"),
    "empty_data_folder": (["data.source={tmp}/emptydir"],
                          r"data\.source '.*/emptydir' contains no \.txt/\.py/\.md/\.jsonl files"),
    "unreadable_tokenizer": (["data.tokenizer={tmp}/tokenizer.json"],
                             r"tokenizer file '.*/tokenizer\.json' is not a valid tokenizer\.json"),
    "missing_tokenizer": (["data.tokenizer={tmp}/none.json"],
                          r"tokenizer file '.*/none\.json' does not exist"),
    "sources_missing_file": (["data.sources=[{{path: {tmp}/no/a.bin, weight: 1}}]"],
                             r"data\.sources\[0\] '.*/no/a\.bin' does not exist; prepare it"),
    "sources_weight_zero": (["data.sources=[{{path: a.bin, weight: 1}}, "
                             "{{path: b.bin, weight: 0}}]"],
                            r"data\.sources\[1\]\.weight=0\.0 must be > 0"),
    "sources_weight_nan": (["data.sources=[{{path: a.bin, weight: .nan}}]"],
                           r"data\.sources\[0\]\.weight=nan must be a finite number"),
    "out_dir_not_writable": (["out_dir={tmp}/a_file/run"],
                             r"out_dir '.*/a_file/run' is not writable \(Not a directory\)"),
    "explicit_distributed_incomplete": (
        ["distributed.mode=explicit", "distributed.num_processes=2"],
        r"distributed\.mode=explicit needs distributed\.coordinator, distributed\.process_id"),
    "resume_other_model_shape": (
        ["out_dir={saved}", "model.d_model=64"],
        r"checkpoint step 3 in .*/saved has a different model \(saved vs config: "
        r"\{'d_model': \(32, 64\)\}\); use a new out_dir, or set the saved values back "
        r"\(model\.d_model=32\) to resume"),
    "duplicate_key_in_a_block": (["--config", "{tmp}/dup_key.yaml"],
                                 r"config file '.*/dup_key\.yaml' sets 'steps' twice in one block "
                                 r"\(lines 2 and 3\); keep one"),
    "duplicate_top_level_block": (["--config", "{tmp}/dup_block.yaml"],
                                  r"config file '.*/dup_block\.yaml' sets 'train' twice in one "
                                  r"block \(lines 1 and 5\)"),
    "yaml_list_with_overrides": (["--config", "{tmp}/list.yaml"],
                                 r"config file '.*/list\.yaml' holds a YAML list, not a mapping of "
                                 r"sections"),
    "lr_nan": (["optim.lr=nan"], r"optim\.lr=nan must be a finite number"),
    "lr_inf": (["optim.lr=.inf"], r"optim\.lr=inf must be a finite number"),
    "b2_above_one": (["optim.b2=1.5"], r"optim\.b2=1\.5 must be in \[0, 1\)"),
    "negative_norm_eps": (["model.norm_eps=-1"], r"model\.norm_eps=-1\.0 must be > 0"),
    "negative_stop_after": (["train.stop_after=-5"], r"train\.stop_after=-5 must be > 0"),
    "profile_steps_backwards": (["train.profile_steps=[5,3]"],
                                r"train\.profile_steps=\[5, 3\] must be \[first, last\]"),
    "bpe_vocab_too_small": (["data.tokenizer=bpe", "data.bpe_vocab_size=300"],
                            r"data\.bpe_vocab_size=300 is too small for a byte-level BPE .*; use "
                            r"at least 512"),
    "binary_data_source": (["data.source={tmp}/program.txt"],
                           r"data\.source '.*/program\.txt' is not text \(it holds NUL bytes\); "
                           r"point data\.source at UTF-8 text"),
    "unknown_option": (["--cpu-devcies", "8"],
                       r"unrecognized arguments: --cpu-devcies; see train\.py --help"),
    "accept_unknown_key": (["checkpoint.accept_changes=[data.sorce]"],
                           r"checkpoint\.accept_changes names an unknown config key 'data\.sorce'"
                           r"; did you mean 'data\.source'\?"),
    "fresh_start_over_checkpoints": (
        ["out_dir={saved2}", "checkpoint.resume=false"],
        r".*/saved2/checkpoints already holds checkpoints \(steps \[3\]\) and "
        r"checkpoint\.resume=false would overwrite them"),
    "config_not_utf8": (["--config", "{tmp}/latin1.yaml"],
                        r"config file '.*/latin1\.yaml' is not UTF-8 text \(byte 0xe9 on line 3\); "
                        r"save it as UTF-8"),
    "yaml_key_not_a_name": (["--config", "{tmp}/list_key.yaml"],
                            r"config file '.*/list_key\.yaml' is not valid YAML \(line 2\)"),
    "steps_beyond_int64": (["train.steps=99999999999999999999"],
                           r"train\.steps=99999999999999999999 is out of range; use a value of at "
                           r"most 9223372036854775807"),
    "steps_beyond_int32": (["train.steps=3000000000"],
                           r"train\.steps=3000000000 is more steps than a run can count \(int32\); "
                           r"use at most 2147483647"),
    "cpu_devices_negative": (["--cpu-devices", "-3"], r"--cpu-devices -3 must be >= 1$"),
    "cpu_devices_zero": (["--cpu-devices", "0"], r"--cpu-devices 0 must be >= 1$"),
    "newline_in_name": (["name=a\ntouch x"],  # a real newline: text keys are taken as typed
                        r"name='a\\ntouch x' contains a control character \(\\n\); remove it"),
    "out_dir_not_utf8": (["out_dir={tmp}/r\udcff"],
                         r"out_dir='.*/r\\udcff' is not UTF-8 text; write it in UTF-8"),
    "empty_out_dir": (["out_dir="], r"out_dir is empty; set it, e.g\. out_dir=runs/demo"),
    "jsonl_lone_surrogate": (["data.source={tmp}/surrogate.jsonl"],
                             r"data\.source '.*/surrogate\.jsonl' line 2 holds a lone surrogate "
                             r"\(\\ud800\), which is not text; fix or remove that line"),
    "jsonl_without_text": (["data.source={tmp}/blank.jsonl"],
                           r"data\.source '.*/blank\.jsonl' holds no text"),
    "negative_seed": (["train.seed=-1"], r"train\.seed=-1 must be >= 0"),
    "zero_checkpoints_kept": (["checkpoint.keep=0"], r"checkpoint\.keep=0 must be > 0"),
    "zero_processes": (["distributed.num_processes=0"],
                       r"distributed\.num_processes=0 must be > 0"),
}

# the other commands: id -> (argv after `python`, expected message regex after "error: ")
_PREPARE = ["-m", "boost_jax.data.prepare"]
_GENERATE = ["-m", "boost_jax.generate", "--run", "{tmp}/no_run"]
OTHER_ROWS = {
    "prepare_lone_surrogate": (
        _PREPARE + ["{tmp}/surrogate.jsonl", "{tmp}/s.bin", "--tokenizer", "byte",
                    "--no-progress"],
        r"'.*/surrogate\.jsonl' line 2 holds a lone surrogate \(\\ud800\), which is not text"),
    "prepare_no_text": (
        _PREPARE + ["{tmp}/blank.jsonl", "{tmp}/b.bin", "--tokenizer", "byte", "--no-progress"],
        r"SOURCE '.*/blank\.jsonl' holds no text; point it at a non-empty corpus"),
    "prepare_zero_workers": (
        _PREPARE + ["{tmp}/blank.jsonl", "{tmp}/w.bin", "--tokenizer", "byte", "--workers", "0"],
        r"--workers 0 must be >= 1"),
    "generate_prompt_not_utf8": (_GENERATE + ["--prompt", "caf\udce9"],
                                 r"--prompt is not UTF-8 text; pass UTF-8 text, or the text in "
                                 r"a UTF-8 file with --prompt-file FILE"),
    "generate_temperature_nan": (_GENERATE + ["--prompt", "a", "--temperature", "nan"],
                                 r"--temperature nan must be 0 \(greedy\) or between 0\.001 "
                                 r"and 1000"),
    "generate_temperature_huge": (_GENERATE + ["--prompt", "a", "--temperature", "1e300"],
                                  r"--temperature 1e\+300 must be 0 \(greedy\) or between"),
    "generate_seed_negative": (_GENERATE + ["--prompt", "a", "--seed", "-1"],
                               r"--seed -1 must be in 0\.\.4294967295"),
    "launch_time_newline": (
        ["-m", "boost_jax.launch", "slurm", "--config", "configs/demo.yaml", "--topology", "cpu",
         "--nodes", "2", "--time", "\n02:00:00"],
        r"--time '\\n02:00:00' is not a SLURM time limit"),
}


# python -m boost_jax.plan rows: id -> (argv, expected message regex after "error: ")
PLAN_ROWS = {
    "plan_zero_nodes_search": (["--nodes", "0", "--search"], r"--nodes 0 must be >= 1"),
    "plan_negative_nodes": (["--nodes", "-2"], r"--nodes -2 must be >= 1"),
    "plan_zero_cpu_devices": (["--nodes", "1", "--cpu-devices", "0"],
                              r"--cpu-devices 0 must be >= 1"),
}


def _snapshot(root):
    """Every file's hash, but the out_dir lock (an empty file a run creates to hold out_dir)."""
    from boost_jax.train.run_lock import LOCK_FILE

    out = {}
    for d, _, files in os.walk(root):
        for f in files:
            if f == LOCK_FILE and d == str(root):
                continue
            p = os.path.join(d, f)
            out[os.path.relpath(p, root)] = hashlib.sha256(open(p, "rb").read()).hexdigest()
    return out


def _save_a_checkpoint(out_dir):
    """A real checkpoint (step 3) of the TINY model, written the way the loop writes it."""
    from boost_jax.config import load_config
    from boost_jax.mesh import mesh_from_config
    from boost_jax.checkpoints.store import Checkpointer
    from boost_jax.checkpoints.run_config import model_signature
    from boost_jax.step.build import build_step

    cfg = load_config(None, TINY + [f"out_dir={out_dir}"])
    bundle = build_step(cfg, mesh_from_config(cfg))
    ckpt = Checkpointer(os.path.join(out_dir, "checkpoints"), cfg.checkpoint)
    ckpt.save(3, bundle.init_state(), {"next_index": 3}, {"model": model_signature(cfg)})
    ckpt.close()
    with open(os.path.join(out_dir, "metrics.jsonl"), "w") as f:
        f.write('{"step": 3, "loss": 5.0}\n')


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bad_input")
    (tmp / "empty.txt").write_text("")
    (tmp / "emptydir").mkdir()
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": ["one document only"]}), tmp / "one_doc.parquet")
    (tmp / "tokenizer.json").write_text('{"version": "1.0", "model": ')
    (tmp / "a_file").write_text("not a directory\n")
    (tmp / "broken.yaml").write_text("train:\n  steps: [1, 2\n")
    (tmp / "dup_key.yaml").write_text("train:\n  steps: 5\n  steps: 6\n")
    (tmp / "dup_block.yaml").write_text("train:\n  steps: 5\nmodel:\n  d_model: 32\ntrain:\n"
                                        "  log_every: 2\n")
    (tmp / "list.yaml").write_text("- train.steps=5\n- model.d_model=32\n")
    (tmp / "latin1.yaml").write_bytes(b"train:\n  steps: 5\n  # caf\xe9\n")
    (tmp / "list_key.yaml").write_text("train:\n  ? [steps]\n  : 5\n")
    (tmp / "surrogate.jsonl").write_text('{"text": "fine"}\n{"text": "a\\ud800b"}\n')
    (tmp / "blank.jsonl").write_text('\n{"text": ""}\n\n')
    shutil.copy(sys.executable, tmp / "program.txt")  # an executable renamed .txt
    saved = tmp / "saved"
    _save_a_checkpoint(str(saved))
    saved2 = tmp / "saved2"  # its own copy: two runs on one out_dir would meet its lock
    shutil.copytree(saved, saved2)
    before = _snapshot(saved), _snapshot(saved2)

    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    procs = {}
    for name, (extra, _) in ROWS.items():
        argv = [a.format(tmp=tmp, saved=saved, saved2=saved2) for a in extra]
        out_dir = [] if any(a.startswith("out_dir=") for a in argv) else [f"out_dir={tmp}/{name}"]
        procs[name] = subprocess.Popen(
            [sys.executable, os.path.join(ROOT, "train.py"), "--cpu-devices", "8", *TINY,
             *out_dir, *argv], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True)
    for name, (argv, _) in PLAN_ROWS.items():
        procs[name] = subprocess.Popen(
            [sys.executable, "-m", "boost_jax.plan", "--config", "configs/demo.yaml", *argv],
            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for name, (argv, _) in OTHER_ROWS.items():
        procs[name] = subprocess.Popen(
            [sys.executable, *(a.format(tmp=tmp) for a in argv)], cwd=ROOT, env=env,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    res = {}
    for name, p in procs.items():
        out, err = p.communicate(timeout=300)
        res[name] = (p.returncode, out, err)
    after = _snapshot(saved), _snapshot(saved2)
    res["_saved_changed"] = sorted(f"{('saved', 'saved2')[i]}/{k}" for i in (0, 1)
                                   for k in set(before[i]) | set(after[i])
                                   if before[i].get(k) != after[i].get(k))
    return res


@pytest.mark.parametrize("row", list(ROWS) + list(PLAN_ROWS) + list(OTHER_ROWS))
def test_bad_input_is_one_line_and_exit_2(results, row):
    code, stdout, stderr = results[row]
    lines = [ln for ln in stderr.splitlines() if ln.strip()]
    assert code == 2, stderr
    assert len(lines) == 1, stderr
    assert lines[0].startswith("error: ")
    expected = {**ROWS, **PLAN_ROWS, **OTHER_ROWS}[row][1]
    assert re.match(expected, lines[0][len("error: "):]), lines[0]


def _cli(*argv):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    return subprocess.run([sys.executable, *argv], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)


def test_overrides_anywhere_on_the_line():
    """train.py, the planner and the analyzer take key=value before, between and after options."""
    r = _cli("train.py", "--config", "configs/demo.yaml", "out_dir=runs/anywhere",
             "--cpu-devices", "8", "parallel.plan=zero3", "--print-config", "train.steps=7")
    assert r.returncode == 0, r.stderr
    assert "out_dir: runs/anywhere" in r.stdout and "plan: zero3" in r.stdout
    assert "steps: 7" in r.stdout
    r = _cli("-m", "boost_jax.plan", "--config", "configs/demo.yaml", "model.d_model=64",
             "--no-compile", "--nodes", "1", "model.n_layers=3", "--json")
    assert r.returncode == 0, r.stderr
    r = _cli("-m", "boost_jax.analysis.comm", "--config", "configs/demo.yaml", "model.d_model=64",
             "--cpu-devices", "8", "train.stesp=3")
    assert r.returncode == 2 and r.stderr.strip() == (
        "error: unknown config key 'train.stesp'; did you mean 'train.steps'?"), r.stderr


def test_nothing_saved_is_lost(results):
    """The two rows that point at a run with a checkpoint leave every file as it was."""
    assert not results["_saved_changed"], results["_saved_changed"]


def test_readme_error_rows_are_the_messages_these_rows_check():
    """The README's train.py table cannot drift from the messages these rows check."""
    regexes = [r for _, r in {**ROWS, **PLAN_ROWS, **OTHER_ROWS}.values()]
    assert check_readme_table("## When something is wrong", "boost_jax.launch slurm` writes",
                              regexes) >= 8


def test_a_data_error_leaves_a_new_or_empty_out_dir_as_it_was(tmp_path):
    """A data problem refused after the run took out_dir's lock: one line, exit 2, and no `.lock`
    left behind; the folders the run made (out_dir and its missing parents) are gone again, an
    empty folder the user made stays, empty."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "blank.jsonl").write_text('\n{"text": ""}\n\n')
    pq.write_table(pa.table({"text": ["one document only"]}), tmp_path / "one.parquet")
    (tmp_path / "mine").mkdir()
    data = {"new": "data.source={t}/blank.jsonl", "deep/er/run": "data.source={t}/blank.jsonl",
            "mine": "data.sources=[{{path: {t}/one.parquet, weight: 1}}]"}
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    procs = {name: subprocess.Popen(
        [sys.executable, os.path.join(ROOT, "train.py"), "--cpu-devices", "8", *TINY,
         f"out_dir={tmp_path / name}", source.format(t=tmp_path)], cwd=ROOT, env=env,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for name, source in data.items()}
    for name, p in procs.items():
        _, err = p.communicate(timeout=300)
        assert p.returncode == 2 and err.startswith("error: data.source") and \
            len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "new").exists() and not (tmp_path / "deep").exists()
    assert os.listdir(tmp_path / "mine") == []
