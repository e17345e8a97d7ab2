"""Test setup: 8 simulated CPU devices, set before JAX initialises."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags:
    os.environ["XLA_FLAGS"] = (_flags + " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

# XLA:CPU fast-compile options for the training loop (tests are compile-bound); subprocesses
# started by tests inherit it.
os.environ.setdefault("BOOST_JAX_FAST_COMPILE", "1")
