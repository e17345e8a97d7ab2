"""boost_jax's CoLA and LaX decoders in PyTorch, for transformers' remote code.

Copied next to the weights by `python -m boost_jax.export`. The model is transformers'
LlamaForCausalLM (RMSNorm, RoPE, GQA, SwiGLU, its KV cache and `generate`) with each of the
seven projections of a block replaced by a low-rank bottleneck of rank r:

    cola   z = x A;                                y = silu(z) B
    lax    z = RMSNorm_r(x A + G(z_prev)) * scale; y = silu(z) B

A is `<proj>.down` (Linear d_in -> r), B is `<proj>.up` (Linear r -> d_out), scale is
`<proj>.latent_scale`, and G is the identity or `<proj>.cross` (Linear r -> r). z_prev is the
latent of the same projection in the previous block (none in the first), for the same tokens:
the latents of one forward pass are carried block to block, so decoding with the KV cache sees
exactly what a full forward does. RMSNorm_r runs in fp32, as boost_jax computes it.
"""

import torch
from torch import nn
from transformers import LlamaForCausalLM

from .configuration_boost_jax import BoostJaxColaConfig, BoostJaxLaxConfig

PROJECTIONS = {"q": ("self_attn", "q_proj"), "k": ("self_attn", "k_proj"),
               "v": ("self_attn", "v_proj"), "o": ("self_attn", "o_proj"),
               "gate": ("mlp", "gate_proj"), "up": ("mlp", "up_proj"),
               "down": ("mlp", "down_proj")}


class LowRankProjection(nn.Module):
    def __init__(self, d_in, d_out, rank, kind, gate, eps, name, carry):
        super().__init__()
        self.down = nn.Linear(d_in, rank, bias=False)
        self.up = nn.Linear(rank, d_out, bias=False)
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
        return self.up(nn.functional.silu(z))


class _LowRankForCausalLM(LlamaForCausalLM):
    def __init__(self, config):
        super().__init__(config)
        ours = config.boost_jax["model"]
        rank = ours.get("rank") or config.hidden_size // 4
        kind, gate = ours["arch"], ours.get("lax_gate", "identity")
        self._carry = {}
        for layer in self.model.layers:
            for name, (part, attr) in PROJECTIONS.items():
                old = getattr(getattr(layer, part), attr)
                setattr(getattr(layer, part), attr, LowRankProjection(
                    old.in_features, old.out_features, rank, kind, gate, config.rms_norm_eps,
                    name, self._carry))
        self.post_init()

    def forward(self, *args, **kwargs):
        self._carry.clear()  # the first block crosses with nothing
        try:
            return super().forward(*args, **kwargs)
        finally:
            self._carry.clear()


class BoostJaxColaForCausalLM(_LowRankForCausalLM):
    config_class = BoostJaxColaConfig


class BoostJaxLaxForCausalLM(_LowRankForCausalLM):
    config_class = BoostJaxLaxConfig
