"""The parallel layout: how one run is cut over its mesh, checked once and resolved into one value.

    check(cfg, mesh)                          every check a parallel layout must pass, as a
                                              one-line ConfigError (the parallel section,
                                              pipeline stages, TP cut): the only caller of
                                              stages.validate and tp.specs.validate_tp
    resolve(cfg, mesh, abstract_params)       check, then the ParallelLayout
    resolve_layers(cfg, mesh)                 the same for the decoder stack alone (no placement)

A ParallelLayout holds what the step's engine needs that a Config would otherwise give: the model
config, the mesh, the Placement (roles → axes, per-leaf layouts) and with it the step's
data-parallel collectives (`collectives()`), the TP context (None without TP), the remat mode,
the pipeline's Schedule (None without a `stage` mesh axis), micro-batches and whether the step's
shard_map is typed (check_vma, backends/cpu.py). step/build.py resolves
it once and hands it to the engine (step/engine.py), which hands the pipeline
(step/pipeline.py) its schedule and the stage-forward pieces; neither sees the Config. The
planner (plan/search.py) and the launcher (launch/slurm.py) call `check` alone on a stand-in
mesh; analysis/tp_layers.py takes `resolve_layers`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

from boost_jax.backends.cpu import check_vma
from boost_jax.layers import forward
from boost_jax.layers.forward import remat_wrapper
from boost_jax.mesh import STAGE
from boost_jax.sharding import stages, step_collectives
from boost_jax.sharding.placement import Placement, make_placement
from boost_jax.sharding.stages import Schedule
from boost_jax.sharding.tp.common import TPContext, make_context
from boost_jax.sharding.tp.specs import MODES, validate_tp


def check(cfg, mesh) -> None:
    """Raise a one-line ConfigError if the model or the run can't take the parallel layout:
    the parallel section on its own (the same check config loading runs, so a config edited
    after loading is caught too), the pipeline split, then the TP cut. `mesh` may be a
    stand-in carrying only axis names and sizes (plan/costmodel.SizesMesh)."""
    cfg.parallel.validate()
    stages.validate(cfg)
    validate_tp(cfg, mesh)


@dataclass(frozen=True)
class ParallelLayout:
    model: Any  # ModelConfig
    mesh: Any
    placement: Optional[Placement]  # None: the decoder stack alone (resolve_layers)
    tp: Optional[TPContext]  # None: tp_mode none
    remat: str  # train.remat
    scan_layers: bool  # train.scan_layers: False, a Python loop of layers (prevent_cse below)
    pipeline: Optional[Schedule]  # the step's (sharding/stages.py); None: no `stage` axis of 2+
    micro_batches: int
    check_vma: bool  # the step's shard_map's (False only for interpreted kernels)

    def ops(self, fetch: Optional[Callable] = None):
        """The forward's ops (layers/forward.py): single-device, or the TP layout's; `fetch`
        gets the weights (None: already whole)."""
        if self.tp is None:
            return forward.Local(self.model, fetch)
        return MODES[self.tp.mode](self.tp, fetch)

    def collectives(self) -> list:
        """Every data-parallel collective of one optimizer step (sharding/step_collectives.py)."""
        passes = step_collectives.Passes.of(self.micro_batches, self.pipeline)
        return step_collectives.step_collectives(self.placement, passes, self.model.tie_embeddings)

    def checkpoint(self, gathers: bool) -> Callable:
        """The per-layer remat wrapper (layers/forward.remat_wrapper); `gathers`: weights are
        gathered. Unscanned layers need prevent_cse: else XLA merges each layer's backward
        replay, gathers included, with its forward, and every layer's gathered weights and
        activations stay alive until the backward (3x the temp memory of a small zero3 step
        compiled for an A100, tests/unit/test_gpu_compile.py)."""
        return remat_wrapper(self.remat, gathers, prevent_cse=not self.scan_layers)


def _layout(cfg, mesh, placement: Optional[Placement]) -> ParallelLayout:
    par = cfg.parallel
    micro = cfg.train.micro_batches
    pipeline = Schedule.of(par, micro, int(mesh.shape[STAGE])) if STAGE in mesh.shape else None
    return ParallelLayout(
        model=cfg.model, mesh=mesh, placement=placement,
        tp=make_context(cfg, mesh) if par.tp_mode != "none" else None,
        remat=cfg.train.remat, scan_layers=cfg.train.scan_layers, pipeline=pipeline,
        micro_batches=micro,
        check_vma=check_vma(cfg))


def resolve(cfg, mesh, abstract_params=None) -> ParallelLayout:
    """`check`, then the layout; with `abstract_params` (pure dict of shapes) its placement
    carries the per-leaf layouts the engine needs."""
    check(cfg, mesh)
    return _layout(cfg, mesh, make_placement(cfg, mesh, abstract_params))


def resolve_layers(cfg, mesh) -> ParallelLayout:
    """`check`, then the layout of the decoder stack alone (analysis/tp_layers.py): no placement,
    no weight gathers."""
    check(cfg, mesh)
    return _layout(cfg, mesh, None)


__all__ = ["check", "resolve", "resolve_layers", "ParallelLayout"]
