"""Layers against independent NumPy references (float64), plus RoPE/attention properties."""

import numpy as np
import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from boost_jax.backends.cpu import fast_compile_options
from boost_jax.config import ModelConfig
from boost_jax.layers import forward
from boost_jax.layers.model import Attention, LowRankLinear, RMSNorm, jit_init, lowrank_init_std

EPS = 1e-6


def np_rms(x, scale, eps=EPS):
    return x / np.sqrt((x ** 2).mean(-1, keepdims=True) + eps) * scale


def np_silu(x):
    return x / (1.0 + np.exp(-x))


def np_layer(kind, p, x, prev):
    if kind == "full":
        return x @ p["w"], None
    z = x @ p["a"]
    if kind == "lax":
        if prev is not None:
            z = z + (prev @ p["g"] if "g" in p else prev)
        z = np_rms(z, p["latent_scale"])
    h = z if kind == "svd" else np_silu(z)
    return h @ p["b"], z


def np_module(make, seed=0):
    """make() built abstractly, then params from NumPy: no init program to compile."""
    graphdef, state = nnx.split(nnx.eval_shape(make))
    rng = np.random.default_rng(seed)
    state = jax.tree.map(lambda x: jnp.asarray(rng.normal(size=x.shape), x.dtype), state)
    return nnx.merge(graphdef, state)


def call(module, *args):
    """module(*args) under one jit (eager mode compiles every op separately: slower)."""
    graphdef, state = nnx.split(module)
    f = lambda s, *a: nnx.merge(graphdef, s)(*a)  # noqa: E731
    return jax.jit(f, compiler_options=fast_compile_options())(state, *args)


def _np_params(layer):
    return {k: np.asarray(v, np.float64) for k, v in layer.params_dict().items()}


@pytest.mark.parametrize("kind,gate,with_prev", [
    ("full", "identity", False), ("svd", "identity", False), ("cola", "identity", False),
    ("lax", "identity", True), ("lax", "gate", True), ("lax", "gate", False)])
def test_lowrank_linear_matches_numpy(kind, gate, with_prev):
    d_in, d_out, r = 12, 10, 4
    layer = np_module(lambda: LowRankLinear(d_in, d_out, kind, rank=r, lax_gate=gate, eps=EPS,
                                            rngs=nnx.Rngs(0)))  # random latent_scale and g
    rng = np.random.default_rng(1)
    x = rng.normal(size=(2, 3, d_in)).astype(np.float32)
    prev = rng.normal(size=(2, 3, r)).astype(np.float32) if with_prev else None
    y, z = call(layer, jnp.asarray(x), None if prev is None else jnp.asarray(prev))
    y_ref, z_ref = np_layer(kind, _np_params(layer), x.astype(np.float64), prev)
    np.testing.assert_allclose(np.asarray(y), y_ref, rtol=1e-5, atol=1e-5)
    if kind == "full":
        assert z is None
    else:
        assert z.shape == (2, 3, r)
        np.testing.assert_allclose(np.asarray(z), z_ref, rtol=1e-5, atol=1e-5)


def test_lowrank_init():
    d_in, d_out, r = 256, 128, 32
    layer = jit_init(lambda: LowRankLinear(d_in, d_out, "lax", rank=r, lax_gate="gate",
                                           rngs=nnx.Rngs(0)))
    std = lowrank_init_std(d_in, d_out, r)
    for p in (layer.a, layer.b):
        assert abs(float(jnp.std(p[...])) / std - 1) < 0.1
    np.testing.assert_array_equal(np.asarray(layer.g[...]), np.eye(r))  # identity crossing
    np.testing.assert_array_equal(np.asarray(layer.latent_scale[...]), np.ones(r))
    full = jit_init(lambda: LowRankLinear(256, 128, "full", init_std=0.02, rngs=nnx.Rngs(0)))
    assert abs(float(jnp.std(full.w[...])) / 0.02 - 1) < 0.05


def test_mixed_precision_linear():
    layer = np_module(lambda: LowRankLinear(16, 8, "cola", rank=4, param_dtype="float32",
                                            dtype="bfloat16", rngs=nnx.Rngs(0)))
    y, z = call(layer, jnp.ones((2, 16), jnp.float32))
    assert y.dtype == z.dtype == jnp.bfloat16 and layer.a[...].dtype == jnp.float32


def test_rms_norm_matches_numpy():
    norm = RMSNorm(16, eps=EPS)
    norm.scale[...] = jnp.linspace(0.5, 2.0, 16)
    x = np.random.default_rng(0).normal(size=(3, 16)).astype(np.float32)
    ref = np_rms(x.astype(np.float64), np.asarray(norm.scale[...], np.float64))
    np.testing.assert_allclose(np.asarray(call(norm, jnp.asarray(x))), ref, rtol=1e-5,
                               atol=1e-6)
    xb = jnp.asarray(x, jnp.bfloat16)  # fp32 statistics, output in the input dtype
    assert jax.eval_shape(norm, xb).dtype == jnp.bfloat16


def np_rope(x, pos, theta=10000.0):
    """Independent form: pair (i, i + hd/2) as a complex number times exp(i·pos·θ_i)."""
    hd = x.shape[-1]
    freqs = theta ** (-np.arange(0, hd, 2) / hd)
    c = x[..., : hd // 2] + 1j * x[..., hd // 2:]
    c = c * np.exp(1j * pos[None, :, None, None] * freqs)
    return np.concatenate([c.real, c.imag], axis=-1)


def test_rope_matches_numpy_and_is_relative():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2, 5, 3, 8)).astype(np.float32)
    pos = np.arange(5) + 7
    rope = jax.jit(forward.apply_rope, compiler_options=fast_compile_options())
    np.testing.assert_allclose(np.asarray(rope(jnp.asarray(x), jnp.asarray(pos))),
                               np_rope(x.astype(np.float64), pos), rtol=1e-5, atol=1e-5)
    q, k = (jnp.asarray(rng.normal(size=(1, 1, 1, 8)), jnp.float32) for _ in range(2))

    def dot(m, n):
        return float(jnp.sum(rope(q, jnp.array([m])) * rope(k, jnp.array([n]))))
    assert dot(3, 1) == pytest.approx(dot(3 + 11, 1 + 11), rel=1e-5)
    assert dot(3, 1) == pytest.approx(dot(2, 0), rel=1e-5)
    assert dot(3, 1) != pytest.approx(dot(3, 2), rel=1e-3)


def np_attention(q, k, v):
    H, K = q.shape[2], k.shape[2]
    k, v = np.repeat(k, H // K, axis=2), np.repeat(v, H // K, axis=2)
    s = np.einsum("bqhd,bshd->bhqs", q, k) / np.sqrt(q.shape[-1])
    s = np.where(np.tril(np.ones((q.shape[1], k.shape[1]), bool)), s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("bhqs,bshd->bqhd", p, v)


def test_causal_attention_gqa_matches_numpy():
    rng = np.random.default_rng(0)
    q = rng.normal(size=(2, 6, 4, 8)).astype(np.float32)
    k, v = (rng.normal(size=(2, 6, 2, 8)).astype(np.float32) for _ in range(2))
    attn = jax.jit(forward.causal_attention, compiler_options=fast_compile_options())
    out = attn(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v))
    assert out.shape == (2, 6, 4, 8)
    np.testing.assert_allclose(np.asarray(out), np_attention(*(a.astype(np.float64)
                               for a in (q, k, v))), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch", ["full", "lax"])
def test_attention_module_causal_and_gqa_shapes(arch):
    cfg = ModelConfig(arch=arch, d_model=32, n_heads=4, n_kv_heads=2, d_ff=48, rank=8)
    attn = np_module(lambda: Attention(cfg, rngs=nnx.Rngs(0)))
    kv_out = cfg.kv_heads * cfg.head_dim
    if arch == "full":
        assert attn.q.w.shape == (32, 32) and attn.k.w.shape == (32, kv_out)
        assert attn.v.w.shape == (32, kv_out) and attn.o.w.shape == (32, 32)
    else:
        assert attn.k.a.shape == (32, 8) and attn.k.b.shape == (8, kv_out)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2, 8, 32)).astype(np.float32)
    x2 = x.copy()
    x2[:, 5:] = rng.normal(size=(2, 3, 32))
    pos = jnp.arange(8)
    p = {"attn": nnx.to_pure_dict(nnx.state(attn, nnx.Param)), "attn_norm": {"scale": jnp.ones(32)}}

    def sublayer(p, x):  # the model's attention sub-layer (norm, projections, RoPE, attention)
        return forward.attention(forward.Local(cfg), cfg, p, x, pos, {})

    sub = jax.jit(sublayer, compiler_options=fast_compile_options())
    y, lat = sub(p, jnp.asarray(x))
    y2, _ = sub(p, jnp.asarray(x2))
    assert y.shape == (2, 8, 32)
    assert set(lat) == {"q", "k", "v", "o"}
    np.testing.assert_allclose(np.asarray(y[:, :5]), np.asarray(y2[:, :5]), rtol=1e-6, atol=1e-6)
    assert not np.allclose(np.asarray(y[:, 5:]), np.asarray(y2[:, 5:]))
