"""boost_jax: pre-training low-rank bottleneck LLMs on many accelerators (README.md)."""

from boost_jax.backends.cuda_plugin import quiet_without_gpu as _quiet_without_gpu

_quiet_without_gpu()  # every command imports this first, before JAX starts
