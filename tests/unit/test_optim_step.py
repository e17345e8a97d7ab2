"""Optimizer steps of the real training step (ddp on 8 devices, 2 micro-batches, clipping,
AdamW) against an independent single-device optax reference."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from boost_jax.backends.cpu import fast_compile_options
from boost_jax.config import load_config
from boost_jax.layers import forward
from boost_jax.mesh import mesh_from_config
from boost_jax.step.build import build_step

STEPS = 3  # warmup 0.3 x 3 rounds to one update: lr, then the cosine down to its end
CFG = ["model.arch=cola", "model.d_model=32", "model.n_layers=2", "model.n_heads=2",
       "model.d_ff=64", "model.rank=8", "model.vocab_size=256", "model.max_seq_len=16",
       "model.dtype=float32", "model.param_dtype=float32", "data.seq_len=16",
       "train.global_batch=16", "train.micro_batches=2", f"train.steps={STEPS}",
       "parallel.plan=ddp", "optim.lr=0.01", "optim.warmup_frac=0.3", "optim.clip_norm=0.05",
       "optim.weight_decay=0.1", "optim.eps=1e-3"]


def _make_reference(cfg, params):
    """optax.adamw with optim.py's schedule and hyperparameters, written out independently:
    run(params, batches, clip) → (params after each batch, gradient norms)."""
    o = cfg.optim
    warmup = max(1, int(o.warmup_frac * STEPS))

    def sched(count):  # update k = count + 1: lr·k/W up to W, then cosine to the last update
        k = count + 1
        t = jnp.clip((k - warmup) / max(STEPS - warmup, 1), 0.0, 1.0)
        cosine = o.lr * (o.min_lr_ratio + (1 - o.min_lr_ratio) * 0.5 * (1 + jnp.cos(jnp.pi * t)))
        return jnp.where(k <= warmup, o.lr * k / warmup, cosine)
    mask = jax.tree_util.tree_map_with_path(
        lambda path, _: path[-1].key not in ("scale", "latent_scale"), params)

    def tx(clip):
        return optax.chain(optax.clip_by_global_norm(clip),
                           optax.adamw(sched, o.b1, o.b2, o.eps, weight_decay=o.weight_decay,
                                       mask=mask))

    ops = forward.Local(cfg.model)

    def grads(p, batch):  # 2 micro-batches of 8 rows, their gradients averaged
        halves = [jax.tree.map(lambda x: x[i * 8:(i + 1) * 8], batch) for i in range(2)]
        gs = [jax.grad(lambda q: forward.loss(ops, cfg.model, q, h))(p) for h in halves]
        return jax.tree.map(lambda a, b: (a + b) / 2, *gs)

    @jax.jit
    def step(p, state, batch, clip):  # one compile serves every clip value
        g = grads(p, batch)
        updates, state = tx(clip).update(g, state, p)
        return optax.apply_updates(p, updates), state, optax.tree.norm(g)

    def run(p, batches, clip):
        state, norms = tx(clip).init(p), []
        for batch in batches:
            p, state, norm = step(p, state, batch, jnp.float32(clip))
            norms.append(float(norm))
        return p, norms

    return run


def test_steps_match_a_single_device_optax_reference():
    cfg = load_config(None, CFG)
    bundle = build_step(cfg, mesh_from_config(cfg), fast_compile_options())
    state = bundle.init_state()
    p0 = jax.tree.map(lambda x: np.asarray(jax.device_get(x)), state["params"])
    rng = np.random.default_rng(0)
    batches = [{k: rng.integers(0, 256, (16, 16), dtype=np.int32) for k in ("inputs", "targets")}
               for _ in range(STEPS)]
    norms = []
    for b in batches:
        state, m = bundle.train_step(state, jax.device_put(b, bundle.batch_sharding))
        norms.append(float(m["grad_norm"]))
    got = jax.tree.map(lambda x: np.asarray(jax.device_get(x)), state["params"])

    reference = _make_reference(cfg, p0)
    want, ref_norms = reference(jax.tree.map(jnp.asarray, p0), batches, cfg.optim.clip_norm)
    assert min(ref_norms) > 4 * cfg.optim.clip_norm  # clipping is active at every step
    np.testing.assert_allclose(norms, ref_norms, rtol=1e-5)
    moved = jax.tree.leaves(jax.tree.map(lambda a, b: np.abs(a - b).max(), got, p0))
    assert min(moved) > 1e-4  # every weight changed
    jax.tree.map(lambda g, w: np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-7), got, want)
    # the comparison can fail: without clipping the reference lands elsewhere
    unclipped, _ = reference(jax.tree.map(jnp.asarray, p0), batches, 1e9)
    assert max(jax.tree.leaves(jax.tree.map(lambda a, b: np.abs(a - b).max(), got,
                                            unclipped))) > 1e-4
