"""Differences between the JAX releases the project runs on (0.10.2 here, 0.11.2 on the lent
GPU image), kept in one place so the callers read as if there were one JAX."""

from __future__ import annotations

import functools

import jax


@functools.cache
def _xla_option_known(name: str, value) -> bool:
    """Whether this jaxlib's XLA accepts the compile option (0.11 dropped some CPU flags,
    e.g. xla_cpu_use_fusion_emitters; an unknown one fails the whole compile)."""
    try:
        jax.jit(lambda x: x + 1).lower(0.0).compile(compiler_options={name: value})
    except jax.errors.JaxRuntimeError as e:
        if "No such compile option" in str(e):
            return False
        raise
    return True


def known_compile_options(options: dict) -> dict:
    """`options` less those this XLA does not know: for speed-only options (fast CPU compile),
    where an option the running XLA dropped must not stop the program."""
    return {k: v for k, v in options.items() if _xla_option_known(k, v)}


def cpu_collectives_need_one_order() -> bool:
    """Whether simulated CPU devices that run collectives need XLA:CPU's concurrency-optimized
    scheduler off. Under it JAX 0.11 lets the devices take independent collectives in
    different orders and aborts on the rendezvous timeout (a pipeline send beside a TP
    all-gather, tests/unit/test_pipeline.py); 0.10 runs them in one order. Only 0.11 turns it
    off: the schedule sets the compiled temporaries the planner and the benchmarks report.
    A later release is to be checked again (an XLA without the flag refuses XLA_FLAGS)."""
    return (0, 11) <= jax.__version_info__ < (0, 12)
