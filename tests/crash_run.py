"""The crash tests' tiny run and their NaN injection, shared by tests/e2e/test_crash.py (with
train.py subprocesses) and tests/unit/test_crash_nonfinite.py (in-process only)."""

import numpy as np
import pytest

TINY = ["model.d_model=32", "model.n_layers=2", "model.n_heads=2", "model.d_ff=64",
        "model.rank=8", "model.max_seq_len=32", "data.seq_len=32", "data.max_bytes=300000",
        "train.global_batch=8", "train.eval_batches=2", "train.log_every=1",
        "logging.progress=false", "logging.tensorboard=false", "logging.plot=false",
        "optim.lr=0.01", "optim.warmup_frac=0.1"]
STEPS = 12
RUN = TINY + [f"train.steps={STEPS}", "train.eval_every=6", "checkpoint.every=3",
              "checkpoint.keep=3"]


@pytest.fixture
def nan_at_step(monkeypatch):
    """Make the loss of one chosen step non-finite, through the real step and loss path.

    The data iterator marks that step's batch (a -1 in inputs[0, 0]); each device's loss
    (boost_jax.step.engine.Engine.local_loss, patched) is multiplied by NaN when its rows carry
    the mark, so the loss and every gradient are NaN exactly for that batch.
    """
    import jax.numpy as jnp

    import boost_jax.data as data_mod
    from boost_jax.step.engine import Engine

    real_local_loss = Engine.local_loss

    def poisoned_local_loss(self, params, batch, *rest, **kw):
        mark = batch["inputs"] < 0
        clean = {k: jnp.maximum(v, 0) for k, v in batch.items()}
        return real_local_loss(self, params, clean, *rest, **kw) * jnp.where(
            jnp.any(mark), jnp.nan, 1.0)

    class MarkedIter:
        def __init__(self, it, step):
            self.it, self.step = it, step

        def __next__(self):
            batch = next(self.it)
            if self.it.get_state()["windows"] == self.step * 8:  # train.global_batch=8
                batch = {k: np.array(v) for k, v in batch.items()}
                batch["inputs"][0, 0] = -1
            return batch

        def get_state(self):
            return self.it.get_state()

        def set_state(self, state):
            self.it.set_state(state)

    real_build_data = data_mod.build_data
    chosen = {}

    def build_data(*a, **k):
        d = real_build_data(*a, **k)
        d.train_iter = MarkedIter(d.train_iter, chosen["step"])
        return d

    monkeypatch.setattr(Engine, "local_loss", poisoned_local_loss)
    monkeypatch.setattr(data_mod, "build_data", build_data)
    return lambda step: chosen.update(step=step)
