"""Predicted vs published: the cost model against BOOST (Perlmutter) and LBP (Frontier).

One set of assumptions for every row (`VALIDATION_ASSUMPTIONS`, printed with the tables); no
constant is tuned per row. What the published papers did not state is fixed here once:

BOOST (MLSys 2026), iteration seconds, seq 4096, batch 4, A100 (Perlmutter, 40 GB profile):
    shapes       LLaMA-2 family: 7B d=4096 L=32 H=32 d_ff=11008; 13B d=5120 L=40 H=40
                 d_ff=13824; 3B is not a LLaMA-2 size — the OpenLLaMA-3B shape d=3200 L=26 H=32
                 d_ff=8640 is used. vocab 32000. Low-rank rows: CoLA, r = d/4 (the 7B comm
                 figure 0.22 GB/layer BOOST reports pins r = 1024).
    methods      full = arch full + Megatron TP; vanilla = CoLA + vanilla low-rank TP;
                 BTP = CoLA + BTP. One TP group (TP2: one NVLink pair; TP4: one node), no DP.
    remat        whole-block recompute for all three (the reference code's only checkpointing
                 mode, as BOOST describes it); flash attention (the published stacks use it).
    13B PP2      2 pipeline stages over 2 nodes, the batch as 4 micro-batches of 1, 1F1B:
                 the engine's pipeline (parallel.pp_stages=2), costed by plan/costmodel.py.
LBP (arXiv 2501.04266), 20B GPT on Frontier:
    shape        GPT-NeoX-20B itself (model.family=gpt_neox, configs/gpt-neox-20b.yaml):
                 d=6144 L=44 H=64 d_ff=24576 vocab 50432, seq 2048, 20.6B parameters.
    run          micro-batch 1 sequence per GCD, no gradient accumulation (DeepSpeed defaults),
                 bf16 weights + fp32 master/Adam, gradients reduced in bf16 (DeepSpeed's
                 default communication dtype), whole-block recompute.
    plans        ZeRO-3 = plan zero3; ZeRO++ = plan zeropp (qwZ int8 gathers + hpZ node
                 secondary + qgZ int4 gradient all-to-alls, inside the node then across);
                 LBP = plan hierarchical (params over the GCD pair, grads over the node,
                 optimizer over all, int8 pair secondary).
    scaling      weak scaling (fixed per-GCD batch): TFLOP/s per GCD at 48 nodes over that at
                 the smallest power-of-two node count where the plan fits in HBM (the paper's
                 single-node 20B run cannot fit: optimizer state over 8 GCDs alone is 31 GB).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from boost_jax.config import load_config
from boost_jax.mesh import NCCL_INTEL_CPU, Topology, get_topology
from boost_jax.plan.costmodel import Assumptions, predict
from boost_jax.sharding.stages import Schedule

VALIDATION_ASSUMPTIONS = Assumptions(attention="flash")
TOLERANCE = 0.25

BOOST_SHAPES = {
    "3B": dict(d=3200, L=26, H=32, d_ff=8640, tp=2, pp=1),
    "7B": dict(d=4096, L=32, H=32, d_ff=11008, tp=4, pp=1),
    "13B": dict(d=5120, L=40, H=40, d_ff=13824, tp=4, pp=2),
}
# Iteration seconds full / vanilla / BTP, BOOST's per-model measurements on Perlmutter as this
# project took them from the paper's evaluation (arXiv 2512.12131). Only its abstract could be
# read again from here, and it states ranges, not these seconds; three of the ratios below fall
# just outside those ranges (ranges_table). Until they are re-read from the paper, rows built
# on them are checks against a transcription.
BOOST_PUBLISHED = {"3B": (1.14, 1.41, 0.78), "7B": (1.06, 1.64, 0.72), "13B": (2.07, 2.42, 1.30)}
BOOST_RANGES = {"btp speed-up over full rank": (1.46, 1.91),
                "btp speed-up over vanilla TP": (1.87, 2.27)}
BOOST_METHODS = (("full", "full", "megatron"), ("vanilla", "cola", "vanilla"),
                 ("btp", "cola", "btp"))

LBP_SHAPE = dict(d=6144, L=44, H=64, d_ff=24576, vocab=50432, seq=2048)  # GPT-NeoX-20B
LBP_PUBLISHED = {"lbp_over_zeropp": 1.71, "scaling_efficiency": 0.94, "zeropp_over_zero3": 1.405}
LBP_NODES = 48
# DeepSpeed, which the paper ran, fetches a submodule's parameters at a time and prefetches the
# next ones, up to stage3_prefetch_bucket_size (5e7 elements), in one coalesced all-gather;
# with qwZ the int8 weights and their scales go as two calls. Read as of
# microsoft/DeepSpeed@38327e07f6cd (not necessarily the paper's version). On the 20B its
# calls are about one large Linear each: an MLP weight in bf16, d x d_ff x 2 bytes.
DEEPSPEED_SOURCE = ("microsoft/DeepSpeed@38327e07f6cd, deepspeed/runtime/zero/"
                    "partition_parameters.py (all_gather_coalesced) and "
                    "partitioned_param_coordinator.py (fetch_sub_module)")
DEEPSPEED_CALL_BYTES = LBP_SHAPE["d"] * LBP_SHAPE["d_ff"] * 2

# Where each published figure comes from
SOURCES = [
    ("BOOST ranges: BTP 1.46–1.91x over full rank, 1.87–2.27x over vanilla TP (1B–40B models, "
     "CoLA/SVD/LaX)", "BOOST (arXiv 2512.12131, MLSys 2026), abstract and section 4"),
    ("BOOST iteration seconds per model (3B TP2, 7B TP4, 13B TP4 PP2; full / vanilla / BTP)",
     "BOOST (arXiv 2512.12131), per-model iteration times on Perlmutter, as transcribed "
     "from its evaluation (not re-checked against the paper's text: its abstract states "
     "the ranges only)"),
    ("LBP over ZeRO++ 1.71x TFLOP/s per GPU; 0.94 scaling efficiency to 384 GCDs (20B GPT)",
     "Scaling LLM Training on Frontier with Low-Bandwidth Partitioning ("
     "arXiv 2501.04266), abstract and results"),
    ("ZeRO++ over ZeRO-3 \"up to\" +40.5% TFLOP/s per GPU (Frontier)", "arXiv 2501.04266, results"),
    ("ZeRO++ cross-node volume 0.75M vs ZeRO-3's 3M per iteration (M = model bytes in fp16)",
     "the ZeRO++ paper (arXiv 2306.10209), its communication-volume analysis"),
]

# Ratios the model does not bring within TOLERANCE, each with the reason (the validation table
# prints it; tests/unit/test_plan.py fails if one of them comes within, or another falls out)
KNOWN_GAPS = {
    "lbp_over_zeropp": "modelled as the paper ran it (the updated weights gathered across "
                       "nodes once per step after the optimizer, in bf16), hierarchical leads "
                       "ZeRO++ by less than published, and would even were nothing of its own "
                       "exposed: ZeRO++'s step over hierarchical's compute, (de)quantization "
                       "and optimizer stays under 1.71x, "
                       "so the gap needs a slower ZeRO++ than the model's; with every RCCL "
                       "ring step at what its measured 32 MiB calls leave, ZeRO++ would be "
                       "that slow and the ratio overshoots, with only the steps between nodes "
                       "it stays short (validation.md, 'Why the remaining gaps'). Our own rows "
                       "beside it (deferred update, quantized legs) come closer",
}


def boost_config(size: str, method: str, remat: str = "full", topology: str = "perlmutter",
                 micro_batches: Optional[int] = None, extra: tuple = ()):
    sh = BOOST_SHAPES[size]
    arch, mode = {m: (a, t) for m, a, t in BOOST_METHODS}[method]
    axes = "[pair]" if sh["tp"] == 2 else "[pair,node]"
    micro = micro_batches or (4 if sh["pp"] > 1 else 1)
    return load_config(None, [
        f"model.arch={arch}", "model.vocab_size=32000", f"model.d_model={sh['d']}",
        f"model.n_layers={sh['L']}", f"model.n_heads={sh['H']}", f"model.d_ff={sh['d_ff']}",
        f"model.rank={sh['d'] // 4}", "model.max_seq_len=4096", "data.seq_len=4096",
        "model.param_dtype=bfloat16", "model.dtype=bfloat16", f"parallel.tp_mode={mode}",
        f"parallel.tp_axes={axes}", f"parallel.pp_stages={sh['pp']}",
        "train.global_batch=4", f"train.micro_batches={micro}",
        f"train.remat={remat}", f"mesh.topology={topology}", *extra])


def boost_sizes(size: str) -> dict:
    """One TP group per stage: a pair (TP2) or a node (TP4), the stages on their own nodes."""
    sh = BOOST_SHAPES[size]
    return {"pair": 2, "node": 1 if sh["tp"] == 2 else 2, "global": sh["pp"]}


def boost_predictions(assumptions: Assumptions = VALIDATION_ASSUMPTIONS,
                      topology: str = "perlmutter", sizes=("3B", "7B", "13B"),
                      remat: str = "full", topo: Optional[Topology] = None) -> dict:
    """`topo` replaces the named topology's profile (the sensitivity's bandwidth variants)."""
    topo = topo or get_topology(topology)
    out = {}
    for size in sizes:
        out[size] = {m: predict(boost_config(size, m, remat, topology), topo, boost_sizes(size),
                                assumptions)
                     for m, _, _ in BOOST_METHODS}
    return out


# The LBP plans as the paper ran them: library rings (flat collectives), the updated weights
# gathered once per step after the optimizer, cross-node legs in bf16. What this project adds
# beyond the paper is reported beside the validation rows (OURS_LBP), never inside them.
PAPER_LBP = ("parallel.collectives=flat", "parallel.defer_update=false",
             "parallel.quantize_cross_node_weights=none", "parallel.quantize_cross_node_grads=none")
# LBP's quantized pair copy, named rather than left to the preset: the planner's own rule
# (plan/secondary.py) keeps a bfloat16 one at this setting (the last OURS_LBP row)
PAPER_LBP_HIERARCHICAL = ("parallel.secondary_dtype=int8",)

# (name, overrides for every plan, overrides for hierarchical only)
OURS_LBP = [
    ("as the paper ran them (the validation rows)", (), ()),
    ("hierarchical's update gather deferred into the next forward (`parallel.defer_update`)",
     (), ("parallel.defer_update=true",)),
    ("deferred, and its cross-node legs int8 weights / int4 gradients",
     (), ("parallel.defer_update=true", "parallel.quantize_cross_node_weights=int8",
          "parallel.quantize_cross_node_grads=int4")),
    ("every plan's collectives two-level (`parallel.collectives=two_level`)",
     ("parallel.collectives=two_level",), ()),
    ("two-level, and hierarchical deferred with quantized legs",
     ("parallel.collectives=two_level",),
     ("parallel.defer_update=true", "parallel.quantize_cross_node_weights=int8",
      "parallel.quantize_cross_node_grads=int4")),
    ("every plan's cross-node legs as log-step exchanges (`parallel.collectives=log_step`)",
     ("parallel.collectives=log_step",), ()),
    ("log-step exchanges, and hierarchical deferred with quantized legs",
     ("parallel.collectives=log_step",),
     ("parallel.defer_update=true", "parallel.quantize_cross_node_weights=int8",
      "parallel.quantize_cross_node_grads=int4")),
    ("hierarchical's pair copy in bfloat16 (`parallel.secondary_dtype`), as the planner "
     "picks it here", (), ("parallel.secondary_dtype=bfloat16",)),
]


def ours_lbp_table(assumptions: Assumptions = VALIDATION_ASSUMPTIONS) -> tuple[str, list]:
    """The 20B GPT on 48 nodes with this project's additions, one row each: hierarchical /
    ZeRO++ and ZeRO++ / ZeRO-3 TFLOP/s per GCD (not validation rows: nothing was published)."""
    lines = ["| variant (48 nodes, 384 GCDs) | hierarchical / ZeRO++ | ZeRO++ / ZeRO-3 | "
             "step s: ZeRO-3 / ZeRO++ / hierarchical | hierarchical once-per-step comm s |",
             "|---|---|---|---|---|"]
    rows = []
    for name, every, hier in OURS_LBP:
        p = {plan: lbp_predict(plan, LBP_NODES, assumptions, 1,
                               every + (hier if plan == "hierarchical" else ()))
             for plan in ("zero3", "zeropp", "hierarchical")}
        hz = p["hierarchical"].tflops_per_device / p["zeropp"].tflops_per_device
        zz = p["zeropp"].tflops_per_device / p["zero3"].tflops_per_device
        rows.append(dict(name=name, lbp_over_zeropp=hz, zeropp_over_zero3=zz))
        steps = " / ".join(f"{p[k].step_time:.2f}" for k in ("zero3", "zeropp", "hierarchical"))
        lines.append(f"| {name} | {hz:.2f} | {zz:.2f} | {steps} | "
                     f"{p['hierarchical'].time['step_comm']:.2f} |")
    return "\n".join(lines), rows


def lbp_config(plan: str, nodes: int, micro_batches: int = 1, extra: tuple = ()):
    s = LBP_SHAPE
    n = nodes * 8
    return load_config(None, [
        "model.arch=full", "model.family=gpt_neox", "model.norm_eps=1e-5",
        f"model.vocab_size={s['vocab']}", f"model.d_model={s['d']}",
        f"model.n_layers={s['L']}", f"model.n_heads={s['H']}", f"model.d_ff={s['d_ff']}",
        f"model.max_seq_len={s['seq']}", f"data.seq_len={s['seq']}",
        "model.param_dtype=bfloat16", "model.dtype=bfloat16", f"parallel.plan={plan}",
        "parallel.grad_accum_dtype=bfloat16", f"train.global_batch={n * micro_batches}",
        f"train.micro_batches={micro_batches}", "train.remat=full", "mesh.topology=frontier",
        *PAPER_LBP, *(PAPER_LBP_HIERARCHICAL if plan == "hierarchical" else ()), *extra])


def lbp_predict(plan: str, nodes: int, assumptions: Assumptions = VALIDATION_ASSUMPTIONS,
                micro_batches: int = 1, extra: tuple = (), topo: Optional[Topology] = None):
    return predict(lbp_config(plan, nodes, micro_batches, extra),
                   topo or get_topology("frontier"), {"pair": 2, "node": 4, "global": nodes},
                   assumptions)


def never_hidden(p) -> float:
    """Seconds of a prediction's step that no overlap takes off: its compute, (de)quantization
    kernels and optimizer (the floor of validation.md's bound on hierarchical / ZeRO++)."""
    return p.time["compute"] + p.time["quant"] + p.time["optimizer"]


def lbp_predictions(assumptions: Assumptions = VALIDATION_ASSUMPTIONS,
                    micro_batches: int = 1, extra: tuple = (),
                    topo: Optional[Topology] = None) -> dict:
    """`extra`: config overrides for every LBP row, `topo`: Frontier changed (the
    sensitivity's variants)."""
    res = {p: lbp_predict(p, LBP_NODES, assumptions, micro_batches, extra, topo)
           for p in ("zero3", "zeropp", "hierarchical")}
    base = None
    for nodes in (1, 2, 4, 8, 16, 32):
        p = lbp_predict("hierarchical", nodes, assumptions, micro_batches, extra, topo)
        if p.fits:
            base = (nodes, p)
            break
    # a variant under which hierarchical never fits: 8 nodes (64 GCDs)
    res["base"] = base or (8, lbp_predict("hierarchical", 8, assumptions, micro_batches, extra,
                                          topo))
    return res


# Megatron-LM on A100 (Narayanan et al., "Efficient Large-Scale Language Model Training on GPU
# Clusters Using Megatron-LM", SC'21, Table 1): the 1T GPT — 128 layers, hidden 25600, 160
# heads, seq 2048, vocab 51200 — on 3072 A100-80GB of Selene (DGX A100) with TP 8 (inside a
# node), PP 64, DP 6, global batch 3072 of micro-batch 1: 163 TFLOP/s per GPU (52% of peak),
# counted by their formula F = 96·B·s·l·h²·(1 + s/6h + V/16lh), which includes the recompute.
# Mapped to this engine: full arch with SwiGLU d_ff = 8h/3 (the 4h MLP's parameter count),
# Megatron TP over pair+node, 64 stages of 1F1B (each backward tick re-runs its stage forward:
# the recompute, so remat=none inside it), DP over the rest (plan ddp), bf16 gradients.
MEGATRON_1T = dict(d=25600, L=128, H=160, d_ff=68264, vocab=51200, seq=2048, tp=8, pp=64,
                   gpus=3072, batch=3072, tflops=163.0)
MEGATRON_SOURCE = ("Narayanan et al., SC'21 (arXiv 2104.04473), Table 1: 1T GPT, 3072 A100, "
                   "TP 8, PP 64, batch 3072, 163 TFLOP/s per GPU")


# Dash et al., "Optimizing Distributed Training on Frontier for Large Language Models" (arXiv
# 2312.12705): 38.38% / 36.14% / 31.96% of peak for GPT 22B / 175B / 1T on Frontier. No source
# we could read gives the layouts and batches of those measured runs. The authors' group
# publishes Megatron-DeepSpeed launch scripts for the same three sizes (DASH_SCRIPTS_SOURCE);
# their layouts are below, with the global batch each script sets.
DASH_PUBLISHED = {"22B": 0.3838, "175B": 0.3614, "1T": 0.3196}
DASH_SCRIPTS = {
    "22B": dict(L=48, d=6144, H=96, tp=4, pp=8, nodes=4, micro=2, batch=20),
    "175B": dict(L=96, d=12288, H=96, tp=8, pp=12, nodes=24, micro=1, batch=12),
    "1T": dict(L=128, d=25600, H=128, tp=8, pp=64, nodes=64, micro=1, batch=8),
}
DASH_SCRIPTS_SOURCE = ("github.com/olcf/ai-training-series, ai_at_scale_part_2/megatron_examples/"
                       "Megatron-DeepSpeed-ORNL/launch_gpt{22b,175b,1T}_srun.frontier")


def one_f_one_b_cap(stages: int, micro_batches: int) -> float:
    """The busy fraction of a 1F1B step, 1 - bubble = m / (m + p - 1) (the engine's schedule,
    step/pipeline.py): the step's MFU cannot exceed it, however fast every kernel runs."""
    return 1.0 - Schedule("1f1b", stages, micro_batches).bubble


def dash_script_caps() -> dict:
    """Per size: micro-batches per replica of the script's layout and the 1F1B cap they set."""
    out = {}
    for size, s in DASH_SCRIPTS.items():
        replicas = s["nodes"] * 8 // (s["tp"] * s["pp"])
        m = s["batch"] // (replicas * s["micro"])
        out[size] = dict(s, replicas=replicas, micro_batches=m,
                         cap=one_f_one_b_cap(s["pp"], m), published=DASH_PUBLISHED[size])
    return out


def megatron_config(extra: tuple = ()):
    m = MEGATRON_1T
    return load_config(None, [
        "model.arch=full", f"model.vocab_size={m['vocab']}", f"model.d_model={m['d']}",
        f"model.n_layers={m['L']}", f"model.n_heads={m['H']}", f"model.d_ff={m['d_ff']}",
        f"model.max_seq_len={m['seq']}", f"data.seq_len={m['seq']}",
        "model.param_dtype=bfloat16", "model.dtype=bfloat16", "parallel.plan=ddp",
        "parallel.tp_mode=megatron", "parallel.tp_axes=[pair,node]",
        f"parallel.pp_stages={m['pp']}", "parallel.pp_schedule=1f1b",
        f"train.global_batch={m['batch']}",
        f"train.micro_batches={m['batch'] // (m['gpus'] // m['tp'] // m['pp'])}",
        "train.remat=none", "parallel.grad_accum_dtype=bfloat16", "mesh.topology=dgx-a100",
        *extra])


def megatron_flops(m: dict = MEGATRON_1T) -> float:
    """Megatron-LM's FLOPs per iteration (recompute included), their eq. (3)."""
    B, s, L, h, V = m["batch"], m["seq"], m["L"], m["d"], m["vocab"]
    return 96 * B * s * L * h * h * (1 + s / (6 * h) + V / (16 * L * h))


def megatron_prediction(assumptions: Assumptions = VALIDATION_ASSUMPTIONS,
                        topo: Optional[Topology] = None):
    m = MEGATRON_1T
    nodes = m["gpus"] // 8
    return predict(megatron_config(), topo or get_topology("dgx-a100"),
                   {"pair": 2, "node": 4, "global": nodes}, assumptions)


def absolute_rows(assumptions: Assumptions = VALIDATION_ASSUMPTIONS,
                  boost: Optional[dict] = None, megatron=None) -> list[dict]:
    """Published absolute figures on the machines they ran on: BOOST iteration seconds
    (Perlmutter) and Megatron-LM's TFLOP/s per GPU (DGX A100)."""
    boost = boost or boost_predictions(assumptions)
    rows = []
    for size, by_m in boost.items():
        for i, meth in enumerate(("full", "vanilla", "btp")):
            pub, pred = BOOST_PUBLISHED[size][i], by_m[meth].step_time
            rows.append(dict(name=f"BOOST {size} {meth} iteration s (Perlmutter)",
                             kind="absolute", published=pub, predicted=pred,
                             error=rel_err(pred, pub), key=f"abs {size} {meth}",
                             source="BOOST (MLSys 2026), per-model iteration seconds"))
    p = megatron if megatron is not None else megatron_prediction(assumptions)
    pred = megatron_flops() / MEGATRON_1T["gpus"] / p.step_time / 1e12
    rows.append(dict(name="Megatron-LM 1T GPT TFLOP/s per GPU (3072 A100)", kind="absolute",
                     published=MEGATRON_1T["tflops"], predicted=pred,
                     error=rel_err(pred, MEGATRON_1T["tflops"]), key="abs megatron 1T",
                     source=MEGATRON_SOURCE))
    return rows


def json_rows(assumptions: Assumptions = VALIDATION_ASSUMPTIONS) -> list[dict]:
    """Every row as {name, kind, published, predicted, source, error, within}: ratios,
    absolute figures, then measured collectives; `within` is |error| <= TOLERANCE."""
    boost, _, ratios = ratio_rows(assumptions)
    src = {True: "BOOST (MLSys 2026), iteration-second ratios",
           False: "Low-Bandwidth Partitioning (arXiv 2501.04266)"}
    out = [dict(name=r["key"], kind="ratio", published=r["published"],
                predicted=r["predicted"], error=r["error"], source=src["model" in r])
           for r in ratios]
    keys = ("name", "kind", "published", "predicted", "error", "source")
    out += [{k: r[k] for k in keys} for r in absolute_rows(assumptions, boost)]
    out += [{k: r[k] for k in keys} for r in collective_rows(assumptions)]
    return [dict(r, within=abs(r["error"]) <= TOLERANCE) for r in out]


def bus_bandwidth(topology: str, nodes: int, payload: float = 2.0 ** 30,
                  assumptions: Assumptions = VALIDATION_ASSUMPTIONS) -> float:
    """The model's nccl-tests bus bandwidth (2(n-1)/n·P / t, bytes/s) of an all-reduce over
    every device of `nodes` nodes: what rccl-tests / nccl-tests all_reduce_perf would print."""
    from boost_jax.mesh import level_of
    from boost_jax.plan.collectives import Coll, coll_time, host_split

    topo = get_topology(topology)
    sizes = {"pair": topo.pair, "node": topo.node, "global": nodes}
    axes = tuple(a for a in ("pair", "node", "global") if sizes[a] > 1)
    n = topo.devices_per_node * nodes
    c = Coll("all_reduce_perf", "all-reduce", payload, n, level_of(axes), 1, "step", axes,
             *host_split(axes, sizes))
    return 2 * (n - 1) / n * payload / coll_time(c, topo, assumptions)


# Measured collectives (kind "collective"): one call's milliseconds of RCCL on Frontier (8 GCDs
# a node) and NCCL on Perlmutter (4 A100 a node), bf16 buffers through torch.distributed (5
# warm-up and 20 timed calls, the mean; all-reduce: Frontier's row the mean over repeats
# (scaling_plot.ipynb), Perlmutter's the minimum (heatmap_variability_plot.ipynb)), as the authors
# of "The Big Send-off" (Singh et al., arXiv 2504.18658) measured them and published them with
# their reproducer (COLLECTIVE_REPOS). P = the gathered output of an all-gather, the input of a
# reduce-scatter, the buffer of an all-reduce, in MiB. The rows: 1 GiB at each machine's
# smallest, a middle and its largest rank count; 32 MiB (the calls XLA's combiners make) at a
# few nodes and at 1024 ranks; the smallest clean size at 1024 ranks; the largest all-reduce
# at the largest rank count; and an rccl-tests output posted with its machine (a small call:
# latency only). Cells where RCCL spikes 10-100x above its neighbours are left out.
COLLECTIVE_REPOS = {
    "ag": "axonn-ai/sc2025-pccl-reproducer@540dd3ebe60b0a30d5250374689b1623d6dae8ca",
    "ar": "keshprad/sc2025-pccl-reproducer@0bad8a63e376d5e36f7a8e4001e91e04a93deb72",
    # rccl-tests all_gather_perf on 4 nodes of 4 MI250X (8 GCDs) on Slingshot-11, the same
    # node as Frontier's; its smallest size (the issue reports the larger ones as anomalous)
    "issue": "github.com/ROCm/rccl/issues/1490 (2025-01-17)",
}
COLLECTIVE_MEASURED = (
    # machine, collective, ranks, P MiB, ms, repository, file
    ("frontier", "reduce-scatter", 8, 1024, 12.404, "ag",
     "data/frontier/fr_reduce_scatter/slurm-2990832.out"),
    ("frontier", "all-gather", 64, 1024, 14.480, "ag",
     "data/frontier/all_gather_2/slurm-2985165.out"),
    ("frontier", "reduce-scatter", 512, 1024, 17.311, "ag",
     "data/frontier/fr_reduce_scatter/slurm-2990838.out"),
    ("frontier", "reduce-scatter", 1024, 1024, 31.625, "ag",
     "data/frontier/fr_reduce_scatter/slurm-2990839.out"),
    ("frontier", "all-gather", 1024, 1024, 93.239, "ag",
     "data/frontier/all_gather_2/slurm-2985161.out"),
    ("frontier", "all-gather", 64, 32, 2.125, "ag", "data/frontier/all_gather_2/slurm-2985165.out"),
    ("frontier", "all-gather", 1024, 32, 31.633, "ag",
     "data/frontier/all_gather_2/slurm-2985161.out"),
    ("frontier", "reduce-scatter", 1024, 2, 3.290, "ag",
     "data/frontier/fr_reduce_scatter/slurm-2990839.out"),
    ("frontier", "all-reduce", 2048, 4096, 150.156, "ar", "scaling_plot.ipynb, cell 5 (rccl)"),
    ("frontier", "all-gather", 32, 0.0625, 0.1075, "issue", "all_gather_perf, 65536 B"),
    ("perlmutter", "all-gather", 16, 1024, 16.246, "ag",
     "data/perlmutter/pm_all_gather/slurm-35376646.out"),
    ("perlmutter", "all-gather", 128, 1024, 17.560, "ag",
     "data/perlmutter/pm_all_gather/slurm-35376713.out"),
    ("perlmutter", "all-gather", 1024, 1024, 26.560, "ag",
     "data/perlmutter/pm_all_gather/slurm-35377620.out"),
    ("perlmutter", "all-gather", 16, 32, 0.671, "ag",
     "data/perlmutter/pm_all_gather/slurm-35376646.out"),
    ("perlmutter", "all-gather", 1024, 32, 10.050, "ag",
     "data/perlmutter/pm_all_gather/slurm-35377620.out"),
    ("perlmutter", "all-gather", 1024, 1, 6.368, "ag",
     "data/perlmutter/pm_all_gather/slurm-35377620.out"),
    ("perlmutter", "all-reduce", 1024, 4096, 154.363, "ar",
     "heatmap_variability_plot.ipynb, cell 4 (xccl)"),
)
# Frontier's node-level bandwidth (boost_jax/mesh.py) is read from this one: not a check
COLLECTIVE_CALIBRATION = ("frontier", "all-gather", 8, 1024, 10.455, "ag",
                          "data/frontier/all_gather_2/slurm-2985168.out")
_SCALE = ("at 1024 GCDs RCCL runs well below its own model even at 1 GiB while 512 GCDs "
          "match: The Big Send-off traces RCCL's losses at scale on Slingshot to the NIC's "
          "software overflow path and to run-to-run variability; the model has no term for it")
_STEP = ("latency-bound: the measurement leaves {} per ring step once the bytes are paid "
         "(column 'implied'), the library's tuning model charges {}: its constants pick an "
         "algorithm, they under-state what a step of a ring over many ranks costs")
_RCCL_STEP = _STEP.format("27 to 31 us", "6 us inside a node and 19.8 us between nodes (Simple)")
_NCCL_LL = _STEP.format("6 to 9 us", "2 us and 2.7 us for LL, the protocol its tuner picks "
                        "here (6 and 14 us for Simple, close to what was measured)")
COLLECTIVE_GAPS = {
    "RCCL all-gather 1024 ranks 1024 MiB (Frontier)": _SCALE,
    "RCCL reduce-scatter 1024 ranks 1024 MiB (Frontier)": _SCALE,
    "RCCL all-gather 64 ranks 32 MiB (Frontier)": _RCCL_STEP,
    "RCCL all-gather 1024 ranks 32 MiB (Frontier)": _RCCL_STEP,
    "RCCL all-reduce 2048 ranks 4096 MiB (Frontier)":
        "bandwidth-bound at 2048 GCDs: the measured bus bandwidth, 57 GB/s a node, is 71% of "
        "what the model's 80% of the four NICs gives (the rows at <= 512 GCDs match)",
    "NCCL all-gather 1024 ranks 32 MiB (Perlmutter)": _NCCL_LL,
    "NCCL all-gather 1024 ranks 1 MiB (Perlmutter)": _NCCL_LL,
}
_ONE_PAT = ("one rank a node, NCCL's tuning model charges PAT more than this run measured: its "
            "bandwidth at 0.75 of the bus and its 2.8 us per rank pick an algorithm, they are "
            "not times (at 64 nodes the 2.8 us per rank alone is 0.18 ms of a 1 MiB call "
            "measured at 0.25 ms). PAT swings between allocations there: the file's other "
            "default-channel runs measured {} GB/s of bus bandwidth for this call, the model "
            "gives {}")
_ONE_RING = ("one rank a node, NCCL's tuning model charges each ring step the tree's network "
             "latency (ppn 1: 8.5 us LL128, 14 us Simple) where the measurement leaves 3.6 to 5 "
             "us (column 'implied'; 5.1 to 6.1 us with the bytes at the 96% of the 12.5 GB/s "
             "port that the same runs' 1 GiB ring reached, where the model takes eta_net's 80%)")


def one_per_node_name(algo: str, nodes: int, mib: float) -> str:
    """The validation row's name of a one-GPU-a-node call timed with NCCL_ALGO=`algo`."""
    return (f"NCCL all-gather {nodes} ranks {mib} MiB (Leonardo, one a node, "
            f"NCCL_ALGO={'PAT' if algo == 'pat' else 'Ring'})")


COLLECTIVE_GAPS.update({
    one_per_node_name(algo, n, mib): why
    for algo, n, mib, why in (
        ("pat", 16, 2, _ONE_PAT.format("5.33 to 7.47 (5.86, 5.33, 7.47)", "5.64: inside")),
        ("pat", 64, 1, _ONE_PAT.format("2.38 to 4.42 (2.38, 4.32, 4.42)", "2.94: inside")),
        ("pat", 64, 4, _ONE_PAT.format("7.26 (v9)", "5.36: below every run")),
        ("ring", 16, 1, _ONE_RING), ("ring", 16, 2, _ONE_RING), ("ring", 64, 4, _ONE_RING))})


# NCCL over one GPU a node, where its tuner may run PAT (kind "collective"): nccl-tests
# all_gather_perf (-b 8 -e 1G -f 2 -g 1 -c 1, srun --ntasks-per-node=1; out-of-place bus
# bandwidth) with NCCL_ALGO=PAT and with NCCL_ALGO=Ring, NCCL at NVIDIA/nccl 5067397 (the commit
# boost_jax/mesh.py pins), on Leonardo's booster, as the authors of a research fork of NCCL
# posted them beside their own algorithm (ONE_PER_NODE_REPO, bench_bine/results.md; the
# commands in bench_bine/final_compare.sh). The rows: the two runs that publish both
# algorithms' bus bandwidth size by size from one allocation at default channels, 16 nodes (the
# mean of 3) and 64 nodes (one), every size they report up to 4 MiB (where NCCL may pick PAT).
# One call = P·(n−1)/n / bus bandwidth. The file's other runs time PAT alone (COLLECTIVE_GAPS
# quotes them where a row is outside 25%).
ONE_PER_NODE_REPO = "HLC-Lab/nccl@0e07bb5f411a78cae504c1efe8e828a484dd8f78"
_THREE_WAY = "bench_bine/results.md, 2026-06-20, 16 nodes, 3 reps"
_V8B = "bench_bine/results.md, 2026-07-08/09 (v8b), 64 nodes, 1 rep"
ONE_PER_NODE_MEASURED = (
    # NCCL_ALGO, nodes, P MiB, bus bandwidth GB/s, where
    ("pat", 16, 0.25, 2.01, _THREE_WAY), ("ring", 16, 0.25, 2.07, _THREE_WAY),
    ("pat", 16, 1, 5.39, _THREE_WAY), ("ring", 16, 1, 5.69, _THREE_WAY),
    ("pat", 16, 2, 7.50, _THREE_WAY), ("ring", 16, 2, 7.83, _THREE_WAY),
    ("pat", 64, 1, 4.10, _V8B), ("ring", 64, 1, 2.02, _V8B),
    ("pat", 64, 4, 7.21, _V8B), ("ring", 64, 4, 6.18, _V8B),
)
# Leonardo's booster node (CINECA, leonardo-supercomputer.cineca.eu/hpc-system: 4 A100 SXM 64
# GB, one Xeon 8358, "2x dual-port HDR network interface (400 Gbps aggregated)") as one rank a
# node sees it: one 100 Gb/s port, 12.5 GB/s each way (inferred: 400 Gb/s over 4 GPUs; the
# same runs' 1 GiB ring plateaus at 12 GB/s of bus bandwidth); NCCL's constants for an Intel
# host (over 2 or more nodes the LL cap is 39 / 20.4 GB/s, llMaxBws). LL128 across nodes needs
# the GPU and its NIC under one PCIe switch, which CINECA does not publish: NCCL's default
# there (on), the reading that favours the model (off, the ring rows outside 25% are 61-72%
# slow instead of 41-49%).
LEONARDO_SOURCES = {
    "bw_global": "leonardo-supercomputer.cineca.eu/hpc-system: booster node, 2 x dual-port HDR "
                 "(400 Gb/s aggregated), inferred one 100 Gb/s port a GPU (the measured ring "
                 "plateaus at 12 GB/s; validation rows only)",
    "library": "NVIDIA/nccl 5067397c2676d5aed50042fc39e5c8ee96eb0027: src/graph/tuning.cc "
               "(getNetOverhead: Intel CPU 1 us; llMaxBws Intel-N2/N4); LL128 across nodes as "
               "NCCL's default where GPU and NIC share a PCIe switch (not published for the "
               "machine; validation rows only)",
}
LEONARDO_ONE_PER_NODE = dataclasses.replace(
    get_topology("dgx-a100"), name="leonardo", pair=1, node=1, bw_global=12.5e9, hbm_bytes=64e9,
    device="A100-SXM-64GB", job=None,
    library=dataclasses.replace(NCCL_INTEL_CPU, ll_cap=(87.7, 39.0, 20.4)))


def collective_call(machine: str, kind: str, ranks: int, mib: float):
    """A Coll of one call over `ranks` devices of whole nodes (contiguous per node)."""
    from boost_jax.mesh import level_of
    from boost_jax.plan.collectives import Coll, host_split

    topo = get_topology(machine)
    nodes = max(ranks // topo.devices_per_node, 1)
    sizes = {"pair": topo.pair, "node": topo.node, "global": nodes}
    axes = tuple(a for a in ("pair", "node", "global") if sizes[a] > 1)
    return topo, Coll("measured", kind, mib * 2.0 ** 20, ranks, level_of(axes), 1, "step",
                      axes, *host_split(axes, sizes))


def collective_ms(machine: str, kind: str, ranks: int, mib: float,
                  assumptions: Assumptions = VALIDATION_ASSUMPTIONS) -> tuple[float, float, str]:
    """(predicted ms, of it latency ms, algorithm/protocol) of one measured call."""
    from boost_jax.plan.collectives import call_cost

    topo, c = collective_call(machine, kind, ranks, mib)
    lat, beta, algo = call_cost(c, topo, assumptions)
    return (lat + beta) * 1e3, lat * 1e3, algo


def one_per_node_call(nodes: int, mib: float):
    """A Coll of one all-gather over `nodes` ranks, one a node (LEONARDO_ONE_PER_NODE)."""
    from boost_jax.plan.collectives import Coll, host_split

    sizes = {"pair": 1, "node": 1, "global": nodes}
    return LEONARDO_ONE_PER_NODE, Coll("measured", "all-gather", mib * 2.0 ** 20, nodes,
                                       "global", 1, "step", ("global",),
                                       *host_split(("global",), sizes))


def _row(name: str, ms: float, topo, c, assumptions, algorithms, source: str) -> dict:
    from boost_jax.plan.collectives import bytes_seconds, call_cost

    lat, beta, algo = call_cost(c, topo, assumptions, algorithms)
    pred = (lat + beta) * 1e3
    implied = ((ms * 1e-3 - bytes_seconds(c, topo, assumptions)) * 1e6 / (c.n - 1)
               if algo.startswith("ring") else None)
    return dict(name=name, kind="collective", published=ms, predicted=pred,
                error=rel_err(pred, ms), latency=lat * 1e3, algorithm=algo, implied=implied,
                source=source)


def collective_rows(assumptions: Assumptions = VALIDATION_ASSUMPTIONS) -> list[dict]:
    """The measured collectives against the model: one call's milliseconds ("implied": what a
    ring's measurement leaves per step once the bytes are paid, Simple at full bandwidth)."""
    rows = []
    for machine, kind, ranks, mib, ms, repo, path in COLLECTIVE_MEASURED:
        topo, c = collective_call(machine, kind, ranks, mib)
        rows.append(_row(f"{topo.library.name} {kind} {ranks} ranks {mib} MiB "
                         f"({machine.capitalize()})", ms, topo, c, assumptions,
                         ("ring", "tree", "pat"),
                         f"{COLLECTIVE_REPOS[repo]}: {path} (ms per call)"))
    for algo, nodes, mib, busbw, where in ONE_PER_NODE_MEASURED:
        topo, c = one_per_node_call(nodes, mib)
        ms = c.payload * (nodes - 1) / nodes / (busbw * 1e9) * 1e3
        rows.append(_row(one_per_node_name(algo, nodes, mib), ms, topo, c, assumptions, (algo,),
                         f"{ONE_PER_NODE_REPO}: {where} ({busbw} GB/s bus bandwidth)"))
    return rows


def measured_rccl_step_us(rows: list) -> float:
    """What RCCL's measured 32 MiB all-gathers (64 and 1024 GCDs, the size of the calls XLA's
    combiners make) leave per ring step once their bytes are paid, the mean of the two
    (`rows`: collective_rows())."""
    steps = [r["implied"] for r in rows
             if r["name"].startswith("RCCL all-gather") and " 32 MiB " in r["name"]]
    return sum(steps) / len(steps)


def frontier_with_ring_step(us: float, inside: bool = True) -> Topology:
    """Frontier with every RCCL ring step (LL and Simple) between nodes, and inside a node
    unless `inside` is false, at `us` microseconds (an all-to-all's messages too)."""
    fr = get_topology("frontier")
    lib, ring = fr.library, {"ring": (us, 0.0, us)}
    return dataclasses.replace(fr, library=dataclasses.replace(
        lib, intra={**lib.intra, **ring} if inside else lib.intra, net={**lib.net, **ring}))


def _value(v) -> str:
    if hasattr(v, "name") and hasattr(v, "base"):  # a CollLibrary
        return (f"{v.name}: base ring {v.base['ring']}, per step inside {v.intra['ring']}, "
                f"between nodes {v.net['ring']} us (LL, LL128, Simple); net overhead "
                f"{v.overhead:g} us" + (
                    f"; PAT at one rank per node: base {v.pat[0]:g} us + log2(m)·tree net "
                    f"step/{v.pat[1]:g} + {v.pat[2]:g} us per rank, bandwidth ×{v.pat[3]:g}"
                    if v.pat else ""))
    if isinstance(v, float) and v >= 1e6:
        return f"{v:.4g}"
    return str(v)


def constants_table() -> str:
    """Every constant of the cost model with its value and source (README.md's table)."""
    from boost_jax.mesh import SOURCED_FIELDS, TOPOLOGY_SOURCES, TOPOLOGIES
    from boost_jax.plan.roofline import ASSUMPTION_SOURCES

    a = Assumptions()
    lines = ["| constant | value | source |", "|---|---|---|"]
    for k, src in ASSUMPTION_SOURCES.items():
        v = getattr(a, k, 40)
        lines.append(f"| `Assumptions.{k}` | {_value(v)} | {src} |")
    for name, topo in TOPOLOGIES.items():
        for k in SOURCED_FIELDS:
            lines.append(f"| `{name}.{k}` | {_value(getattr(topo, k))} | "
                         f"{TOPOLOGY_SOURCES[name][k]} |")
    for k, src in LEONARDO_SOURCES.items():
        lines.append(f"| `leonardo.{k}` | {_value(getattr(LEONARDO_ONE_PER_NODE, k))} | {src} |")
    return "\n".join(lines)


def rel_err(pred: float, pub: float) -> float:
    return pred / pub - 1.0


def _ok(err: float, key: str = "") -> str:
    if abs(err) <= TOLERANCE:
        return "yes"
    return "**no** (known gap, see below)" if key in KNOWN_GAPS else "**no**"


def boost_tables(preds: dict) -> tuple[str, str, list]:
    """(absolute table, ratio table, rows as dicts)."""
    abs_lines = ["| model | TP / PP | method | published s | predicted s | error | compute s | "
                 "TP comm s | predicted GB/device | fits 40 GB |",
                 "|---|---|---|---|---|---|---|---|---|---|"]
    ratio_lines = ["| model | ratio | published | predicted | rel. error | within 25% |",
                   "|---|---|---|---|---|---|"]
    rows = []
    for size, by_m in preds.items():
        sh = BOOST_SHAPES[size]
        pub = dict(zip(("full", "vanilla", "btp"), BOOST_PUBLISHED[size]))
        par = f"TP{sh['tp']}" + (f" PP{sh['pp']}" if sh["pp"] > 1 else "")
        for m in ("full", "vanilla", "btp"):
            p = by_m[m]
            err = rel_err(p.step_time, pub[m])
            abs_lines.append(
                f"| {size} | {par} | {m} | {pub[m]:.2f} | {p.step_time:.2f} | {err:+.0%} | "
                f"{p.time['compute']:.2f} | {p.time['tp']:.2f} | {p.memory['total'] / 1e9:.1f} | "
                f"{'yes' if p.fits else 'no'} |")
        for num, den in (("vanilla", "full"), ("btp", "full"), ("vanilla", "btp")):
            pr = by_m[num].step_time / by_m[den].step_time
            pu = pub[num] / pub[den]
            err = rel_err(pr, pu)
            rows.append(dict(model=size, ratio=f"{num}/{den}", published=pu, predicted=pr,
                             error=err, key=f"{size} {num}/{den}"))
            ratio_lines.append(f"| {size} | {num}/{den} | {pu:.3f} | {pr:.3f} | {err:+.1%} | "
                               f"{_ok(err, f'{size} {num}/{den}')} |")
    return "\n".join(abs_lines), "\n".join(ratio_lines), rows


def lbp_table(res: dict) -> tuple[str, list]:
    z3, zpp, hier = res["zero3"], res["zeropp"], res["hierarchical"]
    base_nodes, base = res["base"]
    pred = {"lbp_over_zeropp": hier.tflops_per_device / zpp.tflops_per_device,
            "zeropp_over_zero3": zpp.tflops_per_device / z3.tflops_per_device,
            "scaling_efficiency": hier.tflops_per_device / base.tflops_per_device}
    names = {"lbp_over_zeropp": "TFLOP/s per GCD, hierarchical / ZeRO++ (384 GCDs)",
             "zeropp_over_zero3": "TFLOP/s per GCD, ZeRO++ / ZeRO-3 (paper: \"up to\" +40.5%)",
             "scaling_efficiency": f"weak-scaling efficiency of hierarchical, 384 GCDs vs "
                                   f"{base_nodes * 8} GCDs"}
    lines = ["| quantity | published | predicted | rel. error | within 25% |",
             "|---|---|---|---|---|"]
    rows = []
    for k in ("lbp_over_zeropp", "scaling_efficiency", "zeropp_over_zero3"):
        err = rel_err(pred[k], LBP_PUBLISHED[k])
        rows.append(dict(quantity=k, published=LBP_PUBLISHED[k], predicted=pred[k], error=err,
                         key=k))
        lines.append(f"| {names[k]} | {LBP_PUBLISHED[k]:.3g} | {pred[k]:.3g} | {err:+.1%} | "
                     f"{_ok(err, k)} |")
    lines += ["", "| plan (48 nodes) | TFLOP/s per GCD | MFU | step s | compute s | "
              "DP comm s (per micro-batch, exposed) | of which (de)quantization s | "
              "once-per-step comm s | global GB/GCD/step | GB/GCD | fits 64 GB |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, p in (("zero3", z3), ("zeropp", zpp), ("hierarchical", hier)):
        lines.append(
            f"| {name} | {p.tflops_per_device:.1f} | {p.mfu:.1%} | {p.step_time:.2f} | "
            f"{p.time['compute']:.2f} | {p.time['dp_exposed']:.2f} | {p.time['quant']:.2f} | "
            f"{p.time['step_comm']:.2f} | "
            f"{p.comm_bytes['global'] / 1e9:.1f} | {p.memory['total'] / 1e9:.1f} | "
            f"{'yes' if p.fits else 'no'} |")
    return "\n".join(lines), rows


def ratio_rows(assumptions: Assumptions = VALIDATION_ASSUMPTIONS, remat: str = "full",
               micro_batches: int = 1, topo: Optional[Topology] = None,
               lbp_extra: tuple = (), lbp_topo: Optional[Topology] = None
               ) -> tuple[dict, dict, list]:
    """(BOOST predictions, LBP predictions, the 12 ratio rows) under one set of choices."""
    boost = boost_predictions(assumptions, remat=remat, topo=topo)
    lbp = lbp_predictions(assumptions, micro_batches, lbp_extra, lbp_topo)
    return boost, lbp, boost_tables(boost)[2] + lbp_table(lbp)[1]


def within(rows: list) -> int:
    return sum(abs(r["error"]) <= TOLERANCE for r in rows)


def variants(assumptions: Assumptions = VALIDATION_ASSUMPTIONS) -> list[tuple[str, dict]]:
    """The fixed choices, one changed at a time (ratio_rows keyword arguments)."""
    rep = dataclasses.replace
    pm100 = rep(get_topology("perlmutter"), bw_node=100e9)
    step = measured_rccl_step_us(collective_rows(assumptions))
    return [
        ("as validated", {}),
        ("dense attention instead of flash",
         dict(assumptions=rep(assumptions, attention="dense"))),
        ("Perlmutter 4-GPU node collective 100 GB/s instead of 300 (BOOST TP4 rows)",
         dict(topo=pm100)),
        ("gradients reduced in fp32 instead of bf16 (LBP rows)",
         dict(lbp_extra=("parallel.grad_accum_dtype=float32",))),
        ("ZeRO++ without qgZ (parallel.quantize_grads=false; gradients reduce-scattered in "
         "bf16 over all GCDs)", dict(lbp_extra=("parallel.quantize_grads=false",))),
        ("no overlap (every collective on the critical path)",
         dict(assumptions=rep(assumptions, overlap="none"))),
        ("overlap and kernel launches as the GPU schedule shows (--overlap gpu, "
         "benchmarks/README.md section 12)", dict(assumptions=rep(assumptions, overlap="gpu"))),
        (f"calls of up to {DEEPSPEED_CALL_BYTES / 2**20:.0f} MiB instead of 30 (the 20B's "
         "largest Linear in bf16: about one DeepSpeed prefetch bucket)",
         dict(assumptions=rep(assumptions, combine_bytes=DEEPSPEED_CALL_BYTES))),
        ("eta_flops 0.5", dict(assumptions=rep(assumptions, eta_flops=0.5))),
        ("eta_net 1.0", dict(assumptions=rep(assumptions, eta_net=1.0))),
        ("launch 2 us per kernel instead of 4", dict(assumptions=rep(assumptions,
                                                                    launch_s=2e-6))),
        (f"every RCCL ring step at {step:.1f} us, what the measured 32 MiB all-gathers over "
         "64 and 1024 GCDs leave (tuning model: 0.8-6 us inside a node, 9.5-19.8 between; LBP "
         "rows)", dict(lbp_topo=frontier_with_ring_step(step))),
        ("LBP with 4 micro-batches per step", dict(micro_batches=4)),
        ("no recompute (BOOST rows)", dict(remat="none")),
    ]


def sensitivity(assumptions: Assumptions = VALIDATION_ASSUMPTIONS) -> str:
    """How the ratios move with the fixed choices, one changed at a time (not used to pick
    them): the 7B BOOST row, the three LBP ratios and how many of the 12 stay within 25%."""
    lines = ["| variant | 7B full / vanilla / btp s (GB/device) | 7B btp/full | 7B vanilla/btp "
             "| LBP hier/ZeRO++ | ZeRO++/ZeRO-3 | LBP scaling eff. | Megatron 1T TFLOP/s | "
             f"ratios within {TOLERANCE:.0%} | absolute within |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for name, kw in variants(assumptions):
        kw = {"assumptions": assumptions, **kw}
        boost, lbp, rows = ratio_rows(**kw)
        absr = absolute_rows(kw["assumptions"], boost)
        meg = absr[-1]["predicted"]
        b = boost["7B"]
        r = {x["key"]: x["predicted"] for x in rows}
        secs = " / ".join(f"{b[k].step_time:.2f} ({b[k].memory['total'] / 1e9:.0f})"
                          for k in ("full", "vanilla", "btp"))
        if not lbp["hierarchical"].fits:
            name += " — hierarchical does not fit 90% of 64 GB"
        lines.append(f"| {name} | {secs} | {r['7B btp/full']:.3f} | {r['7B vanilla/btp']:.3f} | "
                     f"{r['lbp_over_zeropp']:.3f} | {r['zeropp_over_zero3']:.3f} | "
                     f"{r['scaling_efficiency']:.3f} | {meg:.0f} | {within(rows)} of {len(rows)} | "
                     f"{within(absr)} of {len(absr)} |")
    # the other rule considered: each method at its fastest remat that fits an 80 GB A100
    topo = get_topology("perlmutter-80")
    best = {}
    for m, _, _ in BOOST_METHODS:
        opts = [predict(boost_config("7B", m, r, "perlmutter-80"), topo, boost_sizes("7B"),
                        assumptions) for r in ("none", "lowrank", "full")]
        fit = [p for p in opts if p.fits] or opts
        best[m] = min(fit, key=lambda p: p.step_time)
    secs = " / ".join(f"{best[k].step_time:.2f} ({best[k].memory['total'] / 1e9:.0f}, "
                      f"{best[k].layout['remat']})" for k in ("full", "vanilla", "btp"))
    lines.append(f"| fastest remat that fits A100-80GB, per method (BOOST 7B only) | {secs} | "
                 f"{best['btp'].step_time / best['full'].step_time:.3f} | "
                 f"{best['vanilla'].step_time / best['btp'].step_time:.3f} | - | - | - | - | - "
                 "| - |")
    return "\n".join(lines)


def sources_table() -> str:
    lines = ["| published figure | source |", "|---|---|"]
    lines += [f"| {what} | {src} |" for what, src in SOURCES]
    return "\n".join(lines)


def ranges_table(boost: dict) -> str:
    """BOOST's per-model seconds and the predictions against its abstract's ranges."""
    lines = ["| BTP speed-up | BOOST's range | published seconds 3B / 7B / 13B | "
             "predicted 3B / 7B / 13B |", "|---|---|---|---|"]
    for name, (lo, hi), den in (("over full rank", BOOST_RANGES["btp speed-up over full rank"],
                                 0), ("over vanilla TP",
                                      BOOST_RANGES["btp speed-up over vanilla TP"], 1)):
        key = ("full", "vanilla")[den]
        pub = [BOOST_PUBLISHED[k][den] / BOOST_PUBLISHED[k][2] for k in BOOST_SHAPES]
        pred = [boost[k][key].step_time / boost[k]["btp"].step_time for k in BOOST_SHAPES]

        def show(xs):
            return " / ".join(f"{x:.2f}" + ("" if lo <= round(x, 2) <= hi else " (outside)")
                              for x in xs)

        lines.append(f"| {name} | {lo:.2f}–{hi:.2f} | {show(pub)} | {show(pred)} |")
    return "\n".join(lines)
