"""Placement plans: which mesh axes hold the batch, weights, gradients and optimizer state.

A plan maps roles to axes of the ("pair", "node", "global") mesh. Model code never sees this:
the training step asks the Placement for NamedShardings by role.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from boost_jax.errors import ConfigError
from boost_jax.mesh import AXES, axis_size


@dataclass
class Placement:
    mesh: Any
    plan: str
    batch_axes: tuple[str, ...]
    params_axes: tuple[str, ...]
    grads_axes: tuple[str, ...]
    opt_state_axes: tuple[str, ...]
    tp_axes: tuple[str, ...] = ()

    def batch_sharding(self) -> NamedSharding:
        return NamedSharding(self.mesh, P(self.batch_axes or None))

    def replicated(self) -> NamedSharding:
        return NamedSharding(self.mesh, P())

    def shardings(self, tree, axes: Sequence[str]):
        """NamedShardings for every array of `tree`, each sharded over `axes` along one dim."""
        return jax.tree.map(lambda x: NamedSharding(self.mesh, shard_spec(x.shape, axes, self.mesh)),
                            tree)

    def params_shardings(self, params):
        return self.shardings(params, self.params_axes)

    def grads_shardings(self, params):
        return self.shardings(params, self.grads_axes)

    def opt_state_shardings(self, opt_state):
        return self.shardings(opt_state, self.opt_state_axes)


def shard_spec(shape: Sequence[int], axes: Sequence[str], mesh) -> P:
    """Shard the largest dimension that divides by the axes' size; replicate if none does."""
    n = axis_size(mesh, axes)
    if n == 1 or not shape:
        return P()
    for dim in sorted(range(len(shape)), key=lambda i: -shape[i]):
        if shape[dim] % n == 0:
            spec = [None] * len(shape)
            spec[dim] = tuple(axes)
            return P(*spec)
    return P()


PRESETS = {
    # plan: (params, grads, opt_state) as subsets of the data-parallel axes
    "ddp": ((), (), ()),
}


def make_placement(cfg, mesh) -> Placement:
    par = cfg.parallel
    if par.plan not in PRESETS:
        raise ConfigError(f"parallel.plan={par.plan!r} is not available; choose one of {sorted(PRESETS)}")
    tp = tuple(par.tp_axes)
    dp = tuple(a for a in AXES if a not in tp)
    preset = PRESETS[par.plan]

    def pick(override, default):
        axes = tuple(override) if override is not None else tuple(default)
        clash = [a for a in axes if a in tp]
        if clash:
            raise ConfigError(f"axes {clash} are used for tensor parallelism and cannot also hold "
                              "data-parallel roles; remove them from the role override")
        return axes

    batch = pick(par.batch_axes, dp)
    pl = Placement(mesh, par.plan, batch, pick(par.params_axes, preset[0]),
                   pick(par.grads_axes, preset[1]), pick(par.opt_state_axes, preset[2]), tp)
    n_batch = axis_size(mesh, batch)
    micro = cfg.train.global_batch // cfg.train.micro_batches
    if micro % n_batch:
        raise ConfigError(
            f"micro-batch of {micro} sequences (train.global_batch/train.micro_batches) does not "
            f"divide over {n_batch} data-parallel devices; make it a multiple of {n_batch}")
    return pl


def bytes_of(tree) -> int:
    return int(sum(np.prod(x.shape) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree)))
