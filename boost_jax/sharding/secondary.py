"""Weight gathers for sharded plans: ZeRO-3 re-gather, hpZ secondary partition, int8 (qwZ).

Everything here is GSPMD: a gather is a sharding constraint from the stored sharding to "TP
only" (replicated over data-parallel axes), wrapped in a custom_vjp whose backward constrains
the cotangent straight to the *grads* sharding, so XLA emits one reduce-scatter (never an
all-reduce followed by a slice).

Forward / backward of one weight, by plan (A = params axes, S = secondary axes):

    no secondary    full = G_A(x)                     backward replays G_A(x)   (ZeRO-3)
    secondary S     sec  = to_S(x)   [saved]          backward replays G_S(sec)  (hpZ / LBP)
                    full = G_S(sec)
        to_S(x):  S ⊇ A: a local slice of x;  otherwise the flat gather G_A(x) then a local
                  slice (ZeRO++ takes the secondary from the forward's all-gather), so the
                  forward gathers over A once and over S once more (intra-node).
    int8            q, scale = quantize(shard) before the gather (blocks never straddle a shard:
                    the sharded dim is first split into [n_shards, dim/n] and the blocks run
                    along another dim), gather q and scale, dequantize. qwZ (quantize_gather)
                    makes every gather of that weight int8; an int8 secondary is stored as
                    (q, scale) and makes G_S int8.

The backward re-gather falls out of remat: each layer runs under `jax.checkpoint` whose policy
saves the secondary (name SECONDARY_NAME) and never the gathered weight, so the backward pass
recomputes `full` from what is saved — G_S(sec) with a secondary, G_A(x) without one
(x, the stored shard, is an input of the checkpointed layer and always available).
The gradient flows straight through the quantization (straight-through estimator) and the
secondary (stop_gradient): d full / d x is the identity on the unpadded part.

`build_forward` runs the model (boost_jax.layers.model.LlamaModel) layer by layer with these
gathers inside its scan, so only one layer's weights are gathered at a time.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import NamedSharding, PartitionSpec as P

from boost_jax.sharding import quant
from boost_jax.sharding.plans import LeafLayout, Placement, _spec_entry, is_layout

SECONDARY_NAME = "zero_secondary"  # checkpoint_name of every saved secondary partition
FULL_NAME = "zero_full_weight"  # checkpoint_name of every gathered weight (never saved)


# --------------------------------------------------------------------------- per-leaf gather


def reshard_bits(x, sharding, src=None):
    """with_sharding_constraint that moves 16-bit floats as raw 16-bit integers.

    XLA:CPU runs bf16/f16 collectives in f32 (convert → collective → convert), which doubles
    what a gather moves there; a gather is pure data movement, so bitcasting to uint16 first is
    exact and makes the CPU program move what a GPU/TPU would (the bitcasts are free).
    `src` (x's sharding) pins the integer copy before the move; without it XLA's sharding
    propagation reshards the float input of the bitcast instead."""
    if x.dtype in (jnp.bfloat16, jnp.float16):
        u = jax.lax.bitcast_convert_type(x, jnp.uint16)
        if src is not None:
            u = jax.lax.with_sharding_constraint(u, src)
        u = jax.lax.with_sharding_constraint(u, sharding)
        return jax.lax.bitcast_convert_type(u, x.dtype)
    return jax.lax.with_sharding_constraint(x, sharding)



@dataclass(frozen=True)
class LeafGather:
    """Static description of one weight's gathers (hashable: a custom_vjp nondiff arg)."""

    layout: LeafLayout
    mesh: Any
    params_axes: tuple[str, ...]
    grads_axes: tuple[str, ...]
    secondary_axes: Optional[tuple[str, ...]]
    quantize_gather: bool
    secondary_int8: bool
    block: int
    dtype: Any  # working-weight dtype (str): what the gathers move (before int8)
    grad_dtype: Any = "float32"  # dtype the gradient is reduced (and returned) in

    # -- shardings
    def sharding(self, axes) -> NamedSharding:
        return NamedSharding(self.mesh, self.layout.spec(axes))

    @property
    def n(self) -> int:
        return self.layout.padded[self.layout.dim] if self.layout.dim is not None else 1

    @property
    def active(self) -> bool:
        return self.layout.dim is not None and bool(self.params_axes)

    @property
    def quantizable(self) -> bool:
        lay = self.layout
        return lay.dim is not None and not lay.tp[lay.dim] and lay.numel >= 2

    @property
    def int8_primary(self) -> bool:
        return self.quantize_gather and self.quantizable

    @property
    def int8_secondary(self) -> bool:
        return (self.secondary_int8 or self.quantize_gather) and self.quantizable

    @property
    def secondary_is_slice(self) -> bool:
        return self.secondary_axes is not None and set(self.params_axes) <= set(self.secondary_axes)

    # -- chunked int8 layout: dim → (chunks, dim/chunks), blocks along another dim
    def _qaxis(self, chunked_shape) -> int:
        d = self.layout.dim
        cands = [i for i in range(len(chunked_shape)) if i != d
                 and not (i < d and self.layout.tp[i]) and not (i > d + 1 and self.layout.tp[i - 1])]
        return max(cands, key=lambda i: (chunked_shape[i], i))

    def _chunked(self, chunks: int):
        lay, d = self.layout, self.layout.dim
        shape = lay.padded[:d] + (chunks, lay.padded[d] // chunks) + lay.padded[d + 1:]
        qa = self._qaxis(shape)
        nb = math.ceil(shape[qa] / self.block)
        block = math.ceil(shape[qa] / nb)
        return shape, qa, block

    def _q_spec(self, chunked_shape, qa, axes) -> P:
        """Spec of q (qa moved last and split into [nb, block]) with `axes` on the chunk dim."""
        lay, d = self.layout, self.layout.dim
        tp = list(lay.tp[:d]) + [(), ()] + list(lay.tp[d + 1:])
        entries = [_spec_entry(tp[i]) if i != d else _spec_entry(axes)
                   for i in range(len(chunked_shape))]
        del entries[qa]
        return P(*entries, None, None)

    def quantize(self, x, chunks: int, axes):
        """x (padded, sharded over `axes` on dim) → (q, scale) sharded the same way, locally."""
        shape, qa, block = self._chunked(chunks)
        xc = jax.lax.with_sharding_constraint(
            x.reshape(shape), NamedSharding(self.mesh, self._chunk_spec(shape, axes)))
        q, s = quant.quantize(xc, block, axis=qa)
        qs = self._q_spec(shape, qa, axes)
        q = jax.lax.with_sharding_constraint(q, NamedSharding(self.mesh, qs))
        s = jax.lax.with_sharding_constraint(s, NamedSharding(self.mesh, P(*tuple(qs)[:-1])))
        return q, s

    def _chunk_spec(self, shape, axes) -> P:
        lay, d = self.layout, self.layout.dim
        tp = list(lay.tp[:d]) + [(), ()] + list(lay.tp[d + 1:])
        return P(*[_spec_entry(axes) if i == d else _spec_entry(tp[i]) for i in range(len(shape))])

    def dequantize_gather(self, q, s, chunks: int, axes=()):
        """(q, scale) → constrain to `axes` on the chunk dim (a gather) → dequantized padded x."""
        shape, qa, _ = self._chunked(chunks)
        qs = self._q_spec(shape, qa, axes)
        q = jax.lax.with_sharding_constraint(q, NamedSharding(self.mesh, qs))
        s = jax.lax.with_sharding_constraint(s, NamedSharding(self.mesh, P(*tuple(qs)[:-1])))
        y = quant.dequantize(q, s, shape, jnp.dtype(self.dtype), axis=qa)
        return y.reshape(self.layout.padded)

    def unpad(self, x):
        lay = self.layout
        if not lay.pad:
            return x
        return jax.lax.slice_in_dim(x, 0, lay.shape[lay.dim], axis=lay.dim)

    def pad(self, x):
        lay = self.layout
        if not lay.pad:
            return x
        widths = [(0, 0)] * x.ndim
        widths[lay.dim] = (0, lay.pad)
        return jnp.pad(x, widths)

    def n_axes(self, axes) -> int:
        return int(math.prod(self.mesh.shape[a] for a in axes)) if axes else 1

    def local(self, x):
        """The stored shard in the working dtype (a local cast: the caller may pass an fp32
        view of bf16 weights so that gradients come back, and are reduced, in fp32)."""
        if x.dtype == jnp.dtype(self.dtype):
            return x
        return jax.lax.with_sharding_constraint(x.astype(self.dtype),
                                                self.sharding(self.params_axes))

    # -- the gathers (primal computations; gradients are defined below)
    def gather_primary(self, x):
        """Stored shard → padded full weight (flat gather over params axes)."""
        x = self.local(x)
        if self.int8_primary:
            q, s = self.quantize(x, self.n_axes(self.params_axes), self.params_axes)
            return self.dequantize_gather(q, s, self.n_axes(self.params_axes))
        return reshard_bits(x, self.sharding(()), self.sharding(self.params_axes))

    def to_secondary(self, x):
        """Stored shard → the secondary partition (array, or (q, scale) when int8)."""
        S = self.secondary_axes
        src = self.local(x) if self.secondary_is_slice else self.gather_primary(x)
        sec = reshard_bits(src, self.sharding(S),
                           self.sharding(self.params_axes if self.secondary_is_slice else ()))
        if self.int8_secondary:
            return self.quantize(sec, self.n_axes(S), S)
        return sec

    def from_secondary(self, sec):
        if self.int8_secondary:
            q, s = sec
            return self.dequantize_gather(q, s, self.n_axes(self.secondary_axes))
        return reshard_bits(sec, self.sharding(()), self.sharding(self.secondary_axes))

    def grad_to_stored(self, ct, dtype):
        """Cotangent of the full (unpadded) weight → padded, cast to `dtype` (the stored view's,
        normally grad_dtype) *before* the reduction, constrained to the grads sharding: XLA
        emits one reduce-scatter over the grads axes that are batch axes."""
        ct = self.pad(ct.astype(dtype))
        return jax.lax.with_sharding_constraint(ct, self.sharding(self.grads_axes))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _gather_primary(g: LeafGather, x):
    return g.unpad(g.gather_primary(x))


def _gp_fwd(g, x):
    return _gather_primary(g, x), jnp.zeros((0,), x.dtype)


def _gp_bwd(g, res, ct):
    return (g.grad_to_stored(ct, res.dtype),)


_gather_primary.defvjp(_gp_fwd, _gp_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _gather_secondary(g: LeafGather, sec, x):
    """Primal uses only `sec`; `x` (the stored shard) carries the gradient."""
    del x
    return g.unpad(g.from_secondary(sec))


def _gs_fwd(g, sec, x):
    return _gather_secondary(g, sec, x), jnp.zeros((0,), x.dtype)


def _gs_bwd(g, res, ct):
    return (None, g.grad_to_stored(ct, res.dtype))


_gather_secondary.defvjp(_gs_fwd, _gs_bwd)


def gather_leaf(g: LeafGather, x):
    """The full (unpadded) weight for compute, tagged FULL_NAME; see the module docstring."""
    if not g.active:
        return g.unpad(x).astype(g.dtype)
    if g.secondary_axes is None:
        full = _gather_primary(g, x)
    else:
        sec = jax.lax.stop_gradient(g.to_secondary(x))
        sec = checkpoint_name(sec, SECONDARY_NAME)
        full = _gather_secondary(g, sec, x)
    return checkpoint_name(full, FULL_NAME)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 3))
def _embed(g: LeafGather, table, tokens, batch_axes):
    return jnp.take(g.unpad(g.gather_primary(table)), tokens, axis=0)


def _embed_fwd(g, table, tokens, batch_axes):
    return _embed(g, table, tokens, batch_axes), (tokens, jnp.zeros((0,), table.dtype))


def _embed_bwd(g, batch_axes, res, ct):
    """Each device scatter-adds its rows' cotangents into a full (padded) fp32 table, then one
    explicit reduce-scatter (working dtype) over the batch axes onto the grads sharding.
    (Left to GSPMD, XLA instead all-gathers every row's cotangent and token id.)"""
    tokens, marker = res
    lay = g.layout
    axes = tuple(batch_axes)
    tp_entries = lay.spec(())

    def body(ct, tok):
        z = jnp.zeros(lay.padded, jnp.float32)
        z = z.at[tok.reshape(-1)].add(ct.reshape(-1, ct.shape[-1]).astype(jnp.float32))
        z = z.astype(g.dtype)
        if axes:
            z = jax.lax.psum_scatter(z, axes, scatter_dimension=lay.dim, tiled=True)
        return z

    spec_in = _spec_entry(axes)
    out_spec = lay.spec(axes)
    del tp_entries
    d_table = jax.shard_map(body, mesh=g.mesh, in_specs=(P(spec_in), P(spec_in)),
                            out_specs=out_spec)(ct, tokens)
    d_table = jax.lax.with_sharding_constraint(d_table.astype(marker.dtype),
                                               g.sharding(g.grads_axes))
    return (d_table, None)


_embed.defvjp(_embed_fwd, _embed_bwd)


def embed_lookup(g: LeafGather, table, tokens, batch_axes):
    """Embedding rows of `tokens` from the stored table: forward gathers the table (flat, int8
    under qwZ), backward reduce-scatters the table gradient (see _embed_bwd)."""
    if (not g.active or tuple(batch_axes) != tuple(g.grads_axes) or any(g.layout.tp)):
        return jnp.take(gather_leaf(g, table), tokens, axis=0)
    return _embed(g, table, tokens, tuple(batch_axes))


def leaf_gathers(placement: Placement, layouts=None, sliced: bool = False):
    """Pytree of LeafGather matching `layouts` (default: the placement's)."""
    pl = placement
    layouts = pl.layouts if layouts is None else layouts

    def one(lay):
        lay = lay.sliced() if sliced else lay
        return LeafGather(lay, pl.mesh, pl.params_axes, pl.grads_axes, pl.secondary_axes,
                          pl.quantize_gather, pl.secondary_int8, pl.quant_block, pl.param_dtype,
                          pl.grad_accum_dtype)

    return jax.tree.map(one, layouts, is_leaf=is_layout)


def gather_tree(gathers, tree):
    return jax.tree.map(gather_leaf, gathers, tree, is_leaf=lambda x: isinstance(x, LeafGather))


def pad_tree(placement: Placement, tree):
    """Logical arrays → stored (padded) arrays."""
    def one(lay, x):
        if not lay.pad:
            return x
        widths = [(0, 0)] * x.ndim
        widths[lay.dim] = (0, lay.pad)
        return jnp.pad(x, widths)

    return jax.tree.map(one, placement.layouts, tree, is_leaf=is_layout)


def unpad_tree(placement: Placement, tree):
    def one(lay, x):
        return x if not lay.pad else jax.lax.slice_in_dim(x, 0, lay.shape[lay.dim], axis=lay.dim)

    return jax.tree.map(one, placement.layouts, tree, is_leaf=is_layout)


# --------------------------------------------------------------------------- the forward


def remat_policy(remat: str, gathers: bool):
    """The per-layer checkpoint policy (None: no jax.checkpoint at all).

    With gathers the gathered weight must not be saved, so remat="none" becomes "save every
    matmul output plus the named values" (weights are inputs of matmuls, never outputs).
    """
    from boost_jax.layers.linear import LATENT_NAME
    from boost_jax.layers.model import RESIDUAL_NAME

    cp = jax.checkpoint_policies
    if remat == "none":
        if not gathers:
            return None
        return cp.save_from_both_policies(cp.dots_saveable,
                                          cp.save_only_these_names(SECONDARY_NAME, LATENT_NAME,
                                                                   RESIDUAL_NAME))
    if remat == "full":
        return cp.save_only_these_names(SECONDARY_NAME)
    if remat == "lowrank":
        return cp.save_only_these_names(LATENT_NAME, RESIDUAL_NAME, SECONDARY_NAME)
    raise ValueError(f"remat={remat!r}")


def build_forward(cfg, graphdef, placement: Placement, loss: Callable) -> Callable:
    """loss_fn(stored_params, batch, batch_axes) -> scalar, gathering weights layer by layer.

    Mirrors LlamaModel.__call__ (embed → blocks → final_norm → head) using the model's own
    submodules; `loss(logits, targets)` is the token loss (mean cross-entropy).
    """
    from flax import nnx

    from boost_jax.layers.model import LATENT_KEYS

    pl = placement
    mcfg = cfg.model
    remat = cfg.train.remat
    sharded = bool(pl.params_axes)
    policy = remat_policy(remat, sharded)
    gathers = leaf_gathers(pl)
    layer_gathers = leaf_gathers(pl, pl.layouts["blocks"], sliced=True)
    scan = bool(cfg.train.scan_layers)
    tied = mcfg.tie_embeddings

    def ckpt(fn):
        return fn if policy is None else jax.checkpoint(fn, policy=policy)

    def loss_fn(params, batch, batch_axes=pl.batch_axes):
        tokens, targets = batch["inputs"], batch["targets"]
        bspec = NamedSharding(pl.mesh, P(_spec_entry(batch_axes)))
        tokens = jax.lax.with_sharding_constraint(tokens, bspec)
        b, s = tokens.shape
        positions = jnp.arange(s, dtype=jnp.int32)
        model = nnx.merge(graphdef, params)
        dtype = model.dtype

        # embedding: forward-only use (its backward needs no weight), so no checkpoint
        h = embed_lookup(gathers["embed"]["embedding"], params["embed"]["embedding"], tokens,
                         batch_axes).astype(dtype)
        prev = None
        if mcfg.arch == "lax":
            prev = {k: jnp.zeros((b, s, mcfg.r), dtype) for k in LATENT_KEYS}

        if scan:
            gd_blocks, _ = nnx.split(model.blocks)

            def layer(lp, h, prev):
                blk = nnx.merge(gd_blocks, gather_tree(layer_gathers, lp))
                return blk(h, positions, prev)

            layer = ckpt(layer)

            def body(carry, lp):
                return layer(lp, *carry), None

            (h, prev), _ = jax.lax.scan(body, (h, prev), params["blocks"])
        else:
            for i, blk_mod in enumerate(model.blocks):
                gd_i, _ = nnx.split(blk_mod)
                key = i if i in params["blocks"] else str(i)

                def layer(lp, h, prev, gd_i=gd_i, key=key):
                    blk = nnx.merge(gd_i, gather_tree(layer_gathers[key], lp))
                    return blk(h, positions, prev)

                h, prev = ckpt(layer)(params["blocks"][key], h, prev)

        def head(hp, h, targets):
            norm_scale = gather_leaf(gathers["final_norm"]["scale"], hp["final_norm"]["scale"])
            if tied:
                w = gather_leaf(gathers["embed"]["embedding"], hp["embed"]["embedding"]).T
            else:
                w = gather_leaf(gathers["lm_head"]["w"], hp["lm_head"]["w"])
            from boost_jax.layers.norms import rms_norm

            hn = rms_norm(h, norm_scale, mcfg.norm_eps, dtype)
            logits = jnp.einsum("bsd,dv->bsv", hn, w.astype(dtype),
                                preferred_element_type=jnp.float32)
            return loss(logits, targets)

        hp = {"final_norm": params["final_norm"]}
        hp.update({"embed": params["embed"]} if tied else {"lm_head": params["lm_head"]})
        return ckpt(head)(hp, h, targets)

    return loss_fn


__all__ = ["reshard_bits", "LeafGather", "gather_leaf", "gather_tree", "leaf_gathers", "pad_tree", "unpad_tree",
           "build_forward", "remat_policy", "SECONDARY_NAME", "FULL_NAME"]
