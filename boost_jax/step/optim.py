"""The optimizer (`optim.name`) and learning-rate schedule (`optim.schedule`), all from optax.

Every schedule warms up linearly from 0 to `optim.lr` over `warmup_frac` of the steps, then:
cosine / linear decay to lr·min_lr_ratio at the last step, constant, or wsd (warmup-stable-
decay: lr until the last `decay_frac` of the steps, then linear to lr·min_lr_ratio).

The step applies the update to whole (padded) weights under jit, whatever their sharding, so an
elementwise optimizer (adamw, lion, sgd, sgd-momentum) matches the single-device reference on every
plan. Adafactor's factored second moment (row and column means) is also unchanged by zero
padding: the padding scales the row statistic and the column statistic by factors that cancel.
Its update clipping and parameter scaling take an RMS over the whole (padded) weight, so they
are off (the step clips by global norm), and `check_factoring` refuses a padding that changes
which dims are factored. Its statistics add an epsilon (1e-30) to every squared gradient, the
padding's zeros included, and count the padding in their means: `layout_free_statistics`
stores them as the unpadded weights give them, so every array of the state is zero in its
padding and means the same in every layout, as restores under another layout (and the
state's checksums) assume. Clipping is applied outside (the step needs the norm for logging).
"""

from __future__ import annotations

import math
from typing import Optional

import jax
import jax.numpy as jnp
import optax

from boost_jax.config import OptimConfig
from boost_jax.errors import ConfigError
from boost_jax.layers.forward import path_keys
from boost_jax.names import OPTIMIZERS


# what lr_schedule reads (with train.steps): a resume that changes one moves the schedule
SCHEDULE_KEYS = tuple(f"optim.{k}" for k in ("schedule", "lr", "min_lr_ratio", "warmup_frac",
                                             "decay_frac"))


def resumed_lr(old: OptimConfig, old_steps: int, new: OptimConfig, new_steps: int,
               start: int) -> tuple[float, float]:
    """The lr of update start + 1 under the saved run's schedule and under the new one: a
    resume that changes train.steps or SCHEDULE_KEYS re-spreads the schedule over the new
    total from where it stands."""
    return (float(lr_schedule(old, old_steps)(start)), float(lr_schedule(new, new_steps)(start)))


def lr_schedule(cfg: OptimConfig, total_steps: int) -> optax.Schedule:
    """The learning rate of update k + 1 at optimizer count k (0 first). The warmup's first
    update runs at optim.lr / warmup steps and its last at optim.lr (warmup_frac = 0: the
    first update does); the decay reaches optim.lr × min_lr_ratio at update `total_steps`."""
    peak_at = max(1, int(cfg.warmup_frac * total_steps + 1e-9))  # the update at optim.lr
    rest = total_steps - peak_at  # the updates after it
    end = cfg.lr * cfg.min_lr_ratio
    # wsd: the cooldown's length (decay_frac = 0: none)
    decay = min(rest, max(1, round(cfg.decay_frac * total_steps))) if cfg.decay_frac else 0
    if rest <= 0 or cfg.schedule == "constant" or (cfg.schedule == "wsd" and not decay):
        after = optax.constant_schedule(cfg.lr)
    elif cfg.schedule == "cosine":
        after = optax.cosine_decay_schedule(cfg.lr, rest, alpha=cfg.min_lr_ratio)
    elif cfg.schedule == "linear":
        after = optax.linear_schedule(cfg.lr, end, rest)
    else:  # wsd: stable, then a linear cooldown over the last decay_frac of the steps
        after = optax.join_schedules([optax.constant_schedule(cfg.lr),
                                      optax.linear_schedule(cfg.lr, end, decay)], [rest - decay])
    if peak_at == 1:
        return after
    ramp = optax.linear_schedule(cfg.lr / peak_at, cfg.lr, peak_at - 1)
    return optax.join_schedules([ramp, after], [peak_at - 1])


def update_count(opt_state) -> jax.Array:
    """The optimizer's own update count: its schedule reads the next update's lr from it (a
    step that train.skip_nonfinite skips leaves it, and so the schedule, where it was)."""
    def found(x):
        return isinstance(x, optax.ScaleByScheduleState)

    counts = [s.count for s in jax.tree.leaves(opt_state, is_leaf=found) if found(s)]
    if len(counts) != 1:
        raise ValueError(f"expected one scheduled learning rate in the optimizer state, "
                         f"found {len(counts)}")
    return counts[0]


def make_optimizer(cfg: OptimConfig, total_steps: int,
                   layouts=None) -> optax.GradientTransformation:
    """optax's optimizer `cfg.name` on the schedule; weight decay skips the norm gains.
    `layouts`: the stored arrays' layouts (sharding/layout.py), where they may be padded."""
    lr = lr_schedule(cfg, total_steps)
    if cfg.name == "lion":
        return optax.lion(lr, b1=cfg.b1, b2=cfg.b2, weight_decay=cfg.weight_decay,
                          mask=_decay_mask)
    if cfg.name in ("sgd", "sgd-momentum"):  # classic L2 decay (through the momentum)
        momentum = cfg.b1 if cfg.name == "sgd-momentum" else None
        return optax.chain(optax.add_decayed_weights(cfg.weight_decay, _decay_mask),
                           optax.sgd(lr, momentum=momentum))
    if cfg.name == "adafactor":
        tx = optax.adafactor(lr, multiply_by_parameter_scale=False, clipping_threshold=None,
                             weight_decay_rate=cfg.weight_decay or None,
                             weight_decay_mask=_decay_mask)
        return tx if layouts is None else layout_free_statistics(tx, layouts)
    return optax.adamw(lr, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps,
                       weight_decay=cfg.weight_decay, mask=_decay_mask)


STATISTICS = ("v_row", "v_col", "v")  # optax's FactoredState: the second moment's arrays


def layout_free_statistics(tx: optax.GradientTransformation,
                           layouts) -> optax.GradientTransformation:
    """`tx` (Adafactor) storing its statistics as the unpadded weights would give them: zero
    outside each weight's real elements, a row (column) mean over a padded dim counted over its
    real elements (optax's counts the padding's too), and rows and columns as the logical shape
    orders its dims (`transposed`). Each update runs on the statistics turned back into optax's
    and leaves (1 - decay)·epsilon > 0 in the padding, zeroed after it: a padded element's
    update is 0·finite = 0."""

    def init(params):
        return transpose_statistics(tx.init(params), layouts)

    def update(updates, state, params=None):
        state = rescale_statistics(transpose_statistics(state, layouts), layouts, True)
        updates, state = tx.update(updates, state, params)
        return updates, transpose_statistics(rescale_statistics(state, layouts, False), layouts)

    return optax.GradientTransformation(init, update)


def _factored(shape) -> Optional[tuple]:
    """optax's (d1, d0) of a weight: its second largest and largest dim (None: unfactored)."""
    from optax._src.factorized import _factored_dims

    return _factored_dims(tuple(shape), True, 128)


def transposed(lay) -> bool:
    """Whether padding makes optax factor a weight the other way round from its logical shape
    (a padded dim overtakes another of equal size: a d x d weight padded on one dim), so that
    its v_row and v_col swap meaning."""
    a, b = _factored(lay.padded), _factored(lay.shape)
    return a is not None and b is not None and a != b


def _by_path(layouts) -> dict:
    """{path keys of a weight: its layout}: what a statistic of the optimizer state is matched
    to (optax nests the weights' tree inside its state)."""
    import jax

    from boost_jax.sharding.layout import is_layout

    return {path_keys(p): lay for p, lay in
            jax.tree_util.tree_flatten_with_path(layouts, is_leaf=is_layout)[0]}


def transposed_weights(layouts) -> tuple:
    """Names (key paths) of the `transposed` weights of a layout."""
    return tuple("".join(f"[{k!r}]" for k in keys) for keys, lay in _by_path(layouts).items()
                 if transposed(lay))


def transpose_statistics(state, layouts):
    """Swap v_row and v_col of every `transposed` weight (between optax's order and the
    logical one; its own inverse)."""
    import jax
    from optax._src.factorized import FactoredState

    by_path = _by_path(layouts)

    def swap(fs):
        if not isinstance(fs, FactoredState):
            return fs
        rows, treedef = jax.tree_util.tree_flatten_with_path(fs.v_row)
        cols = jax.tree.leaves(fs.v_col)
        flip = [path_keys(p) in by_path and transposed(by_path[path_keys(p)]) for p, _ in rows]
        new_rows = [c if f else r for (_, r), c, f in zip(rows, cols, flip)]
        new_cols = [r if f else c for (_, r), c, f in zip(rows, cols, flip)]
        return fs._replace(v_row=treedef.unflatten(new_rows),
                           v_col=treedef.unflatten(new_cols))

    return jax.tree.map(swap, state, is_leaf=lambda x: isinstance(x, FactoredState))


def rescale_statistics(state, layouts, to_optax: bool):
    """An Adafactor state's statistics (in optax's order of rows and columns) in optax's counts
    (`to_optax`) or layout-free (zero padding, means over real elements); also what converts a
    state that an older step saved in optax's counts. Other optimizers' states and unpadded
    weights are returned as they are."""
    import jax

    from boost_jax.sharding.layout import real_positions

    by_path = _by_path(layouts)

    def one(path, x):
        key = path_keys(path)
        at = next((i for i, k in enumerate(key) if k in STATISTICS), None)
        lay = None if at is None else by_path.get(key[at + 1:])
        if lay is None or x.shape == (1,) != lay.padded:
            return x  # not a statistic, or a placeholder
        vecs, real = real_positions(lay), 1.0
        if all(v.all() for v in vecs):
            return x
        if key[at] != "v":  # v_row averages the largest dim away, v_col the second largest
            dims = _factored(lay.padded)
            drop = dims[1] if key[at] == "v_row" else dims[0]
            real = float(vecs[drop].mean())
            vecs = vecs[:drop] + vecs[drop + 1:]
        if to_optax:
            return x * real
        keep = math.prod(jnp.asarray(v).reshape([-1 if j == i else 1 for j in range(len(vecs))])
                         for i, v in enumerate(vecs))
        return jnp.where(keep, x / real, jnp.zeros_like(x))

    return jax.tree_util.tree_map_with_path(one, state)


# fp32 optimizer-state elements per weight element (the planner's memory model)
STATE_PER_PARAM = {n: OptimConfig(name=n).state_per_param for n in OPTIMIZERS}


def check_factoring(cfg: OptimConfig, layouts) -> None:
    """One-line error when Adafactor would factor a padded weight over other dims than the
    weight itself (then the plan would not match the single-device reference)."""
    if cfg.name != "adafactor":
        return
    import jax

    from boost_jax.sharding.layout import is_layout

    def dims(shape):
        d = _factored(shape)
        return None if d is None else tuple(sorted(d))

    for path, lay in jax.tree_util.tree_flatten_with_path(layouts, is_leaf=is_layout)[0]:
        if dims(lay.shape) != dims(lay.padded):
            raise ConfigError(
                f"optim.name=adafactor: weight {jax.tree_util.keystr(path)} is padded from "
                f"{lay.shape} to {lay.padded} for this plan, which changes the dims Adafactor "
                f"factors; use a device count that divides it or another optim.name")


NO_DECAY = ("scale", "latent_scale")  # norm gains


def _decay_mask(params):
    import jax

    return jax.tree_util.tree_map_with_path(lambda path, _: path_keys(path)[-1] not in NO_DECAY,
                                            params)
