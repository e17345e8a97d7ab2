"""The decoder's params and their init: CausalLM (model.family llama | gpt_neox | gpt2) and the
nnx modules it is built from, which only hold params; the math, written once, is
boost_jax.layers.forward (CausalLM runs it with the single-device ops).

Param tree (`nnx.state(model, nnx.Param)`, paths joined with "/"):
    embed/embedding                 [V, d]       full rank, normal(init_std)
    blocks/attn_norm/scale          [L, d]
    blocks/attn/{q,k,v,o}/...       [L, ...]     q d→H·hd, k/v d→K·hd, o H·hd→d
    blocks/mlp_norm/scale           [L, d]
    blocks/mlp/{gate,up,down}/...   [L, ...]     gate/up d→d_ff, down d_ff→d (no gate: GPT)
    final_norm/scale                [d]
    lm_head/w                       [d, V]       absent when tie_embeddings (uses embed.T)
Each projection is a LowRankLinear of `cfg.arch`: full `w` [d_in, d_out]; svd/cola `a` [d_in, r],
`b` [r, d_out]; lax adds `latent_scale` [r] and, with lax_gate="gate", `g` [r, r]. GPT families:
every norm also has `bias` [d] (LayerNorm), every projection `bias` [d_out], and gpt2 adds
embed/positions [max_seq_len, d] (learned absolute positions). Block params carry a leading layer
axis L with scan_layers=True; with False the blocks are an nnx.List and paths gain the index
instead (`blocks/0/attn/q/a` [d, r]). `nnx.to_flat_state(nnx.state(model, nnx.Param))` gives path
tuples of str and int, e.g. ('blocks', 'attn', 'q', 'a').
Init: embedding, lm_head and full-rank projections normal(init_std); low-rank a, b normal with
std r^-1/4·(d_in+d_out)^-1/4 (CoLA); norm scales and lax latent_scale ones; lax gate g = I.
remat "none", "full" (whole-block recompute) or "lowrank" (saves the rank-r latents and the
residual stream). Residual stream and matmuls run in cfg.dtype; norms, softmax, logits in fp32.
"""

from __future__ import annotations

from typing import Callable, Optional

import jax
import jax.numpy as jnp
from flax import nnx

from boost_jax.backends.cpu import fast_compile_options
from boost_jax.config import ModelConfig
from boost_jax.layers import forward
from boost_jax.layers.forward import LATENT_KEYS, remat_wrapper  # noqa: F401 (re-export)
from boost_jax.names import ARCHS, REMAT_MODES


def lowrank_init_std(d_in: int, d_out: int, r: int) -> float:
    """CoLA init scale for both factors: r^-1/4 · (d_in + d_out)^-1/4."""
    return r ** -0.25 * (d_in + d_out) ** -0.25


class LowRankLinear(nnx.Module):
    """One projection's params (named in the module docstring) for arch `kind`;
    __call__(x, prev=None) -> (y, latent) by forward.lowrank_apply."""

    def __init__(self, d_in: int, d_out: int, kind: str, *, rank: Optional[int] = None,
                 lax_gate: str = "identity", eps: float = 1e-6, init_std: float = 0.02,
                 param_dtype=jnp.float32, dtype=jnp.float32, bias: bool = False,
                 rngs: nnx.Rngs):
        if kind not in ARCHS:
            raise ValueError(f"unknown linear kind {kind!r}; expected one of {ARCHS}")
        self.kind, self.eps, self.dtype = kind, eps, jnp.dtype(dtype)
        param_dtype = jnp.dtype(param_dtype)
        if bias:
            self.bias = nnx.Param(jnp.zeros((d_out,), param_dtype))
        if kind == "full":
            init = jax.nn.initializers.normal(init_std)
            self.w = nnx.Param(init(rngs.params(), (d_in, d_out), param_dtype))
            return
        if not rank:
            raise ValueError(f"kind={kind} needs a rank")
        init = jax.nn.initializers.normal(lowrank_init_std(d_in, d_out, rank))
        self.a = nnx.Param(init(rngs.params(), (d_in, rank), param_dtype))
        self.b = nnx.Param(init(rngs.params(), (rank, d_out), param_dtype))
        if kind == "lax":
            self.latent_scale = nnx.Param(jnp.ones((rank,), param_dtype))
            if lax_gate == "gate":
                self.g = nnx.Param(jnp.eye(rank, dtype=param_dtype))
            elif lax_gate != "identity":
                raise ValueError(f"lax_gate={lax_gate!r}; expected 'identity' or 'gate'")

    @classmethod
    def from_config(cls, cfg, d_in: int, d_out: int, *, rngs: nnx.Rngs) -> "LowRankLinear":
        return cls(d_in, d_out, cfg.arch, rank=cfg.r, lax_gate=cfg.lax_gate, eps=cfg.norm_eps,
                   init_std=cfg.init_std, param_dtype=cfg.param_dtype, dtype=cfg.dtype,
                   bias=cfg.bias, rngs=rngs)

    def params_dict(self) -> dict:
        names = ("w", "a", "b", "latent_scale", "g", "bias")
        return {n: getattr(self, n)[...] for n in names if hasattr(self, n)}

    def __call__(self, x: jax.Array, prev: Optional[jax.Array] = None):
        p = self.params_dict()
        y, z = forward.lowrank_apply(self.kind, p, x, prev, eps=self.eps, dtype=self.dtype)
        return (y + p["bias"].astype(y.dtype) if "bias" in p else y), z


class RMSNorm(nnx.Module):
    """Param `scale` [dim], initialised to ones (the math: forward.rms_norm)."""

    def __init__(self, dim: int, *, eps: float = 1e-6, param_dtype=jnp.float32, dtype=None):
        self.scale = nnx.Param(jnp.ones((dim,), param_dtype))
        self.eps = eps
        self.dtype = dtype

    def __call__(self, x: jax.Array) -> jax.Array:
        return forward.rms_norm(x, self.scale[...], self.eps, self.dtype)


class LayerNorm(nnx.Module):
    """Params `scale` [dim] (ones) and `bias` [dim] (zeros) (the math: forward.layer_norm)."""

    def __init__(self, dim: int, *, eps: float = 1e-5, param_dtype=jnp.float32, dtype=None):
        self.scale = nnx.Param(jnp.ones((dim,), param_dtype))
        self.bias = nnx.Param(jnp.zeros((dim,), param_dtype))
        self.eps = eps
        self.dtype = dtype

    def __call__(self, x: jax.Array) -> jax.Array:
        return forward.layer_norm(x, self.scale[...], self.bias[...], self.eps, self.dtype)


class Attention(nnx.Module):
    """Attention params: q/k/v/o, each a LowRankLinear of the arch (the GQA sub-layer itself is
    boost_jax.layers.forward.attention)."""

    def __init__(self, cfg, *, rngs: nnx.Rngs):
        d, hd = cfg.d_model, cfg.head_dim
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.kv_heads, hd
        self.rope_theta = cfg.rope_theta
        mk = lambda i, o: LowRankLinear.from_config(cfg, i, o, rngs=rngs)  # noqa: E731
        self.q = mk(d, cfg.n_heads * hd)
        self.k = mk(d, cfg.kv_heads * hd)
        self.v = mk(d, cfg.kv_heads * hd)
        self.o = mk(cfg.n_heads * hd, d)


class MLP(nnx.Module):
    """MLP params: gate (SwiGLU only), up, down, each a LowRankLinear of the arch (the sub-layer
    itself is boost_jax.layers.forward.mlp)."""

    def __init__(self, cfg, *, rngs: nnx.Rngs):
        mk = lambda i, o: LowRankLinear.from_config(cfg, i, o, rngs=rngs)  # noqa: E731
        if cfg.swiglu:
            self.gate = mk(cfg.d_model, cfg.d_ff)
        self.up = mk(cfg.d_model, cfg.d_ff)
        self.down = mk(cfg.d_ff, cfg.d_model)


class Block(nnx.Module):
    """One decoder block's params: attn_norm, attn (q, k, v, o), mlp_norm, mlp (gate, up, down).
    The block's math is boost_jax.layers.forward.block."""

    def __init__(self, cfg, *, rngs: nnx.Rngs):
        norm = lambda: make_norm(cfg)  # noqa: E731
        self.attn_norm = norm()
        self.attn = Attention(cfg, rngs=rngs)
        self.mlp_norm = norm()
        self.mlp = MLP(cfg, rngs=rngs)


def make_norm(cfg) -> nnx.Module:
    """LayerNorm (with bias) for the GPT families, RMSNorm for llama."""
    cls = LayerNorm if cfg.bias else RMSNorm
    return cls(cfg.d_model, eps=cfg.norm_eps, param_dtype=cfg.param_dtype,
               dtype=jnp.dtype(cfg.dtype))


class Embedding(nnx.Module):
    def __init__(self, vocab: int, dim: int, *, init_std: float, param_dtype, rngs: nnx.Rngs,
                 positions: int = 0):
        init = jax.nn.initializers.normal(init_std)
        self.embedding = nnx.Param(init(rngs.params(), (vocab, dim), jnp.dtype(param_dtype)))
        if positions:  # learned absolute positions (gpt2)
            self.positions = nnx.Param(
                init(rngs.params(), (positions, dim), jnp.dtype(param_dtype)))


class LMHead(nnx.Module):
    def __init__(self, dim: int, vocab: int, *, init_std: float, param_dtype, rngs: nnx.Rngs):
        init = jax.nn.initializers.normal(init_std)
        self.w = nnx.Param(init(rngs.params(), (dim, vocab), jnp.dtype(param_dtype)))


class CausalLM(nnx.Module):
    def __init__(self, cfg, *, rngs: nnx.Rngs, remat: str = "none", scan_layers: bool = True):
        if remat not in REMAT_MODES:
            raise ValueError(f"remat={remat!r}; expected one of {REMAT_MODES}")
        # a hashable copy of the config: NNX keeps static attributes in the graphdef
        self.cfg_items = tuple(sorted(vars(cfg).items()))
        self.remat, self.scan_layers = remat, scan_layers
        self.dtype = jnp.dtype(cfg.dtype)
        self.embed = Embedding(cfg.vocab_size, cfg.d_model, init_std=cfg.init_std,
                               param_dtype=cfg.param_dtype, rngs=rngs,
                               positions=cfg.max_seq_len if cfg.learned_positions else 0)
        if scan_layers:
            @nnx.split_rngs(splits=cfg.n_layers)
            @nnx.vmap(in_axes=(0,), out_axes=0)
            def make_blocks(r):
                return Block(cfg, rngs=r)
            self.blocks = make_blocks(rngs)
        else:
            self.blocks = nnx.List([Block(cfg, rngs=rngs) for _ in range(cfg.n_layers)])
        self.final_norm = make_norm(cfg)
        self.tie_embeddings = cfg.tie_embeddings
        if not cfg.tie_embeddings:
            self.lm_head = LMHead(cfg.d_model, cfg.vocab_size, init_std=cfg.init_std,
                                  param_dtype=cfg.param_dtype, rngs=rngs)

    @property
    def cfg(self):
        return ModelConfig(**dict(self.cfg_items))

    def params(self) -> dict:
        """The pure nested param dict (the layout every other module reads)."""
        return nnx.to_pure_dict(nnx.state(self, nnx.Param))

    def head_weight(self) -> jax.Array:
        """The [d, V] output projection (embedding transposed when tied)."""
        return self.embed.embedding[...].T if self.tie_embeddings else self.lm_head.w[...]

    def __call__(self, tokens: jax.Array, positions: Optional[jax.Array] = None,
                 return_hidden: bool = False) -> jax.Array:
        """tokens int32 [b, s] → fp32 logits [b, s, V], or with return_hidden the final-normed
        hidden [b, s, d] in cfg.dtype (project it with head_weight()). positions: [s] or [b, s]
        absolute positions for RoPE (default arange(s)); the causal mask is by index."""
        ops, params = forward.Local(self.cfg), self.params()
        ckpt = remat_wrapper(self.remat, prevent_cse=True)
        if not return_hidden:
            return forward.logits(ops, self.cfg, params, tokens, positions, ckpt)
        h = forward.hidden(ops, self.cfg, params, tokens, positions, checkpoint=ckpt)
        return forward.apply_norm(h, params["final_norm"], self.cfg.norm_eps, self.dtype)


def jit_init(make: Callable[[], nnx.Module]) -> nnx.Module:
    """make() run as one jitted program (eager init compiles each random op separately)."""
    graphdef, _ = nnx.split(nnx.eval_shape(make))
    state = jax.jit(lambda: nnx.state(make()), compiler_options=fast_compile_options())()
    return nnx.merge(graphdef, state)


def build_model(cfg, seed: int = 0, remat: str = "none", scan_layers: bool = True
                ) -> CausalLM:
    """Initialised CausalLM on the default device."""
    cfg.validate()
    return jit_init(
        lambda: CausalLM(cfg, rngs=nnx.Rngs(seed), remat=remat, scan_layers=scan_layers))


def abstract_model(cfg, seed: int = 0, remat: str = "none", scan_layers: bool = True):
    """(graphdef, state of jax.ShapeDtypeStruct) without allocating: for lowering big shapes."""
    cfg.validate()
    model = nnx.eval_shape(
        lambda: CausalLM(cfg, rngs=nnx.Rngs(seed), remat=remat, scan_layers=scan_layers))
    return nnx.split(model)


def count_params(model) -> int:
    """Number of parameters (works on real and on nnx.eval_shape'd models)."""
    return sum(int(x.size) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
