#!/usr/bin/env bash
# The GPU check: one command for the lent GPU machine (one H200, its own Python 3.12 image with
# JAX 0.11.2 + CUDA 13, no network), under 8 minutes. First, here: benchmarks/gpu_wheels.sh
# (fills .whl/ with the wheels the image lacks). There, with .whl carried:
#   bash benchmarks/gpu.sh                (writes into $OUT, else runs/gpu-bench)
# Steps, each under its own time limit; a failed step is reported and the next one still runs:
#   0. install .whl/*.whl into a temporary target (PYTHONPATH), check our imports come from
#      there or the image -> env.txt (versions, devices, nvidia-smi)
#   1. benchmarks/kernels.py: each Pallas kernel vs its XLA twin (time, % of copy bandwidth,
#      % of peak, error vs XLA) -> kernels.json
#   2. benchmarks/train_speed.py, CoLA-1B shape (configs/cola-1b.yaml, all 24 layers):
#      BTP with parallel.kernels=pallas vs xla, plain CoLA, full rank at the same width;
#      alternating rounds, tokens/s median and spread, MFU -> train_speed.json
#   3. train.py end to end (data pipeline on grain, tensorboardX, orbax checkpoint), 2 layers,
#      a few steps -> its metrics in the log
#   3b. benchmarks/attention.py: one attention's forward+backward at 4096 tokens, dense vs
#      flash (cuDNN, Pallas, blockwise): time and memory; fails unless auto picks cuDNN on
#      NVIDIA -> attention.json
#   4. summary.md (the tables for benchmarks/README.md); gpu.log holds all output
# Dry run on CPU, tiny shapes, same steps (wheel install included; needs a Python 3.12 with
# the image's JAX, which `make gpu-dry-run` builds):  GPU_DRY_RUN=1 bash benchmarks/gpu.sh DIR
# Env: PY (python; default python3, or .venv-gpu/bin/python in a dry run), WHEELS (.whl),
#      BATCH=64 SEQ=256 (per step, one micro-batch), LAYERS=24, ROUNDS=5, TOPOLOGY=dgx-h100
#      (peak for MFU: the H200 has the H100's 989 TFLOP/s dense bf16),
#      GPU_STEPS="kernels speed e2e attention" (a rerun can take only the steps that failed),
#      FORCE=1 (write into a folder that holds files gpu.sh did not write).
set -uo pipefail
cd "$(dirname "$0")/.."
DRY=${GPU_DRY_RUN:-0}
if [ "${1:-}" = "--dry-run" ]; then DRY=1; shift; fi
OUT=${1:-${OUT:-runs/gpu-bench}}
# a folder this script made holds MARK: a rerun (GPU_STEPS=...) replaces its own files there;
# any other folder that holds files is the user's, replaced only with FORCE=1
MARK=.made_by_gpu_sh
if [ -e "$OUT" ] && [ ! -d "$OUT" ]; then
  echo "error: $OUT is a file, not a folder; pass an output folder" >&2; exit 2
fi
FOREIGN=0
if [ -n "$(ls -A "$OUT" 2>/dev/null)" ] && [ ! -e "$OUT/$MARK" ]; then FOREIGN=1; fi
if [ "$FOREIGN" = 1 ] && [ "${FORCE:-0}" != 1 ]; then
  echo "error: $OUT holds files gpu.sh did not write; pass a new or empty folder, or set" \
       "FORCE=1 to replace its gpu.log, env.txt, *.json and summary.md" >&2; exit 2
fi
WHEELS=${WHEELS:-.whl}
if [ -z "${PY:-}" ]; then
  PY=python3
  if [ "$DRY" = 1 ] && [ -x .venv-gpu/bin/python ]; then PY=.venv-gpu/bin/python; fi
fi
ls "$WHEELS"/*.whl >/dev/null 2>&1 ||
  { echo "error: no wheels in $WHEELS; run benchmarks/gpu_wheels.sh here and carry $WHEELS" >&2
    exit 2; }
"$PY" -c 'import sys; assert sys.version_info[:2] == (3, 12), sys.version' 2>/dev/null ||
  { echo "error: $PY is not Python 3.12, the GPU image's (wheels are cp312); set PY, or run" \
         "make gpu-dry-run to build .venv-gpu" >&2; exit 2; }
mkdir -p "$OUT" || { echo "error: cannot create $OUT; pass another output folder" >&2; exit 2; }
OUT=$(cd "$OUT" && pwd)
# a folder forced open stays the user's: the next run there needs FORCE=1 again
if [ "$FOREIGN" = 0 ]; then : > "$OUT/$MARK"; fi
exec > >(tee "$OUT/gpu.log") 2>&1
TEE=$!
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-/tmp/boost_jax_gpu_cache}
GPU_STEPS=${GPU_STEPS:-kernels speed e2e attention}
want() { [[ " $GPU_STEPS " == *" $1 "* ]]; }
status=0
fail() { echo "FAILED: $*"; status=1; }
T0=$(date +%s)
stamp() { echo "== [$(( $(date +%s) - T0 )) s] $*"; }

if [ "$DRY" = 1 ]; then
  BATCH=4 SEQ=32 ROUNDS=2 TOPOLOGY=cpu
  SHAPE="model.d_model=64 model.n_layers=2 model.n_heads=4 model.d_ff=128 model.rank=16
         model.vocab_size=256 model.max_seq_len=32"
  E2E_SHAPE="$SHAPE"
  KARGS="--quick"; ITERS=1; T_KERNELS=300; T_SPEED=400; T_E2E=200
  AARGS="--lengths 256 --reps 2"; T_ATTN=200
else
  BATCH=${BATCH:-64} SEQ=${SEQ:-256} ROUNDS=${ROUNDS:-5} TOPOLOGY=${TOPOLOGY:-dgx-h100}
  SHAPE="model.n_layers=${LAYERS:-24}"
  E2E_SHAPE="model.n_layers=2"
  KARGS=""; ITERS=3; T_KERNELS=90; T_SPEED=270; T_E2E=75
  AARGS="--lengths 4096 --batch 4 --heads 16 --kv-heads 4 --head-dim 128 --dtype bfloat16
         --require-auto cudnn"; T_ATTN=60
fi

stamp "0. wheels into a temporary target, environment"
SITE="$TMP/site"
"$PY" -m pip install -q --disable-pip-version-check --no-index --no-deps --no-compile \
  --no-cache-dir --upgrade --target "$SITE" "$WHEELS"/*.whl ||
  { echo "error: installing $WHEELS/*.whl into $SITE failed (see above)" >&2; exit 2; }
export PYTHONPATH="$SITE:$PWD"
"$PY" - "$SITE" <<'EOF' | tee "$OUT/env.txt"
import importlib, importlib.metadata as md, platform, subprocess, sys
site = sys.argv[1]
print("python", platform.python_version(), sys.executable)
for dist in ("jax", "jaxlib", "jax-cuda13-plugin", "flax", "optax", "orbax-checkpoint", "chex",
             "numpy", "grain", "array-record", "tensorboardX", "tokenizers", "matplotlib",
             "pyyaml", "rich", "etils", "protobuf", "triton"):
    try:
        print(f"  {dist} {md.version(dist)}")
    except md.PackageNotFoundError:
        print(f"  {dist} -")
for mod in ("grain", "tensorboardX", "array_record"):  # must be the carried ones
    f = importlib.import_module(mod).__file__
    assert f.startswith(site), f"{mod} imported from {f}, not from the wheels in {site}"
import jax
print("devices", jax.devices())
try:
    print(subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,"
                          "clocks.max.sm", "--format=csv"], capture_output=True, text=True,
                         timeout=20).stdout)
except (OSError, subprocess.TimeoutExpired) as e:
    print("nvidia-smi:", e)
EOF
[ "${PIPESTATUS[0]}" = 0 ] || fail "environment check (a wheel or an image package missing)"

BTP="parallel.tp_mode=btp parallel.tp_axes=[pair]"
if want kernels; then
  stamp "1. kernels: Pallas vs XLA"
  timeout -k 10 "$T_KERNELS" "$PY" benchmarks/kernels.py --force --json "$OUT/kernels.json" \
    $KARGS ||
    fail "kernels.py (exit $?)"
fi

if want speed; then
  stamp "2. training speed, CoLA-1B shape: BTP pallas vs xla, CoLA vs full rank"
  # shellcheck disable=SC2086  # word splitting of the override lists is intended
  timeout -k 10 "$T_SPEED" "$PY" benchmarks/train_speed.py --config configs/cola-1b.yaml \
    --set $SHAPE data.seq_len="$SEQ" train.global_batch="$BATCH" train.micro_batches=1 \
          mesh.topology="$TOPOLOGY" \
    --variant cola-btp-pallas $BTP parallel.kernels=pallas \
    --variant cola-btp-xla $BTP parallel.kernels=xla \
    --variant cola model.arch=cola \
    --variant full model.arch=full \
    --rounds "$ROUNDS" --iters "$ITERS" --warmup "$ITERS" --deadline-s $((T_SPEED - 40)) \
    --force --json "$OUT/train_speed.json" || fail "train_speed.py (exit $?)"
fi

if want e2e; then
  stamp "3. train.py end to end (grain data, tensorboardX, orbax checkpoint), kernels=auto"
  # shellcheck disable=SC2086
  timeout -k 10 "$T_E2E" "$PY" train.py --config configs/cola-1b.yaml out_dir="$TMP/run" \
    $E2E_SHAPE $BTP parallel.kernels=auto mesh.topology="$TOPOLOGY" data.seq_len="$SEQ" \
    train.global_batch="$BATCH" train.micro_batches=1 train.steps=10 train.log_every=5 \
    train.eval_every=1000000 train.eval_batches=1 checkpoint.every=1000000 checkpoint.keep=1 \
    logging.tensorboard=true || fail "train.py (exit $?)"
  if [ -f "$TMP/run/metrics.jsonl" ]; then
    tail -n 3 "$TMP/run/metrics.jsonl"
    cp "$TMP/run/metrics.jsonl" "$TMP/e2e_metrics.jsonl"
    ls "$TMP/run" "$TMP/run/checkpoints" 2>/dev/null | tr '\n' ' '; echo
  fi
fi

if want attention; then
  stamp "3b. attention at 4096 tokens: dense vs flash (cuDNN, Pallas, blockwise)"
  # shellcheck disable=SC2086
  timeout -k 10 "$T_ATTN" "$PY" benchmarks/attention.py $AARGS --force \
    --json "$OUT/attention.json" ||
    fail "attention.py (exit $?)"
fi

stamp "4. summary"
"$PY" benchmarks/gpu_summary.py "$OUT" "$TMP/e2e_metrics.jsonl" || fail "gpu_summary.py"
stamp "done, status $status; files in $OUT:"
ls -la "$OUT"
exec 1>&- 2>&-
wait "$TEE" 2>/dev/null  # gpu.log complete before the files go back
exit $status
