"""A weight's gathers as LeafFetch.gathers records them against what the engine issues: each
record that moves is one all-gather of the traced fetch, over its axes, int8 (a packed uint8
buffer) or the working dtype, in its pass; and each is one entry of step_collectives' list."""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

from boost_jax.config import load_config
from boost_jax.mesh import make_mesh
from boost_jax.sharding import bucket, parallel
from boost_jax.sharding.gather import (BACKWARD, FORWARD, HpzForward, LeafFetch, fetch_tree,
                                       secondaries)
from boost_jax.sharding.step_collectives import Passes, leaf_collectives, leaves
from boost_jax.step.build import abstract_params

TINY = ["model.d_model=64", "model.n_layers=2", "model.n_heads=2", "model.d_ff=128",
        "model.rank=16", "model.max_seq_len=16", "data.seq_len=16", "model.vocab_size=256",
        "train.global_batch=32", "model.param_dtype=bfloat16", "model.dtype=bfloat16"]
PAIR = ["parallel.plan=zeropp", "parallel.secondary_axes=[pair]", "train.remat=full",
        "parallel.quantize_gather=false"]
CASES = {  # every branch of LeafFetch.gathers
    "no secondary": ["parallel.plan=zero3"],
    "no secondary, qwZ": ["parallel.plan=zero3", "parallel.quantize_gather=true"],
    "S ⊇ P, int8": ["parallel.plan=hierarchical"],
    "S ⊇ P, working dtype": ["parallel.plan=hierarchical", "parallel.secondary_axes=[pair,node]",
                             "parallel.secondary_dtype=bfloat16"],
    "S ⊂ P cut from the flat gather": ["parallel.plan=zeropp"],
    "S ⊂ P cut, working dtype": ["parallel.plan=zeropp", "parallel.secondary_axes=[pair]",
                                 "parallel.quantize_gather=false",
                                 "parallel.secondary_dtype=bfloat16"],
    "S = ∅, working dtype": ["parallel.plan=zero3", "parallel.secondary_axes=[]"],
    "S = ∅, int8 cut": ["parallel.plan=zero3", "parallel.secondary_axes=[]",
                        "parallel.secondary_dtype=int8"],
    "S = ∅, qwZ's gather kept": ["parallel.plan=zeropp", "parallel.secondary_axes=[]"],
    "hpZ packed": ["parallel.plan=zeropp", "train.remat=full"],
    "hpZ int8": [*PAIR, "parallel.secondary_dtype=int8"],
    "hpZ working dtype": [*PAIR, "parallel.secondary_dtype=bfloat16"],
}


@pytest.fixture(scope="module")
def mesh():
    return make_mesh("cpu", (2, 2, 2))


def _all_gathers(jaxpr) -> list[tuple[tuple, bool]]:
    """(axes, int8) of every all-gather in a jaxpr and those nested in it."""
    out = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "all_gather":
            axes = eqn.params["axis_name"]
            axes = tuple(axes) if isinstance(axes, (tuple, list)) else (axes,)
            out.append((axes, eqn.invars[0].aval.dtype == jnp.uint8))
        for v in eqn.params.values():
            for sub in v if isinstance(v, (tuple, list)) else (v,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    out += _all_gathers(inner)
    return out


def _traced(mesh, fn, *args) -> list[tuple[tuple, bool]]:
    sm = jax.shard_map(fn, mesh=mesh, in_specs=P(), out_specs=P(), check_vma=False)
    return _all_gathers(jax.make_jaxpr(sm)(*args).jaxpr)


def _saved(f: LeafFetch, x):
    """What the forward keeps for the backward's fetch: the secondary (or the stored shard)."""
    if f.hpz:
        rec = HpzForward(x)
        fetch_tree(f, rec)
        return rec.secs[0]
    return secondaries([f], [x])[0]


def _moving(f: LeafFetch, when: str) -> list[tuple[tuple, bool]]:
    return [(g.axes, g.int8) for g in f.gathers() if g.when == when and f.n(g.axes) > 1]


@pytest.mark.parametrize("case", list(CASES))
def test_the_engine_issues_each_gather_as_its_record_says(mesh, case):
    """Forward (the stored shard → the weight, hpZ's secondary kept) and backward (the saved
    copy → the weight): the traced all-gathers, in order, are the records that move."""
    cfg = load_config(None, TINY + CASES[case])
    pl = parallel.resolve(cfg, mesh, abstract_params(cfg.model, cfg.train)[1]).placement
    seen = 0
    for path, lay in leaves(pl):
        f = LeafFetch.of(pl, lay)
        if path[0] != "blocks" or not f.is_gathered:
            continue
        x = jnp.zeros(f.local_shape(f.params_axes), jnp.dtype(f.dtype))
        fwd = _traced(mesh, lambda v: fetch_tree(f, HpzForward(v) if f.hpz else v), x)
        assert fwd == _moving(f, FORWARD), (case, path, f.gathers())
        src = jax.eval_shape(jax.shard_map(lambda v: _saved(f, v), mesh=mesh, in_specs=P(),
                                           out_specs=P(), check_vma=False), x)
        bwd = _traced(mesh, lambda s: bucket.run([f.expand(s)]), src)
        assert bwd == _moving(f, BACKWARD), (case, path, f.gathers())
        listed = [(c.what, c.axes, c.runs) for c in leaf_collectives(pl, path, lay,
                                                                      Passes.of(2))
                  if c.what in ("gather", "gather(S)", "regather", "regather(S)")]
        assert listed == [(g.what, g.axes, g.when) for g in f.gathers() if f.n(g.axes) > 1]
        seen += len(fwd) + len(bwd)
    assert seen > 0


def test_the_records_cover_every_case(mesh):
    """The cases above reach each shape of record the engine reads: a secondary cut from the
    flat gather, one kept as it arrived (over no axes, and over S), and int8 both ways. And
    `expand`, which runs the last record in the backward, runs the one before it in the
    forward (remat replays it): the two differ only in name and pass, but under hpZ."""
    kinds = set()
    for extra in CASES.values():
        cfg = load_config(None, TINY + extra)
        pl = parallel.resolve(cfg, mesh, abstract_params(cfg.model, cfg.train)[1]).placement
        gs = pl.gathers()
        kinds |= {(g.what, bool(g.axes), g.src_axes != g.axes, g.int8, g.source) for g in gs}
        if not pl.hpz:
            fwd, bwd = gs[-2:]
            assert (fwd.when, bwd.when) == ("forward", "backward") and not fwd.source
            assert (fwd.axes, fwd.src_axes, fwd.int8, fwd.decoded) == \
                (bwd.axes, bwd.src_axes, bwd.int8, bwd.decoded), gs
    assert ("gather", True, False, True, True) in kinds  # qwZ's flat gather, secondary cut
    assert ("gather", True, False, False, True) in kinds  # working-dtype flat gather
    assert ("gather", False, True, True, False) in kinds  # a kept int8 gather, used
    assert ("regather(S)", True, True, True, False) in kinds  # hpZ's packed secondary
    assert ("regather", True, False, True, False) in kinds  # qwZ without a secondary
