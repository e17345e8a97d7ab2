"""Hugging Face interop (boost_jax/hf.py, hf_gpt.py): logits equal transformers' within 1e-4 in
fp32 (LlamaForCausalLM, GPTNeoXForCausalLM and GPT2LMHeadModel for arch=full and svd, the
export's own remote code for cola and lax of every family), greedy continuations equal
generate()'s, and export → import is bitwise for every arch and family.

tests/fixtures/hf/<name> for every NAMES entry were written by scripts/hf_fixture.py (models
exported by hf.write and the logits transformers computes for them; for cola and lax the sha256
of the remote code it ran, checked against boost_jax/hf_remote/); where torch and transformers
are installed the comparison also runs against transformers itself on freshly exported
models."""

import importlib.util
import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file

from boost_jax import hf
from boost_jax.backends.cpu import fast_compile_options
from boost_jax.config import ModelConfig
from boost_jax.errors import UserError
from boost_jax.layers import forward
from boost_jax.layers.model import build_model
from train_proc import ROOT

FIXTURES = os.path.join(ROOT, "tests", "fixtures", "hf")
# every arch x family: <arch> (llama), <family> (full), <arch>_<family>
NAMES = ["full", "svd", "cola", "lax", "gpt_neox", "gpt2"] + [
    f"{arch}_{fam}" for fam in ("gpt_neox", "gpt2") for arch in ("svd", "cola", "lax")]


def _hf_fixture():
    """scripts/hf_fixture.py, which wrote tests/fixtures/hf (imported without torch)."""
    import sys

    if os.path.join(ROOT, "scripts") not in sys.path:
        sys.path.insert(0, os.path.join(ROOT, "scripts"))
    import hf_fixture

    return hf_fixture


def _logits(cfg, params, tokens):
    fn = jax.jit(lambda p, t: forward.logits(forward.Local(cfg), cfg, p, t),
                 compiler_options=fast_compile_options())
    return np.asarray(fn(params, jnp.asarray(tokens, jnp.int32)))


@pytest.mark.parametrize("name", NAMES)
def test_logits_equal_transformers_fixture(name):
    d = os.path.join(FIXTURES, name)
    cfg = hf.saved_model(hf.read_config(d))
    assert name in (cfg.arch, cfg.family, f"{cfg.arch}_{cfg.family}")
    params = hf.load_init(d, cfg, stacked=True)
    want = np.load(os.path.join(d, "logits.npy"))
    assert want.std() > 0.5  # logits of order 1: the tolerance below is tight
    got = _logits(cfg, params, np.load(os.path.join(d, "tokens.npy")))
    assert np.abs(got - want).max() < 1e-4
    # and what we would export from these params is the fixture, bit for bit
    main, factors = hf.to_tensors(cfg, params)
    for fname, tensors in ((hf.MODEL_FILE, main), (hf.FACTORS_FILE, factors)):
        if tensors:
            disk = load_file(os.path.join(d, fname))
            assert sorted(disk) == sorted(tensors)
            assert all(np.array_equal(disk[k], tensors[k]) for k in disk)
    if cfg.arch in ("cola", "lax"):  # the modeling code transformers ran is what export writes
        conf = hf.read_config(d)
        assert conf["auto_map"] == hf.remote_code_map(cfg.arch, cfg.family)
        assert conf["architectures"] == [conf["auto_map"]["AutoModelForCausalLM"].split(".")[1]]
        assert not set(hf.REMOTE_CODE) & set(os.listdir(d))  # its digest, not a copy
        fixture = _hf_fixture()
        here = os.path.join(os.path.dirname(hf.__file__), "hf_remote")
        assert fixture.read_digests(d) == fixture.remote_code_digests(here), (
            f"boost_jax/hf_remote/ is not the code {name}'s logits were made with: run "
            f"scripts/hf_fixture.py {name} (its docstring says where)")


@pytest.mark.parametrize("name", NAMES)
def test_greedy_continuation_equals_transformers_generate(name):
    """Our KV-cache decoder continues the prompt as transformers' generate() did (greedy,
    its own KV cache; for lax the latents cross blocks inside each cached step)."""
    from boost_jax.infer.decode import Decoder, Sampling

    d = os.path.join(FIXTURES, name)
    cfg = hf.saved_model(hf.read_config(d))
    want = np.load(os.path.join(d, "greedy.npy"))[0]
    prompt = np.load(os.path.join(d, "tokens.npy"))[0, :6].astype(np.int32)
    assert np.array_equal(want[:6], prompt)
    dec = Decoder(cfg, hf.load_init(d, cfg, stacked=True), cfg.max_seq_len,
                  Sampling(temperature=0.0), compiler_options=fast_compile_options())
    ids = dec.generate(prompt, len(want) - 6)[0]
    assert ids.tolist() == want[6:].tolist()


def test_plain_llama_checkpoint_imports_as_full(tmp_path):
    """A LlamaForCausalLM directory without our config section starts an arch=full model."""
    src = os.path.join(FIXTURES, "full")
    d = tmp_path / "llama"
    shutil.copytree(src, d)
    conf = json.load(open(d / "config.json"))
    conf.pop("boost_jax")
    json.dump(conf, open(d / "config.json", "w"))
    cfg = hf.saved_model(conf)
    assert (cfg.arch, cfg.n_kv_heads, cfg.rope_theta) == ("full", 2, 500.0)
    got = _logits(cfg, hf.load_init(str(d), cfg, stacked=False), np.load(d / "tokens.npy"))
    assert np.abs(got - np.load(d / "logits.npy")).max() < 1e-4
    with pytest.raises(UserError, match=r"holds another model \(model\.d_model 64 vs 32"):
        hf.load_init(str(d), ModelConfig(**{**vars(cfg), "d_model": 64}), stacked=True)


@pytest.mark.parametrize("name,family", [("gpt_neox", "gpt_neox"), ("gpt2", "gpt2")])
def test_plain_gpt_checkpoint_imports_as_full(name, family, tmp_path):
    """A transformers GPT-NeoX / GPT-2 folder without our section starts an arch=full model of
    that family (NeoX's head under transformers 5's name lm_head.weight too)."""
    from safetensors.numpy import save_file

    d = tmp_path / name
    shutil.copytree(os.path.join(FIXTURES, name), d)
    conf = json.load(open(d / "config.json"))
    ours = hf.saved_model(conf)
    conf.pop("boost_jax")
    json.dump(conf, open(d / "config.json", "w"))
    if family == "gpt_neox":
        tensors = load_file(d / hf.MODEL_FILE)
        tensors["lm_head.weight"] = tensors.pop("embed_out.weight")
        save_file(tensors, d / hf.MODEL_FILE)
    cfg = hf.saved_model(conf)
    assert cfg == ModelConfig(**{**vars(ours), "init_std": 0.02, "init_from": None})
    got = _logits(cfg, hf.load_init(str(d), cfg, stacked=False), np.load(d / "tokens.npy"))
    assert np.abs(got - np.load(d / "logits.npy")).max() < 1e-4


def _random_biases(params):
    """GPT families: biases and LayerNorm params start at 0/1; randomise them."""
    rng = np.random.default_rng(0)
    return jax.tree_util.tree_map_with_path(
        lambda p, x: (x + rng.standard_normal(x.shape)).astype(x.dtype)
        if str(p[-1].key) == "bias" else x, params)


@pytest.mark.parametrize("kw", [
    dict(arch="full"), dict(arch="svd", tie_embeddings=True), dict(arch="cola"),
    dict(arch="lax", lax_gate="gate", param_dtype="bfloat16"), dict(arch="lax", scan=False),
    dict(arch="full", family="gpt_neox", rotary_pct=0.25), dict(arch="svd", family="gpt2"),
    dict(arch="lax", family="gpt_neox", lax_gate="gate", scan=False),
    dict(arch="full", family="gpt2", tie_embeddings=True, param_dtype="bfloat16")])
def test_export_import_bitwise(kw, tmp_path):
    scan = kw.pop("scan", True)
    cfg = ModelConfig(vocab_size=256, d_model=32, n_layers=2, n_heads=4, d_ff=64, rank=8,
                      max_seq_len=32, **kw)
    params = jax.tree.map(np.asarray, build_model(cfg, seed=3, scan_layers=scan).params())
    params = _random_biases(params)
    files = hf.write(str(tmp_path), cfg, params, {"tokenizer": "byte"})
    assert (hf.FACTORS_FILE in files) == (cfg.arch == "svd")
    conf = hf.read_config(str(tmp_path))
    hf_type = "llama" if cfg.family == "llama" else cfg.family
    assert conf["model_type"] == (hf_type if cfg.arch in ("full", "svd") else f"boost_jax_{cfg.arch}")
    back = hf.load_init(str(tmp_path), hf.saved_model(conf), stacked=scan)
    assert jax.tree.structure(back) == jax.tree.structure(params)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(back)):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert np.array_equal(a.view(np.uint8), b.view(np.uint8))


@pytest.mark.skipif(not (importlib.util.find_spec("torch") and
                         importlib.util.find_spec("transformers")),
                    reason="torch/transformers not installed; the fixture test covers this")
@pytest.mark.parametrize("name", NAMES)
def test_logits_equal_transformers_live(name, tmp_path):
    fixture = _hf_fixture()
    fixture.export_model(name, str(tmp_path), seed=7)
    cfg = ModelConfig(**fixture.MODELS[name])
    got = _logits(cfg, hf.load_init(str(tmp_path), cfg, stacked=True), fixture.TOKENS)
    assert np.abs(got - fixture.transformers_logits(str(tmp_path), fixture.TOKENS)).max() < 1e-4


def test_gqa_gpt_export_is_refused(tmp_path):
    """transformers' GPT-NeoX and GPT-2 have one kv head per query head."""
    cfg = ModelConfig(arch="full", family="gpt_neox", vocab_size=64, d_model=32, n_layers=1,
                      n_heads=4, n_kv_heads=2, d_ff=64, max_seq_len=16)
    params = jax.tree.map(np.asarray, build_model(cfg).params())
    with pytest.raises(UserError, match="no grouped-query attention"):
        hf.write(str(tmp_path), cfg, params, {})


def test_a_garbage_config_json_is_one_line(tmp_path):
    """init_from / generate read config.json: unreadable, not an object, a non-object
    boost_jax section, a Llama config without its sizes: a UserError naming the problem."""
    from boost_jax import hf
    from boost_jax.errors import UserError

    for text, match in (("garbage", "cannot be read"), ("[]", "is not a model config"),
                        ('{"boost_jax": 5}', "is not a model config"),
                        ('{"boost_jax": {"model": 3}}', "is not a model config"),
                        ('{"boost_jax": {"files_crc32": 5}}', "is not a model config"),
                        ('{"boost_jax": {"files_crc32": {"a": "x"}}}', "is not a model config")):
        (tmp_path / "config.json").write_text(text)
        with pytest.raises(UserError, match=match):
            hf.read_config(str(tmp_path))
    with pytest.raises(UserError, match="lacks a positive integer 'hidden_size'"):
        hf.saved_model({"model_type": "llama"})


@pytest.mark.skipif(not (importlib.util.find_spec("torch") and
                         importlib.util.find_spec("transformers")),
                    reason="torch/transformers not installed (the README's example needs them)")
def test_readme_transformers_example(tmp_path, monkeypatch, capsys):
    """README "Use your model in transformers", run as written on a byte-level CoLA export in
    hf/demo: it prints boost_jax's greedy continuation of the prompt after a document start."""
    import re

    from boost_jax.infer.decode import Decoder, Sampling

    cfg = ModelConfig(arch="cola", vocab_size=256, d_model=32, n_layers=2, n_heads=4, d_ff=64,
                      rank=8, max_seq_len=64, init_std=0.2)
    params = jax.tree.map(np.asarray, build_model(cfg, seed=3).params())
    os.makedirs(tmp_path / "hf" / "demo")
    hf.write(str(tmp_path / "hf" / "demo"), cfg, params,
             {"tokenizer": "byte", "tokenizer_fingerprint": "byte"}, {"eos_token_id": 0})
    readme = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    example = re.findall(r"^```python\n(.*?)^```", readme, flags=re.S | re.M)
    assert len(example) == 1
    monkeypatch.chdir(tmp_path)
    exec(compile(example[0], "README.md", "exec"), {})
    printed = capsys.readouterr().out
    dec = Decoder(cfg, params, cfg.max_seq_len, Sampling(temperature=0.0),
                  compiler_options=fast_compile_options())
    ids = dec.generate(np.array([0, *b"def "], np.int32), 40, eos_id=0)[0]
    want = bytes(int(i) for i in ids).split(b"\0")[0].decode(errors="replace")
    assert printed == want + "\n" and len(want) > 5


@pytest.mark.parametrize("name", ["cola_gpt_neox", "lax_gpt2", "cola"])
def test_low_rank_export_of_every_family_carries_its_remote_code(name, tmp_path):
    """What `python -m boost_jax.export` writes (hf.write) for cola / lax: the modeling code
    and the auto_map naming the family's class, so trust_remote_code loads it."""
    d = os.path.join(FIXTURES, name)
    cfg = hf.saved_model(hf.read_config(d))
    files = hf.write(str(tmp_path), cfg, hf.load_init(d, cfg, stacked=True), {})
    assert set(hf.REMOTE_CODE) <= set(files) == set(os.listdir(tmp_path))
    conf = json.load(open(tmp_path / "config.json"))
    assert conf["auto_map"] == hf.remote_code_map(cfg.arch, cfg.family)
    cls = conf["auto_map"]["AutoModelForCausalLM"].split(".")[1]
    assert conf["architectures"] == [cls]
    for key, module in (("AutoModelForCausalLM", "modeling_boost_jax.py"),
                        ("AutoConfig", "configuration_boost_jax.py")):
        # the names auto_map gives are defined at the top of the files copied (no torch here)
        name = conf["auto_map"][key].split(".")[1]
        assert name in _module_names(tmp_path / module), (key, name)


def _module_names(path) -> set:
    """Names a module binds at its top level (classes, functions, assignments)."""
    import ast

    out = set()
    for node in ast.parse(open(path).read()).body:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef)):
            out.add(node.name)
        elif isinstance(node, ast.Assign):
            out |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    return out


@pytest.mark.skipif(not (importlib.util.find_spec("torch") and
                         importlib.util.find_spec("transformers")),
                    reason="torch/transformers not installed (make hf-live-test runs it)")
@pytest.mark.parametrize("name", ["cola_gpt2", "lax_gpt2", "lax"])
def test_left_padded_batch_generates_like_one_prompt_live(name, tmp_path):
    """generate() on a left-padded batch continues each prompt as it does alone: it takes
    position ids from the attention mask only when the remote model's forward names
    position_ids (GPT-2's learned positions shift otherwise)."""
    import torch

    fixture = _hf_fixture()
    fixture.export_model(name, str(tmp_path), seed=7)
    model = fixture.transformers_model(str(tmp_path))
    long, short = [0] + list(b"def f(x):"), [0] + list(b"ab")
    pad = len(long) - len(short)
    ids = torch.tensor([long, [1] * pad + short])
    mask = torch.tensor([[1] * len(long), [0] * pad + [1] * len(short)])
    kw = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False, eos_token_id=None,
              pad_token_id=1, output_scores=True, return_dict_in_generate=True)
    with torch.no_grad():
        both = model.generate(ids, attention_mask=mask, **kw)
        one = model.generate(torch.tensor([short]), attention_mask=torch.ones(1, len(short),
                                                                              dtype=torch.long),
                             **kw)
    assert both.sequences[1, len(long):].tolist() == one.sequences[0, len(short):].tolist()
    gap = max(float((a[1] - b[0]).abs().max()) for a, b in zip(both.scores, one.scores))
    assert gap < 1e-4, gap


@pytest.mark.skipif(not (importlib.util.find_spec("torch") and
                         importlib.util.find_spec("transformers")),
                    reason="torch/transformers not installed (make hf-live-test runs it)")
def test_padded_embedding_rows_are_never_generated_live(tmp_path):
    """model.vocab_size above the tokenizer's 256 ids: export's generation_config.json keeps
    transformers' generate() off the padding rows, here made the likeliest ids."""
    import torch

    from boost_jax.export import GENERATION_FILE, generation_config

    cfg = ModelConfig(arch="full", vocab_size=320, d_model=32, n_layers=2, n_heads=4, d_ff=64,
                      max_seq_len=32)
    params = jax.tree.map(np.array, build_model(cfg, seed=1).params())
    params["lm_head"]["w"][:, 256:] += 5.0  # the padding rows win every argmax
    hf.write(str(tmp_path), cfg, params, {"tokenizer": "byte"})
    assert generation_config(320, 320, 0) is None
    with open(tmp_path / GENERATION_FILE, "w") as f:
        json.dump(generation_config(256, cfg.vocab_size, 0), f)
    model = _hf_fixture().transformers_model(str(tmp_path))
    ids = torch.tensor([[0, *b"def "]])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8,
                             do_sample=False)
    new = out[0, ids.shape[1]:].tolist()
    assert new and max(new) < 256, new


def _plain(name, tmp_path, **changes):
    """The fixture `name` as a folder transformers wrote (no boost_jax section), config.json
    updated by `changes` (None: drop the key); its path and config."""
    d = tmp_path / name
    shutil.copytree(os.path.join(FIXTURES, name), d)
    conf = json.load(open(d / "config.json"))
    conf.pop("boost_jax")
    for k, v in changes.items():
        if v is None:
            conf.pop(k, None)
        else:
            conf[k] = v
    json.dump(conf, open(d / "config.json", "w"))
    return str(d), conf


@pytest.mark.parametrize("name,changes,match", [
    ("full", dict(rope_parameters={"rope_type": "llama3", "factor": 8.0}),
     "rope_type='llama3' cannot start a run"),
    ("full", dict(rope_scaling={"type": "linear", "factor": 2.0}),
     "rope_type='linear' cannot start a run"),
    ("full", dict(hidden_act="gelu"), "hidden_act='gelu' cannot start a run"),
    ("full", dict(attention_bias=True), "attention_bias=True cannot start a run"),
    ("full", dict(mlp_bias=True), "mlp_bias=True cannot start a run"),
    ("gpt2", dict(scale_attn_by_inverse_layer_idx=True),
     "scale_attn_by_inverse_layer_idx=True cannot start a run"),
    ("gpt2", dict(scale_attn_weights=False), "scale_attn_weights=False cannot start a run"),
    ("gpt_neox", dict(rope_parameters={"rope_type": "linear", "factor": 2.0}),
     "rope_type='linear' cannot start a run")])
def test_a_plain_model_we_would_compute_otherwise_is_refused(name, changes, match, tmp_path):
    """A transformers config.json whose model differs from ours in something the tensors do not
    show (scaled RoPE, activation, attention scaling, biases): refused, never built as ours."""
    _, conf = _plain(name, tmp_path, **changes)
    with pytest.raises(UserError, match=match):
        hf.saved_model(conf)


def test_transformers_5_rope_parameters_and_unread_tensors(tmp_path):
    """rope_theta given only in transformers 5's rope_parameters is read; a tensor the model
    would not read (a bias the config does not declare) is refused; so is a start whose
    numerics differ from the saved model's (rope_theta, norm_eps)."""
    from safetensors.numpy import save_file

    d, conf = _plain("full", tmp_path, rope_theta=None,
                     rope_parameters={"rope_type": "default", "rope_theta": 500.0})
    cfg = hf.saved_model(conf)
    assert cfg.rope_theta == 500.0
    got = _logits(cfg, hf.load_init(d, cfg, stacked=True), np.load(f"{d}/tokens.npy"))
    assert np.abs(got - np.load(f"{d}/logits.npy")).max() < 1e-4
    for key, value in (("rope_theta", 10000.0), ("norm_eps", 1e-5)):
        other = ModelConfig(**{**vars(cfg), key: value})
        with pytest.raises(UserError, match=rf"holds another model \(model\.{key} "):
            hf.load_init(d, other, stacked=True)
    tensors = load_file(f"{d}/{hf.MODEL_FILE}")
    tensors["model.layers.0.self_attn.q_proj.bias"] = np.zeros(32, np.float32)
    tensors["model.layers.1.self_attn.rotary_emb.inv_freq"] = np.ones(4, np.float32)  # a buffer
    save_file(tensors, f"{d}/{hf.MODEL_FILE}")
    with pytest.raises(UserError, match=r"holds 1 tensor this model would not read \(e\.g\. "
                                        r"'model\.layers\.0\.self_attn\.q_proj\.bias'\)"):
        hf.load_init(d, cfg, stacked=True)
    # a tied model whose file stores the head anyway starts (the head is the embedding's copy)
    del tensors["model.layers.0.self_attn.q_proj.bias"]
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"]
    save_file(tensors, f"{d}/{hf.MODEL_FILE}")
    json.dump(dict(conf, tie_word_embeddings=True), open(f"{d}/config.json", "w"))
    tied = hf.saved_model(hf.read_config(d))
    assert tied.tie_embeddings and "lm_head" not in hf.load_init(d, tied, stacked=True)


def test_damaged_tensor_files_and_shapes_are_one_line(tmp_path):
    """A truncated safetensors file, a sharded index that is no index or names a missing shard,
    and tensors whose shapes disagree with config.json: a UserError each, no traceback."""
    from boost_jax.step.build import abstract_params
    from boost_jax.config import TrainConfig

    d, conf = _plain("full", tmp_path)
    cfg = hf.saved_model(conf)
    model = open(f"{d}/{hf.MODEL_FILE}", "rb").read()
    open(f"{d}/{hf.MODEL_FILE}", "wb").write(model[:100])
    with pytest.raises(UserError, match=r"model\.safetensors cannot be read \(Safetensor"):
        hf.load_init(d, cfg, stacked=True)
    open(f"{d}/{hf.MODEL_FILE}", "wb").write(model)
    for index, match in (({"weight_map": 5}, r"model\.safetensors\.index\.json cannot be read"),
                         ({"weight_map": {"x": "model-2.safetensors"}},
                          r"model-2\.safetensors cannot be read \(FileNotFoundError")):
        json.dump(index, open(f"{d}/{hf.MODEL_FILE}.index.json", "w"))
        with pytest.raises(UserError, match=match):
            hf.load_init(d, cfg, stacked=True)
    os.remove(f"{d}/{hf.MODEL_FILE}.index.json")
    wider = ModelConfig(**{**vars(cfg), "vocab_size": 384})  # what config.json would claim
    params = hf.from_tensors(wider, hf.read_tensors(d), True, np.float32)
    want = abstract_params(wider, TrainConfig())[1]
    with pytest.raises(UserError, match=r"the weight \['embed'\]\['embedding'\] has shape "
                                        r"\(256, 32\), where the model its config\.json "
                                        r"describes has \(384, 32\)"):
        hf.check_shapes(d, params, want)
    hf.check_shapes(d, hf.from_tensors(cfg, hf.read_tensors(d), True, np.float32),
                    abstract_params(cfg, TrainConfig())[1])


@pytest.mark.skipif(not (importlib.util.find_spec("torch") and
                         importlib.util.find_spec("transformers")),
                    reason="torch/transformers not installed (make hf-live-test runs it)")
@pytest.mark.parametrize("name", ["lax", "lax_gpt2"])
def test_lax_carry_holds_across_copies_and_direct_forward_calls_live(name, tmp_path):
    """lax's cross-block carry starts empty in every forward: a deepcopy of the model (as
    fine-tuning libraries make) and model.forward() called directly give the logits of a plain
    call, again and again."""
    import copy

    import torch

    fixture = _hf_fixture()
    fixture.export_model(name, str(tmp_path), seed=7)
    model = fixture.transformers_model(str(tmp_path))
    tok = torch.as_tensor(fixture.TOKENS)
    with torch.no_grad():
        want = model(tok, use_cache=False).logits
        twin = copy.deepcopy(model)
        got = [twin(tok, use_cache=False).logits, twin(tok, use_cache=False).logits,
               model.forward(tok, use_cache=False).logits,
               model.forward(tok, use_cache=False).logits]
    assert max(float((g - want).abs().max()) for g in got) < 1e-5
