"""How a data-parallel collective is issued: bucketed; flat, in two levels or as exchanges.

Every data-parallel collective of a fetch (sharding/gather.py) is first described as a `Send`:
the buffer this device contributes and what to do with what arrives. `run` issues them: the
kinds in BUCKETED (qgZ's int4 all-to-alls) are grouped per fetch unit by (kind, axes, dtype,
group), concatenated, sent in one call and split exactly (every element lands where the
weight's own collective would put it); a cross-node all-to-all costs a latency per peer, so a
CoLA-7B layer's sixteen weights in one call save fifteen (so do log_step's exchanges). Other
calls stay one per weight, for XLA's GPU combiners to merge (why: benchmarks/README.md §3).
`group` keeps apart buffers that JAX types differently (a weight's TP axes). Buffers over
n devices: an all-gather's arrives stacked [n, *shape]; a reduce-scatter's is [n, *rest], chunk
i for device i, and arrives summed [*rest]; an all-reduce's arrives summed, same shape; an
all-to-all's [n, *rest] arrives as chunk i from device i.

`parallel.collectives` (Policy): under two_level a call whose group spans hosts (`global`, a
pipeline's `stage`) and a node runs as rank-aligned sub-collectives, no ring over every rank:
an all-gather across (one group per local rank, each by its own NIC), then inside the node; a
reduce-scatter the reverse; an all-reduce as RS inside, AR across, AG inside. Results keep
the flat layout; all-to-alls stay as they are. `auto` picks per call under an α–β model;
log_step runs the layer loop's legs over hosts as Bruck's ⌈log2 g⌉ exchanges, a fetch unit's
buffers in one chain (PCCL's recursive backend, arXiv 2504.18658; `Policy.rings`). All in
benchmarks/README.md §13. `Policy.stages` says what runs, for the engine and the step's list.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp

from boost_jax.backends.cpu import all_gather_bits, ppermute_bits
from boost_jax.mesh import level_of
from boost_jax.names import STAGE_AXIS


# ---------------------------------------------------------------- one call: flat or two levels
OUTER = ("global", STAGE_AXIS)  # axes whose groups cross hosts
SPLIT_KINDS = ("all-gather", "reduce-scatter", "all-reduce")
LOG_KINDS = ("all-gather", "reduce-scatter")  # the kinds log_step runs as exchanges


def exchanges(g: int) -> list[tuple[int, int]]:
    """Bruck's all-gather over g ranks: (k, blocks) per exchange, k = 1, 2, 4, ... < g; in
    exchange k each rank receives the first min(k, g − k) blocks rank +k holds (g − 1 in all)."""
    out, k = [], 1
    while k < g:
        out.append((k, min(k, g - k)))
        k *= 2
    return out


@dataclass(frozen=True)
class Policy:
    """How the data-parallel collectives of one run are issued (hashable: held by LeafFetch)."""

    mode: str = "flat"
    sizes: tuple = ()  # ((axis, size), ...) of the mesh
    links: tuple = ()  # ((level, latency s, bandwidth B/s per device), ...) for `auto`

    @classmethod
    def of(cls, mode: str, mesh_shape, topology=None) -> "Policy":
        links = () if topology is None else tuple(
            (lv, float(topology.latency(lv)), float(topology.bandwidth(lv)))
            for lv in ("pair", "node", "global"))
        return cls(mode, tuple((a, int(n)) for a, n in dict(mesh_shape).items()), links)

    def n(self, axes) -> int:
        size = dict(self.sizes)
        return int(math.prod(size.get(a, 1) for a in axes))

    def split(self, kind: str, axes, payload: float = 0.0) -> Optional[tuple]:
        """(inner, outer) axes when this call runs in two levels, else None."""
        outer = tuple(a for a in axes if a in OUTER)
        inner = tuple(a for a in axes if a not in OUTER)
        if self.mode == "flat" or kind not in SPLIT_KINDS or self.n(outer) <= 1 \
                or self.n(inner) <= 1:
            return None
        if self.mode == "auto" and not self.two_level_wins(kind, inner, outer, payload):
            return None
        return inner, outer

    def two_level_wins(self, kind: str, inner, outer, payload: float) -> bool:
        """The α–β comparison of benchmarks/README.md §13 (no topology: two-level)."""
        if not self.links:
            return True
        link = {lv: (a, b) for lv, a, b in self.links}
        (a_g, b_g), (a_i, b_i) = link["global"], link[level_of(inner)]
        n_in, g = self.n(inner), self.n(outer)
        n = n_in * g
        flat = (n - 1) * a_g + (n - 1) / n * payload / min(n_in * b_g, b_i)
        two = (g - 1) * a_g + (g - 1) / g * payload / (n_in * b_g) + (n_in - 1) * a_i + \
            (n_in - 1) / n_in * payload / b_i
        return two < flat

    def rings(self) -> "Policy":
        """This policy for calls outside the scanned layer loop: log_step's exchanges become
        rings there (two levels kept). Per-layer calls are where a ring's latency adds up;
        and XLA:CPU keys every collective-permute's rendezvous alike (JAX gives each channel
        1), so exchange chains in separate regions at once abort a CPU run: one layer body
        runs at a time, while the ends' and the once-per-step calls could run beside it."""
        return dataclasses.replace(self, mode="two_level") if self.mode == "log_step" else self

    def log_step(self, kind: str, axes) -> bool:
        """Whether a call of `kind` over `axes` runs as Bruck exchanges (log_step: a group
        whose one axis of more than one device crosses hosts; size-1 axes aside, so ranks
        count alike in axis_index and ppermute)."""
        moving = tuple(a for a in axes if self.n((a,)) > 1)
        return self.mode == "log_step" and kind in LOG_KINDS and len(moving) == 1 and \
            moving[0] in OUTER

    def bucketed(self, kind: str, axes) -> bool:
        """Whether a fetch unit's buffers of `kind` over `axes` travel in one call (`run`):
        qgZ's all-to-alls, and under log_step the gathers and reduce-scatters whose group spans
        hosts (each exchange costs a latency, as each peer of an all-to-all does)."""
        if kind in BUCKETED:
            return True
        return self.mode == "log_step" and kind in LOG_KINDS and \
            self.n(tuple(a for a in axes if a in OUTER)) > 1

    def stages(self, kind: str, axes, payload: float, itemsize: int = 4) -> list[tuple]:
        """(kind, axes, payload) of each call that runs for the flat collective (payload: its
        ring formula's P, step_collectives.ring_bytes; itemsize: an all-reduce's element); a
        leg run as exchanges lists each as a collective-permute of the blocks it sends."""
        out = []
        for k, ax, p in self._levels(kind, tuple(axes), payload, itemsize):
            if not self.log_step(k, ax):
                out.append((k, ax, p))
                continue
            g = self.n(ax)
            steps = exchanges(g) if k == "all-gather" else exchanges(g)[::-1]
            out += [("collective-permute", ax, b * p / g) for _, b in steps]
        return out

    def _levels(self, kind: str, axes: tuple, payload: float, itemsize: int) -> list[tuple]:
        """stages() before its exchanges: the flat call, or its two levels."""
        sp = self.split(kind, axes, payload)
        if sp is None:
            return [(kind, axes, payload)]
        inner, outer = sp
        n_in = self.n(inner)
        if kind == "all-gather":
            return [(kind, outer, payload / n_in), (kind, inner, payload)]
        if kind == "reduce-scatter":
            return [(kind, inner, payload), (kind, outer, payload / n_in)]
        if payload < n_in * itemsize:  # fewer elements than members (a scalar): two sums
            return [(kind, inner, payload), (kind, outer, payload)]
        padded = math.ceil(payload / itemsize / n_in) * n_in * itemsize
        return [("reduce-scatter", inner, padded), ("all-reduce", outer, padded / n_in),
                ("all-gather", inner, padded)]


FLAT = Policy()


def _reorder(y, src, dst, policy: Policy):
    """y stacked [n, *rest] row-major over axes `src` → stacked row-major over `dst`."""
    if tuple(src) == tuple(dst):
        return y
    rest = y.shape[1:]
    y = y.reshape(*[policy.n((a,)) for a in src], *rest)
    perm = [src.index(a) for a in dst] + list(range(len(src), y.ndim))
    return jnp.transpose(y, perm).reshape(-1, *rest)


def _exchange_gather(x, axes, g: int):
    """Bruck's all-gather: x → stacked [g, *x.shape] in rank order over `axes`. After the
    exchanges row i holds rank me + i's block; one roll by the rank puts rows in rank order."""
    me = jax.lax.axis_index(axes)
    buf = x[None]
    for k, b in exchanges(g):  # receive rank me + k's first b rows
        perm = [((r + k) % g, r) for r in range(g)]
        buf = jnp.concatenate([buf, ppermute_bits(buf[:b], axes, perm)])
    return jnp.roll(buf, me, axis=0)


def _exchange_scatter(x, axes, g: int):
    """The transpose of _exchange_gather: x [g, *rest], chunk i for rank i → this rank's sum.
    Rows rolled back (row i: rank me + i's chunk); each exchange, last first, sends the rows
    it had received to the rank they came from, which adds them to its first rows."""
    me = jax.lax.axis_index(axes)
    buf = jnp.roll(x, -me, axis=0)
    for k, b in exchanges(g)[::-1]:
        perm = [(r, (r + k) % g) for r in range(g)]
        # a concatenate, not .at[:b].add: XLA 0.11's SPMD pipeline segfaults on the scatter
        # with empty indices that .at makes when b == k
        buf = jnp.concatenate([buf[:b] + ppermute_bits(buf[k:k + b], axes, perm), buf[b:k]])
    return buf[0]


def _gather_leg(x, axes, policy: Policy, to: str = "varying"):
    """One level's all-gather: x → stacked [n, *x.shape], as a ring or as exchanges."""
    if policy.log_step("all-gather", axes):
        return _exchange_gather(x, tuple(axes), policy.n(axes))
    return all_gather_bits(x[None], tuple(axes), 0, to)


def _scatter_leg(x, axes, policy: Policy):
    """One level's reduce-scatter: x [n, *rest] → this device's summed [*rest]."""
    if policy.log_step("reduce-scatter", axes):
        return _exchange_scatter(x, tuple(axes), policy.n(axes))
    return jax.lax.psum_scatter(x, tuple(axes), scatter_dimension=0, tiled=True)[0]


def all_gather(x, axes, policy: Policy = FLAT, to: str = "varying"):
    """x (any shape) → stacked [n, *x.shape], shard i from the i-th device over `axes`.
    Exchanges type their result varying over `axes`: `to="invarying"` keeps a ring."""
    axes = tuple(axes)
    sp = policy.split("all-gather", axes, policy.n(axes) * x.size * x.dtype.itemsize)
    if sp is None:
        return _gather_leg(x, axes, policy if to == "varying" else FLAT, to)
    inner, outer = sp
    y = _gather_leg(x, outer, policy)  # [g, *shape]: one group per local rank
    y = all_gather_bits(y[None], inner, 0, to)  # [n_in, g, *shape]
    return _reorder(y.reshape(-1, *x.shape), inner + outer, axes, policy)


def reduce_scatter(x, axes, policy: Policy = FLAT):
    """x [n, *rest], chunk i for the i-th device over `axes` → this device's summed [*rest]."""
    axes = tuple(axes)
    sp = policy.split("reduce-scatter", axes, x.size * x.dtype.itemsize)
    if sp is None:
        return _scatter_leg(x, axes, policy)
    inner, outer = sp
    y = _reorder(x, axes, inner + outer, policy)
    y = y.reshape(policy.n(inner), policy.n(outer), *x.shape[1:])
    y = jax.lax.psum_scatter(y, inner, scatter_dimension=0, tiled=True)[0]  # [g, *rest]
    return _scatter_leg(y, outer, policy)


def _invariant(y, axes) -> str:
    """The all-gather `to` that makes its result invariant over `axes` (typed programs)."""
    mat = getattr(jax.typeof(y), "manual_axis_type", None)
    vma = getattr(mat, "varying", ()) or ()
    return "invarying" if set(axes) <= set(vma) else "varying"


def all_reduce(x, axes, policy: Policy = FLAT):
    """psum(x, axes): the sum, same shape, invariant over `axes`."""
    axes = tuple(axes)
    sp = policy.split("all-reduce", axes, x.size * x.dtype.itemsize)
    if sp is None:
        return jax.lax.psum(x, axes)
    inner, outer = sp
    n_in, m = policy.n(inner), x.size
    if m < n_in:  # a scalar: nothing to scatter
        return jax.lax.psum(jax.lax.psum(x, inner), outer)
    flat = x.reshape(-1)
    k = -(-m // n_in)
    flat = jnp.pad(flat, (0, k * n_in - m)) if k * n_in > m else flat
    y = jax.lax.psum_scatter(flat.reshape(n_in, k), inner, scatter_dimension=0, tiled=True)[0]
    y = jax.lax.psum(y, outer)
    y = all_gather_bits(y, inner, 0, _invariant(y, inner))  # [n_in·k]
    return y[:m].reshape(x.shape)


def tiled_all_gather(x, axes, dim: int, policy: Policy = FLAT, to: str = "varying"):
    """jax.lax.all_gather(x, axes, axis=dim, tiled=True), in two levels where policy says."""
    axes = tuple(axes)
    if policy.split("all-gather", axes, policy.n(axes) * x.size * x.dtype.itemsize) is None \
            and (to != "varying" or not policy.log_step("all-gather", axes)):
        return all_gather_bits(x, axes, dim, to)
    stacked = all_gather(x, axes, policy, to)
    y = jnp.moveaxis(stacked, 0, dim)
    return y.reshape(*x.shape[:dim], -1, *x.shape[dim + 1:])


def psum_scatter(x, axes, dim: int, policy: Policy = FLAT):
    """jax.lax.psum_scatter(x, axes, scatter_dimension=dim, tiled=True), in two levels."""
    axes = tuple(axes)
    if policy.split("reduce-scatter", axes, x.size * x.dtype.itemsize) is None and \
            not policy.log_step("reduce-scatter", axes):
        return jax.lax.psum_scatter(x, axes, scatter_dimension=dim, tiled=True)
    n = policy.n(axes)
    y = jnp.moveaxis(x, dim, 0)
    y = reduce_scatter(y.reshape(n, y.shape[0] // n, *y.shape[1:]), axes, policy)
    return jnp.moveaxis(y, 0, dim)


# ---------------------------------------------------------------- buckets: Sends into calls
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
    g = all_gather(_flat(bufs, 0), axes, policy)  # [n, Σ]
    return [p.reshape(g.shape[0], *b.shape) for p, b in zip(_split(g, bufs, 0, 1), bufs)]


def _reduce_scatter(bufs, axes, policy):
    y = reduce_scatter(_flat(bufs, 1), axes, policy)
    return [p.reshape(b.shape[1:]) for p, b in zip(_split(y, bufs, 1, 0), bufs)]


def _all_reduce(bufs, axes, policy):
    y = all_reduce(_flat(bufs, 0), axes, policy)
    return [p.reshape(b.shape) for p, b in zip(_split(y, bufs, 0, 0), bufs)]


def _all_to_all(bufs, axes, policy):
    del policy  # qgZ's stages already go inside the node, then across
    y = jax.lax.all_to_all(_flat(bufs, 1), axes, 0, 0, tiled=True)
    return [p.reshape(b.shape) for p, b in zip(_split(y, bufs, 1, 1), bufs)]


_COLLECTIVE = {"all-gather": _all_gather, "reduce-scatter": _reduce_scatter,
               "all-reduce": _all_reduce, "all-to-all": _all_to_all}


def run(requests: list, policy: Policy = FLAT) -> list:
    """Each request a Send or a ready value (passed through) → its result: one collective per
    (kind, axes, dtype, group) among the Sends `policy.bucketed`, one per Send otherwise,
    flat or in two levels as `policy` says."""
    groups: dict[tuple, list[int]] = {}
    for i, r in enumerate(requests):
        if isinstance(r, Send):
            own = None if policy.bucketed(r.kind, r.axes) else i
            groups.setdefault((r.kind, r.axes, jnp.dtype(r.buf.dtype), r.group, own),
                              []).append(i)
    out = list(requests)
    for (kind, axes, *_), idx in groups.items():
        arrived = _COLLECTIVE[kind]([requests[i].buf for i in idx], axes, policy)
        for i, a in zip(idx, arrived):
            out[i] = requests[i].finish(a)
    return out


__all__ = ["Policy", "FLAT", "exchanges", "all_gather", "reduce_scatter", "all_reduce",
           "tiled_all_gather", "psum_scatter", "BUCKETED", "Send", "run", "merge_stacked"]
