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
    dtype: Any  # working-weight dtype (str)

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

    # -- the gathers (primal computations; gradients are defined below)
    def gather_primary(self, x):
        """Stored shard → padded full weight (flat gather over params axes)."""
        if self.int8_primary:
            q, s = self.quantize(x, self.n_axes(self.params_axes), self.params_axes)
            return self.dequantize_gather(q, s, self.n_axes(self.params_axes))
        return jax.lax.with_sharding_constraint(x, self.sharding(()))

    def to_secondary(self, x):
        """Stored shard → the secondary partition (array, or (q, scale) when int8)."""
        S = self.secondary_axes
        src = x if self.secondary_is_slice else self.gather_primary(x)
        sec = jax.lax.with_sharding_constraint(src, self.sharding(S))
        if self.int8_secondary:
            return self.quantize(sec, self.n_axes(S), S)
        return sec

    def from_secondary(self, sec):
        if self.int8_secondary:
            q, s = sec
            return self.dequantize_gather(q, s, self.n_axes(self.secondary_axes))
        return jax.lax.with_sharding_constraint(sec, self.sharding(()))

    def grad_to_stored(self, ct):
        """Cotangent of the full (unpadded) weight → padded, constrained to the grads sharding."""
        ct = self.pad(ct)
        return jax.lax.with_sharding_constraint(ct, self.sharding(self.grads_axes))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _gather_primary(g: LeafGather, x):
    return g.unpad(g.gather_primary(x))


def _gp_fwd(g, x):
    return _gather_primary(g, x), None


def _gp_bwd(g, _, ct):
    return (g.grad_to_stored(ct),)


_gather_primary.defvjp(_gp_fwd, _gp_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _gather_secondary(g: LeafGather, sec, x):
    """Primal uses only `sec`; `x` (the stored shard) carries the gradient."""
    del x
    return g.unpad(g.from_secondary(sec))


def _gs_fwd(g, sec, x):
    return _gather_secondary(g, sec, x), None


def _gs_bwd(g, _, ct):
    return (None, g.grad_to_stored(ct))


_gather_secondary.defvjp(_gs_fwd, _gs_bwd)


def gather_leaf(g: LeafGather, x):
    """The full (unpadded) weight for compute, tagged FULL_NAME; see the module docstring."""
    if not g.active:
        out = x if not g.layout.pad else g.unpad(x)
        return out
    if g.secondary_axes is None:
        full = _gather_primary(g, x)
    else:
        sec = jax.lax.stop_gradient(g.to_secondary(x))
        sec = checkpoint_name(sec, SECONDARY_NAME)
        full = _gather_secondary(g, sec, x)
    return checkpoint_name(full, FULL_NAME)


def leaf_gathers(placement: Placement, layouts=None, sliced: bool = False):
    """Pytree of LeafGather matching `layouts` (default: the placement's)."""
    pl = placement
    layouts = pl.layouts if layouts is None else layouts

    def one(lay):
        lay = lay.sliced() if sliced else lay
        return LeafGather(lay, pl.mesh, pl.params_axes, pl.grads_axes, pl.secondary_axes,
                          pl.quantize_gather, pl.secondary_int8, pl.quant_block, pl.param_dtype)

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
        emb = gather_leaf(gathers["embed"]["embedding"], params["embed"]["embedding"])
        h = jnp.take(emb, tokens, axis=0).astype(dtype)
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


__all__ = ["LeafGather", "gather_leaf", "gather_tree", "leaf_gathers", "pad_tree", "unpad_tree",
           "build_forward", "remat_policy", "SECONDARY_NAME", "FULL_NAME"]
