"""Pipeline stages: which layers and which weights each stage holds (parallel.pp_stages = P).

The mesh's hosts split into a `stage` axis and what stays of `global` (boost_jax/mesh.py), so
every plan and TP mode works inside a stage exactly as without stages. Layers split into P
contiguous runs of k = ceil(L/P): stage s holds layers [s·k, min((s+1)·k, L)); the stacked
block arrays are zero-padded to P·k layers (the padded layers are skipped: identity, zero
gradient) and their layer dim is sharded over `stage`. The embedding runs on the first stage,
the final norm, head and loss on the last; each of those weights is stored with a leading
stage dim of size P holding the real leaf at its owner's slot and zeros elsewhere, so it lives
only on its owner's devices and no collective outside the activation sends crosses stages.

Checkpoints keep this stored form; `restage` (boost_jax/checkpoints/restage.py) turns one stored
form into another, so a run saved with P stages resumes with any other P or none.
"""

from __future__ import annotations

import dataclasses
import math

from boost_jax.errors import ConfigError
from boost_jax.mesh import STAGE
from boost_jax.sharding.layout import LeafLayout

FIRST, LAST = "first", "last"
# the non-block weights and the stage that computes with them
ENDS = {"embed": FIRST, "final_norm": LAST, "lm_head": LAST}


def layers_per_stage(n_layers: int, stages: int, virtual: int = 1) -> int:
    """k: the layers of each of the stages·virtual chunks (the last may hold fewer); validated."""
    chunks = stages * virtual
    what = (f"parallel.pp_stages={stages}" if virtual == 1 else
            f"parallel.pp_stages={stages} x parallel.pp_virtual={virtual}")
    if chunks > n_layers:
        raise ConfigError(f"{what} is more stages than the model's {n_layers} layers "
                          f"(model.n_layers); use at most {n_layers} stages")
    k = math.ceil(n_layers / chunks)
    if (chunks - 1) * k >= n_layers:
        raise ConfigError(
            f"{what} splits {n_layers} layers into runs of {k}, which leaves stage "
            f"{chunks - 1} without a layer; choose stages so that "
            f"(stages-1)·ceil(layers/stages) < layers (e.g. a divisor of {n_layers})")
    return k


def validate(cfg) -> None:
    """One-line ConfigErrors for a pipeline the model or the run cannot take."""
    par, P = cfg.parallel, cfg.parallel.pp_stages
    if P == 1:
        return
    V = par.pp_virtual
    layers_per_stage(cfg.model.n_layers, P, V)
    if V > 1 and cfg.train.micro_batches % P:
        raise ConfigError(
            f"parallel.pp_virtual={V} runs micro-batches in groups of the {P} stages: "
            f"train.micro_batches={cfg.train.micro_batches} is not a multiple of "
            f"parallel.pp_stages={P}; set train.micro_batches to a multiple of {P}")
    if cfg.model.tie_embeddings:
        raise ConfigError(
            "model.tie_embeddings=true with parallel.pp_stages>1: the table would live on the "
            "first and the last stage and its gradient cross stages every step; set "
            "model.tie_embeddings=false")
    if not cfg.train.scan_layers:
        raise ConfigError("parallel.pp_stages>1 needs train.scan_layers=true (stages split "
                          "the stacked layer arrays); drop train.scan_layers=false")
    if par.pp_schedule == "1f1b" and cfg.train.micro_batches < P:
        raise ConfigError(
            f"parallel.pp_schedule=1f1b needs at least as many micro-batches as stages: "
            f"train.micro_batches={cfg.train.micro_batches} < parallel.pp_stages={P}; set "
            f"train.micro_batches>={P} or parallel.pp_schedule=gpipe")


def owner(end: str, stages: int) -> int:
    return 0 if ENDS[end] == FIRST else stages - 1


def stage_layout(path: tuple, lay: LeafLayout, n_layers: int, stages: int,
                 virtual: int = 1) -> LeafLayout:
    """The stored layout of one weight under `stages` stages (see the module docstring)."""
    if path and path[0] == "blocks":
        k = layers_per_stage(n_layers, stages, virtual)
        return dataclasses.replace(lay, padded=(k * stages * virtual, *lay.padded[1:]),
                                   tp=((STAGE,), *lay.tp[1:]),
                                   interleave=(stages, virtual) if virtual > 1 else None)
    return LeafLayout((stages, *lay.shape), (stages, *lay.padded),
                      None if lay.dim is None else lay.dim + 1, ((STAGE,), *lay.tp),
                      layer_axis=True, owner=owner(path[0], stages))


__all__ = ["ENDS", "layers_per_stage", "validate", "owner", "stage_layout"]
