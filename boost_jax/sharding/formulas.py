"""Predicted per-device memory and per-step communication of a placement plan.

Communication is the sum of the step's own list of collectives (sharding/step_collectives.py:
what the engine runs, with its ring costs), by level; a collective belongs to the slowest level
among the axes its group spans (mesh.level_of). For Ψ bf16 weights, k micro-batches, N devices,
a node of D devices and G nodes, the bytes across nodes are k·8Ψ·(N−1)/N for zero3 and
6Ψ(G−1)/(G·D) per step, whatever k, for hierarchical: zero3/hierarchical ≈
(4/3)·k·D·(N−1)/N / ((G−1)/G).

Memory per device (stored state + the accumulator + saved secondaries):
    weights Ψw/|params| (|opt| with a deferred update: Placement.stored_axes)
    master  4Ψ/|opt| (bf16 weights only)      adam 4mΨ/|opt| (m moments: optim.name)
    grads   Ψa/|grads|    (k = 1, no pipeline, the layer stack: Ψa/|grads ∪ (R ∩ opt)|,
                          Placement.accum_axes)
    secondary Ψw/|S| or q(Ψ)/|S| of the layer stack (kept from forward to backward)
Padding (a dim padded to a multiple of the role devices) adds its zeros to every role; the
report lists it separately. A leaf that could not be sharded counts at full size.

Compiled CPU programs are compared through boost_jax.analysis.comm, whose bytes already undo
the XLA:CPU artifacts (bf16 reductions run in fp32; reduce-scatter lowered as all-reduce +
dynamic-slice), so they are what a GPU would move.

Closed forms for every plan and level: benchmarks/README.md §3, "Derivations moved from the
code".
"""

from __future__ import annotations


from boost_jax.mesh import axis_size
from boost_jax.names import MESH_AXES
from boost_jax.sharding.gather import LeafFetch
from boost_jax.sharding.stages import Schedule
from boost_jax.sharding.step_collectives import (Passes, bytes_by_level, int8_payload, itemsize,
                                                 keeps_secondary, leaves, secondary_payload,
                                                 step_collectives,
                                                 tp_local)


def _fetches(pl) -> dict:
    """LeafFetch per leaf path, as the step builds them (per-layer layouts)."""
    return {path: LeafFetch.of(pl, lay) for path, lay in leaves(pl)}


def memory_per_device(pl) -> dict:
    """Predicted bytes per device by role (see module docstring); keys usable with
    comm.compare_memory(..., combine={"argument": ["weights", "master", "adam"]})."""
    mesh = pl.mesh
    w = itemsize(pl.param_dtype)
    a = itemsize(pl.grad_accum_dtype)
    mixed = w != 4
    out = {k: 0.0 for k in ("weights", "master", "adam", "grads", "secondary")}
    pad = {k: 0.0 for k in out}
    unsharded = 0.0
    fetches = _fetches(pl)
    for path, lay in leaves(pl):
        f = fetches[path]
        sharded = lay.dim is not None
        layers = lay.padded[0] if lay.layer_axis else 1
        local = tp_local(f, lay)

        def share(axes, numel):
            return numel / (axis_size(mesh, axes) if sharded else 1)

        roles = {"weights": (pl.stored_axes, w), "adam": (pl.opt_state_axes,
                                                             4 * pl.opt_state_per_param),
                 "grads": (pl.accum_axes(lay), a)}
        if mixed:
            roles["master"] = (pl.opt_state_axes, 4)
        frac = local / lay.padded_numel
        for k, (axes, b) in roles.items():
            out[k] += share(axes, lay.padded_numel) * b * frac
            pad[k] += share(axes, lay.padded_numel - lay.numel) * b * frac
        S = pl.secondary_axes
        if keeps_secondary(pl, lay, path[0]):
            if f.int8_secondary:
                out["secondary"] += layers * secondary_payload(f) / axis_size(mesh, S)
            else:
                out["secondary"] += local * w / axis_size(mesh, S)
        if not sharded and (pl.params_axes or pl.opt_state_axes):
            unsharded += local * (w + 8 + (4 if mixed else 0))
    out["total"] = sum(out.values())
    out["padding"] = sum(pad.values())
    out["padding_by_role"] = pad
    out["unsharded_leaves_bytes"] = unsharded
    out["params"] = sum(lay.numel for _, lay in leaves(pl))
    out["padded_params"] = sum(lay.padded_numel for _, lay in leaves(pl))
    return out


def comm_per_step(pl, micro_batches: int, terms: bool = False, tied: bool = False,
                  schedule: Schedule | None = None) -> dict:
    """Predicted bytes sent per device per optimizer step by the plan's collectives (weight
    gathers and gradient reductions; TP's activation collectives are tp/specs.py's), by level:
    the sum of step_collectives over `micro_batches` passes (a pipeline's: its `schedule`'s
    ticks). `tied`: the embedding is also the head (fetched twice). With terms=True also
    returns the list of (name, kind, level, bytes) contributions."""
    colls = step_collectives(pl, Passes.of(micro_batches, schedule), tied)
    out = bytes_by_level(colls)
    out["total"] = sum(out[lv] for lv in MESH_AXES)
    if terms:
        out["terms"] = [(f"{c.leaf} {c.what}", c.kind, c.level, c.sent) for c in colls]
    return out


__all__ = ["memory_per_device", "comm_per_step", "int8_payload"]
