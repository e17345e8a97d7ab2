"""Pre-norm LLaMA decoder whose 7 projections per block are LowRankLinear of `cfg.arch`.

Param tree (`nnx.state(model, nnx.Param)`, paths joined with "/"):

    embed/embedding                 [V, d]       full rank, normal(init_std)
    blocks/attn_norm/scale          [L, d]
    blocks/attn/{q,k,v,o}/...       [L, ...]     projection params, see below
    blocks/mlp_norm/scale           [L, d]
    blocks/mlp/{gate,up,down}/...   [L, ...]
    final_norm/scale                [d]
    lm_head/w                       [d, V]       absent when tie_embeddings (uses embed.T)

Projection params (linear.py): full `w` [d_in, d_out]; svd/cola `a` [d_in, r], `b` [r, d_out];
lax adds `latent_scale` [r] and, with lax_gate="gate", `g` [r, r].
Projection shapes: q d→H·hd, k/v d→K·hd, o H·hd→d, gate/up d→d_ff, down d_ff→d.

With scan_layers=True every block param carries a leading layer axis L (as listed). With
scan_layers=False the blocks are an nnx.List and paths gain the index instead:
`blocks/0/attn/q/a` [d, r]. Integer path elements stay ints in the flattened state.

Flatten with `nnx.to_flat_state(nnx.state(model, nnx.Param))`: path tuples of str (and int
list indices), e.g. ('blocks', 'attn', 'q', 'a').

Init: embedding, lm_head and full-rank projections normal(init_std); low-rank a, b normal with
std r^-1/4·(d_in+d_out)^-1/4 (CoLA); norm scales and lax latent_scale ones; lax gate g = I.

remat: "none"; "full" (whole-block recompute, only block inputs saved); "lowrank" (save the
rank-r latents tagged "lowrank_latent" in linear.py and block inputs tagged "residual").
Residual stream and matmuls run in cfg.dtype; norms, softmax and logits in fp32.
"""

from __future__ import annotations

from typing import Callable, Optional

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from boost_jax.compat import known_compile_options
from boost_jax.layers.attention import ATTN_PROJ, Attention
from boost_jax.layers.linear import LATENT_NAME
from boost_jax.layers.mlp import MLP_PROJ, MLP
from boost_jax.layers.norms import RMSNorm

REMAT_MODES = ("none", "full", "lowrank")
LATENT_KEYS = ATTN_PROJ + MLP_PROJ  # the 7 latents a lax block passes on
RESIDUAL_NAME = "residual"
LOWRANK_POLICY = jax.checkpoint_policies.save_only_these_names(LATENT_NAME, RESIDUAL_NAME)


class Block(nnx.Module):
    """h → h + attn(attn_norm(h)) → + mlp(mlp_norm(h)).

    __call__(h, positions, prev=None) -> (h, latents); for lax, prev/latents are dicts of the
    7 latents keyed by LATENT_KEYS (prev None means zeros); for other archs latents is None.
    """

    def __init__(self, cfg, *, rngs: nnx.Rngs):
        norm = lambda: RMSNorm(cfg.d_model, eps=cfg.norm_eps, param_dtype=cfg.param_dtype,  # noqa: E731
                               dtype=jnp.dtype(cfg.dtype))
        self.attn_norm = norm()
        self.attn = Attention(cfg, rngs=rngs)
        self.mlp_norm = norm()
        self.mlp = MLP(cfg, rngs=rngs)
        self.carries_latents = cfg.arch == "lax"

    def __call__(self, h: jax.Array, positions: jax.Array, prev: Optional[dict] = None):
        h = checkpoint_name(h, RESIDUAL_NAME)
        a, lat_a = self.attn(self.attn_norm(h), positions, prev)
        h = h + a.astype(h.dtype)
        m, lat_m = self.mlp(self.mlp_norm(h), prev)
        h = h + m.astype(h.dtype)
        return h, ({**lat_a, **lat_m} if self.carries_latents else None)


class Embedding(nnx.Module):
    def __init__(self, vocab: int, dim: int, *, init_std: float, param_dtype, rngs: nnx.Rngs):
        init = jax.nn.initializers.normal(init_std)
        self.embedding = nnx.Param(init(rngs.params(), (vocab, dim), jnp.dtype(param_dtype)))

    def __call__(self, tokens: jax.Array) -> jax.Array:
        return jnp.take(self.embedding[...], tokens, axis=0)


class LMHead(nnx.Module):
    def __init__(self, dim: int, vocab: int, *, init_std: float, param_dtype, rngs: nnx.Rngs):
        init = jax.nn.initializers.normal(init_std)
        self.w = nnx.Param(init(rngs.params(), (dim, vocab), jnp.dtype(param_dtype)))


def _call_block(block: Block, h, positions, prev):
    return block(h, positions, prev)


class LlamaModel(nnx.Module):
    def __init__(self, cfg, *, rngs: nnx.Rngs, remat: str = "none", scan_layers: bool = True):
        if remat not in REMAT_MODES:
            raise ValueError(f"remat={remat!r}; expected one of {REMAT_MODES}")
        self.remat, self.scan_layers = remat, scan_layers
        self.dtype = jnp.dtype(cfg.dtype)
        self.arch, self.rank, self.n_layers = cfg.arch, cfg.r, cfg.n_layers
        self.embed = Embedding(cfg.vocab_size, cfg.d_model, init_std=cfg.init_std,
                               param_dtype=cfg.param_dtype, rngs=rngs)
        if scan_layers:
            @nnx.split_rngs(splits=cfg.n_layers)
            @nnx.vmap(in_axes=(0,), out_axes=0)
            def make_blocks(r):
                return Block(cfg, rngs=r)
            self.blocks = make_blocks(rngs)
        else:
            self.blocks = nnx.List([Block(cfg, rngs=rngs) for _ in range(cfg.n_layers)])
        self.final_norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps, param_dtype=cfg.param_dtype,
                                  dtype=self.dtype)
        self.tie_embeddings = cfg.tie_embeddings
        if not cfg.tie_embeddings:
            self.lm_head = LMHead(cfg.d_model, cfg.vocab_size, init_std=cfg.init_std,
                                  param_dtype=cfg.param_dtype, rngs=rngs)

    def head_weight(self) -> jax.Array:
        """The [d, V] output projection (embedding transposed when tied)."""
        return self.embed.embedding[...].T if self.tie_embeddings else self.lm_head.w[...]

    def _block_fn(self):
        if self.remat == "full":
            return nnx.remat(_call_block)  # no policy: nothing saved but the block inputs
        if self.remat == "lowrank":
            return nnx.remat(_call_block, policy=LOWRANK_POLICY)
        return _call_block

    def __call__(self, tokens: jax.Array, positions: Optional[jax.Array] = None,
                 return_hidden: bool = False) -> jax.Array:
        """tokens int32 [b, s] → fp32 logits [b, s, V], or with return_hidden the final-normed
        hidden [b, s, d] in cfg.dtype (project it with head_weight()). positions: [s] or [b, s]
        absolute positions for RoPE (default arange(s)); the causal mask is by index."""
        b, s = tokens.shape
        if positions is None:
            positions = jnp.arange(s, dtype=jnp.int32)
        h = self.embed(tokens).astype(self.dtype)
        prev = None
        if self.arch == "lax":  # first block crosses with zeros
            prev = {k: jnp.zeros((b, s, self.rank), self.dtype) for k in LATENT_KEYS}
        fn = self._block_fn()
        if self.scan_layers:
            @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
            def run(carry, block):
                return fn(block, carry[0], positions, carry[1])
            h, _ = run((h, prev), self.blocks)
        else:
            for block in self.blocks:
                h, prev = fn(block, h, positions, prev)
        h = self.final_norm(h)
        if return_hidden:
            return h
        return jnp.einsum("bsd,dv->bsv", h, self.head_weight().astype(self.dtype),
                          preferred_element_type=jnp.float32)


def fast_compile_options() -> dict:
    """XLA options for programs whose run time doesn't matter (init, tests). On CPU, LLVM -O0
    and the legacy fusion codegen cut compile time 4-8x (a tiny model's init: ~11 s → ~2 s).
    HLO passes still run, so cost_analysis() is unchanged."""
    if jax.default_backend() != "cpu":
        return {}
    return known_compile_options({"xla_backend_optimization_level": 0,
                                  "xla_llvm_disable_expensive_passes": True,
                                  "xla_cpu_use_fusion_emitters": False})


def jit_init(make: Callable[[], nnx.Module]) -> nnx.Module:
    """make() run as one jitted program (eager init compiles each random op separately)."""
    graphdef, _ = nnx.split(nnx.eval_shape(make))
    state = jax.jit(lambda: nnx.state(make()), compiler_options=fast_compile_options())()
    return nnx.merge(graphdef, state)


def build_model(cfg, seed: int = 0, remat: str = "none", scan_layers: bool = True
                ) -> LlamaModel:
    """Initialised LlamaModel on the default device."""
    cfg.validate()
    return jit_init(
        lambda: LlamaModel(cfg, rngs=nnx.Rngs(seed), remat=remat, scan_layers=scan_layers))


def abstract_model(cfg, seed: int = 0, remat: str = "none", scan_layers: bool = True):
    """(graphdef, state of jax.ShapeDtypeStruct) without allocating: for lowering big shapes."""
    cfg.validate()
    model = nnx.eval_shape(
        lambda: LlamaModel(cfg, rngs=nnx.Rngs(seed), remat=remat, scan_layers=scan_layers))
    return nnx.split(model)


def count_params(model) -> int:
    """Number of parameters (works on real and on nnx.eval_shape'd models)."""
    return sum(int(x.size) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
