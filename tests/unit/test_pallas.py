"""Pallas kernels vs their XLA twins on CPU (interpret=True): forward and VJPs, ragged shapes.

The Pallas interpreter fills outputs and block padding with NaN (checked below), so "no NaN"
proves every output element was written and every ragged edge was masked.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt
from jax.sharding import AbstractDevice, AbstractMesh, use_abstract_mesh
from jax.sharding import PartitionSpec as P

from boost_jax.errors import ConfigError
from boost_jax.pallas import dispatch, grouped, layernorm, rmsnorm
from boost_jax.pallas.common import mm

F32, BF16 = jnp.float32, jnp.bfloat16
# Faster XLA:CPU compiles of the (large) interpreted kernels; numerics are unaffected.
FAST = {"xla_backend_optimization_level": 0}


def _rand(key, shape, dtype, scale=1.0):
    return (scale * jax.random.normal(key, shape, F32)).astype(dtype)


def _fwd_vjp(fn, args):
    """jit(fn forward + VJP with fixed random cotangents) -> (outputs, grads)."""
    @jax.jit  # one compile per case
    def run(*args):
        out, vjp = jax.vjp(fn, *args)
        leaves, tree = jax.tree.flatten(out)
        keys = jax.random.split(jax.random.key(7), len(leaves))
        cts = [_rand(k, o.shape, o.dtype) for k, o in zip(keys, leaves)]
        return out, vjp(jax.tree.unflatten(tree, cts))
    return run.lower(*args).compile(FAST)(*args)


def _rel(p, q):
    p, q = np.asarray(p, np.float64), np.asarray(q, np.float64)
    return float(np.linalg.norm(p - q) / max(np.linalg.norm(q), 1e-30))


def _close(got, want, dtype, what=""):
    for i, (p, q) in enumerate(zip(jax.tree.leaves(got), jax.tree.leaves(want))):
        assert p.shape == q.shape and p.dtype == q.dtype, (what, i, p.shape, q.shape)
        assert not np.isnan(np.asarray(p, np.float32)).any(), f"{what}[{i}]: NaN (unwritten?)"
        if dtype == F32:
            q32 = np.asarray(q, np.float32)
            np.testing.assert_allclose(p, q32, rtol=1e-5, atol=1e-5 * np.abs(q32).max(),
                                       err_msg=f"{what}[{i}]")
        else:
            assert _rel(p, q) <= 1e-2, (what, i, _rel(p, q))


def _compare(fn_p, fn_r, args, dtype, what):
    got, want = _fwd_vjp(fn_p, args), _fwd_vjp(fn_r, args)
    _close(got, want, dtype, what)


# ---------------------------------------------------------------- plumbing
def test_dispatch_resolve():
    assert dispatch.resolve("auto") == "xla"  # CPU
    assert dispatch.resolve("pallas") == "pallas" and dispatch.resolve("xla") == "xla"
    assert dispatch.interpret_mode()
    assert dispatch.shard_map_check_vma("pallas") is False
    assert dispatch.shard_map_check_vma("auto") is True
    with pytest.raises(ConfigError):
        dispatch.resolve("triton")


def test_interpreter_poisons_unwritten_outputs():
    def half(x_ref, o_ref):  # writes only the first 8 rows of a 16-row block
        plt.store(o_ref, x_ref[...], mask=(jnp.arange(16) < 8)[:, None])

    x = jnp.ones((16, 16))
    y = pl.pallas_call(half, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                       interpret=True)(x)
    assert np.isnan(np.asarray(y[8:])).all() and not np.isnan(np.asarray(y[:8])).any()


# ---------------------------------------------------------------- kernels vs XLA
@pytest.mark.parametrize("shape,dtype", [((37, 80), F32), ((2, 8, 128), F32), ((37, 80), BF16)])
def test_local_rmsnorm(shape, dtype):
    k = jax.random.split(jax.random.key(0), 2)
    x, g = _rand(k[0], shape, dtype), _rand(k[1], shape[-1:], dtype, 0.2) + 1
    _compare(lambda x, g: rmsnorm.local_rmsnorm(x, g, 1e-6, interpret=True),
             lambda x, g: rmsnorm.local_rmsnorm_ref(x, g, 1e-6), (x, g), dtype, "norm")


@pytest.mark.parametrize("G,T,r,n,dtype", [(2, 37, 40, 24, BF16)])  # fp32: gqa + concat tests
def test_grouped_up(G, T, r, n, dtype):
    k = jax.random.split(jax.random.key(1), 2)
    z, b = _rand(k[0], (G, T, r), dtype), _rand(k[1], (G, r, n), dtype, r ** -0.5)
    _compare(lambda z, b: grouped.grouped_up(z, b, interpret=True), grouped.grouped_up_ref,
             (z, b), dtype, "grouped_up")


def test_grouped_up_gqa_list():
    k = jax.random.split(jax.random.key(2), 4)
    z = _rand(k[0], (3, 2, 19, 40), F32)  # leading [B, S] dims
    bs = [_rand(k[1], (40, 80), F32), _rand(k[2], (40, 20), F32), _rand(k[3], (40, 20), F32)]
    _compare(lambda z, bs: grouped.grouped_up(z, bs, interpret=True), grouped.grouped_up_ref,
             (z, bs), F32, "gqa")


def test_concat_down():
    k = jax.random.split(jax.random.key(3), 4)
    x = _rand(k[0], (37, 80), F32)
    a = [_rand(k[1], (80, 48), F32), _rand(k[2], (80, 16), F32), _rand(k[3], (80, 16), F32)]
    _compare(lambda x, a: grouped.concat_down(x, a, interpret=True), grouped.concat_down_ref,
             (x, a), F32, "concat_down")


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_norm_matmul(dtype):
    k = jax.random.split(jax.random.key(4), 3)
    x, g = _rand(k[0], (37, 80), dtype), _rand(k[1], (80,), dtype, 0.2) + 1
    a = _rand(k[2], (80, 48), dtype, 80 ** -0.5)
    _compare(lambda x, g, a: grouped.norm_matmul(x, g, a, interpret=True),
             lambda x, g, a: rmsnorm.norm_matmul_ref(x, g, a), (x, g, a), dtype, "norm_matmul")


# ---------------------------------------------------------------- Online-RMSNorm == RMSNorm
EPS = 1e-6


def _dense(x, g, a):
    """Reference: full RMSNorm(x)·γ @ A in fp32."""
    x, g, a = (t.astype(F32) for t in (x, g, a))
    y = x * lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + EPS) * g
    return jnp.dot(y, a, precision=lax.Precision.HIGHEST)


def _inputs(dtype, T=37, d=80, r=48, scales=(1.0, 1e3, 1e-2, 1.0)):
    k = jax.random.split(jax.random.key(5), 3)
    col_scale = jnp.repeat(jnp.asarray(scales, F32), d // len(scales))  # shards 1e3 apart
    x = (jax.random.normal(k[0], (T, d)) * col_scale).astype(dtype)
    g = (1 + 0.2 * jax.random.normal(k[1], (d,))).astype(dtype)
    a = (jax.random.normal(k[2], (d, r)) * d ** -0.5).astype(dtype)
    return x, g, a


@pytest.mark.parametrize("impl", ["pallas", "xla"])
def test_online_rmsnorm_matmul_single_device(impl):
    x, g, a = _inputs(F32, scales=(1.0,))
    fn = lambda x, g, a: rmsnorm.online_rmsnorm_matmul(  # noqa: E731
        x, g, a, x.shape[-1], EPS, None, impl=impl, interpret=True)
    _compare(fn, _dense, (x, g, a), F32, f"single-{impl}")


@pytest.mark.parametrize("impl,dtype", [("pallas", F32), ("xla", F32), ("pallas", BF16),
                                        ("xla", BF16)])
def test_online_rmsnorm_matmul_4_shards(impl, dtype):
    """Split d into 4 shards (scales 1e3 apart), sum the per-shard payloads as the reduce."""
    x, g, a = _inputs(dtype)
    d, t = x.shape[-1], 4

    def sharded(x, g, a):  # vmap over the shard axis: one kernel instance, 4 shards
        part = lambda xs, gs, as_: rmsnorm.online_rmsnorm_partial(  # noqa: E731
            xs, gs, as_, EPS, impl=impl, interpret=True)
        parts = jax.vmap(part)(jnp.stack(jnp.split(x, t, -1)), g.reshape(t, -1),
                               a.reshape(t, -1, a.shape[-1]))
        return rmsnorm.online_rmsnorm_finish(jnp.sum(parts, axis=0), d, EPS, x.dtype)

    # bf16: compare against fp32 math on the same (bf16-rounded) inputs, within bf16 error
    _compare(sharded, lambda x, g, a: _dense(x, g, a).astype(dtype), (x, g, a), dtype,
             f"4shards-{impl}")


def test_online_rmsnorm_matmul_shard_map_psum():
    """The BTP call pattern: shard_map over 4 devices, reduce_fn = psum of [U | S]."""
    mesh = jax.make_mesh((4,), ("tp",), axis_types=(jax.sharding.AxisType.Auto,),
                         devices=jax.devices()[:4])
    x, g, a = _inputs(F32)
    d = x.shape[-1]

    def layer(x, g, a):
        inner = lambda x, g, a: dispatch.online_rmsnorm_matmul(  # noqa: E731
            x, g, a, d, EPS, lambda p: jax.lax.psum(p, "tp"), impl="pallas")
        return jax.shard_map(inner, mesh=mesh, in_specs=(P(None, "tp"), P("tp"), P("tp")),
                             out_specs=P(), check_vma=dispatch.shard_map_check_vma("pallas"))(
            x, g, a)

    _compare(layer, _dense, (x, g, a), F32, "shard_map")


# ---------------------------------------------------------------- Online-LayerNorm
@pytest.mark.parametrize("shape,dtype,offset", [((37, 80), F32, 0.0), ((2, 8, 128), F32, 50.0),
                                                ((37, 80), BF16, 3.0)])
def test_local_layernorm(shape, dtype, offset):
    """The LayerNorm kernel (mean, centred M2, std and x̂) and its VJP equal the XLA twin."""
    k = jax.random.split(jax.random.key(0), 2)
    x = (_rand(k[0], shape, F32) + offset).astype(dtype)
    g = _rand(k[1], shape[-1:], dtype, 0.2) + 1
    _compare(lambda x, g: layernorm.local_layernorm(x, g, 1e-5, interpret=True),
             lambda x, g: layernorm.local_layernorm_ref(x, g, 1e-5), (x, g), dtype, "ln")


def _dense_ln(x, g, b, a):
    xf = x.astype(F32)
    c = xf - jnp.mean(xf, -1, keepdims=True)
    y = c * jax.lax.rsqrt(jnp.mean(c * c, -1, keepdims=True) + EPS) * g.astype(F32) + b
    return mm(y, a.astype(F32))


@pytest.mark.parametrize("impl", ["pallas", "xla"])
def test_online_layernorm_matmul_4_shards(impl):
    """d split into 4 shards (scales 1e3 apart, a common offset): summing the per-shard
    payloads and finishing equals LayerNorm then A, forward and VJP."""
    x, g, a = _inputs(F32)
    x = x + 7.0
    b = 0.1 * jax.random.normal(jax.random.key(9), g.shape)
    d, t = x.shape[-1], 4

    def sharded(x, g, b, a):
        part = lambda xs, gs, bs, as_, i: layernorm.online_layernorm_partial(  # noqa: E731
            xs, gs, bs, as_, i, t, EPS, impl=impl, interpret=True)
        tok, w = jax.vmap(part)(jnp.stack(jnp.split(x, t, -1)), g.reshape(t, -1),
                                b.reshape(t, -1), a.reshape(t, -1, a.shape[-1]), jnp.arange(t))
        return layernorm.online_layernorm_finish(tok.sum(0), w.sum(0), d, t, EPS, F32)

    _compare(sharded, _dense_ln, (x, g, b, a), F32, f"ln4-{impl}")


# ---------------------------------------------------------------- Triton lowering (no GPU needed)
def test_kernels_lower_to_triton():
    """Export fwd+grad for CUDA: runs the Pallas->Triton lowering (power-of-2 tiles, masks,
    dot forms) on CPU; only Triton's own PTX compile is left for the GPU."""
    k = jax.random.split(jax.random.key(6), 4)
    x, g = _rand(k[0], (37, 80), BF16), _rand(k[1], (80,), BF16)
    a, z = _rand(k[2], (80, 48), BF16), _rand(k[3], (3, 37, 40), BF16)
    bs = [a[:40], a[:40, :16], a[:40, :16]]

    def loss(x, g, a, z, bs):
        out = [rmsnorm.local_rmsnorm(x, g)[0], grouped.norm_matmul(x, g, a),
               *grouped.concat_down(x, [a, a[:, :8]]), *grouped.grouped_up(z, bs)]
        return sum(jnp.sum(o.astype(F32) ** 2) for o in out)

    text = _export_for_h100(jax.grad(loss, (0, 1, 2, 3, 4)), _h100_mesh((1,), ("x",)),
                            x, g, a, z, bs)
    # fwd: norm, norm_matmul, concat, grouped; bwd: norm, 2 norm_matmul, 2 concat, 2 grouped
    assert text.count("@__gpu$xla.gpu.triton") == 11


def test_layernorm_kernel_lowers_to_triton():
    """The Online-LayerNorm kernel's forward and backward go through the Triton lowering."""
    k = jax.random.split(jax.random.key(6), 2)
    x, g = _rand(k[0], (37, 80), BF16), _rand(k[1], (80,), BF16)

    def loss(x, g):
        return sum(jnp.sum(o.astype(F32) ** 2) for o in layernorm.local_layernorm(x, g))

    text = _export_for_h100(jax.grad(loss, (0, 1)), _h100_mesh((1,), ("x",)), x, g)
    assert text.count("@__gpu$xla.gpu.triton") == 2  # fwd, bwd


def test_compiled_kernels_in_typed_shard_map_lower_to_triton():
    """The GPU path of BTP: compiled (not interpreted) kernels inside shard_map(check_vma=True).
    Kernel outputs declare the operands' varying axes; align_vma pcasts the invariant latent
    to varying for grouped_up, so backward all-reduces its cotangent (pcast -> psum)."""
    mesh = _h100_mesh((4,), ("tp",))
    d, r, n = 256, 64, 128
    x, g = jax.ShapeDtypeStruct((32, d), BF16), jax.ShapeDtypeStruct((d,), BF16)
    a, b = jax.ShapeDtypeStruct((d, r), BF16), jax.ShapeDtypeStruct((3, r, n), BF16)

    def inner(x, g, a, b):  # x, g, a: this rank's d rows; b: its n columns
        z = rmsnorm.online_rmsnorm_matmul(x, g, a, d, EPS, lambda p: jax.lax.psum(p, "tp"),
                                          impl="pallas")  # invariant over tp
        return grouped.grouped_up(jnp.stack([z] * 3), b)  # varying over tp

    def loss(*args):
        out = jax.shard_map(inner, mesh=mesh, check_vma=True,
                            in_specs=(P(None, "tp"), P("tp"), P("tp"), P(None, None, "tp")),
                            out_specs=P(None, None, "tp"))(*args)
        return jnp.sum(out.astype(F32) ** 2)

    text = _export_for_h100(jax.grad(loss, (0, 1, 2, 3)), mesh, x, g, a, b)
    # fwd: norm_matmul, grouped; bwd: 2 norm_matmul, 2 grouped
    assert text.count("@__gpu$xla.gpu.triton") == 6
    # forward psum of [U | S]; backward psum of the latent's cotangent (pcast's transpose)
    assert text.count("stablehlo.all_reduce") == 2


def _h100_mesh(shape, names) -> AbstractMesh:
    """A device-less mesh of H100s: JAX >= 0.11 reads the Triton target GPU from the device."""
    h100 = AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", num_cores=132, platform="gpu")
    return AbstractMesh(shape, names, axis_types=(jax.sharding.AxisType.Auto,) * len(shape),
                        abstract_device=h100)


def _export_for_h100(fn, mesh: AbstractMesh, *args) -> str:
    """StableHLO text of jit(fn) exported for CUDA on this CPU host (Triton lowering included)."""
    skip = [jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
    with use_abstract_mesh(mesh):
        exp = jax.export.export(jax.jit(fn), platforms=["cuda"], disabled_checks=skip)(*args)
    return exp.mlir_module()
