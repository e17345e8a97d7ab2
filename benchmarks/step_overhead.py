"""Framework step vs a minimal hand-written jax.jit step of the same model, timed side by side.

    python benchmarks/step_overhead.py [--arch cola] [--d 256] [--layers 4] [--batch 16] [--seq 128]
                                       [--rounds 7] [--out benchmarks/results/step_overhead.md]

Both steps compute the same thing: forward, cross-entropy, backward, global-norm clipping and
AdamW, on one device. The framework's step adds its bookkeeping (non-finite flag, schedule
read-out, sharding constraints); the ratio shows what that costs.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.common import (RESULTS, add_out, positive_int, early_cpu_devices, guard_out, interleaved_samples,  # noqa: E402
                               load_note, markdown_table, spread_verdict, write_result)

early_cpu_devices(1)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

from boost_jax.config import load_config  # noqa: E402
from boost_jax.mesh import make_mesh  # noqa: E402
from boost_jax.step.optim import make_optimizer  # noqa: E402
from boost_jax.layers.forward import cross_entropy  # noqa: E402
from boost_jax.step.build import build_step, model_factory  # noqa: E402


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--arch", default="cola")
    p.add_argument("--d", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--rounds", type=positive_int, default=7)
    p.add_argument("--cpu-devices", type=int)
    add_out(p, os.path.join(RESULTS, "step_overhead.md"))
    a = p.parse_args()
    guard_out(a.out, force=a.force)
    return a


def make_cfg(a):
    d = a.d
    return load_config(None, [
        f"model.arch={a.arch}", f"model.d_model={d}", f"model.n_layers={a.layers}",
        f"model.n_heads={max(1, d // 64)}", f"model.d_ff={int(d * 8 / 3) // 8 * 8}",
        f"model.max_seq_len={a.seq}", f"data.seq_len={a.seq}",
        f"train.global_batch={a.batch}", "train.steps=1000"])


def framework_step(cfg, batch):
    """The framework's training step on one device, blocking."""
    mesh = make_mesh("cpu", shape=[1, 1, 1])
    bundle = build_step(cfg, mesh)
    state = {"s": bundle.init_state()}

    def framework():
        state["s"], m = bundle.train_step(state["s"], batch)
        jax.block_until_ready(m["loss"])

    return framework


def hand_step(cfg, batch):
    """The minimal step: what one would write by hand with flax + optax."""
    model = model_factory(cfg.model, cfg.train)()
    graphdef, params = nnx.split(model, nnx.Param)
    params = nnx.to_pure_dict(params)
    tx = optax.chain(optax.clip_by_global_norm(cfg.optim.clip_norm),
                     make_optimizer(cfg.optim, cfg.train.steps))
    hand = {"p": params, "o": tx.init(params)}

    @jax.jit
    def minimal_step(params, opt_state, batch):
        def loss_fn(p):
            return cross_entropy(nnx.merge(graphdef, p)(batch["inputs"]), batch["targets"])

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    def minimal():
        hand["p"], hand["o"], loss = minimal_step(hand["p"], hand["o"], batch)
        jax.block_until_ready(loss)

    return minimal


def report(a, samples, load_before) -> str:
    t = {k: statistics.median(v) for k, v in samples.items()}
    ratios = [f / m for f, m in zip(samples["framework"], samples["minimal"])]
    tok = a.batch * a.seq
    rows = [[k, v * 1e3, tok / v] for k, v in t.items()]
    ratio = t["framework"] / t["minimal"]
    within = "within" if ratio <= 1.10 else "**outside**"
    return f"""# Framework step vs a minimal hand-written step

Reproduce: `python benchmarks/step_overhead.py --rounds {a.rounds}` (writes
`results/step_overhead.md`, copied here).

Same model ({a.arch}, d={a.d}, L={a.layers}, batch {a.batch} × {a.seq} tokens, one
{jax.default_backend().upper()} device), same optimizer; the minimal step is forward +
cross-entropy + `jax.value_and_grad` + optax clip + AdamW in one `jax.jit`. Aim: the framework
within 10%. {a.rounds} alternating rounds of 3 steps after 2 warm-up steps each; {load_before}
before the rounds, {load_note()} after (other processes share the cores).

{markdown_table(["step", "ms/step (median)", "tokens/s"], rows)}

framework / minimal step time: {ratio:.3f} (median; per round {min(ratios):.3f}–{max(ratios):.3f}):
{spread_verdict(ratios, "the framework step", "the minimal step")}; the median is {within} the
10% aim.
"""


def main():
    a = parse_args()
    cfg = make_cfg(a)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, cfg.model.vocab_size, (a.batch, a.seq + 1), dtype=np.int32)
    batch = {"inputs": jnp.asarray(tokens[:, :-1]), "targets": jnp.asarray(tokens[:, 1:])}
    fns = {"framework": framework_step(cfg, batch), "minimal": hand_step(cfg, batch)}
    load_before = load_note()
    samples = interleaved_samples(fns, rounds=a.rounds)
    doc = report(a, samples, load_before)
    print(doc)
    write_result(a.out, doc)


if __name__ == "__main__":
    main()
