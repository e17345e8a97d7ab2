"""Per-device memory of one training step: the buffers the compiled program keeps live at its peak.

Each term is a buffer (or set of buffers) one can name in the GPU program's buffer assignment
(benchmarks/README.md section 11 says where each was found); TERMS names them as the planner's
report prints them. With several micro-batches the peak falls inside the micro-batch loop,
during the backward layer scan; with a deferred update, possibly in the first micro-batch's
backward instead (`peak`: no accumulator yet, but the params shards it hands on and the later
forwards' int8 secondaries). The launcher's XLA flags (mesh.GPU_XLA_SCHEDULE,
--xla_gpu_enable_while_loop_double_buffering) unroll that loop by two, so the next
micro-batch's zero gradient slots already exist while this one's backward runs
(DOUBLE_BUFFERED). With one micro-batch and no pipeline there is no loop: one forward, the
head, one backward, each buffer live only in its phase (ONE_PASS_PHASES), the saved ones
through all three; the peak is the largest phase.

Two terms need their formula. `head` / `head_grads` (one pass): the head's weights fetched
whole and their gradient, held through the backward layer scan to the step's reduction,
head_tp_local x param / grad_accum bytes. `stack_relayout` (no deferred update, int8
secondary): the stored stack of every layer weight quantized along a dim that is not its minor
one is relaid out once before the forward's layer loop (relaid_for_secondary),
StateSizes.relayout x param bytes; counted once in a micro-batch loop (a two-trip loop XLA
unrolls holds one per trip: not modelled). Heap fragmentation (what XLA's packing leaves
between buffers) cannot be modelled from the layout: it is left to the margin of `fit_limit`.
"""

from __future__ import annotations

from boost_jax.mesh import axis_size
from boost_jax.plan.roofline import DTYPE_BYTES
from boost_jax.sharding.step_collectives import keeps_secondary
from boost_jax.step.optim import STATE_PER_PARAM

TERMS = {
    "grads": "gradient accumulator (micro-batch loop carry)",
    "micro_grads": "this micro-batch's block gradients (backward layer-scan carry)",
    "grad_slots": "zero gradient slots the layer scan reads",
    "grad_slots_next": "next micro-batch's zero gradient slots (double-buffered micro-batch loop)",
    "gathered_weights": "two layers' gathered weights (double-buffered layer loop)",
    "params_shards": "params shards the first micro-batch gathers and keeps: the ends', and the "
                     "layer stack's with several micro-batches (parallel.defer_update)",
    "params_capture": "the layer stack's params shards as the first backward's cotangent, for "
                      "the later micro-batches (parallel.defer_update)",
    "secondary_next": "later forwards' saved-secondary stacks, zero-filled before the first "
                      "backward (parallel.defer_update; up to three)",
    "secondary": "secondary weight copy",
    "activations": "saved activations (by remat policy; remat=none: what autodiff keeps)",
    "block_working": "one block's working set (flash statistics included)",
    "stage_inputs": "pipeline stage inputs",
    "logits": "fp32 logits and their gradient (compute dtype)",
    "embed_head": "embedding and head, fetched whole, with their gradients",
    "layer_grads": "one layer's fp32 gradient",
    "stack_relayout": "the layer stack's weights relaid out for their int8 secondary's blocks "
                      "(no deferred update: the forward reads the stack in place)",
    "head": "the head's weights fetched whole (one pass: the head's phase)",
    "head_grads": "the head's gradient, held through the backward layer scan (one pass)",
}
# One micro-batch, no pipeline: the terms each phase adds to the saved ones (every other term:
# the state, the secondary, the saved activations, the gradient buffers)
ONE_PASS_PHASES = {
    "forward": ("params_shards", "stack_relayout", "gathered_weights", "block_working"),
    "head": ("head", "logits"),
    "backward": ("head_grads", "gathered_weights", "layer_grads", "block_working"),
}
DOUBLE_BUFFERED = ("grad_slots_next", "gathered_weights")


def fit_limit(hbm_bytes: float, a) -> float:
    """Bytes a layout may be estimated at and still fit: `hbm_usable` of HBM (what the
    runtime and allocator leave) less the safety `memory_margin` for what is not modelled."""
    return hbm_bytes * a.hbm_usable / (1.0 + a.memory_margin)


def relaid_for_secondary(pl, lay, top: str, sizes: dict) -> bool:
    """Whether XLA keeps a relaid-out copy of this leaf's stored layer stack (`stack_relayout`):
    the layer loop reads the stack in place from the step's arguments (no deferred update)
    and quantizes each layer into the int8 secondary with blocks along a dim that is not the
    minor one (quant.quantize moves it last); XLA's layout assignment then lays the whole
    stack out for that once, before the loop, and holds the copy through the forward."""
    S, P = pl.secondary_axes, tuple(pl.params_axes)
    if (pl.defer_update or not pl.int8_secondary or not lay.layer_axis
            or pl.keeps_int8_gather or tuple(S or ())[:len(P)] != P
            or not keeps_secondary(pl, lay, top)):
        return False
    one = lay.sliced()
    shape = one.local_shape(sizes, S)
    qa = max(range(len(shape)), key=lambda i: (shape[i], i != one.dim, -i))  # quant_axis
    return qa != len(shape) - 1


def loop_trips(cfg, pl) -> int:
    """Trips of the micro-batch scan: less a deferred update's first and a last micro-batch
    that reduces in the backward, both peeled off (step/engine.py: Engine.micro_loop)."""
    micro = cfg.train.micro_batches
    if micro == 1:
        return 0
    return micro - int(bool(pl.defer_update)) - int(bool(pl.reduce_in_backward))


def gradient_terms(cfg, st, pl, gb: int) -> dict:
    """The gradient buffers of the micro-batch loop (see the module docstring)."""
    blocks = (st.grads - st.outside_grads) * gb
    # XLA unrolls a two-trip loop whole: its iterations share one set of zero slots
    loop = cfg.parallel.pp_stages == 1 and loop_trips(cfg, pl) > 2
    return {"grads": st.grads * gb, "micro_grads": blocks, "grad_slots": blocks,
            "grad_slots_next": blocks if loop else 0.0}


def deferred_terms(cfg, st, pl, pb: int, secondary: float) -> dict:
    """A deferred update's buffers: the params shards the first micro-batch gathers (the ends'
    for the step; the layer stack's, kept for its backward, only when they are handed on)."""
    n = axis_size(dict(pl.mesh.shape), pl.params_axes)
    stack = (st.tp_local_padded - st.outside_tp_local) / n * pb
    micro = cfg.train.micro_batches
    if micro == 1:
        return {"params_shards": st.outside_tp_local / n * pb}
    return {"params_shards": st.tp_local_padded / n * pb, "params_capture": stack,
            "secondary_next": min(micro - 1, 3) * secondary}


def peak(mem: dict, one_pass: bool = False) -> tuple[float, str]:
    """(bytes, phase) of the largest peak. One pass (one micro-batch, no pipeline): the saved
    terms plus the largest phase's (ONE_PASS_PHASES). Else the micro-batch loop's backward,
    or a deferred update's first backward (no accumulator yet; its capture and the
    zero-filled stacks)."""
    terms = {k: v for k, v in mem.items() if k != "arguments"}
    if one_pass:
        phased = {k for ks in ONE_PASS_PHASES.values() for k in ks}
        saved = sum(v for k, v in terms.items() if k not in phased)
        adds = {p: sum(terms.get(k, 0.0) for k in ks) for p, ks in ONE_PASS_PHASES.items()}
        phase = max(adds, key=adds.get)
        return saved + adds[phase], phase
    first_only = ("params_capture", "secondary_next")
    later = sum(v for k, v in terms.items() if k not in first_only)
    if "params_capture" not in mem:
        return later, "micro-batch loop"
    first = sum(v for k, v in terms.items() if k != "grads")
    return (first, "first micro-batch") if first > later else (later, "micro-batch loop")


def activation_bytes(cfg, bm, L: int, unremat: float) -> tuple[float, float]:
    """(saved layer inputs, and low-rank latents, by remat policy; one block's working set:
    every kernel's output, flash attention's row statistics among them). Without remat each
    layer keeps `unremat` bytes (what JAX saves, plan/saved.py): none apart."""
    working = sum(o.out_bytes for o in bm.ops)
    remat = cfg.train.remat
    if remat == "none":
        return L * unremat, 0.0
    if remat == "full":
        return L * bm.residual_bytes, working
    return L * (bm.residual_bytes + bm.latent_bytes), working


def one_pass(cfg) -> bool:
    """One micro-batch and no pipeline: no loop, the step's phases peak apart (ONE_PASS_PHASES)."""
    return cfg.train.micro_batches == 1 and cfg.parallel.pp_stages == 1


def ends_terms(cfg, st, pb: int, gb: int) -> dict:
    """The weights outside the layer stack. Several micro-batches: embedding and head fetched
    whole with their gradients, all live through the loop. One pass: the head's weights in
    its phase, their gradient through the backward (the embedding's fetch and gradient fall
    at the step's start and end, outside the phases)."""
    if one_pass(cfg):
        return {"head": st.head_tp_local * pb, "head_grads": st.head_tp_local * gb}
    return {"embed_head": st.outside_tp_local * (pb + gb)}


def estimate(cfg, st, pl, bm, hm, b: int, L: int, stage_inputs: float, limit: float,
             unremat: float) -> dict:
    """Per-device bytes by term; `total`, the `limit` (fit_limit) and `fits` (total <= limit).
    L: the layers one backward holds activations of (costmodel.backward_layers); unremat: the
    bytes one layer keeps under train.remat=none (plan/saved.per_device)."""
    m, par = cfg.model, cfg.parallel
    pb = DTYPE_BYTES[m.param_dtype]
    mem = {"weights": st.params * pb, "master": st.opt * 4 if m.param_dtype != "float32" else 0.0,
           # fp32 optimizer moments ("adam" for every optimizer: the key the reports read)
           "adam": st.opt * 4 * STATE_PER_PARAM[cfg.optim.name],
           "batch": 2 * 4 * b * cfg.data.seq_len * cfg.train.micro_batches}
    mem["arguments"] = mem["weights"] + mem["master"] + mem["adam"] + mem["batch"]
    gb = DTYPE_BYTES[par.grad_accum_dtype]
    mem.update(gradient_terms(cfg, st, pl, gb))
    mem.update(ends_terms(cfg, st, pb, gb))
    mem["gathered_weights"] = 2 * st.per_layer_tp_local * pb if pl.params_axes else 0.0
    if st.relayout:
        mem["stack_relayout"] = st.relayout * pb
    if pl.secondary_axes is not None:
        q8 = 1.0 + 4.0 / par.quant_block
        mem["secondary"] = st.secondary * (q8 if pl.int8_secondary else pb)
    if pl.defer_update:
        mem.update(deferred_terms(cfg, st, pl, pb, mem.get("secondary", 0.0)))
    saved, working = activation_bytes(cfg, bm, L, unremat)
    mem["activations"], mem["block_working"] = float(saved), float(working)
    if stage_inputs:
        mem["stage_inputs"] = stage_inputs
    # the head's backward holds the fp32 logits [tokens, vocab] and their gradient, written in
    # the compute dtype (the cross-entropy's backward is one elementwise fusion with the cast
    # of forward.logits_matmul's cotangent)
    ce = next(o.out_bytes for o in hm.ops if o.name == "cross_entropy")
    mem["logits"] = ce * (1 + DTYPE_BYTES[m.dtype] / 4)
    mem["layer_grads"] = st.per_layer_tp_local * 4
    mem["total"], mem["peak"] = peak(mem, one_pass(cfg))
    mem["limit"], mem["fits"] = limit, mem["total"] <= limit
    return mem


def _gib(x: float) -> str:
    return f"{x / 2**30:.2f} GiB"


def report_lines(mem: dict, a, hbm_bytes: float) -> list[str]:
    """The planner's memory report: every temporary by name, the double-buffered ones apart,
    and the fit rule (threshold and margin, one setting)."""
    temps = [k for k in TERMS if mem.get(k) and k not in DOUBLE_BUFFERED + ("secondary", "grads")]
    dbl = [k for k in DOUBLE_BUFFERED if mem.get(k)]
    out = ["  other temporaries: " + ", ".join(f"{k} {_gib(mem[k])}" for k in temps)]
    if mem.get("params_capture"):
        out.append(f"  peak: {mem['peak']} (the first has params_capture and secondary_next, "
                   "the loop the accumulator `grads`)")
    elif mem["peak"] in ONE_PASS_PHASES:
        out.append(f"  peak: the one pass's {mem['peak']} (the saved terms plus "
                   + ", ".join(ONE_PASS_PHASES[mem["peak"]]) + ")")
    if dbl:
        out.append("  double-buffered by the launcher's XLA flags: "
                   + ", ".join(f"{k} {_gib(mem[k])} ({TERMS[k]})" for k in dbl))
    out.append(f"  fits when total + {a.memory_margin:.0%} margin (XLA's heap packing, not "
               f"modelled) <= {a.hbm_usable:.0%} of HBM: limit "
               f"{_gib(fit_limit(hbm_bytes, a))}")
    return out
