"""The per-layer jax.checkpoint for each remat mode: the one place remat policies are built
(the single-device model and the sharded engine both take theirs from here)."""

from __future__ import annotations

from typing import Callable

import jax

from boost_jax.names import LATENT_NAME, REDUCED_NAME, RESIDUAL_NAME, SECONDARY_NAME


def remat_wrapper(remat: str, gathers: bool = False, prevent_cse: bool = False) -> Callable:
    """The per-layer jax.checkpoint for train.remat (none | full | lowrank).

    With gathered weights the gathered copy is never saved (backward re-fetches it), so
    remat="none" saves every matmul output plus the named values instead (weights are inputs
    of matmuls, never outputs). prevent_cse: jax.checkpoint's (True for the unscanned
    single-device model, whose layers are not inside a scan)."""
    cp = jax.checkpoint_policies
    saved = {"none": (LATENT_NAME, RESIDUAL_NAME, REDUCED_NAME), "full": (),
             "lowrank": (LATENT_NAME, RESIDUAL_NAME)}
    if remat not in saved:
        raise ValueError(f"train.remat={remat!r}; expected none, full or lowrank")
    names = saved[remat] + ((SECONDARY_NAME,) if gathers else ())
    if remat == "none":
        if not gathers:
            return lambda f: f
        policy = cp.save_from_both_policies(cp.dots_saveable, cp.save_only_these_names(*names))
    else:
        policy = cp.save_only_these_names(*names) if names else None
    return lambda f: jax.checkpoint(f, policy=policy, prevent_cse=prevent_cse)
