"""Using a trained run: generate, evaluate, export and model.init_from, as real commands.

One tiny lax run is trained under zero3 + btp on 8 simulated devices (its lax latent scales are
zero-padded in that layout), then sampled on 1 device, evaluated, exported and imported."""

import json
import os
import re
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest

from train_proc import ROOT, train_env

TINY = ["model.arch=lax", "model.d_model=32", "model.n_layers=2", "model.n_heads=2",
        "model.d_ff=68", "model.rank=6", "model.max_seq_len=32", "data.seq_len=32",
        "data.max_bytes=300000", "train.global_batch=8", "train.eval_batches=2",
        "train.steps=4", "train.eval_every=4", "logging.progress=false",
        "logging.tensorboard=false", "logging.plot=false"]
SHARDED = ["parallel.plan=zero3", "parallel.tp_mode=btp", "parallel.tp_axes=[pair]"]


@pytest.fixture(scope="module")
def env(jax_cache):
    return train_env(jax_cache)


def _train(env, out_dir, *extra):
    return subprocess.Popen([sys.executable, "train.py", "--cpu-devices", "8", *TINY,
                             f"out_dir={out_dir}", *extra], cwd=ROOT, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _tool(env, module, *args, devices=1):
    e = dict(env, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")
    return subprocess.Popen([sys.executable, "-m", module, *args], cwd=ROOT, env=e, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _done(p):
    out, err = p.communicate(timeout=300)
    return p.returncode, out, err


def _rows(out_dir):
    return [json.loads(ln) for ln in open(os.path.join(out_dir, "metrics.jsonl"))]


@pytest.fixture(scope="module")
def trained(tmp_path_factory, env):
    out = str(tmp_path_factory.mktemp("use") / "run")
    rc, _, err = _done(_train(env, out, *SHARDED))
    assert rc == 0, err
    return out


@pytest.fixture(scope="module")
def exported(trained, env):
    out = os.path.join(os.path.dirname(trained), "export")
    rc, stdout, err = _done(_tool(env, "boost_jax.export", "--run", trained, "--out", out))
    assert rc == 0, err
    assert "config.json" in stdout and "model.safetensors" in stdout
    return out


def test_generate_on_one_device(trained, env):
    rc, out, err = _done(_tool(env, "boost_jax.generate", "--run", trained, "--prompt", "def ",
                               "--temperature", "0", "--max-new-tokens", "8"))
    assert rc == 0, err
    assert out.startswith("def ") and len(out) > len("def \n")
    assert re.search(r"on cpu: prefill 5 tokens in [\d.]+ ms, decoded 8 tokens at [\d.]+ "
                     r"tokens/s", err), err


def test_logical_params_equal_the_saved_state(trained):
    """open_run's one-device restore == the state restored in the layout that saved it,
    unpadded (bitwise), and that layout really pads something."""
    from boost_jax.infer.load import open_run
    from boost_jax.mesh import mesh_from_config
    from boost_jax.sharding.layout import is_layout
    from boost_jax.checkpoints.store import Checkpointer
    from boost_jax.step.build import build_step

    run = open_run(trained)
    bundle = build_step(run.cfg, mesh_from_config(run.cfg))
    assert any(lay.pad for lay in jax.tree.leaves(bundle.placement.layouts, is_leaf=is_layout))
    ckpt = Checkpointer(os.path.join(trained, "checkpoints"), run.cfg.checkpoint)
    state, _, _ = ckpt.restore(run.step, bundle.abstract_state)
    ckpt.close()
    want = jax.tree.map(np.asarray, bundle.logical_params(state))
    got = jax.tree.map(np.asarray, run.params)
    assert jax.tree.structure(want) == jax.tree.structure(got)
    for w, g in zip(jax.tree.leaves(want), jax.tree.leaves(got)):
        assert w.shape == g.shape and np.array_equal(w, g)


def test_evaluate_val_reproduces_logged_val_loss(trained, env):
    rc, out, err = _done(_tool(env, "boost_jax.evaluate", "--run", trained, "--json"))
    assert rc == 0, err
    got = json.loads(out)
    logged = [r for r in _rows(trained) if "val_loss" in r][-1]
    assert logged["step"] == got["step"] == 4
    assert got["loss"] == pytest.approx(logged["val_loss"], rel=1e-5)
    assert got["perplexity"] == pytest.approx(np.exp(got["loss"]))
    # byte tokens: bits/byte = loss / ln 2 over the non-EOS share of the targets
    assert got["bits_per_byte"] >= got["loss"] / np.log(2)


def test_evaluate_scores_every_token_of_short_and_ragged_files(trained, env, tmp_path):
    """seq_len 32: a 20-byte file is one short window; 73 bytes are two whole windows of 33
    and a tail of 9; every byte but the first is a target, scored once."""
    for n in (20, 73):
        path = tmp_path / f"t{n}.txt"
        path.write_text(("abcdefghij" * 10)[:n])
        rc, out, err = _done(_tool(env, "boost_jax.evaluate", "--run", trained, "--data",
                                   str(path), "--json"))
        assert rc == 0, err
        got = json.loads(out)
        assert got["tokens"] == n - 1
        assert got["windows"] == (1 if n < 33 else 3) and np.isfinite(got["loss"])


def test_export_imports_bitwise_and_starts_a_run(trained, exported, env):
    from boost_jax import hf
    from boost_jax.infer.load import open_run

    run = open_run(trained)
    back = hf.load_init(exported, run.cfg.model, run.cfg.train.scan_layers)
    for a, b in zip(jax.tree.leaves(jax.tree.map(np.asarray, run.params)), jax.tree.leaves(back)):
        assert a.dtype == b.dtype and np.array_equal(a, b)
    conf = json.load(open(os.path.join(exported, "config.json")))
    assert conf["model_type"] == "boost_jax_lax" and conf["boost_jax"]["step"] == 4
    assert conf["auto_map"]["AutoModelForCausalLM"] == "modeling_boost_jax.BoostJaxLaxForCausalLM"
    assert {"modeling_boost_jax.py", "configuration_boost_jax.py"} <= set(os.listdir(exported))
    # a new run (another plan, 1 step) starts from the export: its step-0 val_loss is the
    # source run's final one
    new = os.path.join(os.path.dirname(trained), "from_export")
    start = os.path.join(os.path.dirname(trained), "export_copy")
    shutil.copytree(exported, start)
    rc, _, err = _done(_train(env, new, f"model.init_from={start}", "train.steps=1"))
    assert rc == 0, err
    assert _rows(new)[0]["val_loss"] == pytest.approx(_rows(trained)[-1]["val_loss"], rel=1e-5)
    # the folder a run started from is read only at its start: the run outlives it
    shutil.rmtree(start)
    rc, out, err = _done(_tool(env, "boost_jax.evaluate", "--run", new))
    assert rc == 0 and "loss" in out, err


def test_errors(trained, exported, env, tmp_path):
    """Each mistake: one line `error: ...` on stderr, exit 2, run in parallel."""
    (tmp_path / "empty_run").mkdir()
    (tmp_path / "taken").mkdir()
    (tmp_path / "words.txt").write_text("alpha beta gamma\n" * 400)
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"alpha": 1, "beta": 2, "gamma": 3, "<unk>": 0},
                                     unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tok.json"))
    for out, tok_name in (("words.bin", "byte"), ("words_w.bin", str(tmp_path / "tok.json"))):
        subprocess.run([sys.executable, "-m", "boost_jax.data.prepare",
                        str(tmp_path / "words.txt"), str(tmp_path / out), "--tokenizer",
                        tok_name, "--workers", "1"], cwd=ROOT, env=env, check=True,
                       capture_output=True)
    long_prompt = "x" * 40
    from boost_jax.checkpoints.seal import SEAL_FILE

    shutil.copytree(trained, tmp_path / "no_meta")
    shutil.copytree(trained, tmp_path / "meta_changed")
    meta_dir = tmp_path / "meta_changed" / "checkpoints" / "4" / "meta"
    meta_file = next(p for p in meta_dir.iterdir() if p.is_file())
    meta_file.write_bytes(b"X" + meta_file.read_bytes()[1:])
    shutil.copytree(trained, tmp_path / "empty_step")
    (tmp_path / "empty_step" / "checkpoints" / "9").mkdir()  # a save that never began
    newest = _tool(env, "boost_jax.generate", "--run", str(tmp_path / "empty_step"), "--prompt",
                   "a", "--max-new-tokens", "1")
    shutil.rmtree(tmp_path / "no_meta" / "checkpoints" / "4" / "meta")
    os.remove(tmp_path / "no_meta" / "checkpoints" / "4" / SEAL_FILE)
    rows = {
        "no_run": (_tool(env, "boost_jax.generate", "--run", str(tmp_path / "nope"),
                         "--prompt", "a"), r"no run at '.*/nope' \(no such directory\)"),
        "no_checkpoint": (_tool(env, "boost_jax.evaluate", "--run", str(tmp_path / "empty_run")),
                          r"run '.*/empty_run' has no checkpoint \(nothing in .*\); train it "
                          r"first"),
        "missing_step": (_tool(env, "boost_jax.export", "--run", trained, "--out",
                               str(tmp_path / "x"), "--step", "99"),
                         r"has no checkpoint step 99 \(it has steps \[4\]\)"),
        "prompt_too_long": (_tool(env, "boost_jax.generate", "--run", trained, "--prompt",
                                  long_prompt),
                            r"the prompt is 40 tokens but the model of .* reads at most "
                            r"model\.max_seq_len=32"),
        "export_under_a_file": (_tool(env, "boost_jax.export", "--run", trained, "--out",
                                      str(tmp_path / "words.txt" / "sub")),
                                r"cannot write --out '.*/words\.txt/sub': a folder above it "
                                r"is a file"),
        "export_exists": (_tool(env, "boost_jax.export", "--run", trained, "--out",
                                str(tmp_path / "taken")),
                          r"--out '.*/taken' already exists; pass --force to replace it"),
        "prepare_exists": (_tool(env, "boost_jax.data.prepare", str(tmp_path / "words.txt"),
                                 str(tmp_path / "words.bin"), "--tokenizer", "byte"),
                           r"'.*/words\.bin' and '.*/words\.json' already exist; pass "
                           r"--force"),
        "step_without_meta": (_tool(env, "boost_jax.export", "--run", str(tmp_path / "no_meta"),
                                    "--out", str(tmp_path / "y")),
                              r"checkpoint step 4 in .* lacks its meta item \(the config and "
                              r"checksums it was saved with\), so it is incomplete"),
        "evaluate_other_tokenizer": (
            _tool(env, "boost_jax.evaluate", "--run", trained, "--data",
                  str(tmp_path / "words_w.bin")),
            r"--data '.*/words_w\.bin' was tokenized with '.*tok\.json', another tokenizer "
            r"than this run's 'byte'; prepare it with --tokenizer byte"),
        "meta_changed": (_tool(env, "boost_jax.evaluate", "--run",
                               str(tmp_path / "meta_changed")),
                         r"checkpoint step 4 in .* is corrupted \(file meta/.* does not match"),
        "init_from_missing": (
            _train(env, str(tmp_path / "r0"), f"model.init_from={tmp_path / 'nowhere'}"),
            r"model\.init_from '.*/nowhere' does not exist; point it at a folder written by"),
        "init_from_other_shape": (
            _train(env, str(tmp_path / "r1"), f"model.init_from={exported}", "model.d_model=64"),
            r"model\.init_from '.*' holds another model \(model\.d_model 64 vs 32\); set "
            r"model\.d_model=32"),
        "init_from_other_tokenizer": (
            _train(env, str(tmp_path / "r2"), f"model.init_from={exported}",
                   f"data.tokenizer={tmp_path / 'tok.json'}", "model.vocab_size=256"),
            r"model\.init_from '.*' was trained with another tokenizer than data\.tokenizer="
            r".*; set data\.tokenizer=byte"),
        "bin_other_tokenizer": (
            _train(env, str(tmp_path / "r3"), f"data.source={tmp_path / 'words.bin'}",
                   f"data.tokenizer={tmp_path / 'tok.json'}", "model.vocab_size=256"),
            r"data\.source '.*/words\.bin' was tokenized with 'byte', another tokenizer than "
            r"this run's .*; set data\.tokenizer=byte"),
    }
    failed = []
    for name, (proc, pattern) in rows.items():
        rc, _, err = _done(proc)
        lines = [ln for ln in err.splitlines() if ln.strip()]
        if not (rc == 2 and len(lines) == 1 and lines[0].startswith("error: ")
                and re.search(pattern, lines[0])):
            failed.append(f"{name}: rc={rc} stderr={err[-600:]!r}")
    assert not failed, "\n".join(failed)
    rc, _, err = _done(newest)  # the newest step that holds files
    assert rc == 0 and "step 4 " in err and "decoded 1 token (from the prefill)" in err, err
    assert not os.listdir(tmp_path / "taken")  # nothing written into an existing --out
    # a refused run leaves no out_dir behind (its lock and empty checkpoints/ included)
    assert not [r for r in ("r0", "r1", "r2", "r3", "y") if os.path.exists(tmp_path / r)]
