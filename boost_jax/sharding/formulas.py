"""Predicted per-device memory and per-step communication of a placement plan.

Notation: Ψ parameters (under TP: Ψₜ, the elements of one device's TP shard); bytes per element
w (working weights: 2 bf16, 4 fp32), a (gradients, reduced and accumulated in grad_accum_dtype:
4); k micro-batches; a role over axes X has |X| devices. Ring costs, bytes *sent by one
device* (what comm.py reports):

    all-gather over n devices of a result of P bytes      (n−1)/n · P
    reduce-scatter over n devices of an input of P bytes  (n−1)/n · P
    all-reduce over n devices of P bytes                  2(n−1)/n · P

A collective belongs to the slowest level among the axes its group spans (global > node >
pair). int8 payloads are q(Ψ) = Ψ + 4·blocks (one fp32 scale per block of ≤ quant_block).

Per micro-batch (× k), as boost_jax.train.engine runs it, every weight that is gathered (A =
params axes ≠ ∅); the layers re-fetch in backward, the embedding and head do not:
    forward    no secondary: AG_A(Ψw or q)                       re-gathered in backward: + AG_A
               secondary S:  [AG_A(Ψw or q) unless S ⊇ A] + AG_S(Ψw or q)  backward: + AG_S
    gradient   RS over grads axes of Ψa (AR for a leaf that is not sharded), this device's rows;
               with qgZ (zeropp): an all-to-all of int4 blocks inside the node, AA(qΨ), then
               across nodes, AA(qΨ/D), q(Ψ) = Ψ/2 + 4·blocks
Per optimizer step (× 1), R = batch axes − grads axes (the deferred axes):
    reduce     AR over R − opt of Ψa/|grads| ; RS over R ∩ opt of Ψa/|grads|
    weights    AG over opt − grads of Ψw/|grads| (result) ; AG over grads − params of Ψw/|params|

Closed forms for Ψ bf16 weights (w = 2, a = 4), N devices, a node of D = |pair·node| devices,
G nodes (embedding and head ignored):
    zero3         global: k·(2 + 2 + 4)Ψ·(N−1)/N
    zeropp (qwZ+hpZ over the node, qgZ int4 gradients):
                  global: k·(q₈(Ψ)·(N−1)/N + q₄(Ψ)/D·(G−1)/G) ≈ k·(1.01 + 0.5/D)Ψ
                  node: 2k·q₈(Ψ)·(D−1)/D + k·q₄(Ψ)·(D−1)/D
    hierarchical  global: 4Ψ/D·(G−1)/G + 2Ψ/D·(G−1)/G = 6Ψ(G−1)/(G·D), once per step
                  pair: k·2·(Ψw or q(Ψ))·(|pair|−1)/|pair| ; node: k·4Ψ·(D−1)/D + AG node
    ddp           global: 2(N−1)/N·4Ψ once per step (fp32 all-reduce of the accumulator)
    zero1         global: (N−1)/N·(4Ψ + 2Ψ) once per step
so zero3/hierarchical ≈ (4/3)·k·D·(N−1)/N / ((G−1)/G), zeropp/hierarchical ≈ k·D/6 + k/12.
With TP over `pair` the same hold with Ψₜ and D = |node| (e.g. CoLA-1B on 2×2×2: zero3 over
node+global vs hierarchical's once-per-step reduction across `global`).

Memory per device (stored state + the accumulator + saved secondaries):
    weights Ψw/|params|   master 4Ψ/|opt| (bf16 weights only)   adam 8Ψ/|opt|
    grads   Ψa/|grads|    secondary Ψw/|S| or q(Ψ)/|S| (kept from forward to backward)
Padding (a dim padded to a multiple of the role devices) adds its zeros to every role; the
report lists it separately. A leaf that could not be sharded counts at full size.

Compiled CPU programs are compared through boost_jax.analysis.comm, whose bytes already undo
the XLA:CPU artifacts (bf16 reductions run in fp32; reduce-scatter lowered as all-reduce +
dynamic-slice), so they are what a GPU would move.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import jax
import numpy as np

from boost_jax.sharding import quant
from boost_jax.sharding.gather import LeafFetch, qgz_stages
from boost_jax.sharding.layout import is_layout

LEVELS = ("pair", "node", "global")


def level_of(axes: Sequence[str]) -> Optional[str]:
    axes = set(axes)
    for lv in ("global", "node", "pair"):
        if lv in axes:
            return lv
    return None


def _n(mesh, axes) -> int:
    return int(math.prod(mesh.shape[a] for a in axes)) if axes else 1


def _bytes(dtype) -> int:
    return int(np.dtype(dtype).itemsize)


def _leaves(pl):
    flat = jax.tree_util.tree_flatten_with_path(pl.layouts, is_leaf=is_layout)[0]
    return [(tuple(getattr(k, "key", getattr(k, "idx", k)) for k in p), lay) for p, lay in flat]


def _fetches(pl) -> dict:
    """LeafFetch per leaf path, as the step builds them (per-layer layouts)."""
    return {path: LeafFetch.of(pl, lay) for path, lay in _leaves(pl)}


def int8_payload(f: LeafFetch, axes) -> float:
    """Bytes of q + scales of the whole (TP-local) leaf when each shard over `axes` is
    quantized on its own (what an int8 all-gather over `axes` delivers)."""
    qa, shape = f.quant_axis(axes), f.local_shape(axes)
    return float(f.n(axes) * quant.payload_bytes(shape, f.qblock(shape[qa]), qa))


def qgz_payloads(f: LeafFetch, layers: int) -> list[tuple[tuple, float]]:
    """(axes, all-to-all buffer bytes) of each qgZ stage for one leaf (all its layers): each
    device's n chunks of int4 blocks + fp32 scales (gather.LeafFetch.int4_reduce_scatter)."""
    out, elems = [], math.prod(f.local_shape(()))
    for axes in qgz_stages(f.grads_axes):
        n = f.n(axes)
        m = elems // n
        block = f.qblock(m) + f.qblock(m) % 2
        out.append((axes, layers * n * quant.payload_bytes_int4(m, block)))
        elems = m
    return out


def _tp_local(f: LeafFetch, lay) -> float:
    """Elements of one device's TP shard of the leaf (all layers), padded."""
    return lay.padded_numel / math.prod(f.n(tp) for tp in lay.tp)


def memory_per_device(pl) -> dict:
    """Predicted bytes per device by role (see module docstring); keys usable with
    comm.compare_memory(..., combine={"argument": ["weights", "master", "adam"]})."""
    mesh = pl.mesh
    w = _bytes(pl.param_dtype)
    a = _bytes(pl.grad_accum_dtype)
    mixed = w != 4
    out = {k: 0.0 for k in ("weights", "master", "adam", "grads", "secondary")}
    pad = {k: 0.0 for k in out}
    unsharded = 0.0
    fetches = _fetches(pl)
    for path, lay in _leaves(pl):
        f = fetches[path]
        sharded = lay.dim is not None
        layers = lay.padded[0] if lay.layer_axis else 1
        local = _tp_local(f, lay)

        def share(axes, numel):
            return numel / (_n(mesh, axes) if sharded else 1)

        roles = {"weights": (pl.params_axes, w), "adam": (pl.opt_state_axes, 8),
                 "grads": (pl.grads_axes, a)}
        if mixed:
            roles["master"] = (pl.opt_state_axes, 4)
        frac = local / lay.padded_numel
        for k, (axes, b) in roles.items():
            out[k] += share(axes, lay.padded_numel) * b * frac
            pad[k] += share(axes, lay.padded_numel - lay.numel) * b * frac
        S = pl.secondary_axes
        int8s = f.secondary_int8 or f.quantize_gather
        if S is not None and f.gathers:  # kept from forward to backward, every layer
            if int8s:
                out["secondary"] += layers * int8_payload(f, S) / _n(mesh, S)
            elif tuple(S) != tuple(pl.params_axes):
                out["secondary"] += local * w / _n(mesh, S)
        if not sharded and (pl.params_axes or pl.opt_state_axes):
            unsharded += local * (w + 8 + (4 if mixed else 0))
    out["total"] = sum(out.values())
    out["padding"] = sum(pad.values())
    out["padding_by_role"] = pad
    out["unsharded_leaves_bytes"] = unsharded
    out["params"] = sum(lay.numel for _, lay in _leaves(pl))
    out["padded_params"] = sum(lay.padded_numel for _, lay in _leaves(pl))
    return out


def comm_per_step(pl, micro_batches: int, terms: bool = False, tied: bool = False) -> dict:
    """Predicted bytes sent per device per optimizer step by the plan's collectives (weight
    gathers and gradient reductions; TP's activation collectives are tp/specs.py's), by level,
    as boost_jax.train.engine runs them (see module docstring).

    `tied`: the embedding is also the head (fetched twice). With terms=True also returns the
    list of (name, kind, level, bytes) contributions."""
    mesh = pl.mesh
    k = micro_batches
    w = _bytes(pl.param_dtype)
    a = _bytes(pl.grad_accum_dtype)
    P_, G, O, S, R = (pl.params_axes, pl.grads_axes, pl.opt_state_axes, pl.secondary_axes,
                      pl.deferred_axes)
    out = {lv: 0.0 for lv in LEVELS}
    rows = []

    def add(name, kind, axes, payload, times=1):
        n = _n(mesh, axes)
        lv = level_of(axes)
        if n <= 1 or lv is None or payload <= 0:
            return
        f = 2.0 * (n - 1) / n if kind == "AR" else (n - 1) / n  # AG, RS, AA (all-to-all)
        b = f * payload * times
        out[lv] += b
        rows.append((name, kind, lv, b))

    fetches = _fetches(pl)
    for path, lay in _leaves(pl):
        f = fetches[path]
        name = "/".join(str(p) for p in path)
        psi = _tp_local(f, lay)
        layers = lay.padded[0] if lay.layer_axis else 1
        uses = 2 if (tied and path[:1] == ("embed",)) else 1
        remat = path[:1] == ("blocks",)  # layers re-fetch in backward; embedding and head don't
        if f.gathers:
            int8p = f.quantize_gather
            prim = layers * int8_payload(f, P_) if int8p else psi * w
            if S is None:
                add(name + " fwd", "AG", P_, prim, k * uses)
                if remat:
                    add(name + " bwd", "AG", P_, prim, k)
            else:
                int8s = f.secondary_int8 or f.quantize_gather
                sec = layers * int8_payload(f, S) if int8s else psi * w
                if tuple(S[:len(P_)]) != tuple(P_):  # S ⊂ P: sliced from a flat gather
                    add(name + " fwd", "AG", P_, prim, k * uses)
                add(name + " fwd(S)", "AG", S, sec, k * uses)
                if remat:
                    add(name + " bwd(S)", "AG", S, sec, k)
        if lay.dim is not None and f.quantize_grads and G:
            for axes, payload in qgz_payloads(f, layers):
                add(name + " grad(int4)", "AA", axes, payload, k * uses)
        elif lay.dim is not None:
            add(name + " grad", "RS", G, psi * a, k * uses)
        else:
            add(name + " grad", "AR", G, psi * a, k * uses)
        n_g = _n(mesh, G) if lay.dim is not None else 1
        S2 = tuple(x for x in R if x not in O)
        S1 = tuple(x for x in R if x in O)
        if lay.dim is not None:
            add(name + " reduce(R-opt)", "AR", S2, psi * a / n_g)
            add(name + " reduce(R)", "RS", S1, psi * a / n_g)
        else:
            add(name + " reduce(R)", "AR", R, psi * a)
        if lay.dim is not None:
            if set(P_) <= set(G) <= set(O):
                add(name + " params(opt→grads)", "AG", tuple(x for x in O if x not in G),
                    psi * w / _n(mesh, G))
                add(name + " params(grads→params)", "AG", tuple(x for x in G if x not in P_),
                    psi * w / _n(mesh, P_))
            else:
                add(name + " params", "AG", tuple(x for x in O if x not in P_),
                    psi * w / _n(mesh, P_))
    out["total"] = sum(out[lv] for lv in LEVELS)
    if terms:
        out["terms"] = rows
    return out


__all__ = ["memory_per_device", "comm_per_step", "level_of", "int8_payload"]
