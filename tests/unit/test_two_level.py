"""parallel.collectives=two_level: collectives spanning hosts and a node run as rank-aligned
sub-collectives (sharding/bucket.py). 8 simulated devices as (pair, node, global) =
(2, 2, 2). Each two-level op gives exactly the flat collective's result (awkward shapes, every
axis order); the compiled step's groups never mix `global` with a node axis; losses equal the
flat step's; the step's list (step_collectives.py) is what is compiled."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from boost_jax.mesh import make_mesh
from boost_jax.sharding import bucket
from boost_jax.sharding.bucket import Policy


@pytest.fixture(scope="module")
def mesh():
    return make_mesh("cpu", (2, 2, 2))


AXES_ORDERS = [("pair", "node", "global"), ("global", "pair"), ("node", "global", "pair"),
               ("global", "node")]


def _run(mesh, body, x):
    spec = P(("pair", "node", "global"))
    f = jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec, check_vma=True)
    return np.asarray(jax.jit(f)(x))


@pytest.mark.parametrize("axes", AXES_ORDERS)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_each_op_equals_the_flat_collective(mesh, axes, dtype):
    pol = Policy.of("two_level", mesh.shape)
    assert pol.split("all-gather", axes) is not None
    n = pol.n(axes)
    x = (jnp.arange(8 * 3 * n * 5, dtype=jnp.float32) % 13 - 6).astype(dtype)
    x = x.reshape(8 * 3, n * 5)  # each device: [3, n·5]

    def gathers(v):
        flat = jax.lax.all_gather(v, axes, axis=1, tiled=True)
        two = bucket.tiled_all_gather(v, axes, 1, pol)
        return (flat - two)[:, :v.shape[1]]

    def scatters(v):
        flat = jax.lax.psum_scatter(v, axes, scatter_dimension=1, tiled=True)
        two = bucket.psum_scatter(v, axes, 1, pol)
        return jnp.tile(flat - two, (1, n))

    def reduces(v):  # a padded length: 3·n·5 is not a multiple of the node's members
        d = jax.lax.psum(v[:, :7], axes) - bucket.all_reduce(v[:, :7], axes, pol)
        return jnp.zeros_like(v).at[:, :7].set(d)

    for body in (gathers, scatters, reduces):
        assert not np.any(_run(mesh, body, x)), (body.__name__, axes)


def test_an_op_issues_no_group_that_mixes_global_with_a_node_axis(mesh):
    from boost_jax.analysis.comm import analyze

    pol = Policy.of("two_level", mesh.shape)
    axes = ("pair", "node", "global")

    def body(v):
        g = bucket.tiled_all_gather(v, axes, 0, pol)
        return bucket.psum_scatter(g, axes, 0, pol) + bucket.all_reduce(v, axes, pol)

    spec = P(axes)
    f = jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec)
    r = analyze(f, [jax.ShapeDtypeStruct((24, 5), jnp.float32)], mesh)
    assert r.collectives
    assert all(c.axes == ("global",) or "global" not in c.axes for c in r.collectives), \
        r.table()


@pytest.mark.parametrize("g", [3, 5, 6, 8])
def test_exchanges_equal_the_ring_and_take_log2_steps(g):
    """log_step over g hosts (a (1, 1, g) mesh of the first g devices): Bruck's all-gather and
    its transpose give the ring's results exactly (fp32 and bf16, awkward widths) and compile
    to ⌈log2 g⌉ collective-permutes each, with no ring collective left."""
    from jax.sharding import Mesh

    from boost_jax.analysis.comm import analyze

    mesh = Mesh(np.array(jax.devices()[:g]).reshape(1, 1, g), ("pair", "node", "global"))
    pol = Policy.of("log_step", mesh.shape)
    assert pol.log_step("all-gather", ("global",)) and pol.bucketed("all-gather", ("global",))
    assert pol.log_step("reduce-scatter", ("pair", "node", "global"))  # size-1 axes aside
    two_axes = Policy.of("log_step", {"global": 3, "stage": 2})  # ranks would count unlike
    assert not two_axes.log_step("all-gather", ("stage", "global"))
    assert [b for _, b in bucket.exchanges(g)] and sum(b for _, b in bucket.exchanges(g)) == g - 1
    spec = P("global")
    for dtype in (jnp.float32, jnp.bfloat16):
        x = (jnp.arange(g * 3 * g * 5, dtype=jnp.float32) % 13 - 6).astype(dtype)
        x = x.reshape(g * 3, g * 5)

        def both(v):
            ag = jax.lax.all_gather(v, "global", axis=1, tiled=True) - \
                bucket.tiled_all_gather(v, ("global",), 1, pol)
            rs = jax.lax.psum_scatter(v, "global", scatter_dimension=1, tiled=True) - \
                bucket.psum_scatter(v, ("global",), 1, pol)
            return ag[:, :v.shape[1]], jnp.tile(rs, (1, g))

        f = jax.shard_map(both, mesh=mesh, in_specs=spec, out_specs=(spec, spec))
        assert not any(np.any(np.asarray(d)) for d in jax.jit(f)(x)), (g, dtype)
    for op in (lambda v: bucket.tiled_all_gather(v, ("global",), 1, pol),
               lambda v: bucket.psum_scatter(v, ("global",), 1, pol)):
        f = jax.shard_map(op, mesh=mesh, in_specs=spec, out_specs=spec)
        r = analyze(f, [jax.ShapeDtypeStruct((g * 3, g * 5), jnp.bfloat16)], mesh)
        kinds = [c.kind for c in r.collectives]
        assert kinds == ["collective-permute"] * math.ceil(math.log2(g)), r.table()
        assert all(c.level == "global" and c.dtypes == ["u16"] for c in r.collectives), r.table()


# ---------------------------------------------------------------- the training step

from boost_jax.analysis.comm import analyze_compiled  # noqa: E402
from boost_jax.backends.cpu import fast_compile_options  # noqa: E402
from boost_jax.config import load_config  # noqa: E402
from boost_jax.sharding.step_collectives import Passes, step_collectives  # noqa: E402
from boost_jax.step.build import build_step  # noqa: E402

# awkward sizes: no dim of any weight divides by 8, so every sharded plan pads
ODD = ["model.vocab_size=260", "model.d_model=36", "model.n_layers=2", "model.n_heads=2",
       "model.d_ff=68", "model.rank=9", "model.max_seq_len=16", "data.seq_len=16",
       "train.global_batch=16", "train.steps=20", "optim.lr=0.01", "optim.warmup_frac=0.05"]
PLANS = ("ddp", "zero1", "zero3", "zeropp", "hierarchical")
TP = {"none": [], "btp": ["parallel.tp_mode=btp", "parallel.tp_axes=[pair]"]}
INNER = {"pair", "node"}


def _build(mesh, *extra):
    cfg = load_config(None, ODD + list(extra))
    b = build_step(cfg, mesh, fast_compile_options())
    with jax.set_mesh(mesh):
        c = b.train_step.lower(b.abstract_state, b.abstract_batch()).compile()
    return b, c, analyze_compiled(c, mesh)


def _mixed(r) -> list:
    """Collectives whose groups span hosts (`global`, a pipeline's `stage`) and a node axis."""
    return [c for c in r.collectives if set(c.axes) & {"global", "stage"} and set(c.axes) & INNER]


def _listed_vs_compiled(b, r, micro: int, tp: tuple) -> tuple[dict, dict, dict, dict]:
    """(kind, level) → bytes and calls, from the list and from the compiled step (the TP
    layout's own collectives and the loss's scalar sums left out)."""
    lb, lc, mb, mc = {}, {}, {}, {}
    for c in step_collectives(b.placement, Passes.of(micro)):
        lb[(c.kind, c.level)] = lb.get((c.kind, c.level), 0.0) + c.sent
        lc[(c.kind, c.level)] = lc.get((c.kind, c.level), 0) + c.calls
    for c in r.collectives:
        if (tp and set(c.axes) <= set(tp)) or set(c.shapes) == {"f32[]"}:
            continue
        mb[(c.kind, c.level)] = mb.get((c.kind, c.level), 0.0) + c.bytes_per_step
        mc[(c.kind, c.level)] = mc.get((c.kind, c.level), 0) + c.trip_count
    return lb, lc, mb, mc


def _assert_listed_is_compiled(b, r, micro: int, tp: tuple) -> None:
    """The list has the compiled kinds and levels, their bytes (10%) and calls."""
    lb, lc, mb, mc = _listed_vs_compiled(b, r, micro, tp)
    assert set(lb) == set(mb), r.table()
    for key, v in mb.items():
        assert v == pytest.approx(lb[key], rel=0.10, abs=16), (key, r.table())
        if key[0] != "all-reduce":  # XLA:CPU's combiner merges all-reduces; bytes still count
            assert mc[key] == lc[key], (key, r.table())


def _batch(bundle):
    rng = np.random.default_rng(0)
    x = rng.integers(0, 256, (16, 16)).astype(np.int32)
    return {k: jax.device_put(v, bundle.batch_sharding)
            for k, v in {"inputs": x, "targets": (x + 1) % 256}.items()}


def _losses(step, bundle, init, n=3):
    state, batch, out = jax.device_put(init, bundle.state_shardings), _batch(bundle), []
    for _ in range(n):
        state, m = step(state, batch)
        out.append((float(m["loss"]), float(m["grad_norm"])))
    return np.array(out)


@pytest.fixture(scope="module")
def flat_runs(mesh):
    """Losses and grad norms of 3 flat fp32 steps per (plan, tp), from one initial state."""
    cache = {}

    def get(plan, tp):
        if (plan, tp) not in cache:
            b = build_step(load_config(None, ODD + [f"parallel.plan={plan}",
                                                    "train.micro_batches=2", *TP[tp]]),
                           mesh, fast_compile_options())
            init = jax.device_get(b.init_state())
            cache[(plan, tp)] = (init, _losses(b.train_step, b, init))
        return cache[(plan, tp)]

    return get


@pytest.mark.parametrize("tp", list(TP))
@pytest.mark.parametrize("plan", PLANS)
def test_two_level_step_keeps_groups_apart_counts_what_it_lists_and_equals_flat(
        mesh, flat_runs, plan, tp):
    """Every compiled group lies inside a node or is rank-aligned over `global` alone; the
    list has the compiled kinds, levels, bytes and calls; 3 steps' losses equal flat's (fp32,
    rtol 1e-6: only the order of the sums differs)."""
    init, flat = flat_runs(plan, tp)
    b, c, r = _build(mesh, f"parallel.plan={plan}", "train.micro_batches=2", *TP[tp],
                     "parallel.collectives=two_level")
    assert not _mixed(r), r.table()
    assert r.filter(level="global") and r.filter(level="node"), r.table()
    _assert_listed_is_compiled(b, r, 2, ("pair",) if tp != "none" else ())
    two = _losses(c, b, init)
    np.testing.assert_allclose(two[:, 0], flat[:, 0], rtol=1e-6)  # the losses
    # the norms: one sum of per-leaf partial sums, not the partitioner's order; zeropp's qgZ
    # rounds partial sums to int4 blocks, where another sum order can pick the next level
    np.testing.assert_allclose(two[:, 1], flat[:, 1], rtol=1e-4 if plan == "zeropp" else 1e-5)


def test_hpz_flat_gather_runs_in_two_levels(mesh):
    """zeropp with remat=full gathers each weight over every axis once (hpZ: the secondary
    is cut from what arrived, sharding/hpz.py); that gather, like every fetch unit's, follows
    parallel.collectives: no group mixes `global` with a node axis, the list is what is
    compiled, and 3 steps' losses equal the flat step's."""
    common = ("parallel.plan=zeropp", "train.micro_batches=2", "train.remat=full")
    b, c, r = _build(mesh, *common, "parallel.collectives=two_level")
    assert any(f.hpz for f in jax.tree.leaves(
        b.engine.fetches, is_leaf=lambda v: hasattr(v, "hpz"))), "not an hpZ layout"
    assert not _mixed(r), r.table()
    _assert_listed_is_compiled(b, r, 2, ())
    flat = build_step(load_config(None, ODD + list(common)), mesh, fast_compile_options())
    init = jax.device_get(flat.init_state())
    np.testing.assert_allclose(_losses(c, b, init), _losses(flat.train_step, flat, init),
                               rtol=1e-4)


# ddp aside: its gradients cross hosts in an all-reduce, which log_step runs as two_level does
@pytest.mark.parametrize("plan,tp", [(p, "btp") for p in PLANS if p != "ddp"] +
                         [("zero3", "vanilla")])
def test_log_step_runs_cross_node_legs_as_exchanges_and_equals_flat(mesh, flat_runs, plan, tp):
    """log_step with BTP (and vanilla TP: two chains per layer, one per TP group): in the layer
    loop every data-parallel gather or reduce-scatter that crosses hosts is an exchange
    (collective-permute) over `global` alone, one chain per fetch unit and group; outside it
    they stay rings (Policy.rings); the list has the compiled kinds, levels, bytes and calls;
    the planner reads the exchanges as data-parallel, not as pipeline sends; 3 steps' losses
    equal flat's."""
    from boost_jax.plan.collectives import colls_from_report

    over = TP["btp"] if tp == "btp" else ["model.rank=8", "parallel.tp_mode=vanilla",
                                           "parallel.tp_axes=[pair]"]
    if tp == "btp":
        init, flat = flat_runs(plan, "btp")
    else:
        fb = build_step(load_config(None, ODD + [f"parallel.plan={plan}",
                                                 "train.micro_batches=2", *over]),
                        mesh, fast_compile_options())
        init = jax.device_get(fb.init_state())
        flat = _losses(fb.train_step, fb, init)
    b, c, r = _build(mesh, f"parallel.plan={plan}", "train.micro_batches=2", *over,
                     "parallel.collectives=log_step")
    assert not _mixed(r), r.table()
    # the layer stack's legs over hosts are exchanges; the ends', the step's, all-reduces
    # and qgZ's all-to-alls keep their kinds
    listed = step_collectives(b.placement, Passes.of(2))
    legs = [c for c in listed if c.block and c.phase == "dp" and c.axes == ("global",)]
    assert not [c for c in legs if c.kind in ("all-gather", "reduce-scatter")], legs
    assert [c for c in legs if c.kind == "collective-permute"], listed
    assert all(x.in_loop and x.axes == ("global",) for x in r.collectives
               if x.kind == "collective-permute"), r.table()
    _assert_listed_is_compiled(b, r, 2, ("pair",))
    phases = {x.phase for x in colls_from_report(r, ("pair",), 2)
              if x.kind == "collective-permute"}
    assert phases <= {"dp", "step"}, phases
    two = _losses(c, b, init)
    np.testing.assert_allclose(two[:, 0], flat[:, 0], rtol=1e-6)
    np.testing.assert_allclose(two[:, 1], flat[:, 1], rtol=1e-4 if plan == "zeropp" else 1e-5)


def test_one_micro_batch_reduces_in_two_levels_inside_the_backward(mesh):
    """zero1 with one micro-batch reduce-scatters each layer's gradient over every axis in the
    backward (Placement.in_backward): in the node, then across, as listed. Under `auto`: on
    the `cpu` topology two levels win at every size (benchmarks/README.md section 13)."""
    b, _, r = _build(mesh, "parallel.plan=zero1", "train.micro_batches=1",
                     "parallel.collectives=auto")
    assert b.placement.reduce_in_backward
    assert not _mixed(r), r.table()
    loop = {c.level for c in r.filter(kind="reduce-scatter", in_loop=True)}
    assert loop == {"node", "global"}, r.table()
    lb, lc, mb, mc = _listed_vs_compiled(b, r, 1, ())
    assert set(lb) == set(mb) and all(mc[k] == lc[k] for k in mc if k[0] != "all-reduce")


def test_auto_picks_two_levels_until_the_node_links_cost_more_than_the_latency_saved():
    """The α–β model of sharding/bucket.py on 48 Frontier nodes: a layer's gather (MB) runs
    in two levels, a buffer of 100 GB flat; a group inside the node is never split."""
    from boost_jax.mesh import get_topology

    pol = Policy.of("auto", {"pair": 2, "node": 4, "global": 48}, get_topology("frontier"))
    axes = ("pair", "node", "global")
    for kind in ("all-gather", "reduce-scatter", "all-reduce"):
        assert pol.split(kind, axes, 4e6) == (("pair", "node"), ("global",))
        # the crossover benchmarks/README.md section 13 states: between 0.7 and 0.8 GB
        assert pol.split(kind, axes, 7e8) is not None and pol.split(kind, axes, 8e8) is None
        assert pol.split(kind, axes, 1e11) is None
        assert pol.stages(kind, axes, 1e11) == [(kind, axes, 1e11)]
    assert pol.split("all-gather", ("pair", "node"), 4e6) is None
    cpu = Policy.of("auto", {"pair": 2, "node": 2, "global": 2}, get_topology("cpu"))
    assert all(cpu.split("all-gather", axes, p) for p in (1e3, 1e9, 1e13))
    assert pol.split("all-to-all", axes, 4e6) is None  # qgZ's stages are its own
    two = Policy.of("two_level", {"pair": 2, "node": 4, "global": 48})
    assert two.split("all-gather", axes, 1e11) is not None
    assert Policy.of("flat", {"pair": 2, "node": 4, "global": 48}).split(
        "all-gather", axes, 4e6) is None


def test_auto_from_the_config_and_a_bad_value(mesh):
    from boost_jax.errors import ConfigError
    from boost_jax.sharding.placement import make_placement

    pl = make_placement(load_config(None, ODD + ["parallel.plan=zero3",
                                                 "parallel.collectives=auto"]), mesh)
    assert pl.collectives.mode == "auto" and pl.collectives.links  # the cpu topology's
    assert pl.describe()["collectives"] == "auto"  # what the planner's layout reports
    assert pl.collectives.split("all-gather", pl.params_axes, 1e4) is not None
    with pytest.raises(ConfigError, match="parallel.collectives='ring' is not valid"):
        load_config(None, ["parallel.collectives=ring"])


def test_the_cost_model_times_the_stages_that_run():
    """CoLA-7B zero3 on 48 Frontier nodes: under two_level the planner's collectives are the
    list's stages (none spans `global` and a node axis; each cross-node group has one member
    per host, the host's 8 groups sharing its NICs) and the bytes leaving a node stay flat's."""
    from plan_tiny import cfg7b

    from boost_jax.mesh import get_topology
    from boost_jax.plan import costmodel as C

    sizes, topo = {"pair": 2, "node": 4, "global": 48}, get_topology("frontier")
    out = {}
    for mode in ("flat", "two_level"):
        cfg = cfg7b("cola", "megatron")  # then made TP-free zero3 over 384 devices
        cfg.parallel.plan, cfg.parallel.tp_mode, cfg.parallel.tp_axes = "zero3", "none", []
        cfg.parallel.collectives, cfg.train.global_batch = mode, 768
        _, pl = C.state_sizes(cfg, sizes)
        out[mode] = C.dp_collectives(cfg, sizes, pl)
    two = out["two_level"]
    assert not [c for c in two if "global" in c.axes and set(c.axes) & INNER]
    cross = [c for c in two if c.level == "global"]
    assert cross and all(c.host_members == 1 and c.host_groups == 8 for c in cross)
    egress = {m: sum(c.egress_per_step(topo) for c in cs) for m, cs in out.items()}
    assert egress["two_level"] == pytest.approx(egress["flat"], rel=0.05)


def test_pipeline_stages_sum_the_loss_and_the_norm_in_two_levels():
    """2 stages on (2, 2, 2): the data-parallel groups stay inside the node; the loss's and
    the grad norm's sums over the stages and the node run in two levels (compiled only: the
    engine's sums are the ones the tests above run)."""
    from boost_jax.mesh import make_mesh as mesh_of

    mesh = mesh_of("cpu", (2, 2, 2), stages=2)
    _, _, r = _build(mesh, "parallel.plan=zero3", "train.micro_batches=2",
                     "parallel.pp_stages=2", "parallel.collectives=two_level")
    assert not _mixed(r), r.table()
    assert ("stage",) in {c.axes for c in r.collectives if c.kind == "all-reduce"}, r.table()
