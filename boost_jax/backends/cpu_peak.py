"""The `cpu` topology's peak FLOP/s, measured: a short fp32 GEMM probe, cached per machine.

A fixed per-core guess made CPU MFU mean little; measured, it reads "fraction of this machine's
own GEMM rate". The host's rate is shared by the devices JAX simulates on it, so one device's
peak is the probe's rate / the devices sharing it: this process's for a run, a plan's own count
for the planner (which may simulate fewer or none). The probe (a few 512² matmuls, well under a
second) runs once per machine, platform, CPU model, JAX version and device count; its result is
kept in $XDG_CACHE_HOME/boost_jax/cpu_peak.json (default ~/.cache), but only when the cores
were not busy (1-minute load average below the core count): a probe beside other work reads a
fraction of the rate (a shared 2-core machine cached 81 GFLOP/s of its 317, and CPU MFU read
113%), so it is used by that run alone and the next one measures again. BOOST_JAX_CPU_PEAK_FLOPS
(per-device FLOP/s) skips the probe, e.g. for reproducible plans or tests.
"""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path

from boost_jax.errors import ConfigError

ENV = "BOOST_JAX_CPU_PEAK_FLOPS"
_N = 512  # large enough to reach the BLAS rate, small enough to stay under a second
_memo: dict[str, float] = {}


def cache_path() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "boost_jax" / "cpu_peak.json"


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_key() -> str:
    import jax

    return (f"{platform.system()}-{platform.machine()}|{_cpu_model()}|jax {jax.__version__}|"
            f"{jax.local_device_count()} devices|{os.cpu_count()} cores|quiet probe")


def measure_gemm_flops(n: int = _N, rounds: int = 5) -> float:
    """FLOP/s of the fastest of `rounds` timed batches of jitted fp32 n×n matmuls on one device
    (XLA:CPU runs one matmul on all cores). The best round shrugs off other load."""
    import jax
    import jax.numpy as jnp

    k = 4  # matmuls per batch: one dispatch amortised over several GEMMs
    a = jax.random.normal(jax.random.key(0), (k, n, n), jnp.float32)
    f = jax.jit(lambda x: jnp.einsum("bij,bjk->bik", x, x))
    f(a).block_until_ready()  # compile and warm up
    best = float("inf")
    for _ in range(rounds):
        t = time.perf_counter()
        f(a).block_until_ready()
        best = min(best, time.perf_counter() - t)
    return 2.0 * k * n ** 3 / best


def _read_cache(path: Path) -> dict:
    try:
        d = json.loads(path.read_text())
        return d if isinstance(d, dict) else {}
    except (OSError, ValueError, RecursionError):
        return {}  # missing or damaged: measure again


def _busy() -> bool:
    """Were the cores taken by other work (a load average of at least one per core)? A platform
    without a load average (Windows) says no."""
    try:
        return os.getloadavg()[0] >= (os.cpu_count() or 1)
    except (AttributeError, OSError):
        return False


def host_gemm_flops() -> float:
    """This machine's GEMM FLOP/s: from the cache, else measured and cached."""
    key = machine_key()
    if key in _memo:
        return _memo[key]
    path = cache_path()
    cached = _read_cache(path).get(key)
    if isinstance(cached, (int, float)) and cached > 0:
        _memo[key] = float(cached)
        return _memo[key]
    rate = measure_gemm_flops()
    _memo[key] = rate
    if _busy():
        return rate  # other work shared the cores: not a figure to keep
    try:  # re-read: another process may have written its own machine's entry meanwhile
        path.parent.mkdir(parents=True, exist_ok=True)
        d = _read_cache(path)
        d[key] = rate
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(d, indent=1, sort_keys=True))
        os.replace(tmp, path)
    except OSError:
        pass  # a read-only home still gets the measured figure, just not cached
    _memo[key] = rate
    return rate


def cpu_peak_flops(devices: int | None = None) -> float:
    """Peak FLOP/s of one simulated CPU device when `devices` share this host (default: this
    process's local devices)."""
    v = os.environ.get(ENV)
    if v:
        try:
            peak = float(v)
        except ValueError:
            peak = -1.0
        if not 0 < peak < float("inf"):
            raise ConfigError(f"{ENV}={v!r} is not a positive number of FLOP/s per device; "
                              f"set it to e.g. 5e10 or unset it to measure this machine")
        return peak
    import jax

    return host_gemm_flops() / max(1, devices or jax.local_device_count())
