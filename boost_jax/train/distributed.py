"""Multi-process start-up through jax.distributed (explicit, SLURM, Open MPI or env-configured)."""

from __future__ import annotations

import os

from boost_jax.config import Config
from boost_jax.errors import UserError

_ENV_HINTS = ("JAX_COORDINATOR_ADDRESS", "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE")


def _launched_multi() -> bool:
    if os.environ.get("JAX_COORDINATOR_ADDRESS"):
        return True
    for var in ("SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE"):
        if int(os.environ.get(var, "1") or 1) > 1:
            return True
    return False


def maybe_initialize(cfg: Config) -> None:
    import jax

    d = cfg.distributed
    if d.mode == "off" or jax.distributed.is_initialized():
        return
    if d.mode == "explicit":
        if not (d.coordinator and d.num_processes and d.process_id is not None):
            raise UserError("distributed.mode=explicit needs distributed.coordinator=HOST:PORT, "
                            "distributed.num_processes and distributed.process_id")
        jax.distributed.initialize(d.coordinator, num_processes=d.num_processes,
                                   process_id=d.process_id)
    elif _launched_multi():
        # SLURM / Open MPI / JAX_* environment variables are auto-detected by JAX itself.
        jax.distributed.initialize()
