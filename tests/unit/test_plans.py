"""Placement plans: presets, layouts (padding), numerics against ddp, checkpoints across plans.

Runs on 8 simulated CPU devices. The model has deliberately awkward sizes (vocab 260, d 36,
rank 9, d_ff 68): no dim of any weight divides by 8, so every sharded plan pads.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from boost_jax.backends.cpu import fast_compile_options
from boost_jax.config import CheckpointConfig, load_config
from boost_jax.errors import ConfigError
from boost_jax.mesh import make_mesh
from boost_jax.sharding.placement import choose_layout, make_placement, resolve_roles
from boost_jax.step.build import build_step

ODD = ["model.vocab_size=260", "model.d_model=36", "model.n_layers=2", "model.n_heads=2",
       "model.d_ff=68", "model.rank=9", "model.max_seq_len=16", "data.seq_len=16",
       "train.global_batch=16", "train.micro_batches=2", "train.steps=20", "optim.lr=0.01",
       "optim.warmup_frac=0.05"]
STEPS = 5
# fp32 runs that must equal ddp (int8 switched off), each exercising a different path
EXACT = {
    "zero1": [],
    "zero3": [],
    "zeropp": ["parallel.quantize_gather=false", "parallel.quantize_grads=false",
               "train.remat=full"],  # flat gather + hpZ
    "hierarchical": ["parallel.secondary_dtype=bfloat16"],  # re-gather from the pair shard
    "zero3-keep": ["parallel.secondary_axes=[]"],  # the forward's gather kept for backward
    "hierarchical-node": ["parallel.plan=hierarchical", "parallel.secondary_axes=[pair,node]",
                          "parallel.secondary_dtype=bfloat16", "train.remat=lowrank"],
}
INT8 = {"zeropp": ["parallel.quantize_grads=false"], "hierarchical": [],  # qwZ / int8 secondary
        "keep-hierarchical": ["parallel.secondary_axes=[]"],  # an int8 copy kept whole
        "keep-zeropp": ["parallel.secondary_axes=[]", "parallel.quantize_grads=false"]}
QGZ = ["parallel.quantize_gather=false", "parallel.quantize_grads=true"]  # int4 gradients


def _cfg(*extra):
    return load_config(None, ODD + list(extra))


def _batches():
    rng = np.random.default_rng(0)
    x = rng.integers(0, 256, (16, 16)).astype(np.int32)
    return {"inputs": x, "targets": (x + 1) % 256}  # learnable: the same batch every step


def _run(bundle, state, n):
    batch = {k: jax.device_put(v, bundle.batch_sharding) for k, v in _batches().items()}
    losses = []
    for _ in range(n):
        state, m = bundle.train_step(state, batch)
        losses.append(float(m["loss"]))
    return state, losses


@pytest.fixture(scope="module")
def mesh():
    return make_mesh("cpu", (2, 2, 2))


@pytest.fixture(scope="module")
def runs(mesh, tmp_path_factory):
    """5 fp32 steps per plan from one shared initial state; zero3 saves a checkpoint at 3."""
    from boost_jax.checkpoints.store import Checkpointer

    fast = fast_compile_options()
    ddp = build_step(_cfg(), mesh, fast)
    init = jax.device_get(ddp.init_state())
    out = {"ddp": _run(ddp, jax.device_put(init, ddp.state_shardings), STEPS)[1]}
    ckdir = str(tmp_path_factory.mktemp("ckpt"))
    for name, extra in (list(EXACT.items()) + [("int8-" + k, v) for k, v in INT8.items()]
                        + [("qgz-zeropp", QGZ)]):
        plan = name.split("-")[-1] if name.startswith(("int8-", "qgz-")) else name.split("-")[0]
        b = build_step(_cfg(f"parallel.plan={plan}", *extra), mesh, fast)
        st = jax.device_put(_pad_state(b, init), b.state_shardings)
        if name == "zero3":
            st, first = _run(b, st, 3)
            ck = Checkpointer(ckdir, CheckpointConfig(async_save=False))
            ck.save(3, st, {"pos": 3}, {"plan": "zero3"})
            ck.close()
            st, rest = _run(b, st, STEPS - 3)
            out[name] = first + rest
            out["zero3-bundle"] = b
            out["zero3-final"] = jax.device_get(st)
        else:
            out[name] = _run(b, st, STEPS)[1]
    out["ckdir"] = ckdir
    return out


def _pad_state(bundle, logical_state):
    """ddp's (unpadded) state → this plan's stored layout (zero padding)."""
    from boost_jax.sharding.layout import pad_tree

    pl = bundle.placement

    def pad_params_like(tree):
        return jax.tree.map(np.asarray, pad_tree(pl.layouts, tree))

    st = dict(logical_state)
    st["params"] = pad_params_like(st["params"])
    opt = st["opt_state"]
    leaves, treedef = jax.tree.flatten(opt)
    abs_leaves = jax.tree.leaves(bundle.abstract_state["opt_state"])
    padded = []
    for x, a in zip(leaves, abs_leaves):
        x = np.asarray(x)
        if x.shape != a.shape:
            x = np.pad(x, [(0, t - s) for s, t in zip(x.shape, a.shape)])
        padded.append(x)
    st["opt_state"] = jax.tree.unflatten(treedef, padded)
    return st


# --------------------------------------------------------------------------- presets


def test_presets_map_roles_to_axes():
    def roles(plan, *extra):
        r = resolve_roles(_cfg(f"parallel.plan={plan}", *extra))
        return (r["params"], r["grads"], r["opt_state"], r["secondary"], r["qwz"],
                r["sec_int8"])

    all3 = ("pair", "node", "global")
    assert roles("ddp") == ((), (), (), None, False, False)
    assert roles("zero1") == ((), (), all3, None, False, False)
    assert roles("zero3") == (all3, all3, all3, None, False, False)
    assert roles("zeropp") == (all3, all3, all3, ("pair", "node"), True, True)
    assert roles("hierarchical") == (("pair",), ("pair", "node"), all3, ("pair",), False, True)
    # TP axes never hold data-parallel roles; the weights TP took pair from re-home to node
    r = resolve_roles(_cfg("parallel.plan=hierarchical", "parallel.tp_mode=btp",
                           "parallel.tp_axes=[pair]"))
    assert (r["params"], r["grads"], r["opt_state"], r["batch"]) == \
        (("node",), ("node",), ("node", "global"), ("node", "global"))
    # overrides
    r = resolve_roles(_cfg("parallel.plan=hierarchical", "parallel.params_axes=[pair,node]",
                           "parallel.secondary_axes=[pair,node]"))
    assert r["params"] == ("pair", "node") and r["secondary"] == ("pair", "node")


@pytest.mark.parametrize("extra, match", [
    (["parallel.plan=zero3", "parallel.tp_mode=btp", "parallel.tp_axes=[pair]",
      "parallel.params_axes=[pair,node]"], "tensor parallelism"),
    (["parallel.plan=ddp", "parallel.secondary_axes=[pair]"], "needs sharded weights"),
    (["parallel.plan=ddp", "parallel.quantize_gather=true"], "needs sharded weights"),
    (["parallel.plan=zero3", "parallel.batch_axes=[node]"], "not batch axes"),
])
def test_bad_role_overrides_are_config_errors(extra, match):
    with pytest.raises(ConfigError, match=match):
        resolve_roles(_cfg(*extra))


@pytest.mark.parametrize("extra, match", [
    (["parallel.plan=zeropp", "parallel.defer_update=true"], "sharded like the optimizer"),
    (["parallel.plan=hierarchical", "parallel.defer_update=false",
      "parallel.quantize_cross_node_weights=int8"], "needs a deferred update"),
    (["parallel.plan=zero3", "parallel.quantize_cross_node_grads=int4"], "across nodes"),
    (["parallel.plan=hierarchical", "parallel.batch_axes=[pair,node]",
      "parallel.defer_update=true"], r"sharded over \['global'\], not batch axes"),
])
def test_deferred_and_quantized_cross_node_legs_where_absent_are_config_errors(mesh, extra,
                                                                              match):
    with pytest.raises(ConfigError, match=match):
        make_placement(_cfg(*extra), mesh)


def test_an_update_is_not_deferred_over_axes_that_see_the_same_batch(mesh):
    """Optimizer state over an axis the batch is not split on: the gradient is the same on
    each of its devices, so the deferred gather's transpose cannot reduce-scatter it there;
    the update is gathered after the optimizer instead (trained like ddp, not a failed trace)."""
    for extra in (["parallel.plan=hierarchical", "parallel.batch_axes=[pair,node]"],
                  ["parallel.plan=zero3", "parallel.batch_axes=[pair,node]",
                   "parallel.params_axes=[pair,node]", "parallel.grads_axes=[pair,node]"]):
        pl = make_placement(_cfg(*extra), mesh)
        assert "global" in pl.opt_state_axes and not pl.defer_update
    assert make_placement(_cfg("parallel.plan=hierarchical"), mesh).defer_update


def test_layouts_divide_or_pad():
    mesh = make_mesh("cpu", (2, 2, 2))
    lay = choose_layout((24, 2048, 5461), 64, layer_axis=True)
    assert (lay.dim, lay.pad) == (1, 0)  # d divides; d_ff=5461 does not; never the layer axis
    lay = choose_layout((5461,), 64)
    assert (lay.dim, lay.padded) == (0, (5504,))  # 86 per device, 43 of them padding
    lay = choose_layout((32000, 2048), 384)  # 384 = 2^7·3: nothing divides → pad the vocab
    assert (lay.dim, lay.padded) == (0, (32256, 2048))
    lay = choose_layout((24, 512), 8, tp=[(), ("pair",)], layer_axis=True, mesh=mesh)
    assert (lay.dim, lay.pad) == (1, 0)  # TP dim 512/2 = 256 still divides by 8
    assert lay.spec(("node", "global")) == P(None, ("pair", "node", "global"))


def test_real_positions_mark_what_pad_fills():
    """The per-dim vectors of real_positions multiply out to the elements `pad` fills from the
    logical array: a padded dim, an end weight in its owner's slot, an interleaved layer stack
    with padded layers."""
    from boost_jax.sharding.layout import LeafLayout, pad, real_positions

    for lay in (LeafLayout((5, 3), (5, 4), 1, ((), ())),
                LeafLayout((4, 6), (4, 6), None, ((), ()), layer_axis=True, owner=2),
                LeafLayout((7, 3), (8, 4), 1, ((), ()), layer_axis=True, interleave=(2, 2))):
        vecs = real_positions(lay)
        logical = lay.shape[1:] if lay.owner is not None else lay.shape
        want = np.asarray(pad(lay, jnp.ones(logical))) != 0
        got = np.ones(lay.padded, bool)
        for i, v in enumerate(vecs):
            got &= v.reshape([-1 if j == i else 1 for j in range(len(vecs))])
        np.testing.assert_array_equal(got, want)
        jax.make_jaxpr(lambda: [jnp.asarray(v) for v in real_positions(lay)])()  # jit-safe


def test_padding_is_reported_in_memory(mesh):
    pl = make_placement(_cfg("parallel.plan=zero3"), mesh,
                        __import__("boost_jax.step.build", fromlist=["x"]).abstract_params(
                            _cfg().model, _cfg().train)[1])
    mem = pl.memory()
    assert mem["padded_params"] > mem["params"] and mem["padding"] > 0
    # zero3: every role sharded over all 8 devices (fp32 weights: no master copy)
    psi = mem["padded_params"]
    assert mem["weights"] == pytest.approx(4 * psi / 8)
    assert mem["adam"] == pytest.approx(8 * psi / 8) and mem["master"] == 0


def test_mixed_precision_state_layout(mesh):
    b = build_step(_cfg("parallel.plan=hierarchical", "model.param_dtype=bfloat16",
                        "model.dtype=bfloat16"), mesh)
    st = b.abstract_state
    assert set(st) == {"step", "params", "master", "opt_state"}
    w = st["params"]["blocks"]["mlp"]["up"]["a"]
    m = st["master"]["blocks"]["mlp"]["up"]["a"]
    assert w.dtype == jnp.bfloat16 and m.dtype == jnp.float32
    lay = b.placement.layouts["blocks"]["mlp"]["up"]["a"]
    # the working weights stored on the optimizer's shards: the deferred update (the next
    # step's first forward gathers them to the pair shard, parallel.defer_update)
    assert w.sharding.spec[lay.dim] == ("pair", "node", "global")
    assert m.sharding.spec[lay.dim] == ("pair", "node", "global")
    b0 = build_step(_cfg("parallel.plan=hierarchical", "model.param_dtype=bfloat16",
                         "model.dtype=bfloat16", "parallel.defer_update=false"), mesh)
    assert b0.abstract_state["params"]["blocks"]["mlp"]["up"]["a"].sharding.spec[lay.dim] \
        == "pair"
    mu = [x for x in jax.tree.leaves(st["opt_state"]) if x.shape == m.shape]
    assert mu and all(x.sharding.spec[lay.dim] == ("pair", "node", "global") for x in mu)
    assert b.n_params < sum(math.prod(x.shape) for x in jax.tree.leaves(st["params"]))


# --------------------------------------------------------------------------- numerics


@pytest.mark.parametrize("name", list(EXACT))
def test_plans_give_ddp_losses_in_fp32(runs, name):
    np.testing.assert_allclose(runs[name], runs["ddp"], rtol=1e-5)


@pytest.mark.parametrize("plan", list(INT8))
def test_int8_plans_stay_close_and_learn(runs, plan):
    # int8 per-block weights (block 256: |Δw| ≤ max|block|/254) perturb the loss by ≲ 1e-3;
    # the gap grows with the updates' total lr: 15 lr/W over 5 warmup updates, ≲ 3e-3
    np.testing.assert_allclose(runs["int8-" + plan], runs["ddp"], rtol=3e-3)
    assert runs["int8-" + plan][-1] < runs["int8-" + plan][0] - 0.05


def test_qgz_int4_gradients_stay_close_and_learn(runs):
    """ZeRO++'s qgZ: int4 gradient blocks (|Δ| ≤ max|block|/14 per stage) change the updates
    by a few percent; over 5 warmup updates (15 lr/W in all) the losses stay within 1.5% of
    ddp's and fall."""
    np.testing.assert_allclose(runs["qgz-zeropp"], runs["ddp"], rtol=1.5e-2)
    assert not np.allclose(runs["qgz-zeropp"], runs["ddp"], rtol=1e-6)  # it did quantize
    assert runs["qgz-zeropp"][-1] < runs["qgz-zeropp"][0] - 0.05


def test_losses_fall(runs):
    assert runs["ddp"][-1] < runs["ddp"][0] - 0.05


def test_fetch_of_a_padded_leaf_is_exact_and_reduce_scatters_its_gradient(mesh):
    """One weight under zero3 inside the manual step: the fetch gathers the padded shard into
    the exact weight, and each device's gradient (its own rows: here weighted by its index + 1)
    comes back summed over the devices, in the grads sharding, with zero padding."""
    from boost_jax.sharding.gather import LeafFetch, fetch_leaf, slot_like
    from boost_jax.sharding.layout import spec_entry

    pl = make_placement(_cfg("parallel.plan=zero3"), mesh, {"w": jax.ShapeDtypeStruct(
        (5, 6), jnp.float32)})
    lay = pl.layouts["w"]
    assert lay.padded == (5, 8)
    f = LeafFetch(lay, tuple(mesh.shape.items()), pl.batch_axes, pl.params_axes, pl.grads_axes,
                  None, False, False, 256, "float32", "float32")
    x = jnp.arange(30, dtype=jnp.float32).reshape(5, 6)
    xp = jax.device_put(jnp.pad(x, ((0, 0), (0, 2))), NamedSharding(mesh, lay.spec(
        pl.params_axes)))
    c = jnp.arange(1, 9, dtype=jnp.float32)

    def body(xp, c):
        loss = lambda s: c[0] * jnp.sum(fetch_leaf(f, xp, s) * x)  # noqa: E731
        val, g = jax.value_and_grad(loss)(slot_like(f, f.local_shape(pl.grads_axes), ()))
        return jax.lax.psum(val, pl.batch_axes), g

    rows = P(spec_entry(pl.batch_axes))
    fn = jax.shard_map(body, mesh=mesh, in_specs=(lay.spec(pl.params_axes), rows),
                       out_specs=(P(), lay.spec(pl.grads_axes)))
    val, grad = jax.jit(fn)(xp, c)
    assert float(val) == pytest.approx(36 * float(jnp.sum(x * x)))
    np.testing.assert_array_equal(np.asarray(grad)[:, :6], 36 * np.asarray(x))
    np.testing.assert_array_equal(np.asarray(grad)[:, 6:], 0)


def test_a_kept_int8_gather_is_the_weight_the_plain_int8_gather_gives(mesh):
    """ZeRO++ /keep (qwZ, secondary over no axes) keeps the int8 shards as they arrived: the
    weight it uses is bit for bit the one a plain int8 gather gives (never dequantized and
    quantized again), in the forward and in the backward's re-use of the saved copy."""
    from boost_jax.sharding.gather import LeafFetch, fetch_tree
    from boost_jax.sharding.layout import spec_entry

    pl = make_placement(_cfg("parallel.plan=zero3"), mesh, {"w": jax.ShapeDtypeStruct(
        (6, 40), jnp.float32)})
    lay = pl.layouts["w"]
    x = jax.random.normal(jax.random.key(0), lay.padded, jnp.float32)
    xp = jax.device_put(x, NamedSharding(mesh, lay.spec(pl.params_axes)))

    def weight(secondary):
        f = LeafFetch(lay, tuple(mesh.shape.items()), pl.batch_axes, pl.params_axes,
                      pl.grads_axes, secondary, True, False, 16, "float32", "float32")
        fn = jax.shard_map(lambda v: fetch_tree(f, v)[None], mesh=mesh,
                           in_specs=lay.spec(pl.params_axes),
                           out_specs=P(spec_entry(pl.batch_axes)), check_vma=False)
        return np.asarray(jax.jit(fn)(xp))

    plain, kept = weight(None), weight(())
    assert f"{plain.shape}" == f"{(8, *lay.padded)}"
    np.testing.assert_array_equal(kept, plain)
    assert not np.array_equal(plain[0], np.asarray(x))  # it did quantize


# --------------------------------------------------------------------------- checkpoints


def test_checkpoint_restores_under_another_plan_and_mesh(runs):
    """zero3 on (2,2,2) saved at step 3 → hierarchical on (2,4,1) continues identically; and
    the padded checkpoint restores into unpadded ddp arrays (orbax strict=False)."""
    import orbax.checkpoint as ocp

    from boost_jax.checkpoints.store import Checkpointer

    mesh2 = make_mesh("cpu", (2, 4, 1))
    b2 = build_step(_cfg("parallel.plan=hierarchical", "parallel.secondary_dtype=bfloat16"),
                    mesh2, fast_compile_options())
    ck = Checkpointer(runs["ckdir"], CheckpointConfig(async_save=False))
    state, data, meta = ck.restore(3, b2.abstract_state)
    assert data == {"pos": 3} and meta["plan"] == "zero3"
    lay = b2.placement.layouts["blocks"]["attn"]["q"]["a"]
    # a deferred update stores the new weights on the optimizer's shards
    assert b2.placement.defer_update
    assert state["params"]["blocks"]["attn"]["q"]["a"].sharding.spec[lay.dim] == \
        ("pair", "node", "global")
    _, losses = _run(b2, state, STEPS - 3)
    np.testing.assert_allclose(losses, runs["zero3"][3:], rtol=1e-5)

    # into ddp's unpadded layout: orbax pads/truncates trailing zeros with strict=False
    z3 = runs["zero3-bundle"]
    padded, _, _ = ck.restore(3, z3.abstract_state)
    ddp = build_step(_cfg(), make_mesh("cpu", (2, 2, 2)))
    got = ck.mngr.restore(3, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(ddp.abstract_state, strict=False)))["state"]
    ck.close()
    n_padded = 0
    for lay, a, b in zip(jax.tree.leaves(z3.placement.layouts, is_leaf=lambda x: hasattr(x, "padded")),
                         jax.tree.leaves(padded["params"]), jax.tree.leaves(got["params"])):
        a, b = np.asarray(jax.device_get(a)), np.asarray(jax.device_get(b))
        assert a.shape == lay.padded and b.shape == lay.shape
        n_padded += a.shape != b.shape
        np.testing.assert_array_equal(a[tuple(slice(0, n) for n in lay.shape)], b)
        assert not a[tuple(slice(n, None) if i == lay.dim else slice(None)
                           for i, n in enumerate(lay.shape))].any()  # the padding is zero
    assert n_padded > 0


def test_a_deferred_update_resumes_and_evaluates_the_true_weights(runs, mesh, tmp_path):
    """hierarchical stores the updated weights on the optimizer's shards (the next step's first
    forward gathers them): a run saved at step 3 and restored continues exactly as the
    uninterrupted one, and evaluation on the stored weights is ddp's on the same weights."""
    from boost_jax.checkpoints.store import Checkpointer

    fast = fast_compile_options()
    b = build_step(_cfg("parallel.plan=hierarchical", "parallel.secondary_dtype=bfloat16"),
                   mesh, fast)
    assert b.placement.defer_update and b.placement.stored_axes == b.placement.opt_state_axes
    ddp = build_step(_cfg(), mesh, fast)
    init = jax.device_get(ddp.init_state())
    st, first = _run(b, jax.device_put(_pad_state(b, init), b.state_shardings), 3)
    ck = Checkpointer(str(tmp_path), CheckpointConfig(async_save=False))
    ck.save(3, st, {"pos": 3}, {"plan": "hierarchical"})
    ck.close()
    ck = Checkpointer(str(tmp_path), CheckpointConfig(async_save=False))
    restored, _, _ = ck.restore(3, b.abstract_state)
    ck.close()
    batch = {k: jax.device_put(v, b.batch_sharding) for k, v in _batches().items()}
    logical = jax.device_put(jax.device_get(b.logical_params(restored)),
                             ddp.state_shardings["params"])
    want = float(ddp.eval_step(logical, {k: jax.device_put(v, ddp.batch_sharding)
                                         for k, v in _batches().items()}))
    assert float(b.eval_step(b.eval_params(restored), batch)) == pytest.approx(want, rel=1e-6)
    _, rest = _run(b, restored, STEPS - 3)
    np.testing.assert_allclose(first + rest, runs["hierarchical"], rtol=1e-6)


def test_tensor_parallel_axes_are_left_out_of_the_plan(mesh):
    """hierarchical + BTP over `pair`: weights and grads over node (re-homed), optimizer
    state over node+global, the cross-node reduction deferred to once a step, TP specs kept —
    and the same losses as plain ddp."""
    tp_ok = ["model.vocab_size=256", "model.d_model=32", "model.rank=8", "model.d_ff=64"]
    fast = fast_compile_options()
    ref = build_step(_cfg(*tp_ok), mesh, fast)
    init = jax.device_get(ref.init_state())
    _, want = _run(ref, jax.device_put(init, ref.state_shardings), 3)
    b = build_step(_cfg(*tp_ok, "parallel.plan=hierarchical", "parallel.tp_mode=btp",
                        "parallel.tp_axes=[pair]", "parallel.secondary_dtype=bfloat16"),
                   mesh, fast)  # exact: no int8 copy of the re-homed weights
    pl = b.placement
    # the weights re-homed from pair (TP's) to node, gathered there from the optimizer's shards
    assert (pl.params_axes, pl.grads_axes, pl.opt_state_axes) == (("node",), ("node",),
                                                                 ("node", "global"))
    assert pl.defer_update
    assert pl.deferred_axes == ("global",)  # under TP too: reduced across nodes once a step
    spec = b.abstract_state["opt_state"][0].mu["blocks"]["mlp"]["up"]["b"].sharding.spec
    assert "pair" in str(spec) and "global" in str(spec)
    _, got = _run(b, jax.device_put(_pad_state(b, init), b.state_shardings), 3)
    np.testing.assert_allclose(got, want, rtol=1e-5)
