"""An α–β + roofline cost model of one training step, per device: the workload of a plan.

Everything is per device and per optimizer step unless a name says otherwise. One set of
assumptions (`Assumptions`) is used for every prediction the planner and the validation make.
The pieces live in their own modules:

compute   boost_jax.plan.roofline: every kernel of a block with its FLOPs and HBM bytes, costed
          by a roofline (GEMMs, attention, elementwise; backward and remat replays).
network   boost_jax.plan.collectives: ring collectives on the links they cross (a node's NICs
          shared by the groups leaving it) plus latency.
overlap   as the step compiles with the launcher's XLA flags (mesh.GPU_XLA_SCHEDULE,
          `exposed_dp`): TP collectives and pipeline sends on the critical path, per-layer
          weight gathers and gradient reduce-scatters behind the neighbouring layers' compute
          of their own pass (a deferred leg: its one pass), once-per-step work exposed.
memory    boost_jax.plan.memory: persistent state from the placement's layouts (exact, padding
          included) + the buffers the GPU program keeps live at its peak (the gradient
          buffers of the double-buffered micro-batch loop, two layers' gathered weights,
          activations, logits); "fits" below its `fit_limit`.

This module puts them together for a plan × TP layout: the state sizes from the placement's own
layouts, the data-parallel / ZeRO collectives the step compiles, the memory estimate and the
step time (`predict`). A compiled step's measured collectives (a `CommSummary` of
`collectives.colls_from_report`) can replace the analytic ones.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Optional

from boost_jax.analysis.flops import flops_per_token, param_count
from boost_jax.errors import ConfigError
from boost_jax.mesh import AXES, STAGE, Topology, axis_size, level_of
from boost_jax.plan.collectives import Coll, CommSummary, coll_time, host_split
from boost_jax.plan import memory, overlap, saved
from boost_jax.plan.overlap import gpu_exposed, gpu_launch_seconds, overlap_exposed
from boost_jax.sharding.gather import BACKWARD, FORWARD, qgz_stages
from boost_jax.sharding.step_collectives import (FIRST_FORWARD, LAST_BACKWARD, Passes, is_head,
                                                 bucketed, keeps_secondary, step_collectives)
from boost_jax.sharding.stages import Schedule, layers_per_stage
from boost_jax.plan.roofline import (DTYPE_BYTES, HBM_BW, Assumptions, BlockModel, block_model,
                                     head_model, op_time, resolve_attention)


# --------------------------------------------------------------------------- layouts


class SizesMesh:
    """A stand-in for jax.sharding.Mesh carrying only axis sizes (for analytic placement)."""

    def __init__(self, sizes: dict[str, int]):
        names = AXES + ((STAGE,) if sizes.get(STAGE, 1) > 1 else ())
        self.shape = {a: int(sizes[a]) for a in names}
        self.axis_names = names
        self.size = int(math.prod(self.shape.values()))


def with_stages(cfg, sizes: dict) -> dict:
    """The mesh sizes of cfg's pipeline: `sizes` holding a `stage` axis are taken as they are
    (global = the data-parallel host groups); without one, global counts all hosts and the
    stages are carved out of it, as make_mesh does."""
    pp = cfg.parallel.pp_stages
    if pp == 1 or STAGE in sizes:
        return dict(sizes)
    if sizes["global"] % pp:
        raise ConfigError(f"parallel.pp_stages={pp} does not divide the {sizes['global']} hosts; "
                          "choose stages that divide the node count")
    return {**sizes, "global": sizes["global"] // pp, STAGE: pp}


_ABSTRACT_CACHE: dict = {}


def abstract_param_shapes(cfg):
    """Pure dict of ShapeDtypeStructs of the model's params (cached per model config)."""
    key = repr(cfg.model) + str(cfg.train.scan_layers)
    if key not in _ABSTRACT_CACHE:
        from boost_jax.step.build import abstract_params

        _ABSTRACT_CACHE[key] = abstract_params(cfg.model, cfg.train)[1]
    return _ABSTRACT_CACHE[key]


@dataclass(frozen=True)  # cached per layout (state_sizes): shared
class StateSizes:
    """Per-device element counts of the state, by role, from the placement layouts."""

    tp_local: float  # Σ TP-local elements (unpadded): what one TP rank's weights hold
    tp_local_padded: float
    params: float  # stored elements per device (params sharding, padded)
    grads: float
    opt: float
    secondary: float
    replicated_dp: float  # elements no DP role could shard
    per_layer_tp_local: float  # one block's TP-local elements
    n_leaves: int
    n_block_leaves: int
    outside_tp_local: float = 0.0  # TP-local elements outside the blocks (embedding, head)
    outside_grads: float = 0.0  # of `grads`, the elements outside the blocks
    head_tp_local: float = 0.0  # of `outside_tp_local`, the head's (final norm, head or a tied
    # embedding): what the head's forward and backward fetch whole
    relayout: float = 0.0  # stored stack elements relaid out for the int8 secondary
    # (memory.relaid_for_secondary)
    gathered: bool = False  # some leaf is stored sharded over the params axes, so the step
    # gathers it and checkpoints each layer (step/engine.py, LeafFetch.is_gathered)


def state_sizes(cfg, sizes: dict[str, int]) -> tuple[StateSizes, Any]:
    """Exact per-device element counts (padding included) via the plan's own layouts."""
    from boost_jax.sharding.placement import make_placement

    sizes = with_stages(cfg, sizes)
    pl = make_placement(cfg, SizesMesh(sizes), abstract_param_shapes(cfg))
    # a search costs each layout at every micro-batch count and remat mode: the counts read
    # only whether there are several (Placement.accum_axes) and whether the backward replays
    key = (repr(cfg.model), repr(cfg.parallel), repr(cfg.optim), cfg.train.micro_batches > 1,
           cfg.train.remat == "full", cfg.train.scan_layers, tuple(sorted(sizes.items())))
    if key not in _SIZES:
        _SIZES[key] = _count(cfg, sizes, pl)
    return _SIZES[key], pl


_SIZES: dict = {}


def _count(cfg, sizes: dict[str, int], pl) -> StateSizes:
    from boost_jax.sharding.layout import is_layout
    import jax

    lays = jax.tree_util.tree_flatten_with_path(pl.layouts, is_leaf=is_layout)[0]
    acc = dict(tp=0.0, tpp=0.0, params=0.0, grads=0.0, opt=0.0, sec=0.0, rep=0.0, layer=0.0,
               out=0.0, out_grads=0.0, head=0.0, relayout=0.0)
    tied = cfg.model.tie_embeddings
    nb, gathered = 0, False
    for path, lay in lays:
        tp = math.prod(axis_size(sizes, t) for t in lay.tp)
        local = lay.padded_numel / tp
        acc["tp"] += lay.numel / tp
        acc["tpp"] += local

        def role(axes):
            return local / axis_size(sizes, axes) if lay.dim is not None else local

        acc["params"] += role(pl.stored_axes)
        acc["grads"] += role(pl.accum_axes(lay))
        acc["opt"] += role(pl.opt_state_axes)
        if keeps_secondary(pl, lay, path[0].key):
            acc["sec"] += role(pl.secondary_axes)
        if memory.relaid_for_secondary(pl, lay, path[0].key, sizes):
            acc["relayout"] += role(pl.stored_axes)
        if lay.dim is None:
            acc["rep"] += local
        gathered = gathered or (lay.dim is not None and bool(pl.params_axes))
        if path[0].key == "blocks":
            # one layer, TP-local (a stage's share of the stack is not)
            tp_only = math.prod(axis_size(sizes, [a for a in t if a != STAGE]) for t in lay.tp)
            if lay.layer_axis:
                acc["layer"] += lay.numel / tp_only / lay.shape[0]
                nb += 1
            else:  # train.scan_layers=false: one leaf per layer
                acc["layer"] += lay.numel / tp_only / cfg.model.n_layers
        else:
            acc["out"] += local
            acc["out_grads"] += role(pl.accum_axes(lay))
            acc["head"] += local if is_head(path[0].key) or tied and path[0].key == "embed" \
                else 0.0
    return StateSizes(acc["tp"], acc["tpp"], acc["params"], acc["grads"], acc["opt"],
                      acc["sec"], acc["rep"], acc["layer"], len(lays), nb, acc["out"],
                      acc["out_grads"], acc["head"], acc["relayout"], gathered)


# --------------------------------------------------------------------------- the model


@dataclass
class Prediction:
    layout: dict
    sizes: dict
    devices: int
    tokens_per_step: int
    micro_batch_per_device: int
    micro_batches: int
    flops_per_device: float  # model FLOPs (3x forward, no recompute) per device per step
    executed_flops_per_device: float  # with recompute
    time: dict  # compute (forward: its forward passes') / tp / dp / dp_exposed / step_comm / ...
    comm_bytes: dict  # per level, bytes per device per step
    comm_time: dict  # per level seconds (unoverlapped)
    memory: dict  # bytes per device by component, total, hbm, fits
    step_time: float
    tokens_per_s: float
    tflops_per_device: float
    mfu: float
    peak_flops: float  # one device's, the MFU's denominator
    assumptions: Assumptions
    collectives: list = field(default_factory=list, repr=False)
    notes: list = field(default_factory=list)
    node_egress: dict = field(default_factory=dict)  # tp | dp | step: bytes leaving a host

    @property
    def fits(self) -> bool:
        return bool(self.memory["fits"])

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["assumptions"] = dataclasses.asdict(self.assumptions)
        d["collectives"] = [dataclasses.asdict(c) for c in self.collectives]
        return d


def tp_info(cfg, sizes) -> tuple[str, int]:
    mode = cfg.parallel.tp_mode
    t = axis_size(sizes, cfg.parallel.tp_axes) if mode != "none" else 1
    return mode, t


def stage_layers(cfg) -> int:
    """Layers one device holds: all of them, or its pipeline stage's V chunks of
    ceil(L/(P·V))."""
    pp, v = cfg.parallel.pp_stages, cfg.parallel.pp_virtual
    return v * layers_per_stage(cfg.model.n_layers, pp, v) if pp > 1 else cfg.model.n_layers


def backward_layers(cfg) -> int:
    """Layers whose activations one backward holds: all of them, or one chunk of
    ceil(L/(P·V)) (a pipeline's B tick replays and differentiates one chunk at a time)."""
    pp, v = cfg.parallel.pp_stages, cfg.parallel.pp_virtual
    return layers_per_stage(cfg.model.n_layers, pp, v) if pp > 1 else cfg.model.n_layers


def schedule(cfg) -> Optional[Schedule]:
    """The pipeline's tick schedule (None without stages): the one step/pipeline.py runs."""
    return Schedule.of(cfg.parallel, cfg.train.micro_batches)


def passes(cfg) -> Passes:
    """Passes over each weight per step (micro-batches, or the pipeline's ticks)."""
    return Passes.of(cfg.train.micro_batches, schedule(cfg))


def dp_collectives(cfg, sizes, pl, combine: float = Assumptions.combine_bytes) -> list[Coll]:
    """The step's data-parallel / ZeRO collectives (sharding/step_collectives.py: what the
    engine runs, its calls as XLA's combiners merge them, each result at most `combine` bytes),
    one Coll per kind of collective and group: calls and bytes summed over the weights, so the
    time (linear in both) is the sum of the weights' times."""
    return _grouped(sizes, _per_pass(cfg, sizes, pl, combine), passes(cfg))


_PER_PASS: dict = {}
ONE_PASS = Passes(1, 1, 1, 1, 1)


def _per_pass(cfg, sizes, pl, combine: float) -> list:
    """The step's collectives, merged, for one pass of each kind (ONE_PASS), cached: a search
    costs each layout at every micro-batch count, pipeline schedule and remat mode, and only
    the calls of the per-pass collectives depend on the first two (Passes.per_step: equal to
    the step's own list up to rounding where the ticks do not divide by pp_virtual); of remat
    the list reads only whether each layer's backward replays its forward (hpZ's secondary
    comes from that gather), of the micro-batches only whether the last runs apart (where
    log_step's exchanges run, gather.LeafFetch.of)."""
    key = (repr(cfg.model), repr(cfg.parallel), cfg.train.scan_layers,
           cfg.train.remat == "full", cfg.train.micro_batches > 1, cfg.mesh.topology,
           tuple(sorted(sizes.items())), combine)
    if key not in _PER_PASS:
        listed = step_collectives(pl, ONE_PASS, cfg.model.tie_embeddings)
        _PER_PASS[key] = bucketed(listed, overlap.XLA_COMBINED, combine)
    return _PER_PASS[key]


def _grouped(sizes, listed: list, per: Passes) -> list[Coll]:
    groups: dict = {}
    for c in listed:
        calls = c.calls * per.per_step(c.block, c.runs, c.head) if c.runs in (FORWARD, BACKWARD) \
            else c.calls
        axes = tuple(a for a in c.axes if sizes.get(a, 1) > 1)
        key = (c.what, c.kind, axes, c.level, c.phase, c.runs)
        n, total = groups.get(key, (0.0, 0.0))
        groups[key] = (n + calls, total + c.payload * calls)
    return [Coll(what, kind, total / calls, axis_size(sizes, axes), level, calls, phase,
                 axes, *host_split(axes, sizes), runs=runs)
            for (what, kind, axes, level, phase, runs), (calls, total) in groups.items()]


def quant_seconds(cfg, sizes, st: StateSizes, pl, hbm: float, a: Assumptions) -> float:
    """HBM time of the (de)quantization kernels ZeRO++, the int8 secondaries and quantized
    cross-node legs (`cross_node_quant`) run, per step.

    Memory bound, as DeepSpeed's fused kernels run them: qwZ / an int8 secondary dequantizes
    every gathered weight (read q, write the working dtype; quantizing a shard is 1/|A| of it;
    hpZ: the flat gather in the forward, its kept S-block in the backward; an int8 secondary
    cut from the weights (over S, or kept whole: S = ∅) is quantized once per pass, its
    S-block, and dequantized at each use, forward and backward, unless it is qwZ's gather
    itself, kept as it arrived); qgZ quantizes the gradient
    (read a, write q₄), then per stage dequantizes, sums and requantizes what arrives in one
    pass (read q₄ of the stage's input, write fp32 of its output), the last stage's output
    read once more into the accumulator's dtype.
    """
    m, par = cfg.model, cfg.parallel
    pb, gb = DTYPE_BYTES[m.param_dtype], DTYPE_BYTES[par.grad_accum_dtype]
    q8, q4 = 1.0 + 4.0 / par.quant_block, 0.5 + 4.0 / par.quant_block
    W, k = st.tp_local_padded, passes(cfg).backward  # passes over the weights per step
    A, S = pl.params_axes, pl.secondary_axes
    decodes = len(pl.int8_decodes)  # int8 copies of the whole model dequantized per pass
    cut = 2 if pl.cuts_int8_secondary else 0  # of them, the secondary's two uses
    # a decode reads q and writes the working dtype; a gathered int8 copy was quantized from
    # the A-shard for it; the secondary cut from the weights once per pass, its S-block
    nbytes = k * W * (decodes * (q8 + pb) + (decodes - cut) * (pb + q8) / axis_size(sizes, A))
    kernels = 2 * decodes - cut
    if cut:
        nbytes, kernels = nbytes + k * W * (pb + q8) / axis_size(sizes, S), kernels + 1
    if pl.quantize_grads:
        w_in = W
        nbytes += k * W * (gb + q4)
        for axes in qgz_stages(pl.grads_axes):
            n = axis_size(sizes, axes)
            nbytes += k * (w_in * q4 + w_in / n * 4)
            w_in /= n
        nbytes += k * w_in * (4 + gb)
        kernels += 2 + 2 * len(qgz_stages(pl.grads_axes))
    calls = st.n_leaves - st.n_block_leaves + stage_layers(cfg) * st.n_block_leaves
    x_bytes, x_kernels = cross_node_quant(sizes, pl, W, pb, gb, q8, q4)
    return (nbytes + x_bytes) / (a.eta_hbm * hbm) + (k * kernels + x_kernels) * calls * a.launch_s


def cross_node_quant(sizes, pl, W: float, pb: float, gb: float, q8: float,
                     q4: float) -> tuple[float, int]:
    """(HBM bytes, kernels per weight) of hierarchical's quantized cross-node legs, once per
    step (parallel.quantize_cross_node_*): the deferred update quantizes each source shard
    (read the working dtype, write q₈) and dequantizes what the cross-node gather delivers;
    the gradient's reduce-scatter over R ∩ O quantizes its input (read a, write q) and
    dequantizes and sums what arrives (read q of the input, write fp32 of the result)."""
    nbytes, kernels = 0.0, 0
    for axes, src, result in pl.update_steps() if pl.xq_weights else ():
        if "global" in axes:
            nbytes += (W / axis_size(sizes, src) + W / axis_size(sizes, result)) * (pb + q8)
            kernels += 2
    if pl.xq_grads != "none":
        q = q8 if pl.xq_grads == "int8" else q4
        w_in = W / axis_size(sizes, pl.grads_axes)
        nbytes += w_in * (gb + q) + w_in * q + w_in / axis_size(sizes, pl.reduce_scatter_axes) * 4
        kernels += 2
    return nbytes, kernels


def memory_estimate(cfg, sizes, st: StateSizes, pl, bm: BlockModel, hm: BlockModel,
                    b: int, topo: Topology, a: Assumptions) -> dict:
    """Per-device bytes by named term (boost_jax.plan.memory) and the device's `hbm`; fits
    when the total is within memory.fit_limit."""
    sch, stage = schedule(cfg), 0.0
    if sch is not None:  # the stage inputs a device keeps (its buffer: Schedule.depth + 1)
        stage = (sch.depth + 1) * stage_send_bytes(cfg, sizes, b)
    unremat = saved.per_device(cfg, bm, b, st.gathered, a.attention,
                               st.per_layer_tp_local) if cfg.train.remat == "none" else 0.0
    mem = memory.estimate(cfg, st, pl, bm, hm, b, backward_layers(cfg), stage,
                          memory.fit_limit(topo.hbm_bytes, a), unremat)
    return dict(mem, hbm=topo.hbm_bytes)


def stage_send_bytes(cfg, sizes, b: int) -> float:
    """One device's send between stages: its [b, s, d] slice of the residual stream (BTP: d/t;
    Megatron and vanilla TP keep it whole on every rank), plus LaX's 7 latents of r."""
    m = cfg.model
    mode, t = tp_info(cfg, sizes)
    d = m.d_model / t if mode == "btp" else m.d_model
    width = d + (7 * (m.r / t if mode == "btp" else m.r) if m.arch == "lax" else 0)
    return DTYPE_BYTES[m.dtype] * b * cfg.data.seq_len * width


def block_times(cfg, model: BlockModel, peak: float, hbm: float, a: Assumptions,
                gathers: bool = False) -> tuple[float, float, float]:
    """(forward, backward, remat replay) seconds of one block or the head. remat=none on a
    plan that gathers weights (`gathers`) saves matmul outputs only (forward.remat_wrapper):
    the backward replays the elementwise kernels, and flash attention's kernel or dense
    attention's scale, mask and softmax over the saved scores (its memory traffic)."""
    fused = a.elem_kernels * a.launch_s  # the block's fused elementwise kernels
    fwd = sum(op_time(o, peak, hbm, a) for o in model.ops) + fused
    bwd = sum(op_time(o, peak, hbm, a, backward=True) for o in model.ops) + 2 * fused
    remat = cfg.train.remat
    if remat == "full" or (remat == "lowrank" and cfg.model.arch == "full"):
        return fwd, bwd, fwd
    if remat == "lowrank":
        return fwd, bwd, sum(op_time(o, peak, hbm, a) for o in model.ops
                             if not o.lowrank_saved) + fused
    if gathers:
        replay = [o if o.kind == "elem" or a.attention == "flash" else
                  dataclasses.replace(o, flops=0.0) for o in model.ops if o.kind != "gemm"]
        return fwd, bwd, sum(op_time(o, peak, hbm, a) for o in replay) + fused
    return fwd, bwd, 0.0


def compute_seconds(cfg, bm: BlockModel, hm: BlockModel, L: int, peak: float, hbm: float,
                    a: Assumptions, gathers: bool = False) -> tuple[float, float, float]:
    """(compute, pipeline bubble, forward share) per step: m micro-batches of L blocks + head,
    or the pipeline's ticks (see predict); the forward share is the forward pass's part of
    one micro-batch's compute (the rest: backward and remat replay)."""
    (bf, bb, br), (hf, hb, hr) = (block_times(cfg, bm, peak, hbm, a, gathers),
                                  block_times(cfg, hm, peak, hbm, a))
    micro, sch = cfg.train.micro_batches, schedule(cfg)
    launches = gpu_launch_seconds(cfg, bm, L * passes(cfg).backward, a)
    t_f, t_b = L * bf + hf, L * (bb + br) + hb + hr
    if sch is None:
        return micro * (t_f + t_b) + launches, 0.0, t_f / (t_f + t_b)
    t_embed = sum(op_time(o, peak, hbm, a) for o in hm.ops if o.name == "embed")
    # F: the embedding and the layers, no head; B re-runs them with the head
    t_compute = sch.ticks * (t_embed + L * bf + t_f + t_b) + launches
    return t_compute, t_compute * (sch.stages - 1) / sch.ticks, t_f / (t_f + t_b)


def exposed_dp(cfg, traffic: dict, t_dp: float, busy: float, t_fwd: float, L: int,
               a: Assumptions) -> tuple[float, float]:
    """(exposed seconds, of them the once-per-step legs') of the data-parallel collectives.
    `traffic`: their seconds by the pass they run in (CommSummary.pass_time); `busy`: the
    compute they can hide behind; `t_fwd`: of it the forward's. Analytic lists without a
    pipeline go pass by pass (overlap.pass_exposed); a pipeline's ticks interleave forward
    and backward passes alike (and defer nothing), measured lists do not say which pass a
    collective runs in, and overlap="none" and a share the GPU schedule measured
    (overlap="gpu") are step-wide: those pool the step's traffic against its compute
    (overlap_exposed), the legs' share of it in proportion to their traffic. overlap="gpu"
    without a measured share is overlap="xla"."""
    h = overlap.hidden(cfg.parallel.plan, cfg.parallel.tp_mode, "dp",
                       cfg.train.micro_batches) if a.overlap == "gpu" else None
    if a.overlap == "none" or h is not None or schedule(cfg) is not None or not traffic or \
            "" in traffic:
        x = overlap_exposed(t_dp, busy, L, a, h)  # the legs' share of it: their traffic's
        legs = traffic.get(FIRST_FORWARD, 0.0) + traffic.get(LAST_BACKWARD, 0.0)
        return x, (x * legs / t_dp if t_dp else 0.0)
    m = cfg.train.micro_batches
    return overlap.pass_exposed(traffic, m, t_fwd / m, (busy - t_fwd) / m, L)


def tp_collectives(cfg, sizes, bm: BlockModel, hm: BlockModel, t: int) -> list[Coll]:
    """The TP layout's activation collectives per step, on the critical path; a remat replay
    re-runs the forward's. The lists are the layout's own (block_collectives in
    sharding/tp/megatron.py, vanilla.py, btp.py; the head's in tp/common.py), per block."""
    if t <= 1:
        return []
    tp_axes = tuple(cfg.parallel.tp_axes)
    p = passes(cfg)  # over each block per step
    replays = cfg.train.remat == "full" or (cfg.train.remat == "lowrank"
                                            and bm.replays_collectives_lowrank)
    Lw = stage_layers(cfg)  # block layers the passes run over
    lv, hs = level_of(tp_axes), host_split(tp_axes, sizes)
    embed = [c for c in hm.fwd if c.name == "embed"]  # the embedding's; the rest the head's
    rows = [("tp_fwd", bm.fwd, Lw * (p.forward + (p.backward if replays else 0))),
            ("tp_bwd", bm.bwd, Lw * p.backward), ("tp_head", embed, p.ends_forward),
            ("tp_head", [c for c in hm.fwd if c not in embed], p.head_forward),
            ("tp_head", hm.bwd, p.ends_grads)]
    return [Coll(f"{prefix}_{c.name}", c.kind, c.payload, t, lv, calls, "tp", tp_axes, *hs)
            for prefix, colls, calls in rows for c in colls]


def stage_sends(cfg, sizes, b: int) -> list[Coll]:
    """The pipeline's activation sends per step (none without stages)."""
    sch = schedule(cfg)
    if sch is None:
        return []
    return [Coll("stage_send", "collective-permute", stage_send_bytes(cfg, sizes, b), 2,
                 "global", sch.sends, "tp", (STAGE,), *host_split((STAGE,), sizes))]


REMAT_NONE_NOTE = ("train.remat=none with TP, with pipeline stages, with exactly two "
                   "micro-batches, or with more than two on a plan that gathers weights: the GPU "
                   "programs measured hold up to 2.9x the estimate (more saved activations "
                   "than the model counts, or a loosely packed heap; benchmarks/README.md "
                   "section 11): judge memory with --gpu-compile")
REMAT_NONE_MARK = "none* in the remat column: a layout the train.remat=none note above is about"


def remat_none_unmodelled(cfg, st: StateSizes) -> bool:
    """The layouts whose memory the model does not bound under remat=none, as measured on the
    A100 programs (benchmarks/gpu_compile.py REMAT_NONE): two micro-batches (the live bytes at
    the peak are the model's, but XLA packs its heap into 1.7x as much); several on a plan that
    gathers weights (its program also keeps the zero-filled layer stacks of forwards outside
    the micro-batch loop and the pipelined gathers' peeled layers); tensor parallelism (the
    per-sequence bytes are scaled from the whole layer's, 10-30% short of the layout's own
    trace, plan/saved.py; BTP DDP over 8 micro-batches keeps about three micro-batches' stacks;
    CoLA-1B ZeRO-3 over a BTP pair, one micro-batch: 0.89x); pipeline stages (cola-60m DDP on
    2 stages, 4 micro-batches: the program holds 1.67x the estimate under 1f1b, 1.62x under
    gpipe)."""
    micro = cfg.train.micro_batches
    return cfg.train.remat == "none" and (
        cfg.parallel.pp_stages > 1 or cfg.parallel.tp_mode != "none" or micro == 2
        or micro > 2 and st.gathered)


def _notes(cfg, st: StateSizes, pl, measured, L: int) -> list[str]:
    notes = list(pl.notes)  # roles tensor parallelism took, in one line
    if pl.secondary_axes and not pl.hpz and set(pl.secondary_axes) < set(pl.params_axes):
        notes.append("hpZ without train.remat=full: the forward gathers each layer twice "
                     "(flat, then from its secondary), remat replaying the second")
    if remat_none_unmodelled(cfg, st):
        notes.append(REMAT_NONE_NOTE)
    notes.append("collectives: measured from the compiled step's HLO" if measured is not None
                 else "collectives: analytic (the step's placement, not compiled)")
    sch = schedule(cfg)
    if sch is not None:
        pp, V, micro = sch.stages, sch.virtual, sch.micro
        chunks = f" x {V} virtual" if V > 1 else ""
        notes.append(f"pipeline: {pp}{chunks} stages of {L} layers, {sch.kind} over "
                     f"{micro} micro-batches: bubble {sch.bubble:.0%}, "
                     "each B tick re-runs its stage forward")
        if cfg.parallel.plan == "hierarchical":
            notes.append("hierarchical under pipeline stages: its cross-node reduction and "
                         "update stay once per step (ticks defer neither); --search does not "
                         "rank such layouts")
    return notes


def _layout(cfg, mode: str, t: int, pl) -> dict:
    pp = cfg.parallel.pp_stages
    return dict(plan=cfg.parallel.plan, tp_mode=mode, tp_axes=list(cfg.parallel.tp_axes), tp=t,
                remat=cfg.train.remat, micro_batches=cfg.train.micro_batches,
                pipeline_stages=pp, pp_schedule=cfg.parallel.pp_schedule if pp > 1 else None,
                pp_virtual=cfg.parallel.pp_virtual if pp > 1 else None, placement=pl.describe())


def optimizer_seconds(st: StateSizes, param_dtype: str, hbm: float, a: Assumptions) -> float:
    """AdamW on the opt_state shard: fp32 master/m/v/grad read and written (memory bound)."""
    opt_bytes = st.opt * (4 + 4 + 4 + 4) * 2 + st.params * DTYPE_BYTES[param_dtype]
    return opt_bytes / (a.eta_hbm * hbm) + 40 * a.launch_s


def recompute_factor(cfg) -> float:
    """Executed FLOPs per model FLOP: remat re-runs the forward (+1/3 of forward + backward),
    and so does a pipeline's backward tick (step/pipeline.py)."""
    return (4 / 3 if cfg.train.remat != "none" else 1.0) + \
        (1 / 3 if cfg.parallel.pp_stages > 1 else 0.0)


def predict(cfg, topo: Topology, sizes: dict[str, int],
            assumptions: Optional[Assumptions] = None,
            measured: Optional[CommSummary] = None) -> Prediction:
    """Analytic (or measured-collective) prediction of one optimizer step on `sizes`.

    `measured`: collective cost of a compiled step (CommSummary of colls_from_report, possibly
    extrapolated), used instead of the analytic collective list. With parallel.pp_stages = P
    (`sizes` global = the data-parallel host groups; the `stage` axis is added) the step is the
    engine's pipeline (boost_jax/step/pipeline.py): N+P−1 ticks with a forward (F = one
    chunk's k = ceil(L/(P·V)) layers) and N+P−1 with a backward (B = F re-run with the head +
    its backward), N = V·m, so compute = (N+P−1)·(F+B) — bubble (P−1)/(N+P−1) — and 2(N+P−1)−1
    activation sends on the critical path.
    """
    a = resolve_attention(cfg, topo, assumptions or Assumptions())
    m, s, micro = cfg.model, cfg.data.seq_len, cfg.train.micro_batches
    sizes = with_stages(cfg, sizes)
    mode, t = tp_info(cfg, sizes)
    st, pl = state_sizes(cfg, sizes)
    n_dev = int(math.prod(sizes.values()))
    b = cfg.train.global_batch // micro // axis_size(sizes, pl.batch_axes)  # per device
    peak, hbm = topo.device_peak(n_dev), HBM_BW[topo.name]
    L = backward_layers(cfg)  # per F / B
    bm, hm = block_model(m, b, s, mode, t, a.attention), head_model(m, b, s, mode, t)
    t_compute, t_bubble, fwd = compute_seconds(cfg, bm, hm, L, peak, hbm, a, st.gathered)
    # collectives: analytic, or measured from the compiled step
    colls = tp_collectives(cfg, sizes, bm, hm, t) + stage_sends(cfg, sizes, b) + \
        dp_collectives(cfg, sizes, pl, a.combine_bytes)
    comm = measured if measured is not None else CommSummary.of(colls, topo, a)
    t_tp, t_stepc = (gpu_exposed(cfg, ph, comm.phase_time.get(ph, 0.0), a) for ph in ("tp", "step"))
    t_dp = comm.phase_time.get("dp", 0.0)
    # the (de)quantization kernels run on the GPU next to the compute: never hidden
    t_quant = quant_seconds(cfg, sizes, st, pl, hbm, a)
    t_opt = optimizer_seconds(st, m.param_dtype, hbm, a)
    # the stage sends (part of t_tp: on the critical path), reported apart
    p2p = 0.0 if measured else sum(coll_time(c, topo, a) for c in colls if c.name == "stage_send")
    busy = t_compute - t_bubble
    t_fwd = fwd * busy
    x_dp, x_once = exposed_dp(cfg, comm.pass_time or {}, t_dp, busy, t_fwd, L, a)
    total = t_compute + t_quant + t_tp + x_dp + t_stepc + t_opt
    total_overlap = t_compute + t_quant + t_tp + max(0.0, t_dp - t_compute) + t_stepc + t_opt
    tokens = cfg.train.global_batch * s
    model_flops = flops_per_token(m, s, a.attention)["train"] * tokens / n_dev  # flash: s/2 keys
    mem = memory_estimate(cfg, sizes, st, pl, bm, hm, b, topo, a)
    tflops = model_flops / total / 1e12
    return Prediction(
        layout=_layout(cfg, mode, t, pl), sizes=dict(sizes), devices=n_dev,
        tokens_per_step=tokens, micro_batch_per_device=b, micro_batches=micro,
        flops_per_device=model_flops, executed_flops_per_device=model_flops * recompute_factor(cfg),
        time=dict(compute=t_compute, bubble=t_bubble, forward=t_fwd, tp=t_tp, dp=t_dp,
                  quant=t_quant, p2p=p2p, dp_exposed=x_dp, dp_once_exposed=x_once,
                  dp_latency=comm.dp_latency, step_comm=t_stepc, optimizer=t_opt,
                  nic=comm.nic_seconds(topo, a), total=total, total_overlapped=total_overlap),
        comm_bytes={lv: comm.level_bytes.get(lv, 0.0) for lv in AXES},
        comm_time={lv: comm.level_time.get(lv, 0.0) for lv in AXES}, memory=mem,
        step_time=total, tokens_per_s=tokens / total, tflops_per_device=tflops,
        mfu=tflops * 1e12 / peak, peak_flops=peak, assumptions=a, collectives=colls if measured is None else [],
        notes=_notes(cfg, st, pl, measured, L), node_egress=dict(comm.egress or {}))


def with_overrides(cfg, **kw):
    """A copy of cfg with dotted-key overrides, e.g. with_overrides(cfg, **{"train.remat": "full"})."""
    cfg = dataclasses.replace(cfg)
    for key, value in kw.items():
        sec, name = key.split(".")
        setattr(cfg, sec, dataclasses.replace(getattr(cfg, sec), **{name: value}))
    return cfg


def params_total(cfg) -> int:
    return param_count(cfg.model)
