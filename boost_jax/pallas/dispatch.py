"""Pick Pallas kernels or their XLA twins: the `parallel.kernels` setting (auto | pallas | xla).

resolve(kind) -> "pallas" | "xla":
  auto   -> xla everywhere. Measured on an H200 (benchmarks/README.md §7), the XLA twins train
            a CoLA-1B BTP step faster than these kernels in both runs (612 ms against 889 ms,
            then 242 ms against 5.5 s once both were handed bf16 weights), and are as fast or
            faster kernel by kernel but for the norm alone; `pallas` stays a choice, tested on
            every backend.
  pallas -> pallas; on CPU the same kernels run with interpret=True (slow, for tests);
            on TPU it is an error (these are Triton kernels).
  xla    -> pure jnp references (same math, same signatures).
Every public function here takes impl = auto|pallas|xla and resolves it at trace time.

Inside jax.shard_map (what the caller must do):
  * GPU (compiled Triton): nothing. check_vma=True works: operands are pcast to one common
    varying set and kernel outputs declare it, so replicated weights get psum'd grads.
  * CPU interpret mode (resolve(...) == "pallas" and interpret_mode()): JAX's Pallas
    interpreter cannot carry varying-axis types through the kernel's loops, so the enclosing
    shard_map needs check_vma=False. Use `shard_map_check_vma(kind)` to pick the flag. With
    check_vma=False, collectives in reduce_fn (psum) still differentiate correctly for
    replicated outputs (out_specs=P()) — tests/unit/test_pallas.py checks this on 4 devices, and
    tests/unit/test_pallas_btp.py a whole BTP training run (the step's shard_map, manual over every
    axis; boost_jax/backends/cpu.py recovers the gradient) against kernels=xla.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Optional, Sequence

import jax

from boost_jax.errors import ConfigError
from boost_jax.pallas import grouped, layernorm, rmsnorm

KINDS = ("auto", "pallas", "xla")


_TARGET: list[str] = []  # platforms being compiled for (compile_target), innermost last


@contextlib.contextmanager
def compile_target(platform: str):
    """Pick kernels for `platform` rather than the running backend: the planner compiles the
    step for compile-only GPU devices (--gpu-compile) in a process that runs on the CPU."""
    _TARGET.append(platform)
    try:
        yield
    finally:
        _TARGET.pop()


def platform() -> str:
    """'cuda' | 'rocm' | 'cpu' | 'tpu' | … for the default backend (or the compile target)."""
    if _TARGET:
        return _TARGET[-1]
    backend = jax.default_backend()
    if backend == "gpu":
        dev = jax.devices()[0]
        version = getattr(dev.client, "platform_version", "").lower()
        return "rocm" if ("rocm" in version or "hip" in version) else "cuda"
    return backend


_platform = platform


def resolve(kind: str = "auto") -> str:
    if kind not in KINDS:
        raise ConfigError(f"parallel.kernels={kind!r}; choose one of {list(KINDS)}")
    plat = platform()
    if kind == "auto":
        return "xla"
    if kind == "pallas" and plat == "tpu":
        raise ConfigError("parallel.kernels=pallas: these are Triton (GPU) kernels and do not "
                          "run on TPU; use parallel.kernels=xla or auto")
    return kind


def interpret_mode() -> bool:
    """True where Pallas kernels must run in the interpreter (no GPU)."""
    return platform() not in ("cuda", "rocm")


def shard_map_check_vma(kind: str = "auto") -> bool:
    """The check_vma value an enclosing jax.shard_map must use for these kernels."""
    return not (resolve(kind) == "pallas" and interpret_mode())


def _pick(impl: str):
    r = resolve(impl)
    return r == "pallas", (r == "pallas" and interpret_mode())


def online_rmsnorm(x, gamma, eps: float = 1e-6, impl: str = "auto"):
    """Local part of Online-RMSNorm: -> (x̂ [..., d_i], s [...] fp32, rms [...] fp32)."""
    use, interp = _pick(impl)
    fn = rmsnorm.local_rmsnorm if use else rmsnorm.local_rmsnorm_ref
    return fn(x, gamma, eps, interpret=interp)


def online_rmsnorm_matmul(x_local, gamma_local, a_local, d_global: int, eps: float = 1e-6,
                          reduce_fn: Optional[Callable] = None, impl: str = "auto", *,
                          comm_dtype=None, out_dtype=None):
    """RMSNorm(x)·γ @ A for d-sharded x with one reduction of [U | S]; see rmsnorm.py."""
    use, interp = _pick(impl)
    return rmsnorm.online_rmsnorm_matmul(
        x_local, gamma_local, a_local, d_global, eps, reduce_fn,
        impl="pallas" if use else "xla", interpret=interp, comm_dtype=comm_dtype,
        out_dtype=out_dtype)


def online_layernorm_matmul(x_local, gamma_local, beta_local, a_local, d_global: int,
                            eps: float = 1e-5, reduce_fn: Optional[Callable] = None, rank=0,
                            t: int = 1, impl: str = "auto", *, out_dtype=None):
    """LayerNorm(x)·A for d-sharded x with one reduction; see layernorm.py."""
    use, interp = _pick(impl)
    return layernorm.online_layernorm_matmul(
        x_local, gamma_local, beta_local, a_local, d_global, eps, reduce_fn, rank, t,
        impl="pallas" if use else "xla", interpret=interp, out_dtype=out_dtype)


def grouped_up(z, b, impl: str = "auto"):
    """z [G, ..., r] × B [G, r, n] -> [G, ..., n]; B as a list of [r, n_g] -> list (GQA)."""
    use, interp = _pick(impl)
    return (grouped.grouped_up if use else grouped.grouped_up_ref)(z, b, interpret=interp)


def concat_down(x, a_list, impl: str = "auto", sizes: Optional[Sequence[int]] = None):
    """x [..., d] @ [A_1|A_2|…] as one GEMM -> list of [..., r_k]."""
    use, interp = _pick(impl)
    fn = grouped.concat_down if use else grouped.concat_down_ref
    return fn(x, a_list, sizes, interpret=interp)


def norm_matmul(x, gamma, a, impl: str = "auto", out_dtype=None):
    """Fused local norm + down-projection payload [..., r+1] = [(x⊙γ)@A | Σx²]."""
    use, interp = _pick(impl)
    if use:
        return grouped.norm_matmul(x, gamma, a, out_dtype=out_dtype, interpret=interp)
    return rmsnorm.norm_matmul_ref(x, gamma, a, out_dtype=out_dtype)
