"""Predicted vs published: writes benchmarks/results/validation.md.

    .venv/bin/python benchmarks/validation.py [--out benchmarks/results/validation.md]

Pure cost model (boost_jax.plan.validate): no compile, no devices; runs in seconds.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import sync_readme  # noqa: E402
from boost_jax.mesh import get_topology  # noqa: E402
from boost_jax.plan import validate as V  # noqa: E402


WHY = """## Why the remaining gaps

- **BTP is predicted a little too fast relative to full-rank (btp/full {btp_lo:+.0%}..{btp_hi:+.0%}).**
  The roofline charges BTP's small-K GEMMs (K = r = d/4 or N = d/t) and its extra elementwise
  kernels (SiLU on every latent, Online-RMSNorm statistics) at the same efficiency as Megatron's
  large GEMMs; on A100 such shapes run below that, and kernel/framework overheads of the
  published PyTorch stack are not modelled. The same effect makes vanilla/btp high
  ({vb_lo:+.0%}..{vb_hi:+.0%}). With dense attention (what our own step compiles) btp/full
  comes out closer to the published figure but vanilla/btp far too high (sensitivity table):
  we keep flash attention because the published stacks use it, not because it fits better.
- **Absolute seconds of full-rank are {full_lo:+.0%}..{full_hi:+.0%} for 3B/7B, and the memory
  model says full-rank 3B/7B TP{{2,4}} do not fit 90% of 40 GB** ({mem3:.1f} / {mem7:.1f} GB:
  bf16 weights + fp32 master + Adam + an fp32 gradient accumulator = 18 B/parameter, plus
  recompute activations). The published runs therefore either used 80 GB nodes, bf16 gradient
  buffers, or no recompute. The "no recompute" row brings full-rank 7B to 1.12 s (published
  1.06 s), but then none of the three fits 40 GB and vanilla (105 GB) does not fit 80 GB
  either — so whole-block recompute stays the single stated assumption. Ratios cancel the
  common factor; they are the target.
- **13B PP2** is pipeline-modelled (not implemented): the absolute times depend on the assumed
  micro-batching. With the whole batch as one micro-batch (bubble = one full stage) the
  predictions become 2.73 / 3.19 / 1.41 s (closer to the published 2.07 / 2.42 / 1.30 s for
  full-rank and BTP) and the ratios 1.17 / 0.52 / 2.26 (errors 0% / −18% / +22%): still within
  25%, so the conclusion does not hinge on this choice.
- **LBP vs ZeRO++ is predicted higher than published ({lbp_r:.2f}x vs 1.71x).** Our `zeropp`
  reduces gradients in bf16 over all 384 GCDs (2 bytes/param across nodes) while DeepSpeed's
  ZeRO++ uses qgZ (int4 hierarchical all-to-all, ~0.5 byte/param across nodes), so the modelled
  ZeRO++ is slower than the real one; the flat-ring network model (every byte of a cross-node
  ring at the per-GCD NIC share) also penalises flat ZeRO collectives more than a hierarchical
  NCCL/RCCL algorithm would. With DP collectives fully overlapped the ratio drops to {lbp_ov:.2f}x.
- **ZeRO++/ZeRO-3**: the paper reports "up to +40.5%", a maximum over configurations, compared
  here with one configuration.
"""


def build() -> str:
    a = V.VALIDATION_ASSUMPTIONS
    boost = V.boost_predictions(a)
    abs_t, ratio_t, rows = V.boost_tables(boost)
    lbp = V.lbp_predictions(a)
    lbp_t, lbp_rows = V.lbp_table(lbp)
    n_bad = sum(abs(r["error"]) > V.TOLERANCE for r in rows + lbp_rows)
    pm, fr = get_topology("perlmutter"), get_topology("frontier")
    import dataclasses

    br = {r["model"] + r["ratio"]: r["error"] for r in rows}
    bf = [br[k + "btp/full"] for k in boost]
    vb = [br[k + "vanilla/btp"] for k in boost]
    fe = [boost[k]["full"].step_time / V.BOOST_PUBLISHED[k][0] - 1 for k in ("3B", "7B")]
    ov = V.lbp_predictions(dataclasses.replace(a, dp_overlap=1.0))
    fill = dict(btp_lo=min(bf), btp_hi=max(bf), vb_lo=min(vb), vb_hi=max(vb), full_lo=min(fe),
                full_hi=max(fe), mem3=boost["3B"]["full"].memory["total"] / 1e9,
                mem7=boost["7B"]["full"].memory["total"] / 1e9,
                lbp_r=lbp_rows[0]["predicted"],
                lbp_ov=ov["hierarchical"].tflops_per_device / ov["zeropp"].tflops_per_device)
    doc = f"""# Cost model vs published results

Reproduce: `.venv/bin/python benchmarks/validation.py` (cost model only, a few seconds; the
numbers below are its output). Model code: `boost_jax/plan/costmodel.py`; workload definitions
and the published figures: `boost_jax/plan/validate.py`.

**{len(rows) + len(lbp_rows) - n_bad} of {len(rows) + len(lbp_rows)} predicted ratios are within
{V.TOLERANCE:.0%} of the published ones.** Absolute seconds are shown too; they are *not* the
validation target and are off by up to ~40% (see "Why" below).

## One set of assumptions for every row

{chr(10).join('- ' + x for x in a.describe())}
- hardware: Perlmutter A100-40GB ({pm.peak_flops / 1e12:.0f} TFLOP/s bf16, 1.555 TB/s HBM;
  NVLink pair {pm.bw_pair / 1e9:.0f} GB/s, 4-GPU node collective {pm.bw_node / 1e9:.0f} GB/s,
  Slingshot {pm.bw_global / 1e9:.0f} GB/s per GPU); Frontier MI250X GCD
  ({fr.peak_flops / 1e12:.1f} TFLOP/s, 1.6 TB/s HBM; pair {fr.bw_pair / 1e9:.0f} GB/s, node
  {fr.bw_node / 1e9:.0f} GB/s, Slingshot {fr.bw_global / 1e9:.1f} GB/s per GCD) — boost_jax/mesh.py.
- whole-block recompute (remat=full) for every method and plan; bf16 weights with fp32 master
  and Adam; flash attention (both published stacks use it; our step compiles dense attention,
  see the sensitivity table).
- BOOST rows: one TP group, batch 4 x 4096 tokens, no data parallelism. Shapes: 3B = OpenLLaMA-3B
  (d=3200, L=26, H=32, d_ff=8640; 3B is not a LLaMA-2 size), 7B/13B = LLaMA-2; vocab 32000;
  CoLA rank r = d/4. The vanilla baseline is modelled as *our* vanilla TP (attention replicated
  over the TP group, as boost_jax/sharding/tp_vanilla.py does).
- 13B TP4 PP2 (marked *): pipelines are not implemented; 2 stages are modelled analytically as
  1F1B over 4 micro-batches of 1 sequence (bubble of 1 slot, one activation send per slot over
  Slingshot).
- LBP rows: GPT-NeoX-20B shape (d=6144, L=44, H=64, vocab 50432, seq 2048; SwiGLU d_ff=16384 has
  the same parameter count as its 4d MLP), 1 sequence per GCD per step (DeepSpeed defaults: no
  accumulation), gradients reduced in bf16. ZeRO-3 = `zero3`, ZeRO++ = `zeropp` (int8 qwZ
  gathers + hpZ node secondary), LBP = `hierarchical`.

## BOOST (Perlmutter, A100): iteration seconds, full-rank / vanilla TP / BTP

Ratios (the validation target):

{ratio_t}

Absolute seconds and where the time goes:

{abs_t}

## Low-bandwidth partitioning (Frontier, 20B GPT, 48 nodes = 384 GCDs)

{lbp_t}

Figures (`.venv/bin/python -m boost_jax.plan.plots --out benchmarks/results`, cost model only):
`plan_boost_iteration.png` (the table above as bars, published as ticks),
`plan_bytes_per_level.png` (collective bytes per device per step by plan and level, CoLA-7B on
48 Frontier nodes), `plan_weak_scaling.png` (predicted weak-scaling efficiency vs nodes by plan,
CoLA-7B and the 20B GPT).

## Sensitivity (how the headline ratios move with the fixed choices)

The fixed choices were not tuned per row. One alternative remat rule was also evaluated before
settling on whole-block recompute everywhere (the BOOST reference code's only checkpointing
mode): letting each method use its fastest remat that fits an 80 GB A100. It is the last row;
it moves the ratios further from the published ones (3B vanilla/full would be +32%).

{V.sensitivity(a)}

@@WHY@@
"""
    why = WHY
    return doc.replace("@@WHY@@", why.format(**fill))


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                 "results", "validation.md"))
    args = p.parse_args()
    doc = build()
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        f.write(doc)
    sync_readme(args.out)
    print(doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
