"""AdamW with linear warmup and cosine decay (the CoLA recipe), plus global-norm clipping."""

from __future__ import annotations

import optax

from boost_jax.config import OptimConfig


def lr_schedule(cfg: OptimConfig, total_steps: int) -> optax.Schedule:
    warmup = max(1, int(cfg.warmup_frac * total_steps))
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=cfg.lr, warmup_steps=warmup,
        decay_steps=max(total_steps, warmup + 1), end_value=cfg.lr * cfg.min_lr_ratio)


def make_optimizer(cfg: OptimConfig, total_steps: int) -> optax.GradientTransformation:
    """Clipping is applied outside (the step needs the norm for logging and non-finite checks)."""
    return optax.adamw(lr_schedule(cfg, total_steps), b1=cfg.b1, b2=cfg.b2, eps=cfg.eps,
                       weight_decay=cfg.weight_decay, mask=_decay_mask)


NO_DECAY = ("scale", "latent_scale")  # norm gains


def _decay_mask(params):
    import jax

    def leaf_name(path) -> str:
        last = path[-1]
        return str(getattr(last, "key", getattr(last, "name", last)))

    return jax.tree_util.tree_map_with_path(lambda path, _: leaf_name(path) not in NO_DECAY, params)
