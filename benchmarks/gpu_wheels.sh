#!/usr/bin/env bash
# Download, here, the wheels of every runtime dependency the GPU machine's image lacks
# (benchmarks/gpu_image_packages.txt lists what it has: CPython 3.12, JAX 0.11.2 + CUDA 13,
# flax, optax, orbax-checkpoint, ...) into .whl/ (git-ignored), check that image + wheels hold
# every dependency, and print the list and size. benchmarks/gpu.sh installs them there.
# Usage: benchmarks/gpu_wheels.sh [DIR]   (default .whl; PY=python with pip, default python3)
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=${1:-.whl}
PY=${PY:-python3}
# grain and tensorboardX (pyproject pins) and what they need that the image lacks; all are
# downloaded with --no-deps, gpu_wheels_check.py proves nothing else is missing
WHEELS=(grain==0.2.18 array-record==0.8.6 portpicker==1.6.0 tensorboardX==2.6.5)
PLATFORMS=(manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64
           manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64)
rm -rf "$DEST"
mkdir -p "$DEST"
"$PY" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
  --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none \
  "${PLATFORMS[@]/#/--platform=}" -d "$DEST" "${WHEELS[@]}"
"$PY" benchmarks/gpu_wheels_check.py "$DEST"
