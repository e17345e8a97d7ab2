"""Predicted per-device memory and per-step communication of a placement plan.

Notation: Ψ parameters; bytes per element w (working weights: 2 bf16, 4 fp32), a (gradient
accumulator, grad_accum_dtype: 4), c (per-micro-batch gradient reduction = the working dtype:
2 under bf16); k micro-batches; a role over axes X has |X| devices. Ring costs, bytes *sent by
one device* (what comm.py reports):

    all-gather over n devices of a result of P bytes      (n−1)/n · P
    reduce-scatter over n devices of an input of P bytes  (n−1)/n · P
    all-reduce over n devices of P bytes                  2(n−1)/n · P

A collective belongs to the slowest level among the axes its group spans (global > node >
pair). int8 payloads are q(Ψ) = Ψ + 4·blocks (one fp32 scale per block of ≤ quant_block).

Per micro-batch (× k), every weight that is gathered (A = params axes ≠ ∅):
    forward    no secondary: AG_A(Ψw or q)                       re-gathered in backward: + AG_A
               secondary S:  [AG_A(Ψw or q) unless S ⊇ A] + AG_S(Ψw or q)  backward: + AG_S
    gradient   RS over grads axes of Ψc      (the partial sums of the group's rows)
Per optimizer step (× 1), R = batch axes − grads axes (the deferred axes):
    reduce     AR over R − opt of Ψa/|grads| ; RS over R ∩ opt of Ψa/|grads|
    weights    AG over opt − grads of Ψw/|grads| (result) ; AG over grads − params of Ψw/|params|

Closed forms for Ψ bf16 weights (w = c = 2, a = 4), N devices, a node of D = |pair·node|
devices, G nodes; the embedding's backward needs no weight (no re-gather), ignored here:
    zero3         global: k·(2 + 2 + 2)Ψ·(N−1)/N          (DESIGN's "3Ψ·k" in bf16 elements)
    zeropp (qwZ+hpZ over the node, bf16 gradients — no qgZ):
                  global: k·(q(Ψ) + 2Ψ)·(N−1)/N ≈ 3.03Ψ·k   node: 2k·q(Ψ)·(D−1)/D
                  (DESIGN's 0.75Ψ·k additionally quantizes gradients to int4, qgZ: not done)
    hierarchical  global: 4Ψ/D·(G−1)/G + 2Ψ/D·(G−1)/G = 6Ψ(G−1)/(G·D), once per step
                  pair: k·2·(Ψw or q(Ψ))·(|pair|−1)/|pair| ; node: k·2Ψ·(D−1)/D + AG node
    ddp           global: 2(N−1)/N·4Ψ once per step (fp32 all-reduce of the accumulator)
    zero1         global: (N−1)/N·(4Ψ + 2Ψ) once per step
so zero3/hierarchical ≈ k·D·(N−1)/N / ((G−1)/G) ≥ k·D, zeropp/hierarchical ≈ k·D/2.

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
    from boost_jax.sharding.plans import is_layout

    flat = jax.tree_util.tree_flatten_with_path(pl.layouts, is_leaf=is_layout)[0]
    return [(tuple(getattr(k, "key", getattr(k, "idx", k)) for k in p), lay) for p, lay in flat]


def int8_payload(gather, chunks: int) -> float:
    """Bytes of q + scales for one gather of a leaf quantized in `chunks` shards."""
    shape, qa, block = gather._chunked(chunks)
    rows = math.prod(shape) // shape[qa]
    nb = math.ceil(shape[qa] / block)
    return float(rows * nb * (block + 4))


def memory_per_device(pl) -> dict:
    """Predicted bytes per device by role (see module docstring); keys usable with
    comm.compare_memory(..., combine={"argument": ["weights", "master", "adam"]})."""
    from boost_jax.sharding.secondary import leaf_gathers

    mesh = pl.mesh
    w = _bytes(pl.param_dtype)
    a = _bytes(pl.grad_accum_dtype)
    mixed = w != 4
    out = {k: 0.0 for k in ("weights", "master", "adam", "grads", "secondary")}
    pad = {k: 0.0 for k in out}
    unsharded = 0.0
    gathers = dict(zip([p for p, _ in _leaves(pl)],
                       jax.tree.leaves(leaf_gathers(pl), is_leaf=lambda x: hasattr(x, "layout"))))
    for path, lay in _leaves(pl):
        sharded = lay.dim is not None

        def share(axes, numel):
            return numel / (_n(mesh, axes) if sharded else 1)

        roles = {"weights": (pl.params_axes, w), "adam": (pl.opt_state_axes, 8),
                 "grads": (pl.grads_axes, a)}
        if mixed:
            roles["master"] = (pl.opt_state_axes, 4)
        for k, (axes, b) in roles.items():
            out[k] += share(axes, lay.padded_numel) * b
            pad[k] += share(axes, lay.padded_numel - lay.numel) * b
        g = gathers[path]
        if pl.secondary_axes is not None and g.active:
            S = pl.secondary_axes
            if g.int8_secondary:
                out["secondary"] += int8_payload(g, _n(mesh, S)) / _n(mesh, S)
            elif not (set(S) == set(pl.params_axes)):
                out["secondary"] += lay.padded_numel * w / _n(mesh, S)
        if not sharded and (pl.params_axes or pl.opt_state_axes):
            unsharded += lay.numel * (w + 8 + (4 if mixed else 0))
    out["total"] = sum(out.values())
    out["padding"] = sum(pad.values())
    out["padding_by_role"] = pad
    out["unsharded_leaves_bytes"] = unsharded
    out["params"] = sum(lay.numel for _, lay in _leaves(pl))
    out["padded_params"] = sum(lay.padded_numel for _, lay in _leaves(pl))
    return out


def comm_per_step(pl, micro_batches: int, terms: bool = False) -> dict:
    """Predicted bytes sent per device per optimizer step, by level (see module docstring).

    With terms=True also returns the list of (name, level, bytes) contributions."""
    from boost_jax.sharding.secondary import leaf_gathers

    mesh = pl.mesh
    k = micro_batches
    w = _bytes(pl.param_dtype)
    c = w  # per-micro-batch reduction in the working dtype
    a = _bytes(pl.grad_accum_dtype)
    A, G, O, S, R = (pl.params_axes, pl.grads_axes, pl.opt_state_axes, pl.secondary_axes,
                     pl.deferred_axes)
    out = {lv: 0.0 for lv in LEVELS}
    rows = []

    def add(name, kind, axes, payload, times=1):
        n = _n(mesh, axes)
        lv = level_of(axes)
        if n <= 1 or lv is None or payload <= 0:
            return
        f = 2.0 * (n - 1) / n if kind == "AR" else (n - 1) / n
        b = f * payload * times
        out[lv] += b
        rows.append((name, kind, lv, b))

    gathers = dict(zip([p for p, _ in _leaves(pl)],
                       jax.tree.leaves(leaf_gathers(pl), is_leaf=lambda x: hasattr(x, "layout"))))
    tied = False
    for path, lay in _leaves(pl):
        g = gathers[path]
        name = "/".join(str(p) for p in path)
        psi = lay.padded_numel
        embed = path[:1] == ("embed",) and not tied
        cl = 4 if path[:1] == ("lm_head",) else c  # fp32 logits: the head's dW is fp32
        if g.active and embed and not any(lay.tp):
            # forward: one flat gather; backward: no weight needed, one reduce-scatter
            add(name + " fwd", "AG", A, int8_payload(g, _n(mesh, A)) if g.int8_primary
                else psi * w, k)
            add(name + " grad", "RS", G, psi * c, k)
        elif g.active:
            needs_bwd = not embed
            prim = int8_payload(g, _n(mesh, A)) if g.int8_primary else psi * w
            if S is None:
                add(name + " fwd", "AG", A, prim, k)
                if needs_bwd:
                    add(name + " bwd", "AG", A, prim, k)
            else:
                sec = int8_payload(g, _n(mesh, S)) if g.int8_secondary else psi * w
                if not g.secondary_is_slice:
                    add(name + " fwd", "AG", A, prim, k)
                add(name + " fwd(S)", "AG", S, sec, k)
                if needs_bwd:
                    add(name + " bwd(S)", "AG", S, sec, k)
            add(name + " grad", "RS", G, psi * cl, k)
        elif G or not lay.dim:
            inner = tuple(x for x in pl.batch_axes if x not in R)
            if lay.dim is None and inner:
                add(name + " grad", "AR", inner, psi * c, k)
        n_g = _n(mesh, G) if lay.dim is not None else 1
        undeferred = tuple(x for x in pl.batch_axes if x not in G and x not in R)
        if lay.dim is not None:  # (TP only) batch axes reduced every micro-batch, not deferred
            add(name + " grad(all batch)", "AR", undeferred, psi * c / n_g, k)
        S2 = tuple(x for x in R if x not in O)
        S1 = tuple(x for x in R if x in O)
        add(name + " reduce(R-opt)", "AR", S2, psi * a / n_g)
        if lay.dim is not None:
            add(name + " reduce(R)", "RS", S1, psi * a / n_g)
        else:
            add(name + " reduce(R)", "AR", S1, psi * a)
        if lay.dim is not None:
            if set(A) <= set(G) <= set(O):
                add(name + " params(opt→grads)", "AG", tuple(x for x in O if x not in G),
                    psi * w / _n(mesh, G))
                add(name + " params(grads→params)", "AG", tuple(x for x in G if x not in A),
                    psi * w / _n(mesh, A))
            else:
                add(name + " params", "AG", tuple(x for x in O if x not in A),
                    psi * w / _n(mesh, A))
    out["total"] = sum(out[lv] for lv in LEVELS)
    if terms:
        out["terms"] = rows
    return out


__all__ = ["memory_per_device", "comm_per_step", "level_of", "int8_payload"]
