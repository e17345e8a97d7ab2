"""Tensor parallelism: entry points for the training step and the placement plans.

    validate_tp(cfg, mesh)                    ConfigError (one line) if the model can't be cut
    tp_param_specs(cfg, params)               PartitionSpec per param naming only TP axes
    tp_shardings(cfg, mesh, params, dp_axes)  NamedShardings: TP split + optional DP split
    build_tp_loss_fn(cfg, graphdef, mesh)     loss_fn(params, batch) under jax.shard_map

Three ways to cut a decoder block (cfg.parallel.tp_mode; t = TP degree, b·s tokens):

    mode      arch           forward per layer              backward per layer
    megatron  full           2 AR, b·s·2d                   2 AR, b·s·2d
    vanilla   svd/cola/lax   7 AR, b·s·(5d + 2·d_ff)        7 AR, b·s·(6d + d_ff)
    btp       svd/cola/lax   4 AR, b·s·(7r + 2) (2 fp32)    4 AR, b·s·7r

(MHA; AR = all-reduce over the TP group, ring bytes per device 2(t−1)/t × payload; LaX under
vanilla adds a gather of each latent, see tp_vanilla.py.) Once per step, embedding + head
(tp_head.py): forward AR b·s·d (vocab-parallel embedding; none for btp's d-sharded table) or
AR b·s·d (btp's gather of h), AR b·s (max) and AR 2·b·s (sum-exp, gold) for the
distributed softmax CE; backward AR b·s·d. The derivations are in tp_megatron.py,
tp_vanilla.py and tp_btp.py. At 7B (d=4096, d_ff=11008, r=1024) vanilla/btp = 42496/7170 ≈ 5.93× forward and
35584/7168 ≈ 4.96× backward; btp/megatron = 0.875× forward.

The whole decoder runs inside ONE `jax.shard_map(..., axis_names=set(tp_axes),
check_vma=True)` (tp_common.tp_shard_map; check_vma=False only for btp with the Pallas kernels
in interpret mode, i.e. parallel.kernels=pallas without a GPU — exact, see tp_common): params
enter with in_specs = tp_param_specs (their data-parallel placement on the other axes is left
to XLA: those axes stay automatic), tokens enter replicated over TP
(P()) and sharded over the DP axes by the caller, the scalar loss leaves replicated. Layers run
under lax.scan over the stacked params (a Python loop for scan_layers=False), each wrapped per
cfg.train.remat: none; full (jax.checkpoint of the whole block: replays its collectives);
lowrank (save only the TP-reduced latents and the residual shard: under btp no collective is
replayed in backward).
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from boost_jax.errors import ConfigError
from boost_jax.sharding.tp_btp import btp_block, btp_init_prev
from boost_jax.sharding.tp_common import TPContext, make_context, run_layers, tp_shard_map
from boost_jax.sharding.tp_head import embed, head_loss
from boost_jax.sharding.tp_megatron import megatron_block, megatron_init_prev
from boost_jax.sharding.tp_vanilla import vanilla_block, vanilla_init_prev

MODES: dict[str, tuple[Callable, Callable]] = {
    "megatron": (megatron_block, megatron_init_prev),
    "vanilla": (vanilla_block, vanilla_init_prev),
    "btp": (btp_block, btp_init_prev),
}
LOWRANK_ARCHS = ("svd", "cola", "lax")


# --------------------------------------------------------------------------- validation


def tp_degree(cfg, mesh) -> int:
    return int(np.prod([mesh.shape[a] for a in cfg.parallel.tp_axes])) if cfg.parallel.tp_axes \
        else 1


def validate_tp(cfg, mesh) -> None:
    """Raise ConfigError naming the offending value and the fix if the model can't be cut."""
    par, m = cfg.parallel, cfg.model
    mode = par.tp_mode
    if mode == "none":
        return
    if mode not in MODES:
        raise ConfigError(f"parallel.tp_mode={mode!r} is not one of {['none', *MODES]}")
    axes = list(par.tp_axes)
    if not axes:
        raise ConfigError(f"parallel.tp_mode={mode} needs parallel.tp_axes, e.g. [pair]")
    bad = [a for a in axes if a not in mesh.axis_names]
    if bad or len(set(axes)) != len(axes):
        raise ConfigError(f"parallel.tp_axes={axes} must be distinct axes of the mesh "
                          f"{list(mesh.axis_names)}")
    if mode == "megatron" and m.arch != "full":
        raise ConfigError(f"parallel.tp_mode=megatron cuts full-rank layers but model.arch="
                          f"{m.arch}; use parallel.tp_mode=btp (or vanilla) for low-rank archs")
    if mode in ("vanilla", "btp") and m.arch not in LOWRANK_ARCHS:
        raise ConfigError(f"parallel.tp_mode={mode} needs a low-rank model.arch (svd, cola, lax) "
                          f"but model.arch={m.arch}; use parallel.tp_mode=megatron for arch=full")
    if mode == "btp":  # the only mode that calls the kernels; fail before data and compile
        from boost_jax.pallas import dispatch

        dispatch.resolve(par.kernels)  # one-line ConfigError for pallas on TPU
    t = tp_degree(cfg, mesh)
    need = [("model.vocab_size", m.vocab_size)]  # vocab-parallel head (and embedding)
    if mode == "megatron":
        need += [("model.n_heads", m.n_heads), ("model.n_kv_heads", m.kv_heads),
                 ("model.d_ff", m.d_ff)]
    elif mode == "btp":
        need += [("model.d_model", m.d_model), ("model.n_heads", m.n_heads),
                 ("model.n_kv_heads", m.kv_heads), ("model.d_ff", m.d_ff)]
    else:  # vanilla cuts every projection at its rank
        need += [("model.rank", m.r)]
    for key, value in need:
        if value % t:
            raise ConfigError(
                f"{key}={value} is not divisible by the tensor-parallel degree {t} "
                f"(parallel.tp_axes={axes}, tp_mode={mode}); make {key} a multiple of {t} "
                f"or use fewer TP axes")


# --------------------------------------------------------------------------- param specs


def _split_dim(mode: str, names: Sequence[str], tie: bool) -> Optional[int]:
    """Which dim (negative index) of the param at `names` is split over the TP axes."""
    top = names[0]
    if top == "embed":
        return -1 if (mode == "btp" and not tie) else -2  # d-sharded vs vocab-parallel
    if top == "lm_head":
        return -1
    if top == "final_norm":
        return None
    if top != "blocks" or len(names) < 3:
        raise ValueError(f"unknown parameter {'/'.join(names)}; tp_param_specs needs updating")
    sub, leaf = names[1], names[-1]
    if sub in ("attn_norm", "mlp_norm"):
        return -1 if mode == "btp" else None
    proj = names[2]
    if leaf in ("latent_scale", "g"):
        return None
    if mode == "megatron" and leaf == "w":
        return -2 if proj in ("o", "down") else -1
    if mode == "vanilla" and leaf in ("a", "b"):
        return -1 if leaf == "a" else -2
    if mode == "btp" and leaf in ("a", "b"):
        return -2 if leaf == "a" else -1
    raise ValueError(f"parameter {'/'.join(names)} has no tp_mode={mode} placement")


def _path_names(path) -> list[str]:
    out = []
    for k in path:
        key = getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))
        if isinstance(key, str):
            out.append(key)
    return out


def tp_param_specs(cfg, params) -> Any:
    """PartitionSpec for every leaf of the pure param dict, naming only cfg.parallel.tp_axes.

    Works on arrays or ShapeDtypeStructs, stacked (leading L) or per-layer param trees. The
    split dim holds all TP axes as one tuple entry, e.g. P(None, None, ('pair', 'node')).
    """
    mode, axes, tie = cfg.parallel.tp_mode, tuple(cfg.parallel.tp_axes), cfg.model.tie_embeddings
    if mode not in MODES:
        raise ConfigError(f"tp_param_specs needs a tp_mode in {list(MODES)}, got {mode!r}")

    def spec(path, x):
        dim = _split_dim(mode, _path_names(path), tie)
        if dim is None:
            return P()
        s = [None] * len(x.shape)
        s[dim] = axes
        return P(*s)

    return jax.tree_util.tree_map_with_path(spec, params)


def _local_shape(shape, spec: P, mesh) -> list[int]:
    out = list(shape)
    for i, entry in enumerate(spec):
        if entry is not None:
            names = entry if isinstance(entry, tuple) else (entry,)
            out[i] //= int(np.prod([mesh.shape[a] for a in names]))
    return out


def combine_spec(shape, tp_spec: P, dp_axes: Sequence[str], mesh) -> P:
    """Add a data-parallel split over dp_axes to a TP spec: the largest other dim whose TP-local
    size divides by the DP size (replicated over DP if none does)."""
    dp_axes = tuple(dp_axes)
    n = int(np.prod([mesh.shape[a] for a in dp_axes])) if dp_axes else 1
    spec = list(tp_spec) + [None] * (len(shape) - len(tp_spec))
    if n == 1:
        return P(*spec)
    local = _local_shape(shape, P(*spec), mesh)
    for dim in sorted(range(len(shape)), key=lambda i: -local[i]):
        if spec[dim] is None and local[dim] % n == 0:
            spec[dim] = dp_axes
            return P(*spec)
    return P(*spec)


def tp_shardings(cfg, mesh, params, dp_axes: Sequence[str] = ()) -> Any:
    """NamedShardings: the TP split of tp_param_specs, plus (ZeRO-style) a split of another dim
    over `dp_axes` when given."""
    specs = tp_param_specs(cfg, params)
    return jax.tree.map(lambda x, s: NamedSharding(mesh, combine_spec(x.shape, s, dp_axes, mesh)),
                        params, specs)


def residual_spec(cfg) -> P:
    """Spec of the residual stream [b, s, d] inside the TP region (btp: d-sharded)."""
    return P(None, None, tuple(cfg.parallel.tp_axes)) if cfg.parallel.tp_mode == "btp" else P()


# --------------------------------------------------------------------------- loss


def _decoder_loss(ctx: TPContext, params: dict, inputs, targets):
    block, init_prev = MODES[ctx.mode]
    b, s = inputs.shape
    positions = jnp.arange(s, dtype=jnp.int32)
    h = embed(ctx, params["embed"]["embedding"], inputs)
    h, _ = run_layers(ctx, functools.partial(block, ctx), params["blocks"], h, positions,
                      init_prev(ctx, b, s))
    return head_loss(ctx, params, h, targets)


def build_tp_loss_fn(cfg, graphdef, mesh) -> Callable:
    """loss_fn(params, batch) -> scalar mean CE, the whole model under one TP shard_map.

    `params` is the pure nested dict of the model (graphdef is accepted for the step's
    signature; the TP forward is written against the param-tree contract of layers/model.py).
    batch = {"inputs", "targets"} int32 [b, s], sharded over the DP axes by the caller.
    """
    del graphdef
    validate_tp(cfg, mesh)
    ctx = make_context(cfg, mesh)

    def loss_fn(params, batch):
        specs = tp_param_specs(cfg, params)
        fn = tp_shard_map(ctx, functools.partial(_decoder_loss, ctx), mesh,
                          in_specs=(specs, P(), P()), out_specs=P())
        return fn(params, batch["inputs"], batch["targets"])

    return loss_fn


# --------------------------------------------------------------------------- analysis


def build_tp_layers_fn(cfg, mesh) -> Callable:
    """layers_fn(blocks, h) -> h: the decoder stack only (stacked block params [L, ...]) under
    the TP shard_map, scanned and remat'ed exactly as in the loss — for HLO and memory
    analysis of per-layer communication without the embedding and head."""
    validate_tp(cfg, mesh)
    ctx = make_context(cfg, mesh)
    block, init_prev = MODES[ctx.mode]
    hspec = residual_spec(cfg)

    def fn(blocks, h):
        def body(blocks, h):
            b, s = h.shape[:2]
            positions = jnp.arange(s, dtype=jnp.int32)
            return run_layers(ctx, functools.partial(block, ctx), blocks, h, positions,
                              init_prev(ctx, b, s))[0]

        specs = tp_param_specs(cfg, {"blocks": blocks})["blocks"]
        return tp_shard_map(ctx, body, mesh, in_specs=(specs, hspec), out_specs=hspec)(
            blocks, h)

    return fn


def abstract_params(cfg) -> dict:
    """ShapeDtypeStructs of the model's pure param dict (stacked layers), nothing allocated."""
    from flax import nnx

    from boost_jax.layers.model import LlamaModel

    model = nnx.eval_shape(lambda: LlamaModel(cfg.model, rngs=nnx.Rngs(0), scan_layers=True))
    return nnx.to_pure_dict(nnx.split(model, nnx.Param)[1])


def layers_program(cfg, mesh, batch: int, seq: int, backward: bool = False):
    """(jitted fn, abstract args) of the cfg.model.n_layers TP blocks: forward h -> h, or
    forward+backward (blocks, h, cotangent) -> (dblocks, dh) via jax.vjp. Lower with
    `fn.lower(*args)` under `jax.set_mesh(mesh)`; no real arrays are needed."""
    layers_fn = build_tp_layers_fn(cfg, mesh)
    blocks = abstract_params(cfg)["blocks"]
    specs = tp_param_specs(cfg, {"blocks": blocks})["blocks"]
    blocks = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(
        x.shape, x.dtype, sharding=NamedSharding(mesh, s)), blocks, specs)
    h = jax.ShapeDtypeStruct((batch, seq, cfg.model.d_model), jnp.dtype(cfg.model.dtype),
                             sharding=NamedSharding(mesh, residual_spec(cfg)))
    if not backward:
        return jax.jit(layers_fn), (blocks, h)

    def fwd_bwd(blocks, h, ct):
        _, vjp = jax.vjp(layers_fn, blocks, h)
        return vjp(ct)

    return jax.jit(fwd_bwd), (blocks, h, h)


__all__ = ["validate_tp", "tp_param_specs", "tp_shardings", "combine_spec", "build_tp_loss_fn",
           "build_tp_layers_fn", "layers_program", "abstract_params", "residual_spec",
           "tp_degree", "MODES"]


def block_saved_residuals(cfg, mesh, batch: int, seq: int) -> list[tuple[str, int, str]]:
    """What ONE block keeps for backward on one device under cfg.train.remat.

    Returns [(type, bytes, source)], e.g. ("f32[2,8,16]", 1024, "named 'tp_latent' from ..."),
    from jax.ad_checkpoint.print_saved_residuals of the block traced inside the TP shard_map
    (shapes are per device, collectives are bound). Params are left out: they are inputs of
    the step, not activations. Nothing is compiled.
    """
    import contextlib
    import io
    import re

    from jax.ad_checkpoint import print_saved_residuals

    from boost_jax.analysis.hlo import dtype_bytes
    from boost_jax.sharding.tp_common import remat_block

    validate_tp(cfg, mesh)
    ctx = make_context(cfg, mesh)
    block, init_prev = MODES[ctx.mode]
    blocks = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype),
                          abstract_params(cfg)["blocks"])
    specs = tp_param_specs(cfg, {"blocks": blocks})["blocks"]
    hspec = residual_spec(cfg)
    buf = io.StringIO()

    def body(p, h):
        positions = jnp.arange(seq, dtype=jnp.int32)
        step = remat_block(lambda p, h, prev: block(ctx, p, h, positions, prev), ctx.remat)
        with contextlib.redirect_stdout(buf):
            print_saved_residuals(step, p, h, init_prev(ctx, batch, seq))
        return h

    h = jax.ShapeDtypeStruct((batch, seq, cfg.model.d_model), jnp.dtype(cfg.model.dtype))
    with jax.set_mesh(mesh):
        jax.eval_shape(tp_shard_map(ctx, body, mesh, in_specs=(specs, hspec), out_specs=hspec),
                       blocks, h)
    out = []
    for line in buf.getvalue().splitlines():
        m = re.match(r"\s*([a-z0-9]+)\[([0-9,]*)\]\S*\s+(.*)", line)
        if not m or m.group(3).startswith("from the argument p"):
            continue
        dims = [int(x) for x in m.group(2).split(",") if x]
        dt = {"f32": "f32", "bf16": "bf16", "i32": "s32", "bool": "pred"}.get(m.group(1),
                                                                              m.group(1))
        out.append((f"{m.group(1)}[{m.group(2)}]", int(np.prod(dims) * dtype_bytes(dt)),
                    m.group(3)))
    return out
