"""CausalLM: shapes, scan == loop, remat invariance, bf16 vs fp32, param count.

Most tests fill an abstract model with NumPy values (no init program to compile) and jit with
fast_compile_options(); XLA CPU compile time dominates this file.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from boost_jax.analysis.flops import param_count
from boost_jax.backends.cpu import fast_compile_options
from boost_jax.config import ModelConfig
from boost_jax.layers.forward import cross_entropy
from boost_jax.layers.model import (LATENT_KEYS, CausalLM, abstract_model, build_model,
                                    count_params)

from weights import random_weights

ARCHS = ["full", "svd", "cola", "lax"]
B, S = 2, 8


def small_cfg(arch="lax", **kw):
    base = dict(arch=arch, vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                d_ff=48, rank=8, lax_gate="gate", max_seq_len=S)
    return ModelConfig(**{**base, **kw})


def np_model(cfg, seed=0, **kw):
    """Model with random NumPy weights (norm scales and gates near their init)."""
    graphdef, state = abstract_model(cfg, **kw)
    return nnx.merge(graphdef, jax.tree.map(jnp.asarray, random_weights(state, seed)))


def tokens(seed=0):
    return jax.random.randint(jax.random.key(seed), (B, S), 0, 64, jnp.int32)


def loss_and_grad(model, toks):
    graphdef, params = nnx.split(model)

    def loss(p):
        logits = nnx.merge(graphdef, p)(toks[:, :-1])
        logp = jax.nn.log_softmax(logits, -1)
        return -jnp.take_along_axis(logp, toks[:, 1:, None], -1).mean()
    return jax.jit(jax.value_and_grad(loss), compiler_options=fast_compile_options())(params)


def forward(model, toks, **kw):
    graphdef, params = nnx.split(model)
    f = lambda p, t: nnx.merge(graphdef, p)(t, **kw)  # noqa: E731
    return jax.jit(f, compiler_options=fast_compile_options())(params, toks)


def to_loop(scan, cfg, remat="none"):
    """The scan model's weights in a scan_layers=False model."""
    loop = nnx.merge(*abstract_model(cfg, remat=remat, scan_layers=False))
    for i, block in enumerate(loop.blocks):
        nnx.update(block, jax.tree.map(lambda x: x[i], nnx.state(scan.blocks)))
    for name in ("embed", "final_norm", "lm_head"):
        nnx.update(getattr(loop, name), nnx.state(getattr(scan, name)))
    return loop


@functools.lru_cache(maxsize=None)
def cached_loss_grad(arch, remat="none", scan=True):
    """Each (arch, remat, scan) compiles once for the whole file; same weights for all."""
    model = np_model(small_cfg(arch), remat=remat)
    if not scan:
        model = to_loop(model, small_cfg(arch), remat)
    return model, *loss_and_grad(model, tokens())


@pytest.mark.parametrize("arch", ARCHS)
def test_forward_backward_shapes(arch):
    model, loss, grads = cached_loss_grad(arch)
    assert np.isfinite(float(loss))
    params = nnx.state(model, nnx.Param)
    assert jax.tree.map(jnp.shape, grads) == jax.tree.map(jnp.shape, params)
    assert all(bool(jnp.isfinite(g).all()) for g in jax.tree.leaves(grads))
    assert all(float(jnp.abs(g).max()) > 0 for g in jax.tree.leaves(grads))


def test_logits_and_hidden_dtype_shape():
    model = np_model(small_cfg("cola"))
    logits = forward(model, tokens())
    assert logits.shape == (B, S, 64) and logits.dtype == jnp.float32
    hidden = forward(model, tokens(), return_hidden=True)
    assert hidden.shape == (B, S, 32)
    head = hidden.astype(jnp.float32) @ model.head_weight()
    np.testing.assert_allclose(np.asarray(head), np.asarray(logits), rtol=1e-5, atol=1e-5)
    # RoPE is relative and the mask is by index, so a uniform position offset changes nothing
    shifted = forward(model, tokens(), positions=jnp.arange(S, dtype=jnp.int32) + 5)
    np.testing.assert_allclose(np.asarray(shifted), np.asarray(logits), rtol=1e-4, atol=1e-4)


def test_cross_entropy_backward_is_elementwise():
    """The loss picks the gold logit by a one-hot mask, not a gather: its gradient is the
    softmax minus the mask, elementwise, so XLA writes it straight in the compute dtype (a
    gather's transpose is a scatter into a second fp32 [tokens, vocab] buffer: 0.5 GB more
    on the A100 program of benchmarks/gpu_compile.py's cola-60m pipeline row). Same value and
    gradient as the gather."""
    logits = jax.random.normal(jax.random.key(0), (B, S, 66)) * 3
    targets = jax.random.randint(jax.random.key(1), (B, S), 0, 66)
    grad = jax.grad(cross_entropy)
    hlo = jax.jit(grad).lower(logits, targets).as_text()
    assert "scatter" not in hlo and "gather" not in hlo
    gathered = jnp.take_along_axis(jax.nn.log_softmax(logits), targets[..., None], axis=-1)
    np.testing.assert_allclose(cross_entropy(logits, targets), -jnp.mean(gathered), rtol=1e-6)
    onehot = jax.nn.one_hot(targets, 66)
    np.testing.assert_allclose(grad(logits, targets),
                               (jax.nn.softmax(logits) - onehot) / (B * S), atol=1e-7)


def test_build_model_init_and_layout():
    cfg = small_cfg("lax")
    model = build_model(cfg, seed=0)
    flat = {"/".join(map(str, p)): v for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}
    assert flat["embed/embedding"].shape == (64, 32)
    assert flat["lm_head/w"].shape == (32, 64)
    assert flat["blocks/attn/q/a"].shape == (2, 32, 8)
    assert flat["blocks/attn/k/b"].shape == (2, 8, 16)  # GQA: 2 kv heads × head_dim 8
    assert flat["blocks/mlp/down/a"].shape == (2, 48, 8)
    assert flat["blocks/mlp_norm/scale"].shape == (2, 32)
    np.testing.assert_array_equal(np.asarray(flat["blocks/attn/o/g"][...][1]), np.eye(8))
    a = np.asarray(flat["blocks/attn/q/a"][...])
    assert not np.allclose(a[0], a[1])  # split_rngs: layers get different weights
    assert float(jnp.std(flat["embed/embedding"][...])) == pytest.approx(0.02, rel=0.15)
    loop = abstract_model(cfg, scan_layers=False)[1]
    paths = {"/".join(map(str, p)) for p, _ in nnx.to_flat_state(loop)}
    assert "blocks/1/mlp/up/latent_scale" in paths and "final_norm/scale" in paths


def test_scan_equals_loop():
    # lax (scan vs loop, with remat) is covered by test_remat_in_python_loop_matches_scan
    cfg = small_cfg("full")
    scan = np_model(cfg)
    loop = to_loop(scan, cfg)
    np.testing.assert_allclose(np.asarray(forward(scan, tokens())),
                               np.asarray(forward(loop, tokens())), rtol=1e-5, atol=1e-5)


def _assert_same(loss, grads, ref_loss, ref_grads):
    assert float(loss) == pytest.approx(float(ref_loss), rel=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
                 grads, ref_grads)


@pytest.mark.parametrize("remat", ["full", "lowrank"])
def test_remat_modes_agree(remat):
    _, ref_loss, ref_grads = cached_loss_grad("lax")
    _, loss, grads = cached_loss_grad("lax", remat)
    _assert_same(loss, grads, ref_loss, ref_grads)


def test_remat_in_python_loop_matches_scan():
    _, ref_loss, ref_grads = cached_loss_grad("lax")
    _, loss, grads = cached_loss_grad("lax", "lowrank", False)
    blocks = grads.pop("blocks")
    grads["blocks"] = jax.tree.map(lambda *xs: jnp.stack(xs), *[blocks[i] for i in range(2)])
    _assert_same(loss, grads, ref_loss, ref_grads)


def _inner_saved(remat):
    """Activations saved for backward that were computed inside a block's layers."""
    from jax._src.ad_checkpoint import saved_residuals  # what print_saved_residuals prints
    graphdef, params = nnx.split(np_model(small_cfg("lax", n_layers=1), remat=remat,
                                          scan_layers=False))
    f = lambda p: nnx.merge(graphdef, p)(tokens()).sum()  # noqa: E731
    # the block's functions (layers/forward.py) below `block` itself, whose output is saved
    inner = ("(attention)", "(mlp)", "(dense_attention)", "(apply_rope)", "(lowrank_apply)",
             "(matmul)", "named")
    return [(a.shape, why) for a, why in saved_residuals(f, params)
            if "argument" not in why and any(x in why for x in inner)]


def test_lowrank_remat_saves_only_latents_and_residuals():
    saved = _inner_saved("lowrank")
    latents = [shape for shape, why in saved if "lowrank_latent" in why]
    assert latents == [(B, S, 8)] * len(LATENT_KEYS)
    # the residual stream at the block input and after the attention sub-layer
    assert [shape for shape, why in saved if "'residual'" in why] == [(B, S, 32)] * 2
    assert len(saved) == len(LATENT_KEYS) + 2, saved
    assert len(_inner_saved("none")) > 3 * len(saved)  # the filter does see block internals


def test_bf16_compute_close_to_fp32():
    cfg = small_cfg("lax")
    m32 = np_model(cfg)
    m16 = nnx.merge(nnx.graphdef(np_model(dataclasses.replace(cfg, dtype="bfloat16"))),
                    nnx.state(m32))
    l32, l16 = forward(m32, tokens()), forward(m16, tokens())
    assert l16.dtype == jnp.float32
    rel = float(jnp.linalg.norm(l16 - l32) / jnp.linalg.norm(l32))
    assert rel < 3e-2, rel
    # bf16-stored params run too
    mp = np_model(dataclasses.replace(cfg, param_dtype="bfloat16", dtype="bfloat16"))
    assert nnx.state(mp, nnx.Param)["blocks"]["attn"]["q"]["a"][...].dtype == jnp.bfloat16
    assert bool(jnp.isfinite(forward(mp, tokens())).all())


@pytest.mark.parametrize("kw", [dict(arch="full"), dict(arch="svd"), dict(arch="cola"),
                                dict(arch="lax", lax_gate="identity"), dict(arch="lax"),
                                dict(arch="cola", tie_embeddings=True, n_kv_heads=None),
                                dict(arch="lax", family="gpt_neox"),
                                dict(arch="full", family="gpt2", tie_embeddings=True)])
def test_param_count_matches_formula(kw):
    cfg = small_cfg(**kw)
    graphdef, state = abstract_model(cfg)
    assert count_params(nnx.merge(graphdef, state)) == param_count(cfg)


def test_tied_embeddings_and_bad_remat():
    cfg = small_cfg("cola", tie_embeddings=True)
    model = np_model(cfg)
    assert not hasattr(model, "lm_head")
    np.testing.assert_array_equal(np.asarray(model.head_weight()),
                                  np.asarray(model.embed.embedding[...]).T)
    with pytest.raises(ValueError, match="remat"):
        CausalLM(cfg, rngs=nnx.Rngs(0), remat="some")
