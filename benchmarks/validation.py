"""Predicted vs published: writes benchmarks/results/validation.md.

    .venv/bin/python benchmarks/validation.py [--out benchmarks/results/validation.md]

Pure cost model (benchmarks/published.py): no compile, no devices; runs in seconds.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import add_out, guard_out, ours, sync_readme  # noqa: E402
from boost_jax.mesh import get_topology  # noqa: E402
from benchmarks import published as V  # noqa: E402
from boost_jax.plan.costmodel import predict  # noqa: E402


WHY = """## Why the remaining gaps

- **LBP vs ZeRO++ ({lbp_r:.2f}x vs {pub_lz}x) is outside {tol:.0%}: a known gap, not closed by
  tuning.** Each collective is timed as RCCL runs it: rings whose GCDs on a node are
  contiguous leave the node once (the node's four NICs shared by the groups leaving it), and
  every call pays RCCL's own per-call latency, which grows with the ring's ranks (see
  "Collectives as RCCL and NCCL run them"). Per node and step ZeRO-3 sends {z3_e:.0f} GB out of
  the node, ZeRO++ {zpp_e:.0f} GB, hierarchical {hier_e:.0f} GB. XLA's combiners merge a layer's
  collectives into calls of up to 30 MiB and never cut one, so each of the 20B's weights (72
  to 288 MiB in bf16) is gathered in a call of its own. ZeRO-3 makes {z3_calls:.0f} calls a step
  over all 384 GCDs: {z3_l:.2f} s of its {z3_d:.2f} s of data-parallel time is per-call latency,
  and {z3_x:.2f} s stays exposed. ZeRO++ makes {zpp_calls:.0f} such calls ({zpp_l:.2f} s of
  latency, {zpp_x:.2f} s exposed of {zpp_d:.2f} s) and pays its (de)quantization kernels on the
  compute stream ({quant:.2f} s). Hierarchical, as the paper ran it, reduce-scatters each
  layer's gradient across nodes in the last backward, behind that pass's compute (exposed
  {hier_x:.2f} s of {hier_d:.2f} s), but gathers the updated weights across nodes once per step
  after the optimizer ({hier_s:.2f} s exposed). Each pass hides only its own traffic: ZeRO++'s
  weight gathers in the forward ({zpp_fg:.2f} s a step) meet only the forward's compute
  ({zpp_fc:.2f} s), not the backward's.
- **What bounds it is ZeRO++'s step, not hierarchical's schedule.** Were nothing of
  hierarchical's communication exposed (its step only its {hier_c:.2f} s of compute,
  (de)quantization kernels and optimizer), hierarchical / ZeRO++
  would be at most {bound:.2f}x (ZeRO++'s {zpp_t:.2f} s over it), short of the published
  {pub_lz}x: the gap needs a slower ZeRO++ than the model's. Our own rows ("Beyond the paper")
  defer the update's gather into the next forward, layer by layer ({ours_defer:.2f}x); with
  every plan's collectives two-level, ZeRO++ / ZeRO-3 becomes {ours_zz2:.2f}x. Without overlap
  (sensitivity table) ZeRO++ / ZeRO-3 is {noov_zz:.2f}x; without qgZ, {noq_zz:.2f}x.
- **Both ratios rest on how many ring calls a step makes.** DeepSpeed, which the paper ran,
  fetches parameters a submodule at a time and prefetches the next ones, up to
  stage3_prefetch_bucket_size (5e7 elements), in one coalesced call; with qwZ it gathers the
  scales in calls of their own ({ds_src}, as of that commit; the scales' calls are not counted
  here). With calls of up to {ds_mib:.0f} MiB, the 20B's largest Linear in bf16 (a byte limit:
  ZeRO++'s int8 calls then hold twice the elements DeepSpeed's would), ZeRO-3 takes
  {ds_z3:.2f} s, ZeRO++ {ds_zpp:.2f} s and hierarchical {ds_h:.2f} s: ZeRO++ / ZeRO-3
  {ds_zz:.2f}x, hierarchical / ZeRO++ {ds_hz:.2f}x. The collective rows measure RCCL's
  all-gathers over 1024 GCDs at {ag_lo:.1f} to {ag_hi:.1f}x what the model charges (stated
  gaps there): the 32 MiB ones over 64 and 1024 GCDs, the size of the calls XLA's combiners
  make, leave {st_us:.1f} us per ring step where RCCL's tuning model charges 6 inside a node
  and 19.8 between (Simple). With every RCCL ring step at {st_us:.1f} us (sensitivity table; for
  calls of that size a point estimate, for small ones an over-charge: a 2 MiB reduce-scatter
  over 1024 GCDs leaves {st_lo:.1f} us), ZeRO-3 takes {st_z3:.2f} s, ZeRO++ {st_zpp:.2f} s and
  hierarchical {st_h:.2f} s: hierarchical / ZeRO++ {st_hz:.2f}x and ZeRO++ / ZeRO-3
  {st_zz:.2f}x, both above the published ratios. The measurements cannot tell the steps inside
  a node from those between; with only the latter at {st_us:.1f} us, ZeRO++ takes
  {sn_zpp:.2f} s ({sn_hz:.2f}x and {sn_zz:.2f}x). The published pair lies between those
  readings. The model keeps the libraries' own constants, and the validation rows XLA's call
  sizes, those our own step makes.
- **BTP is predicted a little too fast relative to full-rank (btp/full {btp_lo:+.0%}..{btp_hi:+.0%}).**
  The roofline charges BTP's small-K GEMMs (K = r = d/4 or N = d/t) and its extra elementwise
  kernels (SiLU on every latent, Online-RMSNorm statistics) at the same efficiency as Megatron's
  large GEMMs; on A100 such shapes run below that, and kernel/framework overheads of the
  published PyTorch stack are not modelled. The same effect makes vanilla/btp high
  ({vb_lo:+.0%}..{vb_hi:+.0%}). With dense attention (what our own step compiles) btp/full
  comes out closer to the published figure but vanilla/btp far too high (sensitivity table):
  we keep flash attention because the published stacks use it, not because it fits better.
  The BOOST rows also rest on the 4-GPU node collective of Perlmutter at 300 GB/s (NVLink 3
  through all four A100s); at 100 GB/s the TP4 rows' vanilla TP slows most and
  {pm100} of 12 ratios stay within {tol:.0%}.
- **Absolute seconds of full-rank are {full_lo:+.0%}..{full_hi:+.0%} for 3B/7B, and the memory
  model says full-rank 3B/7B TP{{2,4}} do not fit 90% of 40 GB** ({mem3:.1f} / {mem7:.1f} GB:
  bf16 weights + fp32 master + Adam + an fp32 gradient accumulator = 18 B/parameter, plus
  recompute activations). The published runs therefore either used 80 GB nodes, bf16 gradient
  buffers, or no recompute. The "no recompute" row brings full-rank 7B to {nr_full:.2f} s
  (published {pub7:.2f} s), but then none of the three fits 40 GB and vanilla ({nr_van:.0f} GB) does
  not fit 80 GB either — so whole-block recompute stays the single stated assumption. Ratios
  cancel the common factor; they are the target.
- **13B PP2** runs the engine's pipelined step (1f1b over 4 micro-batches; each backward tick
  re-runs its stage forward): the absolute times depend on the micro-batching. With the whole
  batch as one micro-batch (gpipe; bubble = one full stage) the predictions become {pp1_s} s (published {pub13}) and the ratios {pp1_r}
  (errors {pp1_e}): {pp1_verdict}.
- **ZeRO++/ZeRO-3**: the paper reports "up to {pub_zz_gain:+.1%}", a maximum over
  configurations, compared here with one configuration.
"""


def _pp1(a) -> dict:
    """13B PP2 with the whole batch as one micro-batch (the other pipelining assumption)."""
    topo = get_topology("perlmutter")
    p = {m: predict(V.boost_config("13B", m, micro_batches=1,
                                   extra=("parallel.pp_schedule=gpipe",)),
                    topo, V.boost_sizes("13B"), a) for m, _, _ in V.BOOST_METHODS}
    pub = dict(zip(("full", "vanilla", "btp"), V.BOOST_PUBLISHED["13B"]))
    ratios = [("vanilla", "full"), ("btp", "full"), ("vanilla", "btp")]
    pr = [p[n].step_time / p[d].step_time for n, d in ratios]
    err = [x / (pub[n] / pub[d]) - 1 for x, (n, d) in zip(pr, ratios)]
    ok = all(abs(e) <= V.TOLERANCE for e in err)
    return dict(pp1_s=" / ".join(f"{p[m].step_time:.2f}" for m in ("full", "vanilla", "btp")),
                pp1_r=" / ".join(f"{x:.2f}" for x in pr),
                pp1_e=" / ".join(f"{e:+.0%}" for e in err),
                pp1_verdict=("still within 25%, so the conclusion does not hinge on this choice"
                             if ok else "not all within 25%: the 13B rows depend on this choice"))


def _fastest_remat_3b(a) -> tuple[float, float]:
    """3B vanilla/full error against the published ratio on an 80 GB A100: with whole-block
    recompute (as validated), and with each method's fastest remat that fits."""
    topo = get_topology("perlmutter-80")
    full, best = {}, {}
    for m, _, _ in V.BOOST_METHODS:
        opts = {r: predict(V.boost_config("3B", m, r, "perlmutter-80"), topo,
                           V.boost_sizes("3B"), a) for r in ("none", "lowrank", "full")}
        full[m] = opts["full"]
        best[m] = min([p for p in opts.values() if p.fits] or opts.values(),
                      key=lambda p: p.step_time)
    pub = V.BOOST_PUBLISHED["3B"]
    return tuple(d["vanilla"].step_time / d["full"].step_time / (pub[1] / pub[0]) - 1
                 for d in (full, best))


def forward_gathers(p) -> float:
    """Seconds per step of a prediction's per micro-batch collectives in the forward."""
    from boost_jax.plan.collectives import coll_time

    return sum(coll_time(c, get_topology("frontier"), p.assumptions) for c in p.collectives
               if c.phase == "dp" and c.runs == "forward")


def _lbp_fill(a, lbp: dict, lbp_rows: list) -> dict:
    import dataclasses

    zpp, z3, hier = lbp["zeropp"], lbp["zero3"], lbp["hierarchical"]
    ours = V.ours_lbp_table(a)[1]
    noq = V.lbp_predictions(a, extra=("parallel.quantize_grads=false",))
    noov = V.lbp_predictions(dataclasses.replace(a, overlap="none"))
    r = {x["key"]: x["predicted"] for x in lbp_rows}

    def egress(p):
        return sum(p.node_egress.values()) / 1e9

    def wide_calls(p):  # calls per step of rings over all GCDs
        return sum(c.calls for c in p.collectives if c.n == 384 and c.phase == "dp")

    return dict(lbp_r=r["lbp_over_zeropp"], zz_r=r["zeropp_over_zero3"],
                pub_lz=V.LBP_PUBLISHED["lbp_over_zeropp"],
                pub_zz=V.LBP_PUBLISHED["zeropp_over_zero3"],
                pub_zz_gain=V.LBP_PUBLISHED["zeropp_over_zero3"] - 1,
                z3_e=egress(z3), zpp_e=egress(zpp), hier_e=egress(hier),
                z3_x=z3.time["dp_exposed"], zpp_x=zpp.time["dp_exposed"], z3_d=z3.time["dp"],
                zpp_d=zpp.time["dp"], hier_s=hier.time["step_comm"],
                z3_calls=wide_calls(z3), zpp_calls=wide_calls(zpp), z3_l=z3.time["dp_latency"],
                zpp_l=zpp.time["dp_latency"], zpp_fg=forward_gathers(zpp),
                zpp_fc=zpp.time["forward"],
                hier_x=hier.time["dp_exposed"], hier_d=hier.time["dp"], quant=zpp.time["quant"],
                noov_zz=noov["zeropp"].tflops_per_device / noov["zero3"].tflops_per_device,
                noq_zz=noq["zeropp"].tflops_per_device / noq["zero3"].tflops_per_device,
                ours_defer=ours[1]["lbp_over_zeropp"], ours_zz2=ours[3]["zeropp_over_zero3"],
                **_lbp_bound(a, lbp))


def _lbp_bound(a, lbp: dict) -> dict:
    """What bounds hierarchical / ZeRO++, and the three plans with calls as large as
    DeepSpeed's."""
    import dataclasses

    plans = ("zero3", "zeropp", "hierarchical")

    def steps(assumptions, topo=None) -> dict:
        return {k: V.lbp_predict(k, V.LBP_NODES, assumptions, topo=topo).step_time
                for k in plans}

    d = steps(dataclasses.replace(a, combine_bytes=V.DEEPSPEED_CALL_BYTES))
    rows = V.collective_rows(a)
    ag = [r["published"] / r["predicted"] for r in rows
          if r["name"].startswith("RCCL all-gather 1024 ")]
    step = V.measured_rccl_step_us(rows)
    st = steps(a, V.frontier_with_ring_step(step))
    sn = steps(a, V.frontier_with_ring_step(step, inside=False))
    lo = next(r["implied"] for r in rows
              if r["name"].startswith("RCCL reduce-scatter 1024 ranks 2 MiB"))
    zpp, floor = lbp["zeropp"].step_time, V.never_hidden(lbp["hierarchical"])
    return dict(zpp_t=zpp, ds_mib=V.DEEPSPEED_CALL_BYTES / 2**20,
                ds_src=V.DEEPSPEED_SOURCE, ds_z3=d["zero3"], ds_zpp=d["zeropp"],
                ds_h=d["hierarchical"], ds_zz=d["zero3"] / d["zeropp"],
                ds_hz=d["zeropp"] / d["hierarchical"], ag_lo=min(ag), ag_hi=max(ag),
                hier_c=floor, bound=zpp / floor, st_us=step, st_lo=lo, st_z3=st["zero3"],
                st_zpp=st["zeropp"], st_h=st["hierarchical"],
                st_hz=st["zeropp"] / st["hierarchical"], st_zz=st["zero3"] / st["zeropp"],
                sn_zpp=sn["zeropp"], sn_hz=sn["zeropp"] / sn["hierarchical"],
                sn_zz=sn["zero3"] / sn["zeropp"])


def busbw_table() -> str:
    lines = ["| machine | 1 node | 2 nodes | 8 nodes | 48 nodes |", "|---|---|---|---|---|"]
    for name in ("frontier", "perlmutter"):
        cells = " | ".join(f"{V.bus_bandwidth(name, n) / 1e9:.0f} GB/s" for n in (1, 2, 8, 48))
        lines.append(f"| {name} | {cells} |")
    return "\n".join(lines)


def absolute_table(rows: list) -> str:
    lines = ["| published figure | published | predicted | rel. error | within 25% | source |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        ok = "yes" if abs(r["error"]) <= V.TOLERANCE else "**no**"
        lines.append(f"| {r['name']} | {r['published']:.3g} | {r['predicted']:.3g} | "
                     f"{r['error']:+.1%} | {ok} | {r['source']} |")
    return "\n".join(lines)


def dash_table() -> str:
    lines = ["| GPT | layers / d / heads | TP × PP on nodes | micro-batch / global batch | "
             "micro-batches per replica | 1F1B cap | published MFU |",
             "|---|---|---|---|---|---|---|"]
    for size, c in V.dash_script_caps().items():
        lines.append(f"| {size} | {c['L']} / {c['d']} / {c['H']} | {c['tp']} × {c['pp']} on "
                     f"{c['nodes']} | {c['micro']} / {c['batch']} | {c['micro_batches']} | "
                     f"{c['cap']:.1%} | {c['published']:.2%} |")
    return "\n".join(lines)


def _why_fill(a, boost: dict, rows: list, lbp: dict, lbp_rows: list) -> dict:
    """The figures the "Why" section quotes."""
    br = {r["key"]: r["error"] for r in rows}
    bf = [br[k + " btp/full"] for k in boost]
    vb = [br[k + " vanilla/btp"] for k in boost]
    fe = [boost[k]["full"].step_time / V.BOOST_PUBLISHED[k][0] - 1 for k in ("3B", "7B")]
    nr = V.boost_predictions(a, sizes=("7B",), remat="none")["7B"]
    pm100 = dict(V.variants(a))[
        "Perlmutter 4-GPU node collective 100 GB/s instead of 300 (BOOST TP4 rows)"]
    return dict(btp_lo=min(bf), btp_hi=max(bf), vb_lo=min(vb), vb_hi=max(vb), full_lo=min(fe),
                full_hi=max(fe), mem3=boost["3B"]["full"].memory["total"] / 1e9,
                mem7=boost["7B"]["full"].memory["total"] / 1e9, tol=V.TOLERANCE,
                nr_full=nr["full"].step_time, nr_van=nr["vanilla"].memory["total"] / 1e9,
                pub7=V.BOOST_PUBLISHED["7B"][0],
                pub13=" / ".join(f"{x:.2f}" for x in V.BOOST_PUBLISHED["13B"]) + " s",
                pm100=V.within(V.ratio_rows(a, **pm100)[2]),
                **_pp1(a), **_lbp_fill(a, lbp, lbp_rows))


def _head(n_ok: int, all_rows: list, abs_rows: list) -> str:
    gaps = "\n".join(f"- `{k}`: {why}" for k, why in V.KNOWN_GAPS.items())
    return f"""# Cost model vs published results

Reproduce: `.venv/bin/python benchmarks/validation.py` (cost model only, a few seconds; every
number below, prose included, is its output). Model code: `boost_jax/plan/costmodel.py`;
workload definitions, the published figures and their sources: `benchmarks/published.py`.

**{n_ok} of {len(all_rows)} predicted ratios are within {V.TOLERANCE:.0%} of the published
ones.** The ones outside are known gaps, each with its reason (`published.KNOWN_GAPS`, explained
under "Why" below):

{gaps}

**{V.within(abs_rows)} of {len(abs_rows)} absolute figures are within {V.TOLERANCE:.0%}**
(BOOST's iteration seconds on Perlmutter, Megatron-LM's 1T GPT on 3072 A100):

{absolute_table(abs_rows)}

The absolute rows outside are BOOST's full-rank and vanilla 3B/7B: the model runs them
with whole-block recompute (see "Why" below).

Dash et al.'s Frontier GPT runs (arXiv 2312.12705: 38.38% / 36.14% / 31.96% of peak for
22B / 175B / 1T) are not rows: no source we could read gives the layouts and batches of the
measured runs. The authors' group publishes launch scripts for the same three sizes in a
training series:
{V.DASH_SCRIPTS_SOURCE}.
As laid out there, they cannot be the measured runs, or cannot run here:

{dash_table()}

The cap is the 1F1B busy fraction m / (m + p − 1) of m micro-batches through p stages: the
step's MFU cannot exceed it with every kernel at peak. The 175B and 1T scripts' batches cap
them below what the paper measured, so the measured runs used larger batches, which no source
we could read gives. The 22B script's layout could be the measured one, but it puts its 8
stages two to a node on 4 nodes, and this engine places pipeline stages on whole hosts, so the
cost model cannot run it as laid out.

"""


def collective_table(rows: list) -> str:
    lines = ["| measured call | published ms | predicted ms | rel. error | within 25% | "
             "the library's pick | of it latency ms | implied us per step |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ok = "yes" if abs(r["error"]) <= V.TOLERANCE else "**no** (known gap, see below)"
        implied = "-" if r["implied"] is None else f"{r['implied']:.1f}"
        lines.append(f"| {r['name']} | {r['published']:.3g} | {r['predicted']:.3g} | "
                     f"{r['error']:+.1%} | {ok} | {r['algorithm']} | {r['latency']:.2f} | "
                     f"{implied} |")
    return "\n".join(lines)


def _collectives(rows: list) -> str:
    n_ok = sum(abs(r["error"]) <= V.TOLERANCE for r in rows)
    gaps = "\n".join(f"- `{k}`: {why}" for k, why in V.COLLECTIVE_GAPS.items())
    cal = V.COLLECTIVE_CALIBRATION
    cal_ms = V.collective_ms(*cal[:4])[0]
    repos = "; ".join(f"`{r}`" for r in (*V.COLLECTIVE_REPOS.values(), V.ONE_PER_NODE_REPO))
    return f"""## Collectives as RCCL and NCCL run them (measured calls)

Each collective is timed with the algorithm the library runs (rings for all-gather and
reduce-scatter, or NCCL's PAT over one rank per node; ring or tree for all-reduce; whichever
with its protocol LL / LL128 / Simple the library's tuner predicts fastest) and the
library's own per-call latency (NCCL's and RCCL's `src/graph/tuning.cc`, file and commit in
`boost_jax/mesh.py`; derivation in `benchmarks/README.md`). Against one call's milliseconds as measured on Frontier (RCCL) and
Perlmutter (NCCL) by the authors of "The Big Send-off" (arXiv 2504.18658), published with
their reproducer, one rccl-tests output posted with its machine, and nccl-tests all-gathers
over one A100 a node on Leonardo with `NCCL_ALGO=PAT` and `NCCL_ALGO=Ring` in one allocation
(NCCL at the commit we pin; the model then costs only the algorithm named) ({repos}); P = the
gathered output, the reduce-scatter input or the all-reduce buffer. "Implied" = what a ring's
measurement leaves per step once the bytes are paid (Simple, full bandwidth).

**{n_ok} of {len(rows)} measured calls are within {V.TOLERANCE:.0%}.** The ones outside are
known gaps (`published.COLLECTIVE_GAPS`):

{gaps}

{collective_table(rows)}

Frontier's node-level bandwidth is read from one measurement, not checked against it: RCCL's
{cal[1]} of {cal[3]} MiB over {cal[2]} GCDs, {cal[4]} ms (`{cal[6]}`), predicted {cal_ms:.2f} ms.

What `all_reduce_perf` would print for a 1 GiB all-reduce over every device of the nodes
(bus bandwidth 2(n−1)/n·P / t), as the model costs it:

{busbw_table()}

"""


def _network_and_sources(boost: dict) -> str:
    return f"""## Where the published figures come from

{V.sources_table()}

The per-model seconds against the abstract's ranges (BTP speed-up = the other method's seconds
over BTP's):

{V.ranges_table(boost)}

"""


def _assumptions(a) -> str:
    pm, fr, dg = get_topology("perlmutter"), get_topology("frontier"), get_topology("dgx-a100")
    return f"""## One set of assumptions for every row

{chr(10).join('- ' + x for x in a.describe())}
- hardware: Perlmutter A100-40GB ({pm.peak_flops / 1e12:.0f} TFLOP/s bf16, 1.555 TB/s HBM;
  NVLink pair {pm.bw_pair / 1e9:.0f} GB/s, 4-GPU node collective {pm.bw_node / 1e9:.0f} GB/s,
  4 Slingshot-11 NICs, {pm.nic_node / 1e9:.0f} GB/s per node); Frontier MI250X GCD
  ({fr.peak_flops / 1e12:.1f} TFLOP/s, 1.6 TB/s HBM; pair {fr.bw_pair / 1e9:.0f} GB/s, node
  {fr.bw_node / 1e9:.0f} GB/s, 4 Slingshot-11 NICs, {fr.nic_node / 1e9:.0f} GB/s per node); DGX A100
  for the Megatron-LM row (NVSwitch {dg.bw_node / 1e9:.0f} GB/s per GPU, 8 HDR NICs,
  {dg.nic_node / 1e9:.0f} GB/s per node) — boost_jax/mesh.py, each with its source.
- whole-block recompute (remat=full) for every BOOST and LBP method and plan; bf16 weights with
  fp32 master and Adam; flash attention (the published stacks use it, and the step compiles it
  on GPUs with `model.attention` auto; dense is a sensitivity row).
- Megatron-LM row: the 1T GPT as run (TP 8 inside a DGX node, 64 stages of 1F1B with the
  stage forward re-run in each backward tick — the recompute — DP 6 with bf16 gradients),
  TFLOP/s per GPU counted with Megatron-LM's own formula (recompute included).
- BOOST rows: one TP group, batch 4 x 4096 tokens, no data parallelism. Shapes: 3B = OpenLLaMA-3B
  (d=3200, L=26, H=32, d_ff=8640; 3B is not a LLaMA-2 size), 7B/13B = LLaMA-2; vocab 32000;
  CoLA rank r = d/4. The vanilla baseline is modelled as *our* vanilla TP (attention replicated
  over the TP group, as boost_jax/sharding/tp/vanilla.py does).
- 13B TP4 PP2: the engine's pipeline (`parallel.pp_stages=2`, boost_jax/step/pipeline.py),
  1f1b over 4 micro-batches of 1 sequence: 5 ticks with a forward and 5 with a backward (which
  re-runs its stage forward), bubble 1/5, 9 activation sends over Slingshot on the critical path.
- LBP rows: GPT-NeoX-20B itself (`model.family=gpt_neox`: d=6144, L=44, H=64, 4d GELU MLP,
  LayerNorm, vocab 50432, seq 2048), 1 sequence per GCD per step (DeepSpeed defaults: no
  accumulation), gradients reduced in bf16. ZeRO-3 = `zero3`, ZeRO++ = `zeropp` (int8 qwZ
  gathers + hpZ node secondary + qgZ int4 gradient all-to-alls), LBP = `hierarchical`; all
  three as the paper ran them (`PAPER_LBP` in benchmarks/published.py): flat library rings,
  hierarchical's updated weights gathered once per step after the optimizer, in bf16.
- (de)quantization (qwZ, int8 secondaries, qgZ): memory-bound passes at the HBM roofline, on
  the path of the collectives they feed (boost_jax/plan/costmodel.py, `quant_seconds`).

"""


def _results(a, ratio_t: str, abs_t: str, lbp_t: str, all_rows: list) -> str:
    return f"""## BOOST (Perlmutter, A100): iteration seconds, full-rank / vanilla TP / BTP

Ratios (the validation target):

{ratio_t}

Absolute seconds and where the time goes:

{abs_t}

## Low-bandwidth partitioning (Frontier, 20B GPT, 48 nodes = 384 GCDs)

{lbp_t}

### Beyond the paper: this project's additions at the same setting (not validation rows)

Each row changes the plans as named and keeps everything else as above; nothing here was
published, so nothing here counts toward the validation.

{V.ours_lbp_table(a)[0]}

Figures (`.venv/bin/python benchmarks/plots.py --out benchmarks/results`, cost model only):
`plan_boost_iteration.png` (the table above as bars, published as ticks),
`plan_bytes_per_level.png` (collective bytes per device per step by plan and level, CoLA-7B on
48 Frontier nodes), `plan_weak_scaling.png` (predicted weak-scaling efficiency vs nodes by plan,
CoLA-7B and the 20B GPT).

## Sensitivity (how the ratios move with the fixed choices)

Each row changes one fixed choice and recomputes all {len(all_rows)} ratios; none was tuned
per row. One alternative remat rule was also evaluated before settling on whole-block
recompute everywhere (the BOOST reference code's only checkpointing mode): letting each method
use its fastest remat that fits an 80 GB A100. It is the last row (7B only), where it moves
both ratios further from the published ones; on the 3B it would move vanilla/full from
{_fastest_remat_3b(a)[0]:+.1%} to {_fastest_remat_3b(a)[1]:+.1%} of the published ratio.

{V.sensitivity(a)}

"""


def build() -> str:
    a = V.VALIDATION_ASSUMPTIONS
    boost = V.boost_predictions(a)
    abs_t, ratio_t, rows = V.boost_tables(boost)
    lbp = V.lbp_predictions(a)
    lbp_t, lbp_rows = V.lbp_table(lbp)
    all_rows = rows + lbp_rows
    n_ok = V.within(all_rows)
    abs_rows = V.absolute_rows(a, boost)
    fill = _why_fill(a, boost, rows, lbp, lbp_rows)
    return (_head(n_ok, all_rows, abs_rows) + _collectives(V.collective_rows(a))
            + _network_and_sources(boost) + _assumptions(a)
            + _results(a, ratio_t, abs_t, lbp_t, all_rows) + WHY.format(**fill) + "\n")


ROOT_README = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                           "README.md")


def sync_constants(path: str = ROOT_README) -> None:
    """Write the cost model's constants table into README.md between its markers."""
    begin, end = "<!-- constants -->", "<!-- end constants -->"
    with open(path) as f:
        text = f.read()
    if begin not in text or end not in text:
        return
    head, rest = text.split(begin, 1)
    tail = rest.split(end, 1)[1]
    with open(path, "w") as f:
        f.write(f"{head}{begin}\n{V.constants_table()}\n{end}{tail}")


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--json", action="store_true",
                   help="print every row as {name, kind, published, predicted, source, error, "
                        "within}")
    add_out(p, os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                            "validation.md"))
    args = p.parse_args()
    guard_out(args.out, force=args.force)
    if args.json:
        import json

        print(json.dumps(V.json_rows(), indent=1))
        return 0
    doc = build()
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        f.write(doc)
    if ours(args.out):  # a scratch --out leaves both READMEs alone
        sync_readme(args.out)
        sync_constants()
    print(doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
