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
which dims are factored. Clipping is applied outside (the step needs the norm for logging).
"""

from __future__ import annotations

import optax

from boost_jax.config import OptimConfig
from boost_jax.errors import ConfigError
from boost_jax.layers.forward import path_keys
from boost_jax.names import OPTIMIZERS


def lr_schedule(cfg: OptimConfig, total_steps: int) -> optax.Schedule:
    warmup = max(1, int(cfg.warmup_frac * total_steps))
    end = cfg.lr * cfg.min_lr_ratio
    if cfg.schedule == "cosine":
        return optax.warmup_cosine_decay_schedule(
            init_value=0.0, peak_value=cfg.lr, warmup_steps=warmup,
            decay_steps=max(total_steps, warmup + 1), end_value=end)
    ramp = optax.linear_schedule(0.0, cfg.lr, warmup)
    rest = max(1, total_steps - warmup)
    if cfg.schedule == "linear":
        after = optax.linear_schedule(cfg.lr, end, rest)
    elif cfg.schedule == "constant":
        after = optax.constant_schedule(cfg.lr)
    else:  # wsd: stable, then a linear cooldown over the last decay_frac of the steps
        decay = max(1, min(rest, int(round(cfg.decay_frac * total_steps))))
        after = optax.join_schedules([optax.constant_schedule(cfg.lr),
                                      optax.linear_schedule(cfg.lr, end, decay)], [rest - decay])
    return optax.join_schedules([ramp, after], [warmup])


def make_optimizer(cfg: OptimConfig, total_steps: int) -> optax.GradientTransformation:
    """optax's optimizer `cfg.name` on the schedule; weight decay skips the norm gains."""
    lr = lr_schedule(cfg, total_steps)
    if cfg.name == "lion":
        return optax.lion(lr, b1=cfg.b1, b2=cfg.b2, weight_decay=cfg.weight_decay,
                          mask=_decay_mask)
    if cfg.name in ("sgd", "sgd-momentum"):  # classic L2 decay (through the momentum)
        momentum = cfg.b1 if cfg.name == "sgd-momentum" else None
        return optax.chain(optax.add_decayed_weights(cfg.weight_decay, _decay_mask),
                           optax.sgd(lr, momentum=momentum))
    if cfg.name == "adafactor":
        return optax.adafactor(lr, multiply_by_parameter_scale=False, clipping_threshold=None,
                               weight_decay_rate=cfg.weight_decay or None,
                               weight_decay_mask=_decay_mask)
    return optax.adamw(lr, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps,
                       weight_decay=cfg.weight_decay, mask=_decay_mask)


# fp32 optimizer-state elements per weight element (the planner's memory model)
STATE_PER_PARAM = {n: OptimConfig(name=n).state_per_param for n in OPTIMIZERS}


def check_factoring(cfg: OptimConfig, layouts) -> None:
    """One-line error when Adafactor would factor a padded weight over other dims than the
    weight itself (then the plan would not match the single-device reference)."""
    if cfg.name != "adafactor":
        return
    import jax
    from optax._src.factorized import _factored_dims

    from boost_jax.sharding.layout import is_layout

    def dims(shape):
        d = _factored_dims(tuple(shape), True, 128)
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
