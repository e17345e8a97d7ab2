"""BTP training with parallel.kernels=pallas (the Pallas interpreter on CPU) equals kernels=xla.

The step's shard_map is manual over every axis; for interpreted kernels it runs with
check_vma=False (boost_jax/backends/cpu.py, which says how the gradient is recovered), everywhere
else with check_vma=True. Each run: build_step on the 2x2x2 CPU mesh (TP over `pair`, data parallel over
`node` x `global`), a few AdamW steps on fixed synthetic batches, fp32: same losses (so same
gradients and updates) and the loss falls.
"""

import jax
import numpy as np
import pytest
from jax.experimental import pallas as pl

from boost_jax.backends.cpu import fast_compile_options
from boost_jax.config import load_config
from boost_jax.mesh import make_mesh
from boost_jax.pallas import dispatch
from boost_jax.sharding.tp.specs import validate_tp
from boost_jax.backends.cpu import check_vma
from boost_jax.step.build import build_step

V, B, S, STEPS = 64, 8, 16, 4
TINY = ["model.d_model=32", "model.n_layers=2", "model.n_heads=4", "model.d_ff=64",
        "model.rank=8", f"model.vocab_size={V}", f"model.max_seq_len={S}", f"data.seq_len={S}",
        "data.tokenizer=bpe", f"train.global_batch={B}", f"train.steps={STEPS}",
        "optim.lr=0.01", "optim.warmup_frac=0.1", "parallel.tp_mode=btp"]
CASES = {  # overrides: CoLA, TP 2, DDP over 4; LaX (gated), TP 4, ZeRO-3 over 2, low-rank remat
    "cola-t2-ddp": ["parallel.tp_axes=[pair]"],
    "lax-t4-zero3-lowrank": ["parallel.tp_axes=[pair,node]", "model.arch=lax",
                             "model.lax_gate=gate", "parallel.plan=zero3", "train.remat=lowrank"],
    # GPT-NeoX: Online-LayerNorm kernel (LayerNorm + biases, parallel residual), TP 2
    "neox-cola-t2-ddp": ["parallel.tp_axes=[pair]", "model.family=gpt_neox"],
}


@pytest.fixture(scope="module")
def mesh():
    return make_mesh("cpu", shape=[2, 2, 2])


def _cfg(kernels, extra):
    return load_config(None, TINY + list(extra) + [f"parallel.kernels={kernels}"])


def _batches():
    """Tokens from the first 8 ids of the vocabulary: a unigram the model learns in a few steps
    (loss ln 64 → toward ln 8)."""
    rng = np.random.default_rng(0)
    for _ in range(STEPS):
        toks = rng.integers(0, 8, (B, S + 1)).astype(np.int32)
        yield {"inputs": toks[:, :-1], "targets": toks[:, 1:]}


def _train(cfg, mesh, monkeypatch):
    """-> (losses per step, kernel names traced with interpret=True)."""
    kernels, pallas_call = set(), pl.pallas_call

    def spy(*args, **kw):
        kernels.add((kw.get("name"), kw.get("interpret")))
        return pallas_call(*args, **kw)

    monkeypatch.setattr(pl, "pallas_call", spy)
    bundle = build_step(cfg, mesh, fast_compile_options())
    state, losses = bundle.init_state(), []
    for batch in _batches():
        batch = jax.tree.map(lambda x: jax.device_put(x, bundle.batch_sharding), batch)
        state, m = bundle.train_step(state, batch)
        losses.append(float(m["loss"]))
    monkeypatch.undo()
    return np.asarray(losses), kernels


@pytest.mark.parametrize("case", list(CASES))
def test_btp_pallas_interpret_equals_xla(mesh, case, monkeypatch):
    extra = CASES[case]
    assert not check_vma(_cfg("pallas", extra))  # the interpreted path
    assert check_vma(_cfg("xla", extra))
    got, kernels = _train(_cfg("pallas", extra), mesh, monkeypatch)
    want, none = _train(_cfg("xla", extra), mesh, monkeypatch)
    # forward and backward of the fused norm + down-projection and the grouped up-projection
    # (GPT families: the Online-LayerNorm kernel, then the down-projection)
    norm = ("online_layernorm_fwd", "online_layernorm_bwd") if "neox" in case else (
        "norm_matmul_fwd", "norm_matmul_bwd_dx", "norm_matmul_bwd_da")
    assert {(n, True) for n in (*norm, "grouped_gemm")} <= kernels and not none, (kernels, none)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    assert np.isfinite(got).all() and got[-1] < got[0] - 0.2, got


def test_check_vma_stays_on_where_kernels_compile(mesh, monkeypatch):
    """validate_tp accepts pallas; check_vma=False only for btp with interpreted kernels —
    compiled kernels (a GPU: interpret_mode() False), xla and non-btp modes keep it on."""
    cfg = _cfg("pallas", CASES["cola-t2-ddp"])
    validate_tp(cfg, mesh)
    megatron = _cfg("pallas", ["parallel.tp_axes=[pair]", "model.arch=full",
                               "parallel.tp_mode=megatron"])
    assert check_vma(megatron)
    monkeypatch.setattr(dispatch, "interpret_mode", lambda: False)
    assert check_vma(cfg)
    assert check_vma(_cfg("auto", CASES["cola-t2-ddp"]))
