"""Hugging Face interop: a model's weights as safetensors + config.json, and back.

Our LLaMA is Hugging Face's LlamaForCausalLM: pre-norm RMSNorm blocks, SwiGLU, RoPE in the
half-split rotate_half convention (layers/forward.apply_rope), GQA with query head h reading kv
head h // (H/K) (HF's repeat_kv). Only the storage differs: a projection is w [d_in, d_out] here
(y = x @ w), nn.Linear.weight [d_out, d_in] in torch, so every matrix is transposed (exact):

    ours                                  safetensors name (layer i)
    embed/embedding [V, d]                model.embed_tokens.weight
    blocks/attn_norm/scale                model.layers.i.input_layernorm.weight
    blocks/attn/{q,k,v,o}/w               model.layers.i.self_attn.{q,k,v,o}_proj.weight (.T)
    blocks/mlp_norm/scale                 model.layers.i.post_attention_layernorm.weight
    blocks/mlp/{gate,up,down}/w           model.layers.i.mlp.{gate,up,down}_proj.weight (.T)
    final_norm/scale                      model.norm.weight
    lm_head/w [d, V]                      lm_head.weight (.T; absent when tied)

Low-rank projections (P = any of the seven prefixes above) store a [d_in, r] as P.down.weight
(.T), b [r, d_out] as P.up.weight (.T); lax adds P.latent_scale [r] and, with lax_gate=gate, g
as P.cross.weight (.T). arch=full and svd export LlamaForCausalLM checkpoints (svd's factors
kept beside), cola and lax a model_type boost_jax_<arch> with its PyTorch code (see `write`).
The GPT families (model.family gpt_neox, gpt2) are GPTNeoXForCausalLM and GPT2LMHeadModel:
boost_jax/hf_gpt.py names their tensors; the functions here dispatch on the family. config.json
carries the LLaMA fields and a "boost_jax" section with the full ModelConfig, the run, step and
tokenizer, which is what `model.init_from=DIR` reads back.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Optional

import numpy as np

from boost_jax.errors import UserError

MODEL_FILE = "model.safetensors"
FACTORS_FILE = "lowrank.safetensors"
CONFIG_FILE = "config.json"
PROJ = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj",
        "o": "self_attn.o_proj", "gate": "mlp.gate_proj", "up": "mlp.up_proj",
        "down": "mlp.down_proj"}
GROUP = {"q": "attn", "k": "attn", "v": "attn", "o": "attn", "gate": "mlp", "up": "mlp",
         "down": "mlp"}
NORMS = {"attn_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm"}
FACTOR_NAMES = {"a": "down.weight", "b": "up.weight", "latent_scale": "latent_scale",
                "g": "cross.weight"}


def _t(x) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(x).T)


def layer_list(blocks: dict) -> list[dict]:
    """Per-layer param dicts, from stacked (leading layer axis) or per-index blocks."""
    import jax

    from boost_jax.layers.forward import is_stacked

    if not is_stacked(blocks):
        return [blocks[k] for k in sorted(blocks, key=int)]
    n = len(jax.tree.leaves(blocks)[0])
    return [jax.tree.map(lambda x, i=i: np.asarray(x)[i], blocks) for i in range(n)]


def to_tensors(cfg, params: dict) -> tuple[dict, dict]:
    """(model.safetensors tensors, lowrank.safetensors tensors or {}) of logical params."""
    params = _numpy(params)
    if cfg.family != "llama":
        from boost_jax import hf_gpt

        return hf_gpt.to_tensors(cfg, params, layer_list(params["blocks"]))
    main, factors = {"model.embed_tokens.weight": params["embed"]["embedding"],
                     "model.norm.weight": params["final_norm"]["scale"]}, {}
    if not cfg.tie_embeddings:
        main["lm_head.weight"] = _t(params["lm_head"]["w"])
    for i, lp in enumerate(layer_list(params["blocks"])):
        pre = f"model.layers.{i}"
        for ours, theirs in NORMS.items():
            main[f"{pre}.{theirs}.weight"] = lp[ours]["scale"]
        for name, path in PROJ.items():
            p, key = lp[GROUP[name]][name], f"{pre}.{path}"
            if cfg.arch == "full":
                main[f"{key}.weight"] = _t(p["w"])
                continue
            dest = factors if cfg.arch == "svd" else main
            for k, v in p.items():
                dest[f"{key}.{FACTOR_NAMES[k]}"] = _t(v) if v.ndim == 2 else v
            if cfg.arch == "svd":
                # products of fp32 factors are exact in fp64 and rounded once, so the merged
                # weight is the same bits on every CPU (an fp32 BLAS sum order is not)
                w = np.matmul(p["a"].astype(np.float64), p["b"].astype(np.float64))
                main[f"{key}.weight"] = _t(w.astype(p["a"].dtype))
    return main, factors


def _numpy(tree):
    import jax

    return jax.tree.map(lambda x: np.asarray(x), tree)


def from_tensors(cfg, tensors: dict, stacked: bool, dtype) -> dict:
    """Logical params (numpy, `dtype`) from the tensors named as in the module docstring."""
    def get(name):
        if name not in tensors:
            raise KeyError(name)
        return np.asarray(tensors[name]).astype(dtype)

    if cfg.family != "llama":
        from boost_jax import hf_gpt

        params, layers = hf_gpt.from_tensors(cfg, tensors, get)
        return dict(params, blocks=_blocks(layers, stacked))
    layers = []
    for i in range(cfg.n_layers):
        pre = f"model.layers.{i}"
        lp = {ours: {"scale": get(f"{pre}.{theirs}.weight")} for ours, theirs in NORMS.items()}
        lp["attn"], lp["mlp"] = {}, {}
        for name, path in PROJ.items():
            key = f"{pre}.{path}"
            if cfg.arch == "full":
                p = {"w": _t(get(f"{key}.weight"))}
            else:
                p = {"a": _t(get(f"{key}.down.weight")), "b": _t(get(f"{key}.up.weight"))}
                if cfg.arch == "lax":
                    p["latent_scale"] = get(f"{key}.latent_scale")
                    if cfg.lax_gate == "gate":
                        p["g"] = _t(get(f"{key}.cross.weight"))
            lp[GROUP[name]][name] = p
        layers.append(lp)
    params = {"embed": {"embedding": get("model.embed_tokens.weight")},
              "blocks": _blocks(layers, stacked),
              "final_norm": {"scale": get("model.norm.weight")}}
    if not cfg.tie_embeddings:
        params["lm_head"] = {"w": _t(get("lm_head.weight"))}
    return params


def _blocks(layers: list, stacked: bool) -> dict:
    if stacked:
        import jax

        return jax.tree.map(lambda *xs: np.stack(xs), *layers)
    return dict(enumerate(layers))


def hf_config(cfg, extra: dict) -> dict:
    """config.json: LlamaConfig (GPTNeoXConfig, GPT2Config) fields plus our "boost_jax"
    section."""
    ours = {"boost_jax": dict(extra, model=dataclasses.asdict(cfg),
                              factors=FACTORS_FILE if cfg.arch == "svd" else None)}
    remote = {} if cfg.arch in ("full", "svd") else {
        "architectures": [f"{remote_class(cfg.arch, cfg.family)}ForCausalLM"],
        "auto_map": remote_code_map(cfg.arch, cfg.family)}
    if cfg.family != "llama":
        from boost_jax import hf_gpt

        return hf_gpt.hf_config(cfg) | ours | remote
    llama = cfg.arch in ("full", "svd")
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama" if llama else f"boost_jax_{cfg.arch}",
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model,
        "intermediate_size": cfg.d_ff, "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.kv_heads,
        "head_dim": cfg.head_dim, "hidden_act": "silu",
        "max_position_embeddings": cfg.max_seq_len, "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta, "rope_scaling": None, "attention_bias": False,
        "mlp_bias": False, "attention_dropout": 0.0, "tie_word_embeddings": cfg.tie_embeddings,
        "torch_dtype": cfg.param_dtype, "initializer_range": cfg.init_std,
    } | ours | remote


REMOTE_CODE = ("configuration_boost_jax.py", "modeling_boost_jax.py")


def remote_class(arch: str, family: str = "llama") -> str:
    """The class name stem of a cola / lax export's remote code: BoostJaxCola, BoostJaxLaxGpt2."""
    fam = "" if family == "llama" else "".join(w.title() for w in family.split("_"))
    return f"BoostJax{arch.title()}{fam}"


def remote_code_map(arch: str, family: str = "llama") -> dict:
    """transformers' remote-code entry points of a cola / lax export (boost_jax/hf_remote/)."""
    name = remote_class(arch, family)
    return {"AutoConfig": f"configuration_boost_jax.{name}Config",
            "AutoModelForCausalLM": f"modeling_boost_jax.{name}ForCausalLM"}


# --------------------------------------------------------------------------- files


def write(out: str, cfg, params: dict, extra: dict, top: Optional[dict] = None) -> list[str]:
    """model.safetensors (+ lowrank.safetensors for svd) and config.json into `out`.

    arch=full: model.safetensors is a LlamaForCausalLM checkpoint. svd: the same with each
    W = a @ b merged (fp32), and lowrank.safetensors keeps the factors, so import is exact.
    cola, lax: model.safetensors holds the factors; y = silu(z) @ b with z = x @ a (cola) or
    z = RMSNorm_r(x @ a + G(z of the same projection in the previous block)) (lax) is not a
    LLaMA, so config.json names model_type boost_jax_<arch> and the export carries its PyTorch
    modeling code for every family (hf_remote/, transformers' remote-code convention: `auto_map`
    in config.json), which AutoModelForCausalLM.from_pretrained(dir, trust_remote_code=True)
    loads."""
    from safetensors.numpy import save_file

    from boost_jax.safe_write import file_mode

    main, factors = to_tensors(cfg, params)
    meta = {"format": "pt"}  # transformers expects it
    files = [MODEL_FILE] + ([FACTORS_FILE] if factors else [])
    for name, tensors in zip(files, (main, factors)):
        save_file(tensors, os.path.join(out, name), metadata=meta)
        os.chmod(os.path.join(out, name), file_mode())  # safetensors creates it 0600
    from boost_jax.checkpoints.seal import file_crc32

    # what init_from checks before it trusts the tensors (safetensors has no checksum)
    extra = dict(extra, files_crc32={n: file_crc32(os.path.join(out, n)) for n in files})
    if cfg.arch in ("cola", "lax"):  # so transformers can load it
        import shutil

        here = os.path.join(os.path.dirname(os.path.abspath(__file__)), "hf_remote")
        for name in REMOTE_CODE:
            shutil.copyfile(os.path.join(here, name), os.path.join(out, name))
        files += list(REMOTE_CODE)
    with open(os.path.join(out, CONFIG_FILE), "w") as f:
        json.dump(dict(hf_config(cfg, extra), **(top or {})), f, indent=2, allow_nan=False)
    return files + [CONFIG_FILE]


def check_files(path: str, conf: dict, key: str = "model.init_from") -> None:
    """A one-line error if a tensor file differs from the CRC-32 export recorded (a folder not
    written by export records none)."""
    from boost_jax.checkpoints.seal import file_crc32

    for name, crc in sorted(((conf.get("boost_jax") or {}).get("files_crc32") or {}).items()):
        file = os.path.join(path, name)
        why = ("is missing" if not os.path.isfile(file) else None if file_crc32(file) == crc
               else "does not match the CRC-32 recorded when it was exported")
        if why:
            raise UserError(f"{key} {path!r} is corrupted (file {name} {why}); export the run "
                            "again (python -m boost_jax.export --run RUN --out DIR)")


class Tensors(dict):
    """A folder's tensors by name, noting which ones a loader read."""

    def __init__(self, *args):
        super().__init__(*args)
        self.read: set = set()

    def __getitem__(self, name):
        self.read.add(name)
        return super().__getitem__(name)


# buffers transformers saved in older checkpoints (causal masks, RoPE tables): no weights
BUFFERS = (".rotary_emb.inv_freq", ".attn.bias", ".attn.masked_bias", ".attention.bias",
           ".attention.masked_bias")


def read_tensors(path: str) -> Tensors:
    """Every tensor of DIR's model.safetensors (or its sharded index) and lowrank.safetensors;
    a file that cannot be read is a one-line error."""
    from safetensors import SafetensorError
    from safetensors.numpy import load_file

    files, index = [], os.path.join(path, MODEL_FILE + ".index.json")
    name = os.path.basename(index)
    try:
        if os.path.isfile(index):
            with open(index) as f:
                files = sorted(set(json.load(f)["weight_map"].values()))
        elif os.path.isfile(os.path.join(path, MODEL_FILE)):
            files = [MODEL_FILE]
        if os.path.isfile(os.path.join(path, FACTORS_FILE)):
            files.append(FACTORS_FILE)
        out = Tensors()
        for name in files:
            out.update(load_file(os.path.join(path, name)))
    except (OSError, ValueError, TypeError, KeyError, AttributeError, SafetensorError) as e:
        raise UserError(f"model.init_from {path!r}: {name} cannot be read ({type(e).__name__}: "
                        f"{str(e).splitlines()[0] if str(e) else 'no details'}); export or "
                        "download the model again") from None
    return out


def unread(tensors: Tensors) -> list[str]:
    """Tensors a load left unread, buffers aside: weights of a part our model lacks."""
    return sorted(n for n in set(tensors) - tensors.read if not n.endswith(BUFFERS))


def read_config(path: str, key: str = "model.init_from") -> dict:
    cfg_path = os.path.join(path, CONFIG_FILE)
    if not os.path.isdir(path) or not os.path.isfile(cfg_path):
        raise UserError(f"{key} {path!r} is not a model directory (no {CONFIG_FILE}); point it "
                        "at a folder written by python -m boost_jax.export or a Hugging Face "
                        "LlamaForCausalLM")
    fix = ("export the model again with python -m boost_jax.export, or point it at a Hugging "
           "Face model folder")
    try:
        with open(cfg_path) as f:
            conf = json.load(f)
    except (OSError, ValueError, RecursionError) as e:
        raise UserError(f"{key} {path!r}: its {CONFIG_FILE} cannot be read "
                        f"({type(e).__name__}); {fix}") from None
    ours = conf.get("boost_jax") or {} if isinstance(conf, dict) else None
    crcs = ours.get("files_crc32") or {} if isinstance(ours, dict) else None
    if not isinstance(ours, dict) or not isinstance(ours.get("model") or {}, dict) or \
            not isinstance(crcs, dict) or \
            not all(isinstance(n, str) and isinstance(c, int) for n, c in crcs.items()):
        raise UserError(f"{key} {path!r}: its {CONFIG_FILE} is not a model config (a JSON "
                        f"object, with an object for its boost_jax section); {fix}")
    return conf


def saved_model(conf: dict):
    """The ModelConfig a directory holds: ours from the boost_jax section, else a plain
    LlamaForCausalLM read as arch=full."""
    from boost_jax.config import ModelConfig

    ours = (conf.get("boost_jax") or {}).get("model")
    if ours:
        names = {f.name for f in dataclasses.fields(ModelConfig)}
        return ModelConfig(**{k: v for k, v in ours.items() if k in names})
    if conf.get("model_type") in ("gpt_neox", "gpt2"):
        from boost_jax import hf_gpt

        return hf_gpt.saved_model(conf)
    if conf.get("model_type") != "llama":
        raise UserError(f"a {conf.get('model_type')!r} model cannot start a run; export one "
                        "with python -m boost_jax.export or use a LlamaForCausalLM, "
                        "GPTNeoXForCausalLM or GPT2LMHeadModel")
    from boost_jax.hf_gpt import require, rope_of

    rope = rope_of(conf)
    for key, want, default in (("hidden_act", "silu", "silu"), ("attention_bias", False, False),
                               ("mlp_bias", False, False)):
        require(conf, key, want, default)
    require(dict(rope, model_type=conf["model_type"]), "partial_rotary_factor", 1.0, 1.0)
    need = ("hidden_size", "num_attention_heads", "num_hidden_layers", "intermediate_size",
            "vocab_size")
    lacks = [k for k in need if not isinstance(conf.get(k), int) or conf[k] <= 0]
    if lacks:
        raise UserError(f"this LlamaForCausalLM config.json lacks a positive integer "
                        f"{lacks[0]!r}; it cannot start a run")
    d, h = conf["hidden_size"], conf["num_attention_heads"]
    if conf.get("head_dim", d // h) != d // h:
        raise UserError(f"head_dim={conf['head_dim']} differs from hidden_size / "
                        f"num_attention_heads={d // h}, which this model assumes")
    return ModelConfig(
        arch="full", vocab_size=conf["vocab_size"], d_model=d, n_layers=conf["num_hidden_layers"],
        n_heads=h, n_kv_heads=conf.get("num_key_value_heads", h), d_ff=conf["intermediate_size"],
        max_seq_len=conf.get("max_position_embeddings", 2048),
        rope_theta=rope.get("rope_theta", conf.get("rope_theta", 10000.0)),
        norm_eps=conf.get("rms_norm_eps", 1e-6),
        tie_embeddings=conf.get("tie_word_embeddings", False))


SHAPES = ("arch", "family", "vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff",
          "rank", "lax_gate", "tie_embeddings")
# not shapes, but the saved weights compute another function under other values
NUMERICS = ("norm_eps", "rope_theta", "rotary_pct")


def check_compatible(path: str, saved, cfg) -> None:
    """A one-line error naming the overrides that make `cfg` take the saved model's arrays."""
    def value(c, k):
        alias = {"n_kv_heads": "kv_heads", "rank": "r", "rotary_pct": "rotary_fraction"}
        return getattr(c, alias.get(k, k))

    keys = [k for k in SHAPES if not (saved.arch == "full" and k in ("rank", "lax_gate"))
            and not (saved.arch != "lax" and k == "lax_gate")]
    keys += [k for k in NUMERICS if k == "norm_eps" or not saved.learned_positions]
    if saved.learned_positions:  # the position table's rows
        keys.append("max_seq_len")
    diff = [k for k in keys if value(saved, k) != value(cfg, k)]
    if diff:
        have = ", ".join(f"model.{k} {value(cfg, k)} vs {value(saved, k)}" for k in diff)
        fix = " ".join(f"model.{k}={value(saved, k)}" for k in diff)
        raise UserError(f"model.init_from {path!r} holds another model ({have}); set {fix}")


def load_init(path: str, cfg, stacked: bool) -> dict:
    """Logical params (numpy, model.param_dtype) of DIR for a run whose model is `cfg`."""
    conf = read_config(path)
    check_compatible(path, saved_model(conf), cfg)
    check_files(path, conf)
    import jax.numpy as jnp

    tensors = read_tensors(path)
    try:
        params = from_tensors(cfg, tensors, stacked, jnp.dtype(cfg.param_dtype))
    except KeyError as e:
        raise UserError(f"model.init_from {path!r} lacks the tensor {e.args[0]!r}; it is not a "
                        f"complete {cfg.arch} checkpoint of this model") from None
    except ValueError as e:  # layers whose tensors differ in shape do not stack
        raise UserError(f"model.init_from {path!r}: its tensors disagree in shape ({e}); it is "
                        "not a checkpoint of the model its config.json describes") from None
    if cfg.tie_embeddings:  # a tied head some checkpoints store anyway: the embedding's copy
        tensors.read.update(("lm_head.weight", "embed_out.weight"))
    extra = unread(tensors) if not conf.get("boost_jax") else []  # ours: svd keeps both forms
    if extra:
        raise UserError(f"model.init_from {path!r} holds {len(extra)} tensor"
                        f"{'s' if len(extra) > 1 else ''} this model would not read (e.g. "
                        f"{extra[0]!r}): its config.json describes a model we do not build "
                        "(biases, more layers); it cannot start a run")
    return params


def check_tokenizer(path: str, tokenizer) -> None:
    """The run must tokenize as the model it starts from did (ids are rows of its embedding)."""
    conf = read_config(path)
    theirs = (conf.get("boost_jax") or {}).get("tokenizer_fingerprint")
    tok_file = os.path.join(path, "tokenizer.json")
    if theirs is None and os.path.isfile(tok_file):
        from boost_jax.data.tokenizers import HFTokenizer

        theirs = HFTokenizer.from_file(tok_file).fingerprint
    if theirs is not None and theirs != tokenizer.fingerprint:
        want = "byte" if theirs == "byte" else tok_file
        raise UserError(f"model.init_from {path!r} was trained with another tokenizer than "
                        f"data.tokenizer={getattr(tokenizer, 'name', '?')}; set "
                        f"data.tokenizer={want}")


def check_shapes(path: str, params: dict, want) -> None:
    """A one-line error unless the loaded `params` have the model's logical shapes `want` (a
    config.json whose sizes disagree with its tensors)."""
    import jax

    leaves = jax.tree_util.tree_leaves_with_path
    got = {jax.tree_util.keystr(k): np.shape(x) for k, x in leaves(params)}
    for k, w in leaves(want):
        name = jax.tree_util.keystr(k)
        if got.get(name) != w.shape:
            raise UserError(f"model.init_from {path!r}: the weight {name} has shape "
                            f"{got.get(name)}, where the model its config.json describes has "
                            f"{w.shape}; its config.json and tensors disagree")


def init_state_from(bundle, state: dict, path: str) -> dict:
    """A fresh train state whose weights (and fp32 master copy) are DIR's, in the plan's
    layout; the optimizer moments stay at their initial zeros."""
    import jax
    import jax.numpy as jnp

    from boost_jax.sharding.layout import pad_tree, unpad_tree

    params = load_init(path, bundle.model, bundle.train.scan_layers)
    lay = bundle.placement.layouts
    check_shapes(path, params, jax.eval_shape(lambda p: unpad_tree(lay, p),
                                              bundle.abstract_state["params"]))

    def put(dtype, shardings):
        cast = lambda p: pad_tree(lay, jax.tree.map(lambda x: x.astype(dtype), p))  # noqa: E731
        return jax.jit(cast, out_shardings=shardings)(params)

    state = dict(state, params=put(jnp.dtype(bundle.model.param_dtype),
                                   bundle.state_shardings["params"]))
    if "master" in state:
        state["master"] = put(jnp.float32, bundle.state_shardings["master"])
    return state
