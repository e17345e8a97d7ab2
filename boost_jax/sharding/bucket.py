"""One collective per layer for what XLA will not combine: the int4 all-to-alls of qgZ.

Every data-parallel collective of a fetch (sharding/gather.py) is first described as a `Send`:
the buffer this device contributes and what to do with what arrives. `run` issues them; the
kinds in BUCKETED are grouped per fetch unit by (kind, axes, dtype, group), concatenated, sent
in one call and split exactly (every element lands where the weight's own collective would
put it). A cross-node all-to-all costs a latency per peer whatever its size, so a CoLA-7B
layer's sixteen weights (fourteen factors and two norm scales) in one call save fifteen of
them per layer and pass. Under parallel.collectives=two_level (or auto) each call whose group
spans hosts and a node runs as rank-aligned stages (sharding/two_level.py), its result the same.

All-gathers, reduce-scatters and all-reduces stay one per weight, for XLA's GPU combiners to
merge; concatenating them here measured worse, and the planner counts their calls as the
combiners issue them (plan/costmodel.py). Why: benchmarks/README.md §3, "Derivations moved
from the code".

Buffer conventions (n devices over the axes):
    all-gather      any shape; arrives stacked [n, *shape] (shard i from the i-th device)
    reduce-scatter  [n, *rest], chunk i for device i; arrives as this device's summed [*rest]
    all-reduce      any shape; arrives summed, same shape
    all-to-all      [n, *rest], chunk i for device i; arrives [n, *rest], chunk i from device i
`group` keeps apart buffers that JAX types differently (a weight's TP axes): one device's
concatenation must not mix what varies over the TP group with what does not.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

import jax
import jax.numpy as jnp

from boost_jax.sharding import two_level
from boost_jax.sharding.two_level import FLAT, Policy


BUCKETED = frozenset({"all-to-all"})  # kinds run as one call per fetch unit


@dataclass(frozen=True)
class Send:
    """One weight's part of a collective: its buffer and what turns the arrival into a result."""

    kind: str  # all-gather | reduce-scatter | all-reduce | all-to-all
    axes: tuple[str, ...]
    buf: Any
    finish: Callable = field(default=lambda a: a)
    group: tuple = ()


def merge_stacked(stacked, dim: int):
    """[n, *shape] stacked shards → the tiled gather: shards concatenated along `dim`."""
    n, shape = stacked.shape[0], stacked.shape[1:]
    y = jnp.moveaxis(stacked, 0, dim)
    return y.reshape(*shape[:dim], n * shape[dim], *shape[dim + 1:])


def _split(flat, bufs, lead: int, axis: int):
    """flat's `axis` cut into each buffer's element count after its first `lead` dims."""
    sizes = [math.prod(b.shape[lead:]) for b in bufs]
    cuts = [sum(sizes[:i + 1]) for i in range(len(sizes) - 1)]
    return jnp.split(flat, cuts, axis=axis) if cuts else [flat]


def _flat(bufs, lead: int):
    """Buffers flattened after their first `lead` dims and concatenated there."""
    rows = [b.reshape(*b.shape[:lead], -1) for b in bufs]
    return rows[0] if len(rows) == 1 else jnp.concatenate(rows, axis=lead)


def _all_gather(bufs, axes, policy):
    g = two_level.all_gather(_flat(bufs, 0), axes, policy)  # [n, Σ]
    return [p.reshape(g.shape[0], *b.shape) for p, b in zip(_split(g, bufs, 0, 1), bufs)]


def _reduce_scatter(bufs, axes, policy):
    y = two_level.reduce_scatter(_flat(bufs, 1), axes, policy)
    return [p.reshape(b.shape[1:]) for p, b in zip(_split(y, bufs, 1, 0), bufs)]


def _all_reduce(bufs, axes, policy):
    y = two_level.all_reduce(_flat(bufs, 0), axes, policy)
    return [p.reshape(b.shape) for p, b in zip(_split(y, bufs, 0, 0), bufs)]


def _all_to_all(bufs, axes, policy):
    del policy  # qgZ's stages already go inside the node, then across
    y = jax.lax.all_to_all(_flat(bufs, 1), axes, 0, 0, tiled=True)
    return [p.reshape(b.shape) for p, b in zip(_split(y, bufs, 1, 1), bufs)]


_COLLECTIVE = {"all-gather": _all_gather, "reduce-scatter": _reduce_scatter,
               "all-reduce": _all_reduce, "all-to-all": _all_to_all}


def run(requests: list, policy: Policy = FLAT) -> list:
    """Each request a Send or a ready value (passed through) → its result: one collective per
    (kind, axes, dtype, group) among the Sends of a kind in BUCKETED, one per Send otherwise,
    flat or in two levels as `policy` says (sharding/two_level.py)."""
    groups: dict[tuple, list[int]] = {}
    for i, r in enumerate(requests):
        if isinstance(r, Send):
            own = None if r.kind in BUCKETED else i
            groups.setdefault((r.kind, r.axes, jnp.dtype(r.buf.dtype), r.group, own),
                              []).append(i)
    out = list(requests)
    for (kind, axes, *_), idx in groups.items():
        arrived = _COLLECTIVE[kind]([requests[i].buf for i in idx], axes, policy)
        for i, a in zip(idx, arrived):
            out[i] = requests[i].finish(a)
    return out


__all__ = ["BUCKETED", "Send", "run", "merge_stacked"]
