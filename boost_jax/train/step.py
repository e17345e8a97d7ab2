"""The compiled training step: micro-batch accumulation, clipping, AdamW, placement by plan.

State is a plain pytree {"step", "params", "opt_state"} with params as a pure nested dict (what
`nnx.to_pure_dict` gives), so optax, orbax and the placement plans see ordinary arrays. The
model's forward is rebuilt inside the step with `nnx.merge(graphdef, params)`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from boost_jax.config import Config
from boost_jax.sharding.plans import Placement, make_placement
from boost_jax.train.optim import lr_schedule, make_optimizer


def cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
    logits = logits.astype(jnp.float32)
    logz = jax.nn.logsumexp(logits, axis=-1)
    gold = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    return jnp.mean(logz - gold)


def model_factory(cfg: Config) -> Callable[[], nnx.Module]:
    from boost_jax.layers.model import build_model

    return lambda: build_model(cfg.model, seed=cfg.train.seed, remat=cfg.train.remat,
                               scan_layers=cfg.train.scan_layers)


def abstract_params(cfg: Config):
    """(graphdef, params as a pure dict of ShapeDtypeStruct) without allocating anything."""
    model = nnx.eval_shape(model_factory(cfg))
    graphdef, params = nnx.split(model, nnx.Param)
    return graphdef, nnx.to_pure_dict(params)


def build_loss_fn(cfg: Config, graphdef, mesh) -> Callable:
    """loss_fn(params, batch) -> scalar mean cross-entropy, for the configured TP mode."""
    if cfg.parallel.tp_mode != "none":
        from boost_jax.sharding.tensor_parallel import build_tp_loss_fn

        return build_tp_loss_fn(cfg, graphdef, mesh)

    def loss_fn(params, batch):
        model = nnx.merge(graphdef, params)
        return cross_entropy(model(batch["inputs"]), batch["targets"])

    return loss_fn


@dataclass
class StepBundle:
    cfg: Config
    mesh: Any
    placement: Placement
    graphdef: Any
    tx: optax.GradientTransformation
    abstract_state: Any  # ShapeDtypeStructs with shardings
    state_shardings: Any
    batch_sharding: NamedSharding
    train_step: Callable  # (state, batch) -> (state, metrics)
    eval_step: Callable  # (params, batch) -> loss
    init_state: Callable  # () -> state, sharded

    def abstract_batch(self, batch_size: int | None = None):
        b = batch_size or self.cfg.train.global_batch
        s = self.cfg.data.seq_len
        spec = jax.ShapeDtypeStruct((b, s), jnp.int32, sharding=self.batch_sharding)
        return {"inputs": spec, "targets": spec}


def build_step(cfg: Config, mesh) -> StepBundle:
    placement = make_placement(cfg, mesh)
    graphdef, abs_params = abstract_params(cfg)
    tx = make_optimizer(cfg.optim, cfg.train.steps)
    abs_opt = jax.eval_shape(tx.init, abs_params)

    params_sh = placement.params_shardings(abs_params)
    grads_sh = placement.grads_shardings(abs_params)
    opt_sh = placement.opt_state_shardings(abs_opt)
    rep = placement.replicated()
    state_sh = {"step": rep, "params": params_sh, "opt_state": opt_sh}
    abstract_state = jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
        {"step": jax.ShapeDtypeStruct((), jnp.int32), "params": abs_params, "opt_state": abs_opt},
        state_sh)
    batch_sh = placement.batch_sharding()
    loss_fn = build_loss_fn(cfg, graphdef, mesh)
    schedule = lr_schedule(cfg.optim, cfg.train.steps)
    micro = cfg.train.micro_batches
    clip = cfg.optim.clip_norm
    skip_nonfinite = cfg.train.skip_nonfinite
    batch_axes = placement.batch_axes or None

    def split_micro(x):
        # Row i*M+m goes to micro-batch m so each device's rows stay on that device.
        b = x.shape[0]
        x = x.reshape(b // micro, micro, *x.shape[1:]).swapaxes(0, 1)
        return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P(None, batch_axes)))

    def step_fn(state, batch):
        params = state["params"]
        grad_fn = jax.value_and_grad(loss_fn)
        if micro == 1:
            loss, grads = grad_fn(params, batch)
            grads = jax.lax.with_sharding_constraint(grads, grads_sh)
        else:
            mb = jax.tree.map(split_micro, batch)

            def body(carry, b):
                loss_sum, acc = carry
                loss, g = grad_fn(params, b)
                acc = jax.tree.map(lambda a, x: a + x.astype(jnp.float32), acc, g)
                return (loss_sum + loss, jax.lax.with_sharding_constraint(acc, grads_sh)), None

            zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
            zeros = jax.lax.with_sharding_constraint(zeros, grads_sh)
            (loss, grads), _ = jax.lax.scan(body, (jnp.zeros((), jnp.float32), zeros), mb)
            loss = loss / micro
            grads = jax.tree.map(lambda g: g / micro, grads)
        gnorm = optax.global_norm(grads)
        if clip > 0:
            scale = jnp.minimum(1.0, clip / (gnorm + 1e-6))
            grads = jax.tree.map(lambda g: g * scale, grads)
        grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, params)
        updates, opt_state = tx.update(grads, state["opt_state"], params)
        new_params = optax.apply_updates(params, updates)
        finite = jnp.isfinite(loss) & jnp.isfinite(gnorm)
        new_state = {"step": state["step"] + 1, "params": new_params, "opt_state": opt_state}
        if skip_nonfinite:
            # A bad batch leaves the weights and moments untouched; the step counter advances.
            kept = {"step": state["step"] + 1, "params": params, "opt_state": state["opt_state"]}
            new_state = jax.tree.map(lambda n, o: jnp.where(finite, n, o), new_state, kept)
        metrics = {"loss": loss, "grad_norm": gnorm, "lr": schedule(state["step"]),
                   "finite": finite}
        return new_state, metrics

    train_step = jax.jit(step_fn, in_shardings=(state_sh, batch_sh),
                         out_shardings=(state_sh, rep), donate_argnums=(0,))
    eval_step = jax.jit(loss_fn, in_shardings=(params_sh, batch_sh), out_shardings=rep)
    factory = model_factory(cfg)

    def init_state():
        def init():
            params = nnx.to_pure_dict(nnx.split(factory(), nnx.Param)[1])
            return {"step": jnp.zeros((), jnp.int32), "params": params,
                    "opt_state": tx.init(params)}

        return jax.jit(init, out_shardings=state_sh)()

    return StepBundle(cfg, mesh, placement, graphdef, tx, abstract_state, state_sh, batch_sh,
                      train_step, eval_step, init_state)


def build_step_for_analysis(cfg: Config, mesh):
    """(jitted step, abstract args) for lowering without real arrays (comm analyzer, planner)."""
    bundle = build_step(cfg, mesh)
    return bundle.train_step, (bundle.abstract_state, bundle.abstract_batch())
