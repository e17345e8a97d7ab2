"""Each Pallas kernel compiles for A100 (sm_80) and H100 (sm_90), forward and backward, on a
machine without a GPU: the CUDA plugin's compiler (the gpu-compile extra) builds the Triton
kernels for compile-only devices of XLA's published target configs. The kernels choose the
Triton backend through their compiler params, so what compiles here is what runs on a GPU.
Run by `make gpu-compile-test`; skipped without the extra."""

import re

import jax
import jax.numpy as jnp
import pytest
from jax.experimental import pallas as pl
from jax.sharding import SingleDeviceSharding

from boost_jax.pallas import flash, grouped, rmsnorm
from boost_jax.pallas.common import triton_params
from boost_jax.plan import gpu_target

pytestmark = pytest.mark.skipif(
    not gpu_target.plugin_installed(),
    reason="the gpu-compile extra (jax-cuda12-plugin) is not installed; make gpu-compile-test "
           "installs it and runs these")

TARGETS = {"sm_80": "a100_sxm_40", "sm_90": "h100_sxm"}
BF = jnp.bfloat16
T, D, R = 300, 200, 40  # awkward sizes: every tile is padded and masked


def _device(sm: str):
    from jax.experimental import topologies

    t = topologies.get_topology_desc("", "cuda", topology="1 x 1 x 1",
                                     target_config=gpu_target.target_config(TARGETS[sm]))
    return t.devices[0]


def _triton_kernels(fn, shapes, sm: str, backward: bool = True, dtype=BF) -> list[str]:
    """Compile value_and_grad(sum(fn)) (or fn) for the target; the pallas_call names of its Triton
    kernels."""
    dev = _device(sm)
    assert dev.device_kind == {"sm_80": "NVIDIA A100-SXM4-40GB",
                               "sm_90": "NVIDIA H100 80GB HBM3"}[sm]
    sh = SingleDeviceSharding(dev)
    args = [jax.ShapeDtypeStruct(s, dtype, sharding=sh) for s in shapes]

    def loss(*xs):
        out = fn(*xs)
        return sum(jnp.sum(o.astype(jnp.float32)) for o in jax.tree.leaves(out))

    f = jax.value_and_grad(loss, argnums=tuple(range(len(args)))) if backward else fn
    text = jax.jit(f).lower(*args).compile().as_text()
    calls = [ln for ln in text.splitlines() if 'custom_call_target="__gpu$xla.gpu.triton"' in ln]
    return sorted(re.search(r'op_name="[^"]*?(\w+)\)*/pallas_call"', ln).group(1)
                  for ln in calls)


CASES = {
    "online_rmsnorm": (lambda x, g: rmsnorm.local_rmsnorm(x, g), [(T, D), (D,)],
                       ["online_rmsnorm_bwd", "online_rmsnorm_fwd"]),
    "norm_matmul": (lambda x, g, a: grouped.norm_matmul(x, g, a), [(T, D), (D,), (D, R)],
                    ["norm_matmul_bwd_da", "norm_matmul_bwd_dx", "norm_matmul_fwd"]),
    "grouped_up": (lambda z, b: grouped.grouped_up(z, b), [(3, T, R), (3, R, D)],
                   ["grouped_gemm"] * 3),
    "concat_down": (lambda x, a1, a2: grouped.concat_down(x, [a1, a2]),
                    [(T, D), (D, R), (D, 24)], ["grouped_gemm"] * 3),
    # GQA (4 query heads on 2 key heads), 300 positions: the last tile is padded and masked
    "flash_attention": (lambda q, k, v: flash.flash_attention(q, k, v),
                        [(2, T, 4, 64), (2, T, 2, 64), (2, T, 2, 64)],
                        ["flash_attention_bwd", "flash_attention_fwd"]),
}


@pytest.mark.parametrize("sm", sorted(TARGETS))
@pytest.mark.parametrize("kernel", sorted(CASES))
def test_kernel_compiles_for_gpu(kernel, sm):
    fn, shapes, want = CASES[kernel]
    assert _triton_kernels(fn, shapes, sm) == want  # forward and backward kernels, as Triton


@pytest.mark.parametrize("sm", sorted(TARGETS))
def test_fp32_flash_with_wide_heads_fits_shared_memory(sm):
    """fp32 (the model's default dtype, which cuDNN does not take) with a head dim of 160,
    padded to 256: the backward's 64-row tiles asked 213 KB of an A100's 167 KB of shared memory
    and 295 KB of an H100's 232 KB; its tiles are halved (flash.bwd_tile)."""
    shapes = [(1, 100, 2, 160)] * 3
    fn = CASES["flash_attention"][0]
    assert _triton_kernels(fn, shapes, sm, dtype=jnp.float32) == \
        ["flash_attention_bwd", "flash_attention_fwd"]


def test_a_kernel_triton_rejects_fails_here():
    """The check can fail: a block that is no power of two does not compile for Triton."""

    def bad(x_ref, o_ref):
        o_ref[...] = x_ref[...] * 2

    def fn(x):
        return pl.pallas_call(bad, out_shape=jax.ShapeDtypeStruct((T, 3), BF),
                              grid=(T // 3,), in_specs=[pl.BlockSpec((3, 3), lambda i: (i, 0))],
                              out_specs=pl.BlockSpec((3, 3), lambda i: (i, 0)),
                              compiler_params=triton_params(), name="bad_block")(x)

    with pytest.raises(Exception, match="power of 2|power-of-2|power of two"):
        _triton_kernels(fn, [(T, 3)], "sm_80", backward=False)
