"""boost_jax's CoLA and LaX decoders in PyTorch, for transformers' remote code.

Copied next to the weights by `python -m boost_jax.export`. The model is transformers' own
LlamaForCausalLM, GPTNeoXForCausalLM or GPT2LMHeadModel (norms, positions, attention, its KV
cache and `generate`) with each projection of a block replaced by a low-rank bottleneck of
rank r (the GPT families add a bias to y):

    cola   z = x A;                                y = silu(z) B
    lax    z = RMSNorm_r(x A + G(z_prev)) * scale; y = silu(z) B

A is `<proj>.down` (Linear d_in -> r), B is `<proj>.up` (Linear r -> d_out), scale is
`<proj>.latent_scale`, and G is the identity or `<proj>.cross` (Linear r -> r). z_prev is the
latent of the same projection in the previous block (none in the first), for the same tokens:
the latents of one forward pass are carried block to block, so decoding with the KV cache sees
exactly what a full forward does. RMSNorm_r runs in fp32, as boost_jax computes it. The GPT
families' projections live under `<layer>.attn.{q,k,v,o}` and `<layer>.mlp.{up,down}` (the
names of the export); their fused q|k|v input is rebuilt from q, k and v.
"""

import torch
from torch import nn
from transformers import GPT2LMHeadModel, GPTNeoXForCausalLM, LlamaForCausalLM

from .configuration_boost_jax import (BoostJaxColaConfig, BoostJaxColaGpt2Config,
                                      BoostJaxColaGptNeoxConfig, BoostJaxLaxConfig,
                                      BoostJaxLaxGpt2Config, BoostJaxLaxGptNeoxConfig)

PROJECTIONS = {"q": ("self_attn", "q_proj"), "k": ("self_attn", "k_proj"),
               "v": ("self_attn", "v_proj"), "o": ("self_attn", "o_proj"),
               "gate": ("mlp", "gate_proj"), "up": ("mlp", "up_proj"),
               "down": ("mlp", "down_proj")}
# transformers' module each GPT projection replaces: (qkv, o, up, down) as (owner, attribute)
GPT_SLOTS = {"gpt2": (("attn", "c_attn"), ("attn", "c_proj"), ("mlp", "c_fc"), ("mlp", "c_proj")),
             "gpt_neox": (("attention", "query_key_value"), ("attention", "dense"),
                          ("mlp", "dense_h_to_4h"), ("mlp", "dense_4h_to_h"))}


class LowRankProjection(nn.Module):
    def __init__(self, d_in, d_out, rank, kind, gate, eps, name, carry, bias=False):
        super().__init__()
        self.down = nn.Linear(d_in, rank, bias=False)
        self.up = nn.Linear(rank, d_out, bias=False)
        self.bias = nn.Parameter(torch.zeros(d_out)) if bias else None
        self.kind, self.eps, self.name = kind, eps, name
        self._carry = carry  # shared by every projection of the model; reset per forward
        if kind == "lax":
            self.latent_scale = nn.Parameter(torch.ones(rank))
            self.cross = nn.Linear(rank, rank, bias=False) if gate == "gate" else None

    def forward(self, x):
        z = self.down(x)
        if self.kind == "lax":
            zf = z.float()
            prev = self._carry.get(self.name)
            if prev is not None:
                zf = zf + (prev if self.cross is None else self.cross(prev)).float()
            inv = torch.rsqrt(zf.pow(2).mean(-1, keepdim=True) + self.eps)
            z = (zf * inv * self.latent_scale.float()).to(x.dtype)
            self._carry[self.name] = z
        y = self.up(nn.functional.silu(z))
        return y if self.bias is None else y + self.bias


class _Call:
    """Stands where transformers calls one of its projections (not a module: the weights are
    registered once, under the export's names)."""

    def __init__(self, fn):
        self.fn = fn

    def __call__(self, x):
        return self.fn(x)


class _FusedQKV:
    """transformers' fused q|k|v projection made of our three; the block's projections are an
    attribute, not a closure, so a deepcopy of the model calls its own copies."""

    def __init__(self, box, family, heads, kv_heads):
        self.box, self.family, self.heads, self.kv_heads = box, family, heads, kv_heads

    def __call__(self, x):
        box, heads, kv_heads = self.box, self.heads, self.kv_heads
        q, k, v = box.q(x), box.k(x), box.v(x)
        if kv_heads != heads:  # grouped-query: query head h reads kv head h // (heads/kv_heads)
            k, v = (t.view(*t.shape[:-1], kv_heads, -1).repeat_interleave(
                heads // kv_heads, dim=-2).flatten(-2) for t in (k, v))
        if self.family == "gpt2":  # q | k | v
            return torch.cat([q, k, v], dim=-1)
        split = [t.view(*t.shape[:-1], heads, -1) for t in (q, k, v)]  # NeoX: per head q, k, v
        return torch.stack(split, dim=-2).reshape(*x.shape[:-1], -1)


def _low_rank_settings(config):
    ours = config.boost_jax["model"]
    return (ours.get("rank") or config.hidden_size // 4, ours["arch"],
            ours.get("lax_gate", "identity"), ours.get("norm_eps", 1e-6))


def _swap_gpt_layer(layer, family, config, carry):
    """Put the low-rank projections under layer.attn / layer.mlp and route transformers'
    calls of its own projections to them."""
    rank, kind, gate, eps = _low_rank_settings(config)
    d, d_ff = config.hidden_size, (config.n_inner if family == "gpt2"
                                   else config.intermediate_size) or 4 * config.hidden_size
    if not hasattr(layer, "attn"):
        layer.attn = nn.Module()
    heads = config.num_attention_heads
    kv_heads = config.boost_jax["model"].get("n_kv_heads") or heads
    kv = d // heads * kv_heads
    dims = {"q": (d, d), "k": (d, kv), "v": (d, kv), "o": (d, d), "up": (d, d_ff),
            "down": (d_ff, d)}
    for name, (d_in, d_out) in dims.items():
        box = layer.attn if name in "qkvo" else layer.mlp
        setattr(box, name, LowRankProjection(d_in, d_out, rank, kind, gate, eps, name, carry,
                                             bias=True))
    calls = (_FusedQKV(layer.attn, family, heads, kv_heads), layer.attn.o,
             layer.mlp.up, layer.mlp.down)
    for (owner, attr), fn in zip(GPT_SLOTS[family], calls):
        owner = getattr(layer, owner)
        delattr(owner, attr)
        setattr(owner, attr, _Call(fn))


class _CarryReset:
    """The carry empties as the first block starts and after the last: the first block crosses
    with nothing. Done by hooks on the blocks, which every forward calls through __call__ (a
    direct model.forward() too), not by overriding forward, whose signature generate() reads
    (GPT-2's learned positions come from the attention mask only when forward names
    position_ids). The hooks are bound methods, so a deepcopy's clear its own carry."""

    def _clear_carry(self, *_):
        self._carry.clear()  # returns None: the block's input and output stay as they are

    def _hook_carry(self, blocks) -> None:
        blocks[0].register_forward_pre_hook(self._clear_carry)
        blocks[-1].register_forward_hook(self._clear_carry)


class _LowRankForCausalLM(_CarryReset, LlamaForCausalLM):
    def __init__(self, config):
        super().__init__(config)
        rank, kind, gate, _ = _low_rank_settings(config)
        self._carry = {}
        for layer in self.model.layers:
            for name, (part, attr) in PROJECTIONS.items():
                old = getattr(getattr(layer, part), attr)
                setattr(getattr(layer, part), attr, LowRankProjection(
                    old.in_features, old.out_features, rank, kind, gate, config.rms_norm_eps,
                    name, self._carry))
        self._hook_carry(self.model.layers)
        self.post_init()


class _LowRankGpt(_CarryReset):
    """A GPT-family model (`_family`: gpt_neox or gpt2) with low-rank block projections."""

    _family = ""

    def __init__(self, config):
        super().__init__(config)
        self._carry = {}
        blocks = self.gpt_neox.layers if self._family == "gpt_neox" else self.transformer.h
        for layer in blocks:
            _swap_gpt_layer(layer, self._family, config, self._carry)
        self._hook_carry(blocks)
        self.post_init()


class _LowRankGptNeox(_LowRankGpt, GPTNeoXForCausalLM):
    _family = "gpt_neox"


class _LowRankGpt2(_LowRankGpt, GPT2LMHeadModel):
    _family = "gpt2"


def _model(name: str, body, config_class):
    """The model class of one export kind (named in config.json's auto_map and architectures)."""
    return type(name, (body,), {"config_class": config_class})


BoostJaxColaForCausalLM = _model("BoostJaxColaForCausalLM", _LowRankForCausalLM,
                                 BoostJaxColaConfig)
BoostJaxLaxForCausalLM = _model("BoostJaxLaxForCausalLM", _LowRankForCausalLM, BoostJaxLaxConfig)
BoostJaxColaGptNeoxForCausalLM = _model("BoostJaxColaGptNeoxForCausalLM", _LowRankGptNeox,
                                        BoostJaxColaGptNeoxConfig)
BoostJaxLaxGptNeoxForCausalLM = _model("BoostJaxLaxGptNeoxForCausalLM", _LowRankGptNeox,
                                       BoostJaxLaxGptNeoxConfig)
BoostJaxColaGpt2ForCausalLM = _model("BoostJaxColaGpt2ForCausalLM", _LowRankGpt2,
                                     BoostJaxColaGpt2Config)
BoostJaxLaxGpt2ForCausalLM = _model("BoostJaxLaxGpt2ForCausalLM", _LowRankGpt2,
                                    BoostJaxLaxGpt2Config)


def _neox_head_name():
    """The export names NeoX's head embed_out.weight, as transformers 4 does; transformers 5
    renames it to lm_head for GPTNeoXForCausalLM by class name, so for ours too."""
    try:
        from transformers.conversion_mapping import (WeightRenaming,
                                                      register_checkpoint_conversion_mapping)
    except ImportError:  # transformers 4: the module is embed_out itself
        return
    for cls in (BoostJaxColaGptNeoxForCausalLM, BoostJaxLaxGptNeoxForCausalLM):
        register_checkpoint_conversion_mapping(
            cls.__name__, [WeightRenaming(source_patterns=r"^embed_out\.",
                                          target_patterns="lm_head.")], overwrite=True)


_neox_head_name()
