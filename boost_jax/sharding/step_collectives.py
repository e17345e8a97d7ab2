"""The data-parallel collectives of one optimizer step, weight by weight: the one list the engine
runs, the formulas count (sharding/formulas.py) and the planner times (plan/costmodel.py).

Notation: Ψ the elements of one device's TP shard of a weight (one layer of a stacked leaf);
w bytes per working-weight element (2 bf16, 4 fp32), a per gradient element (grad_accum_dtype);
A params axes, S secondary axes, G grads axes, O opt_state axes, R = batch axes − G (the
deferred axes). Ring costs, bytes *sent by one device* per call over n devices (`ring_bytes`):
(n−1)/n · P for an all-gather of a P-byte result, a reduce-scatter of a P-byte input or an
all-to-all of a P-byte buffer; 2(n−1)/n · P for an all-reduce of P bytes.

Per pass over the weights (`Passes`: once per micro-batch; more with pipeline ticks):
    gather     forward (regather: backward) gathers, one per LeafFetch.gathers record, what the
               engine issues: AG_A(Ψw, or int8 q(Ψ) under qwZ); with a secondary AG_S
    grad       RS_G(Ψa) into the grads sharding (AR_G if not sharded); qgZ: int4 all-to-alls
Once per step, on the whole leaf (engine.reduce_deferred, step/build.make_step_fn):
    reduce     AR over R − O, then RS over R ∩ O (per layer in backward: Placement.in_backward)
    update     AG of the new weights opt_state → grads → params (Placement.update_stages)
    grad norm  one fp32 partial sum per leaf, all-reduced over every axis
int8 payloads are q(Ψ) = Ψ + 4·blocks (one fp32 scale per block of ≤ quant_block); qgZ's int4
payloads Ψ/2 + 4·blocks. Under parallel.collectives two_level / auto / log_step, a collective
whose group spans hosts and a node is listed as the stages that run instead (Policy.stages),
log_step's exchanges as collective-permutes of the blocks each sends, merged per fetch unit.

Derivations (each row, bucketing, quantized legs, stages): benchmarks/README.md §3.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Sequence

import jax
import numpy as np

from boost_jax.layers.forward import path_keys
from boost_jax.mesh import axis_size, level_of
from boost_jax.sharding import quant
from boost_jax.sharding.bucket import BUCKETED
from boost_jax.sharding.gather import BACKWARD, FORWARD, Gather, LeafFetch, qgz_stages
from boost_jax.sharding.layout import LeafLayout, is_layout
from boost_jax.sharding.stages import ENDS, LAST, Schedule


# Where a collective runs: in every forward or backward pass over the layers; in the first
# forward or the last backward only (once per step, layer by layer: the deferred update, the
# reduction in the backward); or outside the passes, once per step (STEP).
FIRST_FORWARD, LAST_BACKWARD, STEP = "first forward", "last backward", "step"
RUNS = (FORWARD, BACKWARD, FIRST_FORWARD, LAST_BACKWARD)


def ring_bytes(kind: str, n: int, payload: float) -> float:
    """Bytes one device sends for a ring collective over n members (payload as documented)."""
    if n <= 1:
        return 0.0
    if kind == "all-reduce":
        return 2.0 * (n - 1) / n * payload
    if kind in ("all-gather", "reduce-scatter", "all-to-all"):
        return (n - 1) / n * payload
    return float(payload)  # collective-permute / broadcast: the whole buffer once


def moving_level(sizes, axes) -> str:
    """level_of the axes that have more than one device: a group over (pair, global) on one
    node crosses only the pair link (as the cost model and the compiled groups see it)."""
    return level_of(tuple(a for a in axes if axis_size(sizes, (a,)) > 1))


@dataclass(frozen=True)
class Collective:
    """One collective of the step: `calls` calls per optimizer step of `payload` bytes each."""

    leaf: str  # the weight's path, e.g. blocks/attn/wq/A
    what: str  # gather | gather(S) | regather | regather(S) | grad | grad(int4) | reduce | ...
    kind: str  # all-gather | reduce-scatter | all-reduce | all-to-all | collective-permute
    axes: tuple[str, ...]
    n: int  # devices in one group
    payload: float  # bytes of one call's un-sharded buffer (the ring formulas' P)
    calls: float  # per optimizer step
    phase: str  # dp: per pass, inside the layer loop | step: once per step
    level: str  # the slowest link its group crosses, size-1 axes aside (moving_level)
    bucket: tuple = ()  # what it shares one call with (sharding/bucket.py); () its own call
    runs: str = STEP  # the pass it runs in (RUNS), or STEP: outside the passes
    merged: bool = False  # one call with its bucket's in the engine (Policy.bucketed)

    @property
    def sent(self) -> float:
        """Bytes one device sends per optimizer step."""
        return ring_bytes(self.kind, self.n, self.payload) * self.calls

    @property
    def block(self) -> bool:
        """A weight of the layer stack (a merged call: its bucket's leaf, named by the unit)."""
        return self.leaf.split("/", 1)[0] == "blocks"

    @property
    def head(self) -> bool:
        """A weight of the head (final norm, LM head): fetched by the passes that run it."""
        return is_head(self.leaf.split("/", 1)[0])


@dataclass(frozen=True)
class Passes:
    """Passes of one optimizer step over each weight: forward fetches, backward re-fetches and
    gradient reductions of the layer stack, and of the ends (embedding, head, final norm)."""

    forward: float
    backward: float
    ends_forward: float
    ends_grads: float
    head_forward: float  # of ends_forward, the passes that run the head

    @classmethod
    def of(cls, micro_batches: int, schedule: Schedule | None = None) -> "Passes":
        """One of each per micro-batch; a pipeline (sharding/stages.Schedule) fetches a chunk's
        weights on every tick with F and again on every tick with B (its forward re-run), a
        tick running one of the V chunks; the ends run on every tick, whatever its chunk:
        the embedding fetched on each with F and each with B, the head on each with B (F
        leaves it out, step/pipeline.py), both reduced on each with B."""
        m = micro_batches
        if schedule is None or schedule.stages == 1:
            return cls(m, m, m, m, m)
        ticks, v = schedule.ticks, schedule.virtual
        return cls(2 * ticks / v, ticks / v, 2 * ticks, ticks, ticks)

    def per_step(self, block: bool, runs: str, head: bool = False) -> float:
        """How often a collective that runs in each pass's `runs` (FORWARD or BACKWARD) runs
        per step, for a weight of the layer stack (`block`), the `head` or the embedding
        (an end's backward only reduces its gradient)."""
        if runs == FORWARD:
            return self.forward if block else self.head_forward if head else self.ends_forward
        return self.backward if block else self.ends_grads


def is_head(top: str) -> bool:
    """Whether a top-level weight is the head's (the ends the last stage holds)."""
    return ENDS.get(top) == LAST


def int8_payload(f: LeafFetch, axes) -> float:
    """Bytes of q + scales of one layer's (TP-local) leaf when each shard over `axes` is
    quantized on its own (what an int8 all-gather over `axes` delivers)."""
    qa, shape = f.quant_axis(axes), f.local_shape(axes)
    return float(f.n(axes) * quant.payload_bytes(shape, f.qblock(shape[qa]), qa))


def gather_payload(f: LeafFetch, g: Gather) -> float:
    """Bytes of one layer's weight (TP-local) as gather `g` delivers it: int8 blocks of each
    shard over its src_axes (q + scales), or the working dtype."""
    if g.int8:
        return int8_payload(f, g.src_axes)
    return float(math.prod(f.local_shape(())) * itemsize(f.dtype))


def secondary_payload(f: LeafFetch) -> float:
    """Bytes of one layer's secondary (the whole weight's), as the backward gathers it."""
    return gather_payload(f, f.gathers()[-1])


def quantized_rs_payload(f: LeafFetch, axes, elems: float, bits: int) -> float:
    """Bytes of the all-to-all buffer of a quantized reduce-scatter over `axes` of `elems`
    elements (LeafFetch.int4_reduce_scatter: n chunks of int8 or int4 blocks + fp32 scales)."""
    n = f.n(axes)
    m = int(elems) // n
    if bits == 8:
        return float(n * quant.payload_bytes((m,), f.qblock(m)))
    return float(n * quant.payload_bytes_int4(m, f.qblock(m) + f.qblock(m) % 2))


def qgz_payloads(f: LeafFetch) -> list[tuple[tuple[str, ...], float]]:
    """(axes, all-to-all buffer bytes) of each qgZ stage for one layer of a leaf: each
    device's n chunks of int4 blocks + fp32 scales (LeafFetch.int4_reduce_scatter)."""
    out, elems = [], math.prod(f.local_shape(()))
    for axes in qgz_stages(f.grads_axes):
        n = f.n(axes)
        m = elems // n
        block = f.qblock(m) + f.qblock(m) % 2
        out.append((axes, n * quant.payload_bytes_int4(m, block)))
        elems = m
    return out


def leaves(pl) -> list[tuple[tuple, LeafLayout]]:
    """(path, layout) of every weight of a placement."""
    flat = jax.tree_util.tree_flatten_with_path(pl.layouts, is_leaf=is_layout)[0]
    return [(path_keys(p), lay) for p, lay in flat]


def device_layers(f: LeafFetch, lay: LeafLayout) -> int:
    """Layers of a stacked leaf on one device (a pipeline stage's share; 1 if not stacked)."""
    return lay.padded[0] // f.n(lay.tp[0]) if lay.layer_axis else 1


def tp_local(f: LeafFetch, lay: LeafLayout) -> float:
    """Elements of one device's TP (and stage) shard of the whole leaf, padded."""
    return lay.padded_numel / math.prod(f.n(tp) for tp in lay.tp)


def keeps_secondary(pl, lay: LeafLayout, top: str) -> bool:
    """Whether a leaf keeps a secondary copy from forward to backward (the memory it costs,
    for the byte formulas and the planner alike): every gathered layer weight, unless the copy
    would be the stored shard itself (a working-dtype secondary over the params axes). The
    embedding's and head's is dead once their forward gather ran."""
    S = pl.secondary_axes
    if S is None or top != "blocks" or lay.dim is None or not pl.params_axes:
        return False
    return pl.int8_secondary or tuple(S) != tuple(pl.params_axes)


def itemsize(dtype) -> int:
    return int(np.dtype(dtype).itemsize)


def leaf_collectives(pl, path: tuple, lay: LeafLayout, passes: Passes,
                     uses: int = 1) -> list[Collective]:
    """The collectives of one weight per optimizer step; `uses`: fetches per pass (2 for an
    embedding that is also the head)."""
    f = LeafFetch.of(pl, lay)
    name = "/".join(str(p) for p in path)
    layers = device_layers(f, lay)
    psi = tp_local(f, lay) / layers  # one layer's elements
    w, a = itemsize(pl.param_dtype), itemsize(pl.grad_accum_dtype)
    block = path[:1] == ("blocks",)
    # a tied embedding's second use is the head's (tied tables take no stages: stages.validate)
    fwd = layers * (passes.per_step(block, FORWARD, is_head(path[0]))
                    + (uses - 1) * passes.head_forward)
    bwd = layers * passes.per_step(block, BACKWARD) if block else 0  # ends: the forward's copy
    grad_calls = layers * uses * passes.per_step(block, BACKWARD)
    out: list[Collective] = []

    unit = path[:2] if block and not lay.layer_axis else path[:1]  # one fetch_tree call

    def add(what, kind, axes, payload, calls, runs, step=None):
        phase = "step" if runs == STEP else "dp"
        key = (unit, f.group, what, step) if phase == "dp" else ()
        pol = pl.step_policy if phase == "step" else \
            f.collectives if runs in (FIRST_FORWARD, LAST_BACKWARD) else f.per_pass
        merged = phase == "dp" and pol.bucketed(kind, axes)
        if f.n(axes) > 1 and calls > 0 and payload > 0:
            out.extend(Collective(name, what, k, ax, f.n(ax), float(p), calls, phase,
                                  moving_level(f._size, ax), key + (j,) if merged else key,
                                  runs, merged)
                       for j, (k, ax, p) in enumerate(
                           pol.stages(kind, axes, payload, a)))

    for g in f.gathers():  # what the engine issues (LeafFetch.expand, secondary_source, ...)
        add(g.what, "all-gather", g.axes, gather_payload(f, g),
            fwd if g.when == FORWARD else bwd, g.when)
    int4 = dict(qgz_payloads(f)) if f.quantize_grads and f.dim is not None else {}
    for i, (kind, axes) in enumerate(f.grad_steps()):
        if kind == "all-to-all":
            add("grad(int4)", kind, axes, int4[axes], grad_calls, BACKWARD, step=i)
        else:
            add("grad", kind, axes, psi * a, grad_calls, BACKWARD, step=i)
    # the reduction over R: per layer in the backward, or once per step on the whole leaf
    ar, rs = pl.deferred_reduction(lay)
    per_layer, calls, runs = (1, layers, LAST_BACKWARD) if pl.in_backward(lay) else \
        (layers, 1, STEP)
    payload = psi * per_layer * a / (f.n(pl.grads_axes) if lay.dim is not None else 1)
    i = len(f.grad_steps())  # reduce_all's round of each step (R's in the backward after G's)
    add("reduce", "all-reduce", ar, payload, calls, runs, i)
    step = f.cross_node_step(rs) if rs and lay.dim is not None else ("reduce-scatter", rs)
    if step[0] == "all-to-all":  # quantized across nodes (parallel.quantize_cross_node_grads)
        add(f"reduce(int{step[2]})", "all-to-all", rs,
            quantized_rs_payload(f, rs, payload / a, step[2]), calls, runs, i + bool(ar))
    else:
        add("reduce", "reduce-scatter", rs, payload, calls, runs, i + bool(ar))
    if lay.dim is not None:
        _update(pl, f, pl.defer_update and (block or lay.after_stack), layers, psi * w, add)
    return out


def _update(pl, f: LeafFetch, deferred: bool, layers: int, layer_bytes: float, add) -> None:
    """The new weights to the params sharding: once per step after the optimizer, or
    `deferred`, per layer in the next step's first forward (the after-stack units: where it
    fetches them; the embedding: at its start, once per step)."""
    per, calls, runs = (1, layers, FIRST_FORWARD) if deferred else (layers, 1, STEP)
    for r, (axes, src, left) in enumerate(pl.update_steps()):
        if pl.xq_weights and "global" in axes:  # int8 blocks of each source shard
            add("update(int8)", "all-gather", axes,
                per * int8_payload(f, src) / f.n(left), calls, runs, ("u", r))
        else:
            add("update", "all-gather", axes, layer_bytes * per / f.n(left), calls, runs,
                ("u", r))


def step_collectives(pl, passes: Passes, tied: bool = False) -> list[Collective]:
    """Every data-parallel collective of one optimizer step of placement `pl` (TP's activation
    collectives are each layout's, sharding/tp/; pipeline sends are step/pipeline.py's). `tied`:
    the embedding is also the head (fetched twice)."""
    out: list[Collective] = []
    all_leaves = leaves(pl)
    for path, lay in all_leaves:
        uses = 2 if (tied and path[:1] == ("embed",)) else 1
        out += leaf_collectives(pl, path, lay, passes, uses)
    out = bucketed(out)
    every = tuple(a for a, n in pl.mesh.shape.items() if int(n) > 1)
    n_all = axis_size(pl.mesh, every)
    if n_all > 1:  # the clip's global norm: one fp32 partial sum per leaf
        out.extend(Collective("*", "grad norm", k, ax, axis_size(pl.mesh, ax), float(p), 1,
                              "step", level_of(ax)) for k, ax, p in
                   pl.collectives.stages("all-reduce", every, 4.0 * len(all_leaves), 4))
    return out


def combined_bytes(c: Collective) -> float:
    """What XLA's combiners hold to their threshold: a merged call's result, for a
    reduce-scatter its group's 1/n share of the payload."""
    return c.payload / max(c.n, 1) if c.kind == "reduce-scatter" else c.payload


def bucketed(colls: Sequence[Collective], kinds=BUCKETED,
             limit: float = math.inf) -> list[Collective]:
    """Collectives of `kinds` (or `merged`) that run together (a fetch unit's weights with the
    same kind, axes, TP group and step: sharding/bucket.py for the engine's, XLA's combiners
    for the others) merged, the payload the sum, the calls those of combined(): a merged call's result
    holds at most `limit` bytes (combined_bytes), and one weight's collective is never split."""
    out: list[Collective] = []
    at: dict[tuple, int] = {}
    members: dict[int, list[float]] = {}
    payload: dict[int, float] = {}  # a bucket's summed payload (one replace per bucket)
    for c in colls:
        key = (c.bucket, c.kind, c.axes, c.calls, c.runs) if c.bucket and \
            (c.kind in kinds or c.merged) else None
        if key is None:
            out.append(c)
            continue
        if key not in at:
            at[key] = len(out)
            members[len(out)], payload[len(out)] = [], 0.0
            out.append(c)
        i = at[key]
        payload[i] += c.payload
        members[i].append(combined_bytes(c))
    for i, sizes in members.items():
        k = combined(sizes, limit)
        out[i] = dataclasses.replace(out[i], leaf="/".join(map(str, out[i].bucket[0])),
                                     payload=payload[i] / k, calls=out[i].calls * k)
    return out


def combined(sizes: Sequence[float], limit: float) -> int:
    """Calls XLA's combiners make of collectives whose results hold `sizes` bytes, in order:
    each joins the open call while that call stays within `limit`; one over it runs alone
    (collective_combiner_utils.h: it can never be combined), never cut."""
    calls, held = 0, 0.0
    for s in sizes:
        if calls and held + s <= limit:
            held += s
        else:
            calls, held = calls + 1, s
    return calls


def bytes_by_level(colls: Sequence[Collective]) -> dict[str, float]:
    """Bytes one device sends per step, by level (pair, node, global)."""
    out = {lv: 0.0 for lv in ("pair", "node", "global")}
    for c in colls:
        if c.level in out:
            out[c.level] += c.sent
    return out


__all__ = ["Collective", "Passes", "RUNS", "STEP", "FIRST_FORWARD", "LAST_BACKWARD",
           "step_collectives", "leaf_collectives",
           "ring_bytes", "int8_payload", "qgz_payloads",
           "bytes_by_level", "bucketed", "combined_bytes", "leaves", "tp_local",
           "device_layers"]
