"""Tensor parallelism: which layouts exist, whether a model can be cut, and how each param is split.

    MODES                         tp_mode → the layout's ops (layers/forward.py's Ops)
    SPLITS                        tp_mode → the layout's SPLIT: the dim each leaf is cut along
    validate_tp(cfg, mesh)        ConfigError (one line) if the model can't be cut; called
                                  only by sharding/parallel.check
    tp_param_specs(cfg, params)   PartitionSpec per param naming only the TP axes

Three ways to cut a decoder block (t = TP degree, b·s tokens; derivations, and the list the
planner prices (block_collectives), in megatron.py, vanilla.py and btp.py):

    mode      arch           forward per layer              backward per layer
    megatron  full           2 AR, b·s·2d                   2 AR, b·s·2d
    vanilla   svd/cola/lax   7 AR, b·s·(5d + 2·d_ff)        7 AR, b·s·(6d + d_ff)
    btp       svd/cola/lax   4 AR, b·s·(7r + 2) (2 fp32)    4 AR, b·s·7r

(MHA; AR = all-reduce over the TP group, ring bytes per device 2(t−1)/t × payload.) Once per
step, embedding + head (common.py). GPT families: the same counts (btp: LayerNorm statistics in
the same all-reduce, see btp.py); biases and gpt2's position table are laid out like the
output they are added to. At 7B (d=4096, d_ff=11008, r=1024) vanilla/btp =
42496/7170 ≈ 5.93× forward and 35584/7168 ≈ 4.96× backward; btp/megatron = 0.875× forward.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import jax
from jax.sharding import PartitionSpec as P

from boost_jax.errors import ConfigError
from boost_jax.layers.forward import path_keys
from boost_jax.mesh import axis_size
from boost_jax.pallas import dispatch
from boost_jax.sharding.tp import btp, megatron, vanilla
from boost_jax.sharding.tp.btp import BTPOps
from boost_jax.sharding.tp.megatron import MegatronOps
from boost_jax.sharding.tp.vanilla import VanillaOps

MODES = {"megatron": MegatronOps, "vanilla": VanillaOps, "btp": BTPOps}
SPLITS = {"megatron": megatron.SPLIT, "vanilla": vanilla.SPLIT, "btp": btp.SPLIT}
LOWRANK_ARCHS = ("svd", "cola", "lax")


# --------------------------------------------------------------------------- validation


def tp_degree(cfg, mesh) -> int:
    return axis_size(mesh, cfg.parallel.tp_axes)


def validate_tp(cfg, mesh) -> None:
    """Raise ConfigError naming the offending value and the fix if the model can't be cut.
    The parallel section itself (tp_mode set with tp_axes) is ParallelConfig.validate's."""
    par, m = cfg.parallel, cfg.model
    mode = par.tp_mode
    if mode == "none":
        return
    axes = list(par.tp_axes)
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
    if m.n_kv_heads is None:  # it follows model.n_heads, which is named already
        need = [(k, v) for k, v in need if k != "model.n_kv_heads"]
    bad = [(key, value) for key, value in need if value % t]  # all of them, in one line
    if bad:
        names = " and ".join(f"{key}={value}" for key, value in bad)
        which = bad[0][0] if len(bad) == 1 else "each"
        raise ConfigError(
            f"{names} {'is' if len(bad) == 1 else 'are'} not divisible by the tensor-parallel "
            f"degree {t} (parallel.tp_axes={axes}, tp_mode={mode}); make {which} a multiple of "
            f"{t} or use fewer TP axes")


# --------------------------------------------------------------------------- param specs


def _split_dim(mode: str, names: Sequence[str], tie: bool) -> Optional[int]:
    """Which dim (negative index) of the param at `names` is split over the TP axes, read from
    the layout's own table (SPLIT in megatron.py, vanilla.py, btp.py)."""
    split, top, leaf = SPLITS[mode], names[0], names[-1]
    if leaf == "positions":  # laid out like the residual stream (btp: d-sharded)
        return split["positions"]
    if top == "embed":
        return -2 if tie else split["embed"]  # a tied table is the vocab-parallel head's
    if top == "lm_head":
        return -1
    if top == "final_norm":
        return None
    if top != "blocks" or len(names) < 3:
        raise ValueError(f"unknown parameter {'/'.join(names)}; tp_param_specs needs updating")
    if names[1] in ("attn_norm", "mlp_norm"):
        return split["norm"]
    if leaf in ("latent_scale", "g"):  # LaX's crossing runs on replicated latents
        return None
    for key in (f"{names[2]}.{leaf}", leaf):  # a projection's own entry first (megatron's o)
        if key in split["leaves"]:
            return split["leaves"][key]
    raise ValueError(f"parameter {'/'.join(names)} has no tp_mode={mode} placement")


def _path_names(path) -> list[str]:
    return [key for key in path_keys(path) if isinstance(key, str)]


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


def residual_spec(cfg) -> P:
    """Spec of the residual stream [b, s, d] inside the TP region (btp: d-sharded)."""
    return P(None, None, tuple(cfg.parallel.tp_axes)) if cfg.parallel.tp_mode == "btp" else P()
