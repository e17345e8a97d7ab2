"""int8 block quantization: error bound, padding, payload, straight-through gradient, sharding."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from boost_jax.analysis.comm import analyze
from boost_jax.mesh import make_mesh
from boost_jax.sharding.quant import (dequantize, fake_quant, max_error_bound, payload_bytes,
                                      quantize, quantized_all_gather)


def _x(shape, seed=0, scale=3.0):
    return (np.random.default_rng(seed).standard_normal(shape) * scale).astype(np.float32)


def _bound(s, block, n):
    """max|block|/254 = scale/2, laid out like the data (blocks along the last axis)."""
    return np.repeat(np.asarray(s) / 2, block, axis=-1)[..., :n]


@pytest.mark.parametrize("shape,block", [((4, 1024), 256), ((3, 1000), 256), ((37,), 16),
                                         ((5, 7, 3), 4), ((2, 300), 1000)])
def test_round_trip_within_bound(shape, block):
    x = _x(shape)
    x[..., 0] = 100.0  # an outlier only inflates its own block
    q, s = quantize(x, block)
    nb = -(-shape[-1] // block)
    assert q.dtype == jnp.int8 and s.dtype == jnp.float32
    assert q.shape == shape[:-1] + (nb, block) and s.shape == shape[:-1] + (nb,)
    y = dequantize(q, s, x.shape, x.dtype)
    assert y.shape == x.shape
    err = np.abs(np.asarray(y) - x)
    bound = _bound(s, block, shape[-1])
    assert np.all(err <= bound * (1 + 1e-5) + 1e-7)
    if shape == (3, 1000):
        np.testing.assert_allclose(np.asarray(max_error_bound(x, block)), bound, rtol=1e-6)
    # bound is max|block|/254 per element
    xb = np.pad(np.abs(x), [(0, 0)] * (x.ndim - 1) + [(0, nb * block - shape[-1])])
    blockmax = xb.reshape(shape[:-1] + (nb, block)).max(-1)
    np.testing.assert_allclose(np.asarray(s), blockmax / 127, rtol=1e-6)


def test_other_axis_zero_blocks_and_scalar():
    x = _x((64, 3))
    q, s = quantize(x, 32, axis=0)
    assert q.shape == (3, 2, 32)
    y = dequantize(q, s, x.shape, jnp.float32, axis=0)
    assert np.all(np.abs(np.asarray(y) - x) <= _bound(s, 32, 64).T + 1e-6)
    z = jnp.zeros((2, 10))
    qz, sz = quantize(z, 4)
    assert not np.any(np.asarray(qz)) and not np.any(np.asarray(sz))
    np.testing.assert_array_equal(dequantize(qz, sz, z.shape), z)
    assert fake_quant(jnp.float32(2.5)).shape == ()


def test_int8_payload_about_half_of_bf16():
    x = jnp.asarray(_x((512, 1024)), jnp.bfloat16)
    q, s = quantize(x)
    int8_bytes = q.nbytes + s.nbytes
    assert int8_bytes == payload_bytes(x.shape)
    ratio = int8_bytes / x.nbytes
    assert 0.5 < ratio < 0.52  # (256 + 4) / (2 * 256)
    y = dequantize(q, s, x.shape, jnp.bfloat16)
    assert y.dtype == jnp.bfloat16


def test_fake_quant_gradient_is_identity():
    x = _x((3, 300))
    w = _x((3, 300), seed=1)
    g = jax.grad(lambda v: jnp.sum(fake_quant(v, 64) * w))(x)
    np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    y = fake_quant(x, 64)
    assert np.all(np.abs(np.asarray(y) - x) <= _bound(quantize(x, 64)[1], 64, 300) + 1e-6)


def test_sharded_input_inside_jit_stays_local():
    mesh = make_mesh("cpu", (2, 2, 2))
    sh = NamedSharding(mesh, P(("pair", "node", "global"), None))
    x = jax.device_put(_x((16, 600)), sh)
    f = jax.jit(lambda v: fake_quant(v, 128))
    y = f(x)
    assert y.sharding.is_equivalent_to(sh, 2)
    x = np.asarray(x)
    assert np.all(np.abs(np.asarray(y) - x) <= _bound(quantize(x, 128)[1], 128, 600) + 1e-6)
    r = analyze(lambda v: quantize(v, 128), (jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh),),
                mesh)
    assert r.collectives == []  # blocks run along the unsharded axis: no communication


def test_quantized_all_gather_moves_int8_and_has_exact_gather_gradient():
    mesh = make_mesh("cpu", (2, 2, 2))
    x = _x((8, 100))  # 2 rows per node shard; 100 not a multiple of the block

    def gather(v):
        return quantized_all_gather(v, "node", axis=0, block=64)

    f = jax.shard_map(gather, mesh=mesh, in_specs=P("node"), out_specs=P(), check_vma=False)
    y = jax.jit(f)(x)
    assert y.shape == x.shape
    assert np.all(np.abs(np.asarray(y) - x) <= _bound(quantize(x, 64)[1], 64, 100) + 1e-6)
    r = analyze(f, (x,), mesh)
    gathers = r.filter(kind="all-gather")
    assert gathers and all(c.level == "node" for c in gathers)
    assert len(gathers) == 1 and gathers[0].dtypes == ["u8"]  # int8 and scales, one gather
    # gradient: transpose of a tiled all-gather (psum_scatter), straight through quantization
    w = _x((8, 100), seed=2)

    def loss(gather_fn):
        sm = jax.shard_map(lambda a: gather_fn(a) * w, mesh=mesh, in_specs=P("node"),
                           out_specs=P(), check_vma=False)
        return jax.grad(lambda v: jnp.sum(sm(v)))(x)

    g_q = loss(gather)
    g_ref = loss(lambda a: jax.lax.all_gather(a, "node", axis=0, tiled=True))
    np.testing.assert_allclose(np.asarray(g_q), np.asarray(g_ref), rtol=1e-6)
    assert np.any(np.asarray(g_ref))


def test_int4_round_trip_within_half_a_step():
    from boost_jax.sharding.quant import dequantize_int4, payload_bytes_int4, quantize_int4

    x = jax.random.normal(jax.random.key(0), (3, 1000)) * jnp.arange(1, 4)[:, None]
    q, s = quantize_int4(x, 256)
    assert q.dtype == jnp.uint8 and q.shape == (3, 4, 128)
    y = dequantize_int4(q, s, 1000)
    bound = np.repeat(np.asarray(s), 256, axis=-1)[:, :1000] / 2
    assert np.all(np.abs(np.asarray(y - x)) <= bound + 1e-6)
    assert payload_bytes_int4(1000, 256) == 4 * (128 + 4)


def test_qgz_reduce_scatter_is_psum_scatter_within_int4_error():
    """ZeRO++'s qgZ (int4 all-to-all inside the node, then across nodes) against the exact
    tiled reduce-scatter, on 8 devices with their own gradients."""
    from jax.sharding import PartitionSpec as P

    from boost_jax.mesh import make_mesh
    from boost_jax.sharding.gather import LeafFetch, qgz_stages
    from boost_jax.sharding.layout import choose_layout

    mesh = make_mesh("cpu", (2, 2, 2))
    axes = ("pair", "node", "global")
    assert qgz_stages(axes) == [("pair", "node"), ("global",)]
    lay = choose_layout((64, 40), 8)
    f = LeafFetch(lay, tuple(mesh.shape.items()), axes, axes, axes, None, False, False, 256,
                  "float32", "float32", True)
    ct = jax.random.normal(jax.random.key(1), (8, 64, 40))
    # int4-representable at both stages (every block holds ±7, sums stay on the grid): exact
    grid = jnp.broadcast_to((jnp.arange(64 * 40) % 15 - 7).reshape(64, 40), (8, 64, 40))

    def body(c):
        c = c[0]
        return f.reduce(c)[None], jax.lax.psum_scatter(c, axes, scatter_dimension=lay.dim,
                                                       tiled=True)[None]

    spec = P(axes)
    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=(spec, spec)))
    got, want = fn(grid.astype(jnp.float32))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))  # chunks land right
    got, want = (np.asarray(x) for x in fn(ct))
    # each stage rounds every device's chunk to half an int4 step of its block's max
    bound = 2 * 8 * float(jnp.max(jnp.abs(ct))) / 14
    assert np.max(np.abs(got - want)) <= bound
    # Gaussian gradients: a step is ~0.4σ of a block, two stages → ~17% relative error norm
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 0.25


def test_pack_keeps_blocks_and_scales_bit_exact():
    from boost_jax.sharding.quant import pack, quantize_int4, unpack

    x = _x((3, 5, 130))
    for (q, s), dtype in ((quantize(x, 64), jnp.int8), (quantize_int4(x, 64), jnp.uint8)):
        buf = pack(q, s)
        assert buf.dtype == jnp.uint8 and buf.shape == q.shape[:-1] + (q.shape[-1] + 4,)
        q2, s2 = unpack(buf, dtype)
        assert q2.dtype == q.dtype and s2.dtype == jnp.float32
        np.testing.assert_array_equal(np.asarray(q2), np.asarray(q))
        np.testing.assert_array_equal(np.asarray(s2), np.asarray(s))
