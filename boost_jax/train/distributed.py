"""Multi-process start-up through jax.distributed: explicit config, launcher env, SLURM, Open MPI.

Where the processes come from, in order (``distributed.mode=auto``):

1. ``JAX_COORDINATOR_ADDRESS`` + ``JAX_NUM_PROCESSES`` + ``JAX_PROCESS_ID`` in the environment
   (what ``scripts/launch_local.py`` sets; the same names torchrun-style launchers can export);
2. SLURM (``SLURM_NTASKS`` > 1): JAX's own SLURM detection picks the coordinator (first node of
   the step) and the rank, unless ``distributed.coordinator`` names one;
3. Open MPI (``OMPI_COMM_WORLD_SIZE`` > 1): rank and size from Open MPI's variables; the
   coordinator from ``distributed.coordinator`` / ``JAX_COORDINATOR_ADDRESS`` or, under
   Open MPI 4 (ORTE), JAX's own detection;
4. ``JAX_COORDINATOR_ADDRESS`` alone: JAX's own cluster detection (Kubernetes, TPU, ...);
5. otherwise a single process and no jax.distributed at all.

``distributed.mode=explicit`` takes coordinator, num_processes and process_id from the config
(process_id may come from the environment, as launchers set one rank per process);
``distributed.mode=off`` never initialises.

Order matters: jax.distributed must start before JAX creates its backends, and the per-process
CPU device count (``--cpu-devices`` / ``distributed.local_cpu_devices``) must be set before the
backends too. :func:`setup` does both, in that order, before anything touches a device. On CPU
the cross-process collectives use gloo (JAX's default on this version; set explicitly here).
"""

from __future__ import annotations

import contextlib
import errno
import os
import socket
import sys
import threading
import time
from dataclasses import dataclass
from typing import Mapping, Optional

from boost_jax.config import MAX_TIMEOUT_S, Config
from boost_jax.errors import UserError


@dataclass(frozen=True)
class Launch:
    """How to call jax.distributed.initialize; None fields are left to JAX's cluster detection."""

    coordinator: Optional[str]
    num_processes: Optional[int]
    process_id: Optional[int]
    source: str  # config | env | slurm | openmpi


def _env_int(env: Mapping[str, str], name: str) -> Optional[int]:
    raw = env.get(name)
    if raw is None or raw == "":
        return None
    try:
        return int(raw)
    except ValueError:
        raise UserError(f"environment variable {name}={raw!r} must be an integer") from None


def _check_coordinator(addr: str, where: str) -> str:
    host, sep, port = addr.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise UserError(f"{where}={addr!r} must look like HOST:PORT, e.g. 10.0.0.1:12345")
    return addr


def _checked(launch: Launch) -> Launch:
    n, pid = launch.num_processes, launch.process_id
    if n is not None and n < 1:
        raise UserError(f"num_processes={n} ({launch.source}) must be >= 1")
    if n is not None and pid is not None and not 0 <= pid < n:
        raise UserError(f"process_id={pid} ({launch.source}) must be in 0..{n - 1}")
    return launch


def resolve(cfg: Config, env: Optional[Mapping[str, str]] = None) -> Optional[Launch]:
    """Decide whether and how to start jax.distributed (pure: reads only `cfg` and `env`)."""
    env = os.environ if env is None else env
    d = cfg.distributed
    if d.mode == "off":
        return None
    if d.mode == "explicit":
        pid = d.process_id if d.process_id is not None else _env_int(env, "JAX_PROCESS_ID")
        missing = [k for k, v in (("distributed.coordinator", d.coordinator),
                                  ("distributed.num_processes", d.num_processes),
                                  ("distributed.process_id", pid)) if v is None]
        if missing:
            raise UserError(f"distributed.mode=explicit needs {', '.join(missing)} "
                            "(e.g. distributed.coordinator=HOST:PORT distributed.num_processes=2 "
                            "distributed.process_id=0)")
        return _checked(Launch(_check_coordinator(d.coordinator, "distributed.coordinator"),
                               d.num_processes, pid, "config"))

    coord = d.coordinator or env.get("JAX_COORDINATOR_ADDRESS") or None
    where = "distributed.coordinator" if d.coordinator else "JAX_COORDINATOR_ADDRESS"
    n, pid = _env_int(env, "JAX_NUM_PROCESSES"), _env_int(env, "JAX_PROCESS_ID")
    if n is not None or pid is not None:
        if coord is None or n is None or pid is None:
            raise UserError("JAX_NUM_PROCESSES / JAX_PROCESS_ID are set but not all of "
                            "JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and JAX_PROCESS_ID are")
        if n == 1:
            if pid != 0:
                raise UserError(f"JAX_PROCESS_ID={pid} with JAX_NUM_PROCESSES=1; the only "
                                "process is 0")
            return None
        return _checked(Launch(_check_coordinator(coord, where), n, pid, "env"))

    slurm_n = _env_int(env, "SLURM_STEP_NUM_TASKS") or _env_int(env, "SLURM_NTASKS")
    if slurm_n is not None and slurm_n > 1:
        return _slurm(env, slurm_n, coord, where)

    ompi_n = _env_int(env, "OMPI_COMM_WORLD_SIZE")
    if ompi_n is not None and ompi_n > 1:
        if coord is not None:
            return _checked(Launch(_check_coordinator(coord, where), ompi_n,
                                   _env_int(env, "OMPI_COMM_WORLD_RANK"), "openmpi"))
        if "OMPI_MCA_orte_hnp_uri" in env:  # Open MPI 4: JAX finds the coordinator itself
            return Launch(None, None, None, "openmpi")
        raise UserError(f"Open MPI started {ompi_n} processes but no coordinator is known; set "
                        "distributed.coordinator=HOST:PORT (rank 0's host) or "
                        "JAX_COORDINATOR_ADDRESS")

    if coord is not None and d.coordinator:
        raise UserError("distributed.coordinator is set but the process count and rank are "
                        "unknown; use distributed.mode=explicit with distributed.num_processes "
                        "and distributed.process_id, or launch under SLURM / Open MPI")
    if coord is not None:  # JAX_COORDINATOR_ADDRESS alone: let JAX's cluster detection try
        return Launch(None, None, None, "env")
    return None


def _slurm(env: Mapping[str, str], n: int, coord: Optional[str], where: str) -> Launch:
    """A SLURM step of n tasks: the coordinator given, or found by JAX's SLURM detection."""
    if coord is not None:
        return _checked(Launch(_check_coordinator(coord, where), n,
                               _env_int(env, "SLURM_PROCID"), "slurm"))
    if not env.get("SLURM_JOB_ID"):  # what JAX's SLURM detection looks for
        raise UserError(f"SLURM_NTASKS={n} is set but SLURM_JOB_ID is not, so the coordinator "
                        "cannot be found; start every process with srun inside the job, or set "
                        "distributed.mode=off for one process")
    return Launch(None, None, None, "slurm")


def setup(cfg: Config, cpu_devices: Optional[int] = None) -> Optional[Launch]:
    """Start jax.distributed if this is a multi-process launch, then set the CPU device count.

    Must run before anything creates a JAX backend (device queries, arrays, jit calls).
    Returns the Launch used, or None for a single process.
    """
    if cpu_devices is not None and cpu_devices < 1:
        raise UserError(f"--cpu-devices {cpu_devices} must be >= 1")
    launch = _start(cfg)
    n = cpu_devices or cfg.distributed.local_cpu_devices
    if n:
        from boost_jax.mesh import set_cpu_devices

        set_cpu_devices(n, "--cpu-devices" if cpu_devices else
                        "distributed.local_cpu_devices=")
    return launch


def _unreachable(addr: str, timeout_s: float) -> Optional[str]:
    """Why nothing answers at the coordinator's address within timeout_s, else None. XLA's
    client aborts the whole process (no Python exception) when it cannot reach the coordinator,
    so the other ranks look first; rank 0 may still be starting, hence the retries."""
    host, _, port = addr.rpartition(":")
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection((host.strip("[]"), int(port)), timeout=2.0).close()
            return None
        except OSError as e:
            if time.monotonic() >= deadline:
                return f"nothing answers at {addr} after {timeout_s:g} s ({e.strerror or e})"
            time.sleep(0.2)


def _start(cfg: Config) -> Optional[Launch]:
    import jax

    launch = resolve(cfg)
    if launch is not None and not jax.distributed.is_initialized():
        try:
            # gloo is this JAX's default for CPU collectives; pin it so an environment that
            # changed the default still gets working cross-process collectives.
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
        except Exception:  # noqa: BLE001 - option absent on other JAX versions
            pass
        # XLA's own limit past ours: the watchdog ends a start-up at init_timeout_s, in one
        # line, before XLA aborts (its abort comes a few seconds after its limit)
        kwargs = {"initialization_timeout": min(cfg.distributed.init_timeout_s + XLA_MARGIN_S,
                                                MAX_TIMEOUT_S)}
        if launch.coordinator is not None:
            kwargs.update(coordinator_address=launch.coordinator,
                          num_processes=launch.num_processes, process_id=launch.process_id)
        how = (f"coordinator {launch.coordinator}, {launch.num_processes} processes, this is "
               f"process {launch.process_id}" if launch.coordinator else f"{launch.source} "
               "auto-detection")
        timeout = cfg.distributed.init_timeout_s
        if launch.process_id == 0:
            _refuse_taken_port(launch.coordinator, how)
        try:
            why = (_unreachable(launch.coordinator, timeout)
                   if launch.coordinator and launch.process_id else None)
            if why is None:
                with _watchdog(timeout, how):
                    jax.distributed.initialize(**kwargs)
        except Exception as e:  # noqa: BLE001 - RuntimeError / ValueError / XlaRuntimeError
            why = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
        if why is not None:
            raise UserError(f"jax.distributed.initialize failed ({how}): {why}; "
                            f"{DETECTED_FIX if launch.coordinator is None else FIX}")
    return launch


FIX = "check that every process was started and can reach the coordinator"
XLA_MARGIN_S = 30
# JAX's own cluster detection found no coordinator, process count or rank
DETECTED_FIX = ("set JAX_NUM_PROCESSES and JAX_PROCESS_ID beside JAX_COORDINATOR_ADDRESS (or "
                "start the processes with srun / mpirun), or distributed.mode=off for one "
                "process")


def _refuse_taken_port(addr: Optional[str], how: str) -> None:
    """Process 0 serves the coordinator at `addr`: refuse a port taken on this host, where
    XLA's service would crash the process (no Python error)."""
    addr = os.environ.get("JAX_COORDINATOR_BIND_ADDRESS") or addr  # what JAX binds, if set
    if addr is None:
        return
    port = addr.rpartition(":")[2]
    if not port.isdigit():
        return  # JAX's own error names it
    port = int(port)
    with socket.socket(socket.AF_INET) as s:  # 0.0.0.0 clashes with a dual-stack listener too
        # a socket in TIME_WAIT (a run that just ended) is no obstacle: only a listener is
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("", port))
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise UserError(f"jax.distributed cannot start ({how}): port {port} is taken on "
                                "this host, where process 0 serves the coordinator (another "
                                "run's?); choose another port for every process") from None


@contextlib.contextmanager
def _watchdog(timeout_s: float, how: str):
    """XLA aborts the process (SIGABRT, a C++ stack) when start-up times out, a process
    missing: this ends it first, in one line, exit code 2."""
    def fire():
        sys.stderr.write(f"error: jax.distributed.initialize did not finish within "
                         f"{timeout_s:g} s ({how}): a process is missing or cannot reach the "
                         f"coordinator; {FIX}, or raise distributed.init_timeout_s\n")
        sys.stderr.flush()
        os._exit(2)

    timer = threading.Timer(timeout_s, fire)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


def maybe_initialize(cfg: Config) -> None:
    """Start jax.distributed if the config / environment asks for it (no-op if already started).

    Kept for callers that do not go through train.py; a process whose JAX backend is already up
    cannot join a distributed run any more (jax.distributed raises, reported as a UserError).
    """
    _start(cfg)
