"""The compiled training step: placement by plan, micro-batch accumulation, clipping, AdamW.

State is a plain pytree (orbax and optax see ordinary arrays):

    {"step":      int32, replicated
     "params":    working weights, model.param_dtype, sharded over the plan's params axes
     "master":    fp32 master weights over opt_state axes (only when param_dtype=bfloat16)
     "opt_state": optax AdamW state; moments over opt_state axes, counters replicated}

Arrays are stored in the plan's layout (boost_jax.sharding.plans): one dim sharded, padded with
zeros at its end when it does not divide — `bundle.placement.layouts` says which. The model's
forward is rebuilt inside the step (boost_jax.sharding.secondary.build_forward) and gathers
each layer's weights just before use; backward re-gathers them (or their secondary partition).

One step, per micro-batch m (lax.scan), with R = batch axes not covered by grads axes:
    per group r ∈ R (vmap, spmd_axis_name=R): loss and gradient of its rows; the gradient is
    reduce-scattered to the grads sharding *inside the group* and added to an accumulator
    [|R|, ...] (grad_accum_dtype) that stays unreduced over R.
then once per optimizer step: sum over R straight into the opt_state sharding (reduce-scatter
across R — the only cross-node gradient traffic of `hierarchical`), clip by global norm, AdamW
on the fp32 master shard, and gather the new working weights back in stages
(opt_state → grads → params sharding), so the cross-node part moves only the node's shard.
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
from boost_jax.sharding.plans import Placement, _spec_entry, is_layout, make_placement
from boost_jax.sharding.secondary import reshard_bits
from boost_jax.train.optim import lr_schedule, make_optimizer


def cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
    logits = logits.astype(jnp.float32)
    logz = jax.nn.logsumexp(logits, axis=-1)
    gold = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    return jnp.mean(logz - gold)


def model_factory(cfg: Config) -> Callable[[], nnx.Module]:
    """() -> the model, built in place (traceable: usable under jit and nnx.eval_shape)."""
    from boost_jax.layers.model import LlamaModel

    def make():
        cfg.model.validate()
        return LlamaModel(cfg.model, rngs=nnx.Rngs(cfg.train.seed), remat=cfg.train.remat,
                          scan_layers=cfg.train.scan_layers)

    return make


def abstract_params(cfg: Config):
    """(graphdef, params as a pure dict of ShapeDtypeStruct) without allocating anything."""
    model = nnx.eval_shape(model_factory(cfg))
    graphdef, params = nnx.split(model, nnx.Param)
    return graphdef, nnx.to_pure_dict(params)


def build_loss_fn(cfg: Config, graphdef, mesh, placement: Placement | None = None) -> Callable:
    """loss_fn(stored_params, batch[, batch_axes]) -> scalar mean cross-entropy.

    tp_mode=none: the layer-by-layer forward with the plan's gathers. TP: the TP loss on
    weights gathered over the data-parallel axes up front (no per-layer gather or secondary).
    """
    if placement is None:
        placement = make_placement(cfg, mesh, abstract_params(cfg)[1])
    if cfg.parallel.tp_mode != "none":
        from boost_jax.sharding.secondary import gather_tree, leaf_gathers
        from boost_jax.sharding.tensor_parallel import build_tp_loss_fn

        tp_loss = build_tp_loss_fn(cfg, graphdef, mesh)
        gathers = leaf_gathers(placement)

        def loss_fn(params, batch, batch_axes=None):
            return tp_loss(gather_tree(gathers, params), batch)

        return loss_fn
    from boost_jax.sharding.secondary import build_forward

    return build_forward(cfg, graphdef, placement, cross_entropy)


@dataclass
class StepBundle:
    cfg: Config
    mesh: Any
    placement: Placement
    graphdef: Any
    tx: optax.GradientTransformation
    abstract_state: Any  # ShapeDtypeStructs with shardings (stored, possibly padded shapes)
    state_shardings: Any
    batch_sharding: NamedSharding
    train_step: Callable  # (state, batch) -> (state, metrics)
    eval_step: Callable  # (state["params"], batch) -> loss
    init_state: Callable  # () -> state, sharded
    n_params: int = 0  # logical parameter count (without padding)

    def abstract_batch(self, batch_size: int | None = None):
        b = batch_size or self.cfg.train.global_batch
        s = self.cfg.data.seq_len
        spec = jax.ShapeDtypeStruct((b, s), jnp.int32, sharding=self.batch_sharding)
        return {"inputs": spec, "targets": spec}

    def eval_params(self, state):
        """What eval_step takes: the stored working weights."""
        return state["params"]

    def logical_params(self, state):
        """Unpadded working weights (a jitted slice; for export and inspection)."""
        from boost_jax.sharding.secondary import unpad_tree

        return jax.jit(lambda p: unpad_tree(self.placement, p))(state["params"])


def _tree_wsc(tree, shardings):
    return jax.tree.map(jax.lax.with_sharding_constraint, tree, shardings)


def make_deferred_reduce(pl: Placement, mesh) -> Callable:
    """acc [|R|, ...] (accum sharding) → Σ over R, in the opt_state sharding.

    When opt_state axes = grads axes + (part of) R, in that order on the sharded dim (the
    canonical order guarantees it for the presets), this is one explicit reduce-scatter over
    R ∩ opt (after an all-reduce over R − opt, if any) per leaf inside a shard_map, so the
    compiled program shows exactly the collective the plan calls for. Otherwise GSPMD does
    the sum and the resharding."""
    from jax.sharding import PartitionSpec

    R = pl.deferred_axes
    lay_tree = pl.layouts
    S1 = tuple(a for a in R if a in pl.opt_state_axes)
    S2 = tuple(a for a in R if a not in pl.opt_state_axes)
    lead = _spec_entry(R)

    def as_tuple(e):
        return () if e is None else ((e,) if isinstance(e, str) else tuple(e))

    def explicit_ok(lay) -> bool:
        if lay.dim is None:
            return True
        o = as_tuple(lay.spec(pl.opt_state_axes)[lay.dim])
        g = as_tuple(lay.spec(pl.grads_axes)[lay.dim])
        return o == g + S1 and all(
            as_tuple(a) == as_tuple(b) for i, (a, b) in enumerate(
                zip(lay.spec(pl.opt_state_axes), lay.spec(pl.grads_axes))) if i != lay.dim)

    leaves = jax.tree.leaves(lay_tree, is_leaf=is_layout)
    ok = bool(R) and all(explicit_ok(l) for l in leaves)
    out_sh = pl.master_shardings()

    if not ok:
        def gspmd(acc):
            return _tree_wsc(jax.tree.map(lambda a: jnp.sum(a, axis=0), acc), out_sh)
        return gspmd

    in_specs = jax.tree.map(lambda l: PartitionSpec(lead, *l.spec(pl.grads_axes)), lay_tree,
                            is_leaf=is_layout)
    out_specs = jax.tree.map(lambda l: l.spec(pl.opt_state_axes), lay_tree, is_leaf=is_layout)

    def body(acc):
        def one(lay, x):
            x = x[0]
            if S2:
                x = jax.lax.psum(x, S2)
            if S1:
                x = (jax.lax.psum(x, S1) if lay.dim is None else
                     jax.lax.psum_scatter(x, S1, scatter_dimension=lay.dim, tiled=True))
            return x

        return jax.tree.map(one, lay_tree, acc, is_leaf=is_layout)

    return jax.shard_map(body, mesh=mesh, in_specs=(in_specs,), out_specs=out_specs)


def _fast_compile_options() -> dict:
    try:
        from boost_jax.layers.model import fast_compile_options

        return fast_compile_options()
    except ImportError:  # pragma: no cover
        return {}


def build_step(cfg: Config, mesh, compiler_options: dict | None = None) -> StepBundle:
    """The plan's StepBundle. `compiler_options` go to the train/eval jits (tests pass
    boost_jax.layers.model.fast_compile_options() to cut CPU compile time ~4x); the one-off
    init program always compiles with the fast options."""
    graphdef, abs_params = abstract_params(cfg)
    placement = make_placement(cfg, mesh, abs_params)
    pl = placement
    lay = pl.layouts
    is_lay = is_layout
    tx = make_optimizer(cfg.optim, cfg.train.steps)
    pdtype = jnp.dtype(cfg.model.param_dtype)
    mixed = pdtype != jnp.float32  # bf16 working weights + fp32 master copy
    acc_dtype = jnp.dtype(cfg.parallel.grad_accum_dtype)

    stored = jax.tree.map(lambda l: jax.ShapeDtypeStruct(l.padded, pdtype), lay, is_leaf=is_lay)
    stored32 = jax.tree.map(lambda l: jax.ShapeDtypeStruct(l.padded, jnp.float32), lay,
                            is_leaf=is_lay)
    abs_opt = jax.eval_shape(tx.init, stored32)

    params_sh = pl.params_shardings()
    grads_sh = pl.grads_shardings()
    master_sh = pl.master_shardings()
    accum_sh = pl.accum_shardings()
    opt_sh = pl.opt_state_shardings(abs_opt)
    rep = pl.replicated()
    state_sh = {"step": rep, "params": params_sh, "opt_state": opt_sh}
    abs_tree = {"step": jax.ShapeDtypeStruct((), jnp.int32), "params": stored,
                "opt_state": abs_opt}
    if mixed:
        state_sh["master"] = master_sh
        abs_tree["master"] = stored32
    abstract_state = jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), abs_tree, state_sh)
    batch_sh = pl.batch_sharding()
    loss_fn = build_loss_fn(cfg, graphdef, mesh, pl)
    schedule = lr_schedule(cfg.optim, cfg.train.steps)
    micro = cfg.train.micro_batches
    clip = cfg.optim.clip_norm
    skip_nonfinite = cfg.train.skip_nonfinite
    R = pl.deferred_axes
    n_r = 1
    for a in R:
        n_r *= mesh.shape[a]
    inner = pl.inner_batch_axes
    grads_stage = (pl.grads_axes if set(pl.params_axes) <= set(pl.grads_axes)
                   <= set(pl.opt_state_axes) else None)

    reduce_deferred = make_deferred_reduce(pl, mesh)

    def split_micro(x):
        # Row i*M+m goes to micro-batch m so each device's rows stay on that device.
        b = x.shape[0]
        x = x.reshape(b // micro, micro, *x.shape[1:]).swapaxes(0, 1)
        return jax.lax.with_sharding_constraint(
            x, NamedSharding(mesh, P(None, _spec_entry(pl.batch_axes))))

    def group_rows(x):
        # [b, ...] (batch axes R-major) → [|R|, b/|R|, ...]: a local reshape
        x = x.reshape(n_r, x.shape[0] // n_r, *x.shape[1:])
        return jax.lax.with_sharding_constraint(
            x, NamedSharding(mesh, P(_spec_entry(R), _spec_entry(inner))))

    def micro_grads(params, b):
        """(loss [|R|] or scalar, grads) for one micro-batch; grads [|R|, ...] unreduced over R.

        Differentiates w.r.t. a grad_accum_dtype view of the stored weights: the gathers cast
        it back to the working dtype before moving it, and the gradient comes back (and is
        reduced) in grad_accum_dtype — Megatron's fp32 gradient reduction by default."""
        view = jax.tree.map(lambda x: x.astype(acc_dtype), params)
        if not R:
            loss, g = jax.value_and_grad(loss_fn)(view, b)
            return loss, _tree_wsc(g, grads_sh)
        gb = jax.tree.map(group_rows, b)
        vg = jax.vmap(jax.value_and_grad(lambda p, x: loss_fn(p, x, inner)), in_axes=(None, 0),
                      spmd_axis_name=R if len(R) > 1 else R[0])
        losses, g = vg(view, gb)
        # per-group losses stay on their group until the end of the step (no cross-R traffic)
        losses = jax.lax.with_sharding_constraint(losses, NamedSharding(mesh, P(_spec_entry(R))))
        return losses, _tree_wsc(g, accum_sh)

    def step_fn(state, batch):
        params = state["params"]
        if micro == 1:
            loss, acc = micro_grads(params, batch)
            acc = jax.tree.map(lambda g: g.astype(acc_dtype), acc)
        else:
            mb = jax.tree.map(split_micro, batch)

            def body(carry, b):
                loss_sum, acc = carry
                # tie the weights to this micro-batch: XLA may not hoist their (loop-invariant)
                # gathers out of the loop, so each micro-batch gathers like DeepSpeed does and
                # full weights never stay alive across micro-batches
                p, b = jax.lax.optimization_barrier((params, b))
                loss, g = micro_grads(p, b)
                acc = jax.tree.map(lambda a, x: a + x.astype(acc_dtype), acc, g)
                return (loss_sum + loss, _tree_wsc(acc, accum_sh if R else grads_sh)), None

            zshape = (lambda s: (n_r, *s)) if R else (lambda s: s)
            zeros = jax.tree.map(lambda l: jnp.zeros(zshape(l.padded), acc_dtype), lay,
                                 is_leaf=is_lay)
            zeros = _tree_wsc(zeros, accum_sh if R else grads_sh)
            loss0 = jnp.zeros((n_r,) if R else (), jnp.float32)
            if R:
                loss0 = jax.lax.with_sharding_constraint(
                    loss0, NamedSharding(mesh, P(_spec_entry(R))))
            (loss, acc), _ = jax.lax.scan(body, (loss0, zeros), mb)
            loss = loss / micro
        loss = jnp.mean(loss)
        # once per step: reduce the deferred axes straight into the optimizer's sharding
        norm = 1.0 / (micro * n_r)
        if R:
            grads = reduce_deferred(acc)
        grads = jax.tree.map(lambda a: a.astype(jnp.float32) * norm, grads if R else acc)
        grads = _tree_wsc(grads, master_sh)
        gnorm = optax.tree.norm(grads)
        if clip > 0:
            scale = jnp.minimum(1.0, clip / (gnorm + 1e-6))
            grads = jax.tree.map(lambda g: g * scale, grads)
        master = state["master"] if mixed else _tree_wsc(params, master_sh)
        updates, opt_state = tx.update(grads, state["opt_state"], master)
        new_master = _tree_wsc(optax.apply_updates(master, updates), master_sh)
        # cast on the opt_state shard, so the gathers below move the working dtype
        new_params = _tree_wsc(jax.tree.map(lambda x: x.astype(pdtype), new_master), master_sh)
        src = master_sh
        if grads_stage is not None:  # cross-node part first: opt_state → grads sharding
            new_params = jax.tree.map(reshard_bits, new_params, grads_sh, src)
            src = grads_sh
        new_params = jax.tree.map(reshard_bits, new_params, params_sh, src)
        finite = jnp.isfinite(loss) & jnp.isfinite(gnorm)
        new_state = {"step": state["step"] + 1, "params": new_params, "opt_state": opt_state}
        if mixed:
            new_state["master"] = new_master
        if skip_nonfinite:
            # A bad batch leaves the weights and moments untouched; the step counter advances.
            kept = dict(state, step=state["step"] + 1)
            new_state = jax.tree.map(lambda n, o: jnp.where(finite, n, o), new_state, kept)
        metrics = {"loss": loss, "grad_norm": gnorm, "lr": schedule(state["step"]),
                   "finite": finite}
        return new_state, metrics

    copts = dict(compiler_options or {})
    train_step = jax.jit(step_fn, in_shardings=(state_sh, batch_sh),
                         out_shardings=(state_sh, rep), donate_argnums=(0,),
                         compiler_options=copts or None)
    eval_step = jax.jit(lambda p, b: loss_fn(p, b), in_shardings=(params_sh, batch_sh),
                        out_shardings=rep, compiler_options=copts or None)
    import dataclasses

    cfg32 = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, param_dtype="float32"))
    factory32 = model_factory(cfg32)

    def init_state():
        from boost_jax.sharding.secondary import pad_tree

        def init():
            p32 = pad_tree(pl, nnx.to_pure_dict(nnx.split(factory32(), nnx.Param)[1]))
            state = {"step": jnp.zeros((), jnp.int32),
                     "params": jax.tree.map(lambda x: x.astype(pdtype), p32),
                     "opt_state": tx.init(p32)}
            if mixed:
                state["master"] = p32
            return state

        return jax.jit(init, out_shardings=state_sh,
                       compiler_options=_fast_compile_options() or None)()

    n_params = sum(l.numel for l in jax.tree.leaves(lay, is_leaf=is_lay))
    return StepBundle(cfg, mesh, placement, graphdef, tx, abstract_state, state_sh, batch_sh,
                      train_step, eval_step, init_state, n_params)


def build_step_for_analysis(cfg: Config, mesh, compiler_options: dict | None = None):
    """(jitted step, abstract args) for lowering without real arrays (comm analyzer, planner)."""
    bundle = build_step(cfg, mesh, compiler_options)
    return bundle.train_step, (bundle.abstract_state, bundle.abstract_batch())
