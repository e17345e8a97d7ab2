"""Hugging Face interop for the GPT families: GPTNeoXForCausalLM (gpt_neox), GPT2LMHeadModel (gpt2).

Layer i, ours → theirs (NeoX nn.Linear weights are [out, in], transposed; GPT-2's Conv1D
weights are [in, out], our layout):

    ours                       gpt_neox                                gpt2
    embed/embedding            gpt_neox.embed_in.weight                transformer.wte.weight
    embed/positions            —                                       transformer.wpe.weight
    attn_norm/{scale,bias}     layers.i.input_layernorm.{weight,bias}  h.i.ln_1.{weight,bias}
    attn/{q,k,v} w, bias       layers.i.attention.query_key_value      h.i.attn.c_attn
    attn/o                     layers.i.attention.dense                h.i.attn.c_proj
    mlp_norm/{scale,bias}      layers.i.post_attention_layernorm       h.i.ln_2
    mlp/up, mlp/down           layers.i.mlp.dense_h_to_4h, dense_4h_to_h   h.i.mlp.c_fc, c_proj
    final_norm                 gpt_neox.final_layer_norm               transformer.ln_f
    lm_head/w [d, V]           embed_out.weight (.T)                   lm_head.weight (.T)

The fused q|k|v: GPT-2 concatenates q, k, v along the output; NeoX interleaves them per head
(output index = (head, {q, k, v}, head_dim)). Both have no GQA.

arch=full writes exactly these; svd writes the merged W = a·b (fp64 product, rounded once)
there and keeps every factor (and bias) in lowrank.safetensors as `<layer>.<attn|mlp>.<proj>.
<down.weight|up.weight|bias>`; cola and lax write their factors and biases under those
names in model.safetensors (not a transformers model: model_type boost_jax_<arch>, with the
export's remote code, boost_jax/hf_remote/, named in `auto_map`).
"""

from __future__ import annotations

import numpy as np

from boost_jax.errors import UserError

FAMILY = {
    "gpt_neox": dict(arch="GPTNeoXForCausalLM", embed="gpt_neox.embed_in.weight",
                     final="gpt_neox.final_layer_norm", head="embed_out.weight",
                     layer="gpt_neox.layers.{}", qkv="attention.query_key_value",
                     norms={"attn_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm"},
                     proj={"o": "attention.dense", "up": "mlp.dense_h_to_4h",
                           "down": "mlp.dense_4h_to_h"}, conv1d=False),
    "gpt2": dict(arch="GPT2LMHeadModel", embed="transformer.wte.weight",
                 positions="transformer.wpe.weight", final="transformer.ln_f",
                 head="lm_head.weight", layer="transformer.h.{}", qkv="attn.c_attn",
                 norms={"attn_norm": "ln_1", "mlp_norm": "ln_2"},
                 proj={"o": "attn.c_proj", "up": "mlp.c_fc", "down": "mlp.c_proj"}, conv1d=True),
}
GROUP = {"q": "attn", "k": "attn", "v": "attn", "o": "attn", "up": "mlp", "down": "mlp"}
FACTOR_NAMES = {"a": "down.weight", "b": "up.weight", "latent_scale": "latent_scale",
                "g": "cross.weight", "bias": "bias"}
OLD_HEAD = "lm_head.weight"  # transformers >= 5 names NeoX's embed_out so


def _t(x) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(x).T)


def fuse_qkv(family: str, q, k, v, heads: int) -> np.ndarray:
    """[..., H·hd] ×3 → the fused output axis (gpt2: q|k|v; neox: per head q, k, v)."""
    if family == "gpt2":
        return np.concatenate([q, k, v], axis=-1)
    split = lambda x: x.reshape(*x.shape[:-1], heads, -1)  # noqa: E731
    out = np.stack([split(q), split(k), split(v)], axis=-2)
    return out.reshape(*q.shape[:-1], -1)


def split_qkv(family: str, fused, heads: int) -> list:
    if family == "gpt2":
        return np.split(fused, 3, axis=-1)
    x = fused.reshape(*fused.shape[:-1], heads, 3, -1)
    return [x[..., j, :].reshape(*fused.shape[:-1], -1) for j in range(3)]


def _full_w(cfg, p) -> np.ndarray:
    """The projection's [d_in, d_out] matrix (svd: a·b in fp64, rounded once)."""
    if cfg.arch == "full":
        return p["w"]
    return np.matmul(p["a"].astype(np.float64), p["b"].astype(np.float64)).astype(p["a"].dtype)


def _layer_tensors(cfg, f: dict, i: int, lp: dict, main: dict, factors: dict) -> None:
    pre = f["layer"].format(i)
    orient = (lambda w: w) if f["conv1d"] else _t
    for ours, theirs in f["norms"].items():
        main[f"{pre}.{theirs}.weight"] = lp[ours]["scale"]
        main[f"{pre}.{theirs}.bias"] = lp[ours]["bias"]
    projs = {n: lp[GROUP[n]][n] for n in GROUP}
    if cfg.arch in ("full", "svd"):
        qkv = [projs[n] for n in "qkv"]
        main[f"{pre}.{f['qkv']}.weight"] = orient(
            fuse_qkv(cfg.family, *(_full_w(cfg, p) for p in qkv), cfg.n_heads))
        main[f"{pre}.{f['qkv']}.bias"] = fuse_qkv(cfg.family, *(p["bias"] for p in qkv),
                                                  cfg.n_heads)
        for n, path in f["proj"].items():
            main[f"{pre}.{path}.weight"] = orient(_full_w(cfg, projs[n]))
            main[f"{pre}.{path}.bias"] = projs[n]["bias"]
    if cfg.arch != "full":
        dest = factors if cfg.arch == "svd" else main
        for n, p in projs.items():
            for k, v in p.items():
                dest[f"{pre}.{GROUP[n]}.{n}.{FACTOR_NAMES[k]}"] = _t(v) if v.ndim == 2 else v


def to_tensors(cfg, params: dict, layers: list) -> tuple[dict, dict]:
    """(model.safetensors, lowrank.safetensors or {}) of numpy params; `layers` per layer."""
    f = FAMILY[cfg.family]
    if cfg.arch in ("full", "svd") and cfg.kv_heads != cfg.n_heads:
        raise UserError(f"{f['arch']} has no grouped-query attention but model.n_kv_heads="
                        f"{cfg.kv_heads} < model.n_heads={cfg.n_heads}; train the "
                        f"{cfg.family} model without model.n_kv_heads to export it")
    main, factors = {f["embed"]: params["embed"]["embedding"],
                     f"{f['final']}.weight": params["final_norm"]["scale"],
                     f"{f['final']}.bias": params["final_norm"]["bias"]}, {}
    if "positions" in f:
        main[f["positions"]] = params["embed"]["positions"]
    if not cfg.tie_embeddings:
        main[f["head"]] = _t(params["lm_head"]["w"])
    for i, lp in enumerate(layers):
        _layer_tensors(cfg, f, i, lp, main, factors)
    return main, factors


def _layer_params(cfg, f: dict, i: int, get) -> dict:
    pre = f["layer"].format(i)
    orient = (lambda w: w) if f["conv1d"] else _t
    lp = {ours: {"scale": get(f"{pre}.{theirs}.weight"), "bias": get(f"{pre}.{theirs}.bias")}
          for ours, theirs in f["norms"].items()}
    lp["attn"], lp["mlp"] = {}, {}
    if cfg.arch == "full":
        ws = split_qkv(cfg.family, orient(get(f"{pre}.{f['qkv']}.weight")), cfg.n_heads)
        bs = split_qkv(cfg.family, get(f"{pre}.{f['qkv']}.bias"), cfg.n_heads)
        for n, w, b in zip("qkv", ws, bs):
            lp["attn"][n] = {"w": np.ascontiguousarray(w), "bias": np.ascontiguousarray(b)}
        for n, path in f["proj"].items():
            lp[GROUP[n]][n] = {"w": orient(get(f"{pre}.{path}.weight")),
                               "bias": get(f"{pre}.{path}.bias")}
        return lp
    names = ["a", "b", "bias"] + (["latent_scale"] if cfg.arch == "lax" else []) + \
        (["g"] if cfg.arch == "lax" and cfg.lax_gate == "gate" else [])
    for n in GROUP:
        key = f"{pre}.{GROUP[n]}.{n}"
        p = {k: get(f"{key}.{FACTOR_NAMES[k]}") for k in names}
        lp[GROUP[n]][n] = {k: _t(v) if v.ndim == 2 else v for k, v in p.items()}
    return lp


def from_tensors(cfg, tensors: dict, get) -> tuple[dict, list]:
    """(the non-layer params, per-layer params) from tensors named as in the module doc."""
    f = FAMILY[cfg.family]
    head = f["head"] if f["head"] in tensors or OLD_HEAD not in tensors else OLD_HEAD
    params = {"embed": {"embedding": get(f["embed"])},
              "final_norm": {"scale": get(f"{f['final']}.weight"),
                             "bias": get(f"{f['final']}.bias")}}
    if "positions" in f:
        params["embed"]["positions"] = get(f["positions"])
    if not cfg.tie_embeddings:
        params["lm_head"] = {"w": _t(get(head))}
    return params, [_layer_params(cfg, f, i, get) for i in range(cfg.n_layers)]


def hf_config(cfg) -> dict:
    """config.json fields of GPTNeoXConfig / GPT2Config (low-rank archs: boost_jax_<arch>)."""
    hf = cfg.arch in ("full", "svd")
    common = {"architectures": [FAMILY[cfg.family]["arch"] if hf
                                else f"BoostJax{cfg.arch.title()}ForCausalLM"],
              "vocab_size": cfg.vocab_size, "tie_word_embeddings": cfg.tie_embeddings,
              "initializer_range": cfg.init_std, "torch_dtype": cfg.param_dtype}
    if cfg.family == "gpt2":
        return common | {
            "model_type": "gpt2" if hf else f"boost_jax_{cfg.arch}", "n_embd": cfg.d_model,
            "n_layer": cfg.n_layers, "n_head": cfg.n_heads, "n_inner": cfg.d_ff,
            "n_positions": cfg.max_seq_len, "activation_function": "gelu_new",
            "layer_norm_epsilon": cfg.norm_eps, "resid_pdrop": 0.0, "embd_pdrop": 0.0,
            "attn_pdrop": 0.0, "scale_attn_weights": True}
    return common | {
        "model_type": "gpt_neox" if hf else f"boost_jax_{cfg.arch}",
        "hidden_size": cfg.d_model, "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads, "intermediate_size": cfg.d_ff, "hidden_act": "gelu",
        "rotary_pct": cfg.rotary_fraction, "rotary_emb_base": cfg.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta,
                            "partial_rotary_factor": cfg.rotary_fraction},
        "max_position_embeddings": cfg.max_seq_len, "layer_norm_eps": cfg.norm_eps,
        "use_parallel_residual": True, "attention_bias": True, "attention_dropout": 0.0,
        "hidden_dropout": 0.0}


def require(conf: dict, key: str, want, default) -> None:
    """A one-line error unless config.json's `key` (absent: `default`) is what our model runs."""
    if conf.get(key, default) != want:
        raise UserError(f"a {conf.get('model_type')} model with {key}={conf.get(key)!r} cannot "
                        f"start a run (this model family has {key}={want!r})")


def rope_of(conf: dict) -> dict:
    """config.json's RoPE parameters: transformers 5 writes `rope_parameters` (rope_type,
    rope_theta, partial_rotary_factor), older versions `rope_scaling` beside a top-level
    rope_theta. Only the unscaled RoPE is ours: any other rope_type is refused."""
    rope = conf.get("rope_parameters") or conf.get("rope_scaling") or {}
    if not isinstance(rope, dict):
        raise UserError(f"a {conf.get('model_type')} config.json whose rope_parameters is "
                        f"{rope!r} cannot start a run (expected an object)")
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind != "default":
        raise UserError(f"a {conf.get('model_type')} model with rope_type={kind!r} cannot start "
                        "a run (our RoPE is the unscaled one, rope_type 'default')")
    return rope


def saved_model(conf: dict):
    """ModelConfig (arch=full) of a plain GPTNeoXForCausalLM or GPT2LMHeadModel config.json."""
    from boost_jax.config import ModelConfig

    if conf["model_type"] == "gpt2":
        for key, want, default in (("activation_function", "gelu_new", "gelu_new"),
                                   ("scale_attn_weights", True, True),
                                   ("scale_attn_by_inverse_layer_idx", False, False)):
            require(conf, key, want, default)
        d = conf.get("n_embd", 768)
        return ModelConfig(
            arch="full", family="gpt2", vocab_size=conf["vocab_size"], d_model=d,
            n_layers=conf["n_layer"], n_heads=conf["n_head"], d_ff=conf.get("n_inner") or 4 * d,
            max_seq_len=conf.get("n_positions", 1024),
            norm_eps=conf.get("layer_norm_epsilon", 1e-5),
            tie_embeddings=conf.get("tie_word_embeddings", True))
    for key, want, default in (("use_parallel_residual", True, True), ("hidden_act", "gelu", "gelu"),
                               ("attention_bias", True, True)):
        require(conf, key, want, default)
    rope = rope_of(conf)
    return ModelConfig(
        arch="full", family="gpt_neox", vocab_size=conf["vocab_size"], d_model=conf["hidden_size"],
        n_layers=conf["num_hidden_layers"], n_heads=conf["num_attention_heads"],
        d_ff=conf["intermediate_size"], max_seq_len=conf.get("max_position_embeddings", 2048),
        rotary_pct=rope.get("partial_rotary_factor", conf.get("rotary_pct", 0.25)),
        rope_theta=rope.get("rope_theta", conf.get("rotary_emb_base", 10000.0)),
        norm_eps=conf.get("layer_norm_eps", 1e-5),
        tie_embeddings=conf.get("tie_word_embeddings", False))
