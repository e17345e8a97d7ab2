"""Every user mistake in README.md ("When something is wrong"): train.py prints one line
`error: ...` on stderr, exits 2,
and leaves what was already saved in out_dir untouched.

All rows run as train.py subprocesses, started together (they are independent) so the module
costs about as much as its slowest rows.
"""

import hashlib
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["model.d_model=32", "model.n_layers=2", "model.n_heads=2", "model.d_ff=64",
        "model.rank=8", "model.max_seq_len=32", "data.seq_len=32", "data.max_bytes=300000",
        "train.global_batch=8", "train.eval_batches=2", "train.steps=4",
        "logging.progress=false", "logging.tensorboard=false", "logging.plot=false"]


def _has_validate_tp():
    try:
        from boost_jax.sharding.tensor_parallel import validate_tp  # noqa: F401
    except ImportError:
        return False
    return True


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
    "tp_not_dividing_heads": (
        ["parallel.tp_mode=btp", "parallel.tp_axes=[pair]", "model.n_heads=3",
         "model.d_model=48"],
        r"model\.n_heads=3 is not divisible by the tensor-parallel degree 2 "
        r"\(parallel\.tp_axes=\['pair'\], tp_mode=btp\)"),
    "mesh_larger_than_devices": (
        ["mesh.shape=[2,2,4]"],
        r"mesh \(pair=2, node=2, global=4\) needs 16 devices but only 8 are present; use "
        r"--cpu-devices 16"),
    "missing_data_path": (["data.source={tmp}/no/such/corpus.txt"],
                          r"data\.source '.*/no/such/corpus\.txt' does not exist"),
    "empty_data_file": (["data.source={tmp}/empty.txt"],
                        r"data\.source '.*/empty\.txt' holds no text"),
    "empty_data_folder": (["data.source={tmp}/emptydir"],
                          r"data\.source '.*/emptydir' contains no \.txt/\.py/\.md/\.jsonl files"),
    "unreadable_tokenizer": (["data.tokenizer={tmp}/tokenizer.json"],
                             r"tokenizer file '.*/tokenizer\.json' is not a valid tokenizer\.json"),
    "missing_tokenizer": (["data.tokenizer={tmp}/none.json"],
                          r"tokenizer file '.*/none\.json' does not exist"),
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
    "fresh_start_over_checkpoints": (
        ["out_dir={saved}", "checkpoint.resume=false"],
        r".*/saved/checkpoints already holds checkpoints \(steps \[3\]\) and "
        r"checkpoint\.resume=false would overwrite them"),
}


def _snapshot(root):
    out = {}
    for d, _, files in os.walk(root):
        for f in files:
            p = os.path.join(d, f)
            out[os.path.relpath(p, root)] = hashlib.sha256(open(p, "rb").read()).hexdigest()
    return out


def _save_a_checkpoint(out_dir):
    """A real checkpoint (step 3) of the TINY model, written the way the loop writes it."""
    from boost_jax.config import load_config
    from boost_jax.mesh import mesh_from_config
    from boost_jax.train.checkpoint import Checkpointer
    from boost_jax.train.run_config import model_signature
    from boost_jax.train.step import build_step

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
    (tmp / "tokenizer.json").write_text('{"version": "1.0", "model": ')
    (tmp / "a_file").write_text("not a directory\n")
    (tmp / "broken.yaml").write_text("train:\n  steps: [1, 2\n")
    saved = tmp / "saved"
    _save_a_checkpoint(str(saved))
    before = _snapshot(saved)

    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    procs = {}
    for name, (extra, _) in ROWS.items():
        if name == "tp_not_dividing_heads" and not _has_validate_tp():
            continue
        argv = [a.format(tmp=tmp, saved=saved) for a in extra]
        out_dir = [] if any(a.startswith("out_dir=") for a in argv) else [f"out_dir={tmp}/{name}"]
        procs[name] = subprocess.Popen(
            [sys.executable, os.path.join(ROOT, "train.py"), "--cpu-devices", "8", *TINY,
             *out_dir, *argv], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True)
    res = {}
    for name, p in procs.items():
        out, err = p.communicate(timeout=300)
        res[name] = (p.returncode, out, err)
    res["_saved_unchanged"] = before == _snapshot(saved)
    return res


@pytest.mark.parametrize("row", list(ROWS))
def test_bad_input_is_one_line_and_exit_2(results, row):
    if row not in results:
        pytest.skip("boost_jax.sharding.tensor_parallel.validate_tp is not there yet")
    code, stdout, stderr = results[row]
    lines = [ln for ln in stderr.splitlines() if ln.strip()]
    assert code == 2, stderr
    assert len(lines) == 1, stderr
    assert lines[0].startswith("error: ")
    assert re.match(ROWS[row][1], lines[0][len("error: "):]), lines[0]


def test_nothing_saved_is_lost(results):
    """The two rows that point at a run with a checkpoint leave every file as it was."""
    assert results["_saved_unchanged"]
