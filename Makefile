# `make train` and `make test` create the virtual environment on first use.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
ARGS ?=

.PHONY: train test test-unit test-e2e bench convergence clean gpu-dry-run gpu-compile-test gpu-compile-bench hf-live-test

# One recipe for every virtual environment DIR/.installed: $(call venv,PYTHON,PIP ARGS) creates
# DIR with PYTHON and installs PIP ARGS; a comma in PIP ARGS is written $(comma), as call splits
# its arguments at commas.
comma := ,
define venv
$(1) -m venv $(@D)
$(@D)/bin/pip install -q --upgrade pip
$(@D)/bin/pip install -q $(2)
touch $@
endef

$(VENV)/.installed: pyproject.toml
	$(call venv,$(PYTHON),-e '.[test]')

train: $(VENV)/.installed
	$(PY) train.py --config configs/demo.yaml $(ARGS)

test: $(VENV)/.installed
	$(PY) -m pytest tests -n 2 --dist loadfile $(ARGS)

# The in-process tests alone (quick feedback), or only those that start train.py, a module's
# CLI or a script as a process.
test-unit: $(VENV)/.installed
	$(PY) -m pytest tests/unit -n 2 --dist loadfile $(ARGS)

test-e2e: $(VENV)/.installed
	$(PY) -m pytest tests/e2e -n 2 --dist loadfile $(ARGS)

# Learning per FLOP (benchmarks/README.md section 10); its results file says how long it took.
convergence: $(VENV)/.installed
	$(PY) benchmarks/convergence.py $(ARGS)

# The GPU check (benchmarks/gpu.sh) on CPU with tiny shapes, in a Python 3.12 stand-in for the
# GPU machine's image (JAX 0.11.2, no grain/tensorboardX: they come from .whl/ as there).
PYTHON312 ?= python3.12
GPU_VENV ?= .venv-gpu

$(GPU_VENV)/.installed: benchmarks/gpu_image_requirements.txt
	$(call venv,$(PYTHON312),-r benchmarks/gpu_image_requirements.txt)

gpu-dry-run: $(GPU_VENV)/.installed
	bash benchmarks/gpu_wheels.sh
	GPU_DRY_RUN=1 PY=$(GPU_VENV)/bin/python bash benchmarks/gpu.sh runs/gpu-dry-run

# Compile for NVIDIA GPUs on this machine, without one: a separate venv with the CUDA plugin's
# compiler (~4.4 GB), then the tests that compile the training step and the Pallas kernels for
# A100 (sm_80) and H100 (sm_90) targets. JAX_PLATFORMS=cpu keeps the plugin from looking for a GPU.
GPUC_VENV ?= .venv-gpuc

$(GPUC_VENV)/.installed: pyproject.toml
	$(call venv,$(PYTHON),-e '.[test$(comma)gpu-compile]')

gpu-compile-test: $(GPUC_VENV)/.installed
	JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 JAX_PLATFORMS=cpu $(GPUC_VENV)/bin/python -m pytest \
		tests/unit/test_gpu_compile.py tests/unit/test_pallas_gpu.py -p no:xdist $(ARGS)

# Kernels per block as XLA emits them (the table the cost model reads), the analytic model vs
# the GPU-compiled step (CoLA-1B, CoLA-7B on Perlmutter, CoLA-GPT-NeoX-20B on Frontier), and
# what the GPU schedule hides per plan x TP mode (benchmarks/README.md sections 11-13); not
# part of `make bench`, which runs without the extra.
# Every export loaded in transformers (torch on the CPU) against boost_jax's logits and greedy
# tokens, and the README's "Use your model in transformers" run as written: a separate venv.
HF_VENV ?= .venv-hf

$(HF_VENV)/.installed: pyproject.toml
	$(call venv,$(PYTHON),-e '.[test$(comma)hf-live]')

hf-live-test: $(HF_VENV)/.installed
	$(HF_VENV)/bin/python -m pytest tests/unit/test_hf.py -k "live or readme_transformers" \
		-p no:xdist -rs $(ARGS)

gpu-compile-bench: $(GPUC_VENV)/.installed
	$(GPUC_VENV)/bin/python benchmarks/gpu_kernels.py
	$(GPUC_VENV)/bin/python benchmarks/gpu_compile.py $(ARGS)
	$(GPUC_VENV)/bin/python benchmarks/gpu_overlap.py
	$(GPUC_VENV)/bin/python benchmarks/gpu_scan_layers.py

# Every CPU figure of benchmarks/README.md and benchmarks/results/ (not the GPU check, gpu.sh,
# and not `make convergence`); each script writes its results file and copies it into the README.
bench: BENCH_START := $(shell date +%s)
bench: $(VENV)/.installed
	$(PY) benchmarks/validation.py
	$(PY) benchmarks/plots.py --out benchmarks/results
	$(PY) benchmarks/partitioning.py
	$(PY) benchmarks/qgz_demo.py
	$(PY) benchmarks/cross_node_quant_demo.py
	$(PY) benchmarks/tensor_parallel.py --out benchmarks/results/tensor_parallel.md
	$(PY) benchmarks/plan_7b.py
	$(PY) benchmarks/step_overhead.py --rounds 7
	$(PY) benchmarks/cola_vs_full.py --rounds 5
	$(PY) benchmarks/prepare_speed.py --mib 16 --rounds 3
	$(PY) benchmarks/stream_speed.py
	$(PY) benchmarks/pipeline.py
	$(PY) benchmarks/search_speed.py
	$(PY) benchmarks/attention.py --lengths 32,64,128,256,512,1024,2048 --reps 9 --out benchmarks/results/attention_cpu.md
	$(PY) benchmarks/bench_time.py --since $(BENCH_START)

# What the tests and imports leave behind; never runs/ (the user's trained runs and
# checkpoints) or the virtual environments.
clean:
	rm -rf .pytest_cache
	find . \( -name '.venv*' -o -name runs -o -name .git \) -prune -o -name __pycache__ \
		-type d -prune -exec rm -rf {} +
