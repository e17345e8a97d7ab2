"""Analytic FLOPs (analysis/flops.py) against XLA's cost_analysis of the compiled model."""

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from boost_jax.analysis.flops import flops_per_token, param_count
from boost_jax.backends.cpu import fast_compile_options
from boost_jax.config import ModelConfig
from boost_jax.layers.model import abstract_model

B, S = 2, 64


def cfg_for(arch, **kw):
    # d large enough that matmuls dominate norms/softmax/SiLU (which flops.py ignores)
    base = dict(arch=arch, vocab_size=512, d_model=256, n_layers=2, n_heads=4, n_kv_heads=2,
                d_ff=512, rank=64, lax_gate="gate", max_seq_len=S)
    return ModelConfig(**{**base, **kw})


def xla_flops(cfg, train):
    # scan_layers=False: cost_analysis counts a while-loop (scan) body once, not L times
    graphdef, state = abstract_model(cfg, scan_layers=False)
    toks = jax.ShapeDtypeStruct((B, S), jnp.int32)

    def loss(p, t):
        logits = nnx.merge(graphdef, p)(t)
        logp = jax.nn.log_softmax(logits, -1)
        return -jnp.take_along_axis(logp, t[..., None], -1).mean()
    f = jax.grad(loss) if train else loss
    compiled = jax.jit(f).lower(state, toks).compile(fast_compile_options())
    cost = compiled.cost_analysis()
    assert isinstance(cost, dict)  # a dict on this JAX (older versions: a list of dicts)
    return cost["flops"] / (B * S)


@pytest.mark.parametrize("arch,train", [("full", False), ("svd", False), ("cola", True),
                                        ("lax", False), ("lax", True)])
def test_flops_match_xla(arch, train):
    cfg = cfg_for(arch)
    want = flops_per_token(cfg, S)["train" if train else "forward"]
    got = xla_flops(cfg, train)
    assert got == pytest.approx(want, rel=0.10), (got / want)


def test_flops_formula_by_hand():
    cfg = cfg_for("cola", lax_gate="identity")
    d, r, f, kv, L = 256, 64, 512, 128, 2
    proj = 2 * r * ((d + d) * 2 + (d + kv) * 2 + (d + f) * 2 + (f + d))
    ft = flops_per_token(cfg, S)
    assert ft["per_layer"] == proj + 4 * S * d
    assert ft["forward"] == L * (proj + 4 * S * d) + 2 * d * 512
    assert ft["train"] == 3 * ft["forward"]
    full = cfg_for("full", n_kv_heads=None)  # classic 6N: 2·(matmul params) per token
    matmul_params = param_count(full) - 512 * 256 - (2 * L + 1) * 256
    assert flops_per_token(full, S)["forward"] == 2 * matmul_params + L * 4 * S * 256


def test_flash_counts_only_the_causal_tiles():
    """Flash attention computes the kv tiles at or below the diagonal: at 4096 positions in
    tiles of 256, 16·17/2 = 136 of the 256 tiles the dense path computes."""
    cfg = cfg_for("cola", max_seq_len=4096)
    dense = flops_per_token(cfg, 4096)
    flash = flops_per_token(cfg, 4096, "blockwise")
    assert flash["attention"] * 256 == dense["attention"] * 136
    assert flash["projections"] == dense["projections"]
    assert flops_per_token(cfg, 200, "blockwise") == flops_per_token(cfg, 200)  # one tile
    # tiles of 64: 3 of 4 at 128 positions
    assert flops_per_token(cfg, 128, "pallas")["attention"] * 4 == \
        flops_per_token(cfg, 128)["attention"] * 3
