#!/usr/bin/env bash
# GPU check of the Pallas kernels, < 5 minutes on one H200; installs nothing.
#   1. benchmarks/kernels.py: each kernel vs its XLA twin (time, GB/s vs copy bandwidth,
#      TFLOP/s vs peak, relative error vs XLA) -> OUT/kernels.{txt,json}
#   2. a few training steps of configs/cola-1b.yaml (BTP code path, t=1) with
#      parallel.kernels=pallas and then =xla -> tokens/s and MFU from OUT/train-*/metrics.jsonl
# Usage: benchmarks/gpu.sh [OUT_DIR]        (default runs/gpu-bench)
# Env:   PY (python), STEPS=20, LAYERS=4 (cola-1b widths, fewer layers to fit the time box;
#        LAYERS=24 for the full model), BATCH=8, SEQ=1024, TOPOLOGY=dgx-h100 (peak FLOP/s
#        for MFU; H200 has the H100's 989 TFLOP/s bf16), EXTRA="key=value ..." more overrides,
#        KARGS="--quick" extra kernels.py flags (a CPU dry run of this script).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-runs/gpu-bench}
if [ -z "${PY:-}" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
STEPS=${STEPS:-20}; LAYERS=${LAYERS:-4}; BATCH=${BATCH:-8}; SEQ=${SEQ:-1024}
TOPOLOGY=${TOPOLOGY:-dgx-h100}; EXTRA=${EXTRA:-}
mkdir -p "$OUT"
status=0
$PY -c "import jax; print('jax', jax.__version__, jax.devices())" || exit 1

echo "== kernel timings (pallas vs xla)"
timeout 100 $PY benchmarks/kernels.py --topology "$TOPOLOGY" --json "$OUT/kernels.json" ${KARGS:-} \
  2>&1 | tee "$OUT/kernels.txt"
[ "${PIPESTATUS[0]}" = 0 ] || { echo "kernels.py FAILED"; status=1; }

for K in pallas xla; do
  RUN="$OUT/train-$K"
  rm -rf "$RUN"
  echo "== train cola-1b (L=$LAYERS) parallel.kernels=$K, $STEPS steps"
  # eval/checkpoint intervals past the run: only the forced final eval and save happen
  timeout 110 $PY train.py --config configs/cola-1b.yaml out_dir="$RUN" \
    parallel.kernels=$K parallel.tp_mode=btp "parallel.tp_axes=[pair]" \
    mesh.topology="$TOPOLOGY" model.n_layers="$LAYERS" train.steps="$STEPS" \
    train.global_batch="$BATCH" train.micro_batches=1 data.seq_len="$SEQ" \
    train.log_every=5 train.eval_every=1000000 train.eval_batches=1 \
    checkpoint.every=1000000 checkpoint.keep=1 logging.tensorboard=false logging.plot=false \
    $EXTRA 2>&1 | tail -n 12
  [ "${PIPESTATUS[0]}" = 0 ] || { echo "train.py kernels=$K FAILED"; status=1; }
  rm -rf "$RUN/checkpoints"  # GBs of state we do not need
done

echo "== summary"
$PY - "$OUT" <<'EOF'
import json, statistics, sys
from pathlib import Path
out = Path(sys.argv[1])
summary = {}
kj = out / "kernels.json"
if kj.exists():
    rows = json.loads(kj.read_text())["rows"]
    for r in rows:
        if r["impl"] == "pallas":
            print(f"kernel {r['kernel']:>17} {r['pass_']:>8}: {r['speedup_vs_xla']:.2f}x vs xla, "
                  f"{r['pct_copy_bw']:.0f}% copy BW, {r['pct_peak']:.1f}% peak, "
                  f"rel err {r['rel_err_vs_xla']:.1e}")
    summary["kernels"] = rows
for k in ("pallas", "xla"):
    m = out / f"train-{k}" / "metrics.jsonl"
    rows = [json.loads(l) for l in m.open()] if m.exists() else []
    perf = [r for r in rows if "tokens_per_s" in r][1:] or [r for r in rows if "tokens_per_s" in r]
    if not perf:
        print(f"train kernels={k}: no throughput rows in {m}")
        continue
    tps = statistics.median(r["tokens_per_s"] for r in perf)  # first window skipped: warm-up
    mfu = statistics.median(r["mfu"] for r in perf)
    summary[f"train_{k}"] = dict(tokens_per_s=tps, mfu=mfu, final_loss=perf[-1]["loss"])
    print(f"train kernels={k:>6}: {tps:,.0f} tokens/s  MFU {mfu:.1%}  loss {perf[-1]['loss']:.4f}")
if "train_pallas" in summary and "train_xla" in summary:
    s = summary["train_pallas"]["tokens_per_s"] / summary["train_xla"]["tokens_per_s"]
    summary["train_speedup_pallas_vs_xla"] = s
    print(f"train speed-up pallas/xla: {s:.3f}x")
(out / "summary.json").write_text(json.dumps(summary, indent=1))
EOF
exit $status
