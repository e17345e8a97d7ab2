"""The compiled training step: placement by plan, micro-batch accumulation, clipping, optimizer.

State is a plain pytree (orbax and optax see ordinary arrays), each array stored in the plan's
layout (boost_jax.sharding.placement: one dim sharded, padded with zeros at its end when it
does not divide — `bundle.placement.layouts` says which):

    {"step":      int32, replicated
     "params":    working weights, model.param_dtype, sharded over the plan's params axes
                  (over its opt_state axes with a deferred update: Placement.stored_axes)
     "master":    fp32 master weights over opt_state axes (only when param_dtype=bfloat16)
     "opt_state": the optax state; param-shaped moments over opt_state axes, the rest
                  (counters, Adafactor's factored statistics) replicated}
One optimizer step, top to bottom in step_fn:
    1. loss and gradient: boost_jax.step.engine (one shard_map over every mesh axis: the
       micro-batch loop, per-layer weight gathers, TP collectives, the gradient reduce-scattered
       into the grads sharding each micro-batch in grad_accum_dtype and reduced over the
       remaining batch axes once, straight into the opt_state sharding)
    2. clip by global norm
    3. the optimizer (optim.name, step/optim.py) on the fp32 master shard (opt_state sharding)
    4. the new working weights gathered back in stages (opt_state → grads → params sharding),
       so the cross-node part moves only the node's shard — or, with parallel.defer_update,
       stored cast on the opt_state shard: the next step's first micro-batch gathers each
       layer just before use (step/engine.py), behind the previous layer's compute
2 and 4 run in two levels under parallel.collectives two_level / auto (sharding/step_two_level.py).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import NamedSharding

from boost_jax.backends.cpu import dev_compile_options, fast_compile_options, reshard_bits
from boost_jax.config import ModelConfig, OptimConfig, TrainConfig
from boost_jax.sharding.layout import is_layout, pad_tree, unpad_tree
from boost_jax.sharding import parallel
from boost_jax.sharding import step_two_level
from boost_jax.sharding.placement import Placement
from boost_jax.step.engine import Engine
from boost_jax.step.optim import check_factoring, lr_schedule, make_optimizer, update_count


def model_factory(model: ModelConfig, train: TrainConfig) -> Callable[[], nnx.Module]:
    """() -> the model, built in place (traceable: usable under jit and nnx.eval_shape);
    `train` gives the seed, remat and scan_layers."""
    from boost_jax.layers.model import CausalLM

    def make():
        model.validate()
        return CausalLM(model, rngs=nnx.Rngs(train.seed), remat=train.remat,
                        scan_layers=train.scan_layers)

    return make


def abstract_params(model: ModelConfig, train: TrainConfig):
    """(graphdef, params as a pure dict of ShapeDtypeStruct) without allocating anything."""
    module = nnx.eval_shape(model_factory(model, train))
    graphdef, params = nnx.split(module, nnx.Param)
    return graphdef, nnx.to_pure_dict(params)


@dataclass
class StepBundle:
    model: ModelConfig
    train: TrainConfig
    seq_len: int  # data.seq_len: the batch's sequence length
    mesh: Any
    placement: Placement
    engine: Engine
    tx: optax.GradientTransformation
    abstract_state: Any  # ShapeDtypeStructs with shardings (stored, possibly padded shapes)
    state_shardings: Any
    batch_sharding: NamedSharding
    train_step: Callable  # (state, batch) -> (state, metrics)
    eval_step: Callable  # (state["params"], batch) -> loss
    init_state: Callable  # () -> state, sharded
    n_params: int  # logical parameter count (without padding)

    def abstract_batch(self, batch_size: int | None = None):
        b = batch_size or self.train.global_batch
        spec = jax.ShapeDtypeStruct((b, self.seq_len), jnp.int32, sharding=self.batch_sharding)
        return {"inputs": spec, "targets": spec}

    def eval_params(self, state):
        """What eval_step takes: the stored working weights."""
        return state["params"]

    def logical_params(self, state):
        """Unpadded working weights (a jitted slice; for export and inspection)."""
        return jax.jit(lambda p: unpad_tree(self.placement.layouts, p),
                       compiler_options=dev_compile_options())(state["params"])


def constrain_tree(tree, shardings):
    return jax.tree.map(jax.lax.with_sharding_constraint, tree, shardings)


def state_layout(pl: Placement, tx, pdtype):
    """(abstract state with shardings, state shardings) of the plan (see the module docstring)."""
    lay = pl.layouts
    stored = jax.tree.map(lambda l: jax.ShapeDtypeStruct(l.padded, pdtype), lay, is_leaf=is_layout)
    stored32 = jax.tree.map(lambda l: jax.ShapeDtypeStruct(l.padded, jnp.float32), lay,
                            is_leaf=is_layout)
    abs_opt = jax.eval_shape(tx.init, stored32)
    state_sh = {"step": pl.replicated(), "params": pl.stored_shardings(),
                "opt_state": pl.opt_state_shardings(abs_opt)}
    abs_tree = {"step": jax.ShapeDtypeStruct((), jnp.int32), "params": stored,
                "opt_state": abs_opt}
    if pdtype != jnp.float32:  # bf16 working weights + fp32 master copy
        state_sh["master"] = pl.master_shardings()
        abs_tree["master"] = stored32
    abstract = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                            abs_tree, state_sh)
    return abstract, state_sh


def make_step_fn(train: TrainConfig, optim: OptimConfig, pl: Placement, engine: Engine,
                 tx) -> Callable:
    """(state, batch) -> (state, metrics): one optimizer step, top to bottom."""
    pdtype = jnp.dtype(pl.param_dtype)
    mixed = pdtype != jnp.float32
    params_sh, grads_sh, master_sh = (pl.params_shardings(), pl.grads_shardings(),
                                      pl.master_shardings())
    grads_fn = engine.grads_fn(train.micro_batches)
    schedule, clip = lr_schedule(optim, train.steps), optim.clip_norm
    grads_stage = pl.update_via_grads
    # parallel.collectives two_level / auto: the norm and the gathers below in two levels
    two = pl.collectives.mode != "flat"

    def move(tree, src, dst, src_sh, dst_sh):
        if two:
            return step_two_level.update_gather(pl, tree, src, dst)
        return jax.tree.map(reshard_bits, tree, dst_sh, src_sh)

    def gather_update(new_params):
        src, src_sh = pl.opt_state_axes, master_sh
        if grads_stage:
            new_params = move(new_params, src, pl.grads_axes, src_sh, grads_sh)
            src, src_sh = pl.grads_axes, grads_sh
        return move(new_params, src, pl.params_axes, src_sh, params_sh)

    def step_fn(state, batch):
        params = state["params"]
        # 1. loss and gradient (micro-batches, per-layer gathers, TP, deferred reduction)
        loss, grads = grads_fn(params, batch)
        grads = constrain_tree(jax.tree.map(lambda g: g.astype(jnp.float32), grads), master_sh)
        # 2. clip by global norm
        gnorm = step_two_level.global_norm(pl, grads, pl.opt_state_axes) if two else \
            optax.tree.norm(grads)
        if clip > 0:
            scale = jnp.minimum(1.0, clip / (gnorm + 1e-6))
            grads = jax.tree.map(lambda g: g * scale, grads)
        # 3. the optimizer on the fp32 master shard
        master = state["master"] if mixed else constrain_tree(params, master_sh)
        updates, opt_state = tx.update(grads, state["opt_state"], master)
        new_master = constrain_tree(optax.apply_updates(master, updates), master_sh)
        # 4. the new working weights, cast on the opt_state shard so the gathers move pdtype
        new_params = constrain_tree(jax.tree.map(lambda x: x.astype(pdtype), new_master), master_sh)
        if not pl.defer_update:  # else stored as cast: the next forward gathers each layer
            new_params = gather_update(new_params)
        finite = jnp.isfinite(loss) & jnp.isfinite(gnorm)
        new_state = {"step": state["step"] + 1, "params": new_params, "opt_state": opt_state}
        if mixed:
            new_state["master"] = new_master
        if train.skip_nonfinite:
            # A bad batch leaves the weights, moments and schedule untouched; the step counter
            # advances.
            kept = dict(state, step=state["step"] + 1)
            new_state = jax.tree.map(lambda n, o: jnp.where(finite, n, o), new_state, kept)
        lr = schedule(update_count(state["opt_state"]))  # applied: a skipped step keeps it
        metrics = {"loss": loss, "grad_norm": gnorm, "lr": lr,
                   "finite": finite}
        return new_state, metrics

    return step_fn


def make_init(model: ModelConfig, train: TrainConfig, pl: Placement, tx,
              state_sh) -> Callable:
    """() -> the initial state, sharded (one jitted program, fast-compile options)."""
    pdtype = jnp.dtype(model.param_dtype)
    factory32 = model_factory(dataclasses.replace(model, param_dtype="float32"), train)

    def init():
        p32 = pad_tree(pl.layouts, nnx.to_pure_dict(nnx.split(factory32(), nnx.Param)[1]))
        state = {"step": jnp.zeros((), jnp.int32),
                 "params": jax.tree.map(lambda x: x.astype(pdtype), p32),
                 "opt_state": tx.init(p32)}
        if pdtype != jnp.float32:
            state["master"] = p32
        return state

    return lambda: jax.jit(init, out_shardings=state_sh,
                           compiler_options=fast_compile_options() or None)()


def build_step(cfg, mesh, compiler_options: dict | None = None) -> StepBundle:
    """The plan's StepBundle from the loaded run config: the ParallelLayout resolved once here
    (sharding/parallel.resolve, whose checks fail before anything is built; nothing compiles
    until the first call), then the builders below, each given only the sections it reads.
    `compiler_options` go to the train/eval jits (tests pass
    boost_jax.backends.cpu.fast_compile_options() to cut CPU compile time ~4x); the one-off
    init program always compiles with the fast options."""
    model, train, optim = cfg.model, cfg.train, cfg.optim
    layout = parallel.resolve(cfg, mesh, abstract_params(model, train)[1])
    pl = layout.placement
    check_factoring(optim, pl.layouts)
    tx = make_optimizer(optim, train.steps, pl.layouts)
    abstract_state, state_sh = state_layout(pl, tx, jnp.dtype(model.param_dtype))
    engine = Engine(layout)
    batch_sh, rep = pl.batch_sharding(), pl.replicated()
    copts = dict(compiler_options or {}) or None
    train_step = jax.jit(make_step_fn(train, optim, pl, engine, tx),
                         in_shardings=(state_sh, batch_sh),
                         out_shardings=(state_sh, rep), donate_argnums=(0,),
                         compiler_options=copts)
    eval_step = jax.jit(engine.loss_fn(), in_shardings=(state_sh["params"], batch_sh),
                        out_shardings=rep, compiler_options=copts)
    n_params = sum(l.numel for l in jax.tree.leaves(pl.layouts, is_leaf=is_layout))
    return StepBundle(model, train, cfg.data.seq_len, mesh, pl, engine, tx, abstract_state,
                      state_sh, batch_sh, train_step, eval_step,
                      make_init(model, train, pl, tx, state_sh), n_params)


def build_step_for_analysis(cfg, mesh, compiler_options: dict | None = None):
    """(jitted step, abstract args) for lowering without real arrays (comm analyzer, planner)."""
    bundle = build_step(cfg, mesh, compiler_options)
    return bundle.train_step, (bundle.abstract_state, bundle.abstract_batch())
