"""Every workaround for running on CPU (tests, laptops, the planner's simulated devices): what
each dodges, and how to tell when it can go. The analyzer's CPU corrections (reading compiled
HLO as a GPU would run it) are boost_jax/analysis/cpu_lowering.py.

1. check_vma / untyped_tp_grads — Pallas kernels in the interpreter (parallel.kernels=pallas
   without a GPU, btp only: the one layout that calls the kernels). JAX's Pallas interpreter
   cannot carry varying-axis (vma) types through its loops ("Scan carry input and output got
   mismatched varying manual axes"), so the step's shard_map runs with check_vma=False. JAX then
   differentiates each device's program as a plain SPMD function: the gradient is that of
   Σ_devices loss = t × (the loss, counted once per TP rank), and each TP rank's copy of a
   replicated weight gets its own share. untyped_tp_grads undoes both (divide by t; all-reduce
   the TP-replicated leaves over TP) — exact, only with more backward all-reduces than the
   typed program. Can go when `python -c` of a pallas_call(interpret=True) under
   jax.shard_map(check_vma=True) runs (tests/unit/test_pallas_btp.py would keep passing).
2. all_gather_bits / ppermute_bits / reshard_bits — XLA:CPU runs bf16/f16 collectives in f32 (convert →
   collective → convert), which doubles what a gather moves there. A gather is pure data
   movement, so moving the raw 16 bits as uint16 is exact and makes the CPU program move what a
   GPU would. Harmless elsewhere (the bitcasts are free). Can go when a bf16 all-gather in a
   CPU-compiled HLO is no longer wrapped in converts (tests/unit/test_plans_hlo.py checks the
   dtypes the gathers move).
3. fast_compile_options — XLA options for programs whose run time does not matter (init,
   tests): LLVM -O0 and the legacy fusion codegen. Can go when a tiny model's jit_init compiles
   as fast without them. dev_compile_options: the same under BOOST_JAX_FAST_COMPILE=1 only.
"""

from __future__ import annotations

import os
from typing import Optional

import jax
import jax.numpy as jnp

from boost_jax.compat import known_compile_options
from boost_jax.pallas import dispatch


def check_vma(cfg) -> bool:
    """False only where Pallas kernels run in the interpreter inside the TP step (1 above)."""
    return cfg.parallel.tp_mode != "btp" or dispatch.shard_map_check_vma(cfg.parallel.kernels)


def untyped_tp_grads(grads, layouts, tp_axes: tuple, tp_size: int):
    """The gradient of the loss from the untyped (check_vma=False) program's (1 above):
    `layouts` the grads' LeafLayouts, `tp_axes` the TP mesh axes, `tp_size` their size."""

    def one(lay, g):
        replicated = not any(a in tp_axes for tp in lay.tp for a in tp)
        return (jax.lax.psum(g, tp_axes) if replicated and tp_axes else g) / tp_size

    return jax.tree.map(one, layouts, grads, is_leaf=lambda x: hasattr(x, "padded"))


def _is16(x) -> bool:
    return x.dtype in (jnp.bfloat16, jnp.float16)


def all_gather_bits(x, axes, dim: int, to: str = "varying"):
    """Tiled all-gather inside shard_map that moves 16-bit floats as raw bits (2 above); `to`:
    the result's type over `axes` (jax.lax.all_gather's)."""
    return _as_bits(lambda v: jax.lax.all_gather(v, axes, axis=dim, tiled=True, to=to), x)


def ppermute_bits(x, axes, perm):
    """jax.lax.ppermute that moves 16-bit floats as raw bits (2 above)."""
    return _as_bits(lambda v: jax.lax.ppermute(v, axes, perm), x)


def _as_bits(move, x):
    """move(x), a 16-bit float moved as its raw uint16 bits (2 above)."""
    if not _is16(x):
        return move(x)
    return jax.lax.bitcast_convert_type(move(jax.lax.bitcast_convert_type(x, jnp.uint16)),
                                        x.dtype)


def reshard_bits(x, sharding, src=None):
    """with_sharding_constraint that moves 16-bit floats as raw 16-bit integers (2 above).

    `src` (x's sharding) pins the integer copy before the move; without it XLA's sharding
    propagation reshards the float input of the bitcast instead."""
    if _is16(x):
        u = jax.lax.bitcast_convert_type(x, jnp.uint16)
        if src is not None:
            u = jax.lax.with_sharding_constraint(u, src)
        u = jax.lax.with_sharding_constraint(u, sharding)
        return jax.lax.bitcast_convert_type(u, x.dtype)
    return jax.lax.with_sharding_constraint(x, sharding)


def fast_compile_options() -> dict:
    """XLA options for programs whose run time doesn't matter (init, tests). On CPU, LLVM -O0
    and the legacy fusion codegen cut compile time 4-8x (a tiny model's init: ~11 s → ~2 s).
    HLO passes still run, so cost_analysis() is unchanged."""
    if jax.default_backend() != "cpu":
        return {}
    return known_compile_options({"xla_backend_optimization_level": 0,
                                  "xla_llvm_disable_expensive_passes": True,
                                  "xla_cpu_use_fusion_emitters": False})


def dev_compile_options() -> Optional[dict]:
    """fast_compile_options() when BOOST_JAX_FAST_COMPILE is set and not 0 (development and
    tests on CPU: programs compile ~5x faster and run slower), else None: XLA's defaults."""
    if os.environ.get("BOOST_JAX_FAST_COMPILE", "") not in ("", "0"):
        return fast_compile_options() or None
    return None
