"""The Pallas (Triton) flash attention kernel (boost_jax/pallas/flash.py): in JAX's Pallas
interpreter on CPU it equals dense attention, forward and every gradient (fp32), with GQA and
a length that is not a multiple of the tile; exported for an H100 it lowers to Triton kernels
only, also inside a typed shard_map with the heads sharded (the TP layouts' GPU path)."""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from boost_jax.layers import forward
from boost_jax.pallas import flash as pallas_flash
from test_pallas import FAST, _export_for_h100, _h100_mesh

F32, BF16 = jnp.float32, jnp.bfloat16


def _qkvw(b, s, H, K, hd):
    ks = jax.random.split(jax.random.key(3), 4)
    q, w = (jax.random.normal(x, (b, s, H, hd)) for x in (ks[0], ks[3]))
    k, v = (jax.random.normal(x, (b, s, K, hd)) for x in ks[1:3])
    return q, k, v, w


def test_interpreted_kernel_equals_dense_with_gqa_and_padding(monkeypatch):
    """Through the model's dispatch on a ROCm platform: 21 positions = two 16-tiles, padded."""
    monkeypatch.setattr(forward, "platform", lambda: "rocm")
    monkeypatch.setattr(pallas_flash, "TILE", 16)
    assert forward.attention_impl("flash", 21, "rocm") == "pallas"
    q, k, v, w = _qkvw(1, 21, 4, 2, 8)

    def run(fn):
        f = jax.jit(jax.value_and_grad(lambda q, k, v: jnp.sum(fn(q, k, v) * w), (0, 1, 2)))
        return f.lower(q, k, v).compile(FAST)(q, k, v)

    got = run(lambda q, k, v: forward.causal_attention(q, k, v, kind="flash"))
    want = run(forward.dense_attention)
    for a, c in zip(jax.tree.leaves(want), jax.tree.leaves(got)):
        assert not np.isnan(np.asarray(c)).any()
        np.testing.assert_allclose(c, a, rtol=1e-5, atol=1e-5 * float(np.abs(a).max()))


def test_wide_fp32_heads_run_in_smaller_tiles_and_equal_dense():
    """fp32 at head dim 130 (padded to 256) takes 32-row tiles (a 64-row one does not fit a
    GPU's shared memory: tests/unit/test_pallas_gpu.py); 40 positions are two of them."""
    assert pallas_flash.fit_tile(64, 130, F32) == 32 and pallas_flash.fit_tile(64, 256, BF16) == 64
    q, k, v, w = _qkvw(1, 40, 2, 1, 130)

    def run(fn):
        f = jax.jit(jax.value_and_grad(lambda q, k, v: jnp.sum(fn(q, k, v) * w), (0, 1, 2)))
        return f.lower(q, k, v).compile(FAST)(q, k, v)

    got = run(lambda q, k, v: pallas_flash.flash_attention(q, k, v, interpret=True))
    want = run(forward.dense_attention)
    for a, c in zip(jax.tree.leaves(want), jax.tree.leaves(got)):
        np.testing.assert_allclose(c, a, rtol=1e-5, atol=1e-5 * float(np.abs(a).max()))


def test_kernel_lowers_to_triton_in_typed_shard_map():
    """Heads sharded over 4 devices as under TP; no [s, s] array anywhere in the program."""
    mesh = _h100_mesh((4,), ("tp",))
    s = 200
    q = jax.ShapeDtypeStruct((2, s, 8, 64), BF16)
    kv = jax.ShapeDtypeStruct((2, s, 4, 64), BF16)

    def loss(q, k, v):
        out = jax.shard_map(pallas_flash.flash_attention, mesh=mesh, check_vma=True,
                            in_specs=(P(None, None, "tp"),) * 3, out_specs=P(None, None, "tp"))(
            q, k, v)
        return jnp.sum(out.astype(F32) ** 2)

    text = _export_for_h100(jax.grad(loss, (0, 1, 2)), mesh, q, kv, kv)
    # the forward kernel and the backward one (dK, dV, then dQ); delta = rowsum(dO·O) is XLA's
    assert text.count("@__gpu$xla.gpu.triton") == 2
    padded = -(-s // 64) * 64
    assert f"{padded}x{padded}x" not in text and f"{s}x{s}x" not in text
