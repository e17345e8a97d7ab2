"""Placement plans, measured from the compiled HLO of the whole training step (no execution).

Tiny CoLA model in bf16 mixed precision on 8 simulated devices as (pair, node, global) =
(2, 2, 2), 4 micro-batches unless said otherwise. Per-level bytes come from
boost_jax.analysis.comm, which undoes XLA:CPU's fp32 promotion of bf16 reductions and its
all-reduce+dynamic-slice lowering of reduce-scatter (bytes as a GPU would move them).
"""

import jax
import pytest

from boost_jax.analysis import hlo as H
from boost_jax.analysis.comm import analyze_compiled
from boost_jax.backends.cpu import fast_compile_options
from boost_jax.config import OptimConfig, load_config
from boost_jax.mesh import make_mesh
from boost_jax.sharding.formulas import comm_per_step
from boost_jax.sharding.step_collectives import Passes, step_collectives
from boost_jax.step.build import build_step

TINY = ["model.d_model=64", "model.n_layers=2", "model.n_heads=2", "model.d_ff=128",
        "model.rank=16", "model.max_seq_len=16", "data.seq_len=16", "model.vocab_size=256",
        "train.global_batch=32", "train.steps=10", "model.param_dtype=bfloat16",
        "model.dtype=bfloat16"]


# hierarchical's cross-node legs quantized: the deferred update's gather int8, the gradient's
# reduce-scatter int4 (XQ) or int8 (XQ8)
XQ = ("parallel.quantize_cross_node_weights=int8", "parallel.quantize_cross_node_grads=int4")
XQ8 = ("parallel.quantize_cross_node_weights=int8", "parallel.quantize_cross_node_grads=int8")


@pytest.fixture(scope="module")
def mesh():
    return make_mesh("cpu", (2, 2, 2))


@pytest.fixture(scope="module")
def compiled(mesh):
    """Lazily compiled (bundle, report) per (plan, micro_batches, extra overrides)."""
    cache = {}

    def get(plan, micro=4, *extra):
        key = (plan, micro, extra)
        if key not in cache:
            cfg = load_config(None, TINY + [f"parallel.plan={plan}",
                                            f"train.micro_batches={micro}", *extra])
            b = build_step(cfg, mesh, fast_compile_options())
            with jax.set_mesh(mesh):
                c = b.train_step.lower(b.abstract_state, b.abstract_batch()).compile()
            cache[key] = (b, analyze_compiled(c, mesh))
        return cache[key]

    return get


def _is_backward(module, c) -> bool:
    ins = module.computations[c.computation].instrs[c.name]
    return "transpose(" in (ins.attr("metadata") or "")


def test_hierarchical_keeps_the_microbatch_loop_inside_the_node(compiled):
    """Across nodes, inside a loop, only the deferred update and the last micro-batch's
    reduction run: each layer's gather from the optimizer's sharding and its gradient's
    reduce-scatter, once per layer and step (the first and the last micro-batch's layer
    loops, not the micro-batch loop); parallel.defer_update=false gathers after the optimizer."""
    b, r = compiled("hierarchical")
    assert b.placement.defer_update
    looped = [c for c in r.filter(level="global") if c.in_loop]
    # the first micro-batch's update gathers and the last one's gradient reduce-scatters
    assert {c.kind for c in looped} == {"all-gather", "reduce-scatter"}, r.table()
    assert all(c.trip_count == 2 for c in looped), r.table()
    b0, r0 = compiled("hierarchical", 4, "parallel.defer_update=false")
    assert not b0.placement.defer_update
    looped = [c for c in r0.filter(level="global") if c.in_loop]
    assert {c.kind for c in looped} == {"reduce-scatter"}, r0.table()  # the last backward's
    assert all(c.trip_count == 2 for c in looped), r0.table()
    assert "all-gather" in {c.kind for c in r0.filter(level="global", in_loop=False)}
    # and every per-micro-batch collective is present, inside the node
    assert r.filter(level=("pair", "node"), in_loop=True)


def test_hierarchical_internode_bytes_match_the_formula(compiled):
    b, r = compiled("hierarchical")
    predicted = comm_per_step(b.placement, 4)["global"]
    measured = r.per_level()["global"]["bytes"]
    assert measured == pytest.approx(predicted, rel=0.10), r.table()
    # the two once-per-step cross-node collectives: fp32 reduce-scatter, bf16 weight gather
    kinds = {(c.kind, c.dtypes[0]) for c in r.filter(level="global") if c.payload_bytes > 256}
    assert kinds == {("reduce-scatter", "f32"), ("all-gather", "u16")}, r.table()


def test_zero3_internode_bytes_grow_with_micro_batches(compiled):
    _, r1 = compiled("zero3", 1)
    _, r4 = compiled("zero3", 4)
    g1 = r1.per_level()["global"]["bytes"]
    g4 = r4.per_level()["global"]["bytes"]
    assert g4 / g1 == pytest.approx(4.0, rel=0.05)
    b, _ = compiled("zero3", 4)
    assert g4 == pytest.approx(comm_per_step(b.placement, 4)["global"], rel=0.10)


def test_zeropp_backward_gathers_stay_inside_the_node(compiled):
    b, r = compiled("zeropp", 4, "train.remat=full")
    module = H.parse_module(r.hlo_text)
    gathers = [c for c in r.filter(kind="all-gather", in_loop=True)]
    bwd = [c for c in gathers if _is_backward(module, c)]
    fwd = [c for c in gathers if not _is_backward(module, c)]
    assert bwd and fwd
    assert {c.level for c in bwd} == {"node"}, r.table()
    # hpZ as DeepSpeed runs it: the forward gathers each layer once, flat over all; the
    # node-level secondary is cut from that gather (no second gather inside the node)
    assert {c.level for c in fwd} == {"global"}, r.table()
    assert all(c.dtypes == ["u8"] for c in gathers)  # int8 blocks and their scales, packed
    # ZeRO-3 re-gathers across nodes in backward; hpZ does not
    _, r3 = compiled("zero3")
    m3 = H.parse_module(r3.hlo_text)
    assert "global" in {c.level for c in r3.filter(kind="all-gather", in_loop=True)
                        if _is_backward(m3, c)}
    g, g3 = r.per_level()["global"]["bytes"], r3.per_level()["global"]["bytes"]
    assert g == pytest.approx(comm_per_step(b.placement, 4)["global"], rel=0.10)
    # qwZ halves the forward gather's bytes, qgZ the gradient's (int4 vs zero3's fp32)
    assert g < 0.8 * g3


def test_an_empty_secondary_keeps_the_forward_gather_for_the_backward(compiled):
    """parallel.secondary_axes=[] (FSDP's reshard_after_forward=False): the forward gathers
    each layer's weights across nodes once and the backward uses that copy, so no all-gather
    runs in the backward: the gathers move zero3's bytes less its backward re-gathers."""
    b, r = compiled("zero3", 4, "parallel.secondary_axes=[]")
    assert b.placement.secondary_axes == ()
    module = H.parse_module(r.hlo_text)
    gathers = r.filter(kind="all-gather", in_loop=True)
    assert gathers and not [c for c in gathers if _is_backward(module, c)], r.table()
    b3, r3 = compiled("zero3")
    ag = lambda rep: sum(c.bytes_per_step for c in rep.collectives  # noqa: E731
                         if c.kind == "all-gather")
    regather = sum(c.sent for c in step_collectives(b3.placement, Passes.of(4))
                   if c.what == "regather")
    assert regather > 0.3 * ag(r3)
    assert ag(r) == pytest.approx(ag(r3) - regather, rel=0.10), (r.table(), r3.table())


def test_int8_gathers_move_about_half_the_bytes(compiled):
    _, r8 = compiled("hierarchical")  # preset: int8 secondary over pair
    _, r16 = compiled("hierarchical", 4, "parallel.secondary_dtype=bfloat16")

    def layer_gathers(r):  # inside the layer scan, itself inside the micro-batch scan
        return [c for c in r.filter(kind="all-gather", level="pair") if len(c.loops) >= 2]

    b8 = sum(c.bytes_per_step for c in layer_gathers(r8))
    b16 = sum(c.bytes_per_step for c in layer_gathers(r16))
    assert {d for c in layer_gathers(r8) for d in c.dtypes} == {"u8"}  # q + scales, packed
    assert {d for c in layer_gathers(r16) for d in c.dtypes} == {"u16"}  # bf16 bits
    assert 0.45 < b8 / b16 < 0.6, (b8, b16)


def test_hierarchical_crosses_nodes_far_less_than_zero3_and_zeropp(compiled):
    g = {p: compiled(p)[1].per_level()["global"]["bytes"]
         for p in ("hierarchical", "zero3", "zeropp")}
    assert g["hierarchical"] <= g["zero3"] / 16
    assert g["hierarchical"] <= g["zeropp"] / 4


@pytest.mark.parametrize("optim", ["adamw", "lion", "sgd"])
def test_argument_memory_matches_the_role_formula(compiled, optim):
    """The state's bytes per device by role, for optimizers that keep 2, 1 and 0 moments."""
    from boost_jax.analysis.comm import compare_memory

    # the default optimizer's programs are those the other tests compiled: not compiled again
    extra = () if optim == OptimConfig().name else (f"optim.name={optim}",)
    for plan in ("hierarchical", "zero3"):
        b, r = compiled(plan, 4, *extra)
        pred = b.placement.memory()
        batch = 2 * b.train.global_batch * b.seq_len * 4 / 8
        pred = {"weights": pred["weights"], "master": pred["master"], "adam": pred["adam"],
                "batch": batch}
        rows = compare_memory(r.memory, pred, rtol=0.10,
                              combine={"argument": ["weights", "master", "adam", "batch"]})
        assert rows["argument"]["ok"], (plan, rows)


@pytest.mark.parametrize("weights,compute", [("float32", "float32"), ("float32", "bfloat16"),
                                             ("bfloat16", "bfloat16")])
def test_gradients_are_reduced_in_fp32_whatever_the_compute_dtype(mesh, weights, compute):
    """zero3 with each weight/compute dtype pair: every per-micro-batch gradient reduce-scatter
    moves fp32 (parallel.grad_accum_dtype), and the bytes per level match the formula."""
    cfg = load_config(None, TINY + ["parallel.plan=zero3", "train.micro_batches=2",
                                    f"model.param_dtype={weights}", f"model.dtype={compute}"])
    b = build_step(cfg, mesh, fast_compile_options())
    with jax.set_mesh(mesh):
        c = b.train_step.lower(b.abstract_state, b.abstract_batch()).compile()
    r = analyze_compiled(c, mesh)
    grads = [x for x in r.filter(kind="reduce-scatter", in_loop=True) if x.payload_bytes > 256]
    assert grads and all(x.dtypes == ["f32"] for x in grads), r.table()
    # (XLA:CPU would run a bf16 reduction in fp32 too: the analyzer marks those as promoted)
    assert not [f for x in grads for f in x.cpu_fixes if "promoted" in f], r.table()
    pred = comm_per_step(b.placement, 2)
    for lv in ("node", "global"):
        assert r.per_level()[lv]["bytes"] == pytest.approx(pred[lv], rel=0.10), (lv, r.table())


def test_qgz_reduces_gradients_by_int4_all_to_all_inside_the_node_then_across(compiled):
    """zeropp (qgZ on by default, ZeRO++'s int4 gradients): the per-micro-batch gradient
    reduction is two all-to-alls of int4 blocks (node, then global) instead of an fp32
    reduce-scatter over all devices; bytes per level match the formula, and nodes are crossed
    with less than half of the bytes of zeropp with parallel.quantize_grads=false."""
    b, r = compiled("zeropp")
    b_plain, plain = compiled("zeropp", 4, "parallel.quantize_grads=false")
    assert b.placement.quantize_grads and not b_plain.placement.quantize_grads
    a2a = r.filter(kind="all-to-all", in_loop=True)
    assert {c.level for c in a2a} == {"node", "global"}, r.table()
    assert {d for c in a2a for d in c.dtypes} == {"u8"}  # packed int4 and fp32 scales
    # one call per bucket (a layer's weights), stage and pass, as the schedule counts them
    listed = sum(c.calls for c in step_collectives(b.placement, Passes.of(4))
                 if c.kind == "all-to-all")
    assert sum(c.trip_count for c in a2a) == listed, r.table()
    assert not [c for c in r.filter(kind="reduce-scatter", in_loop=True) if c.payload_bytes > 256]
    pred = comm_per_step(b.placement, 4)
    for lv in ("node", "global"):
        assert r.per_level()[lv]["bytes"] == pytest.approx(pred[lv], rel=0.10), (lv, r.table())
    assert r.per_level()["global"]["bytes"] < 0.5 * plain.per_level()["global"]["bytes"]


def test_one_micro_batch_reduces_across_nodes_inside_the_layer_loop(compiled):
    """With one micro-batch there is nothing to accumulate: hierarchical reduce-scatters each
    layer's gradient across nodes in the backward, inside the layer loop (with four the
    cross-node collectives all stay out of the loop, test above)."""
    b, r = compiled("hierarchical", 1)
    assert b.placement.reduce_in_backward
    inside = [c for c in r.filter(level="global", in_loop=True) if c.kind == "reduce-scatter"]
    assert inside, r.table()
    listed = [c for c in step_collectives(b.placement, Passes.of(1))
              if c.what == "reduce" and c.level == "global" and c.leaf.startswith("blocks")]
    assert listed and all(c.phase == "dp" for c in listed)


def _per_level(rows) -> dict:
    """{(kind, level): [calls, bytes sent]} per step summed over (kind, level, calls, bytes)."""
    out: dict = {}
    for kind, level, calls, sent in rows:
        row = out.setdefault((kind, level), [0.0, 0.0])
        row[0], row[1] = row[0] + calls, row[1] + sent
    return out


@pytest.mark.parametrize("plan,tp,micro,extra", [
    ("hierarchical", (), 4, ()), ("zero3", (), 4, ()), ("zeropp", (), 4, ()),
    ("zero1", (), 4, ()), ("hierarchical", ("pair",), 4, ()), ("zeropp", ("pair",), 4, ()),
    ("hierarchical", (), 1, ()), ("zero1", (), 1, ()),
    ("zero3", (), 4, ("parallel.secondary_axes=[]",)),
    ("zeropp", ("pair",), 1, ("parallel.secondary_axes=[]",)),
    ("hierarchical", (), 4, XQ), ("hierarchical", (), 1, XQ8),
    ("hierarchical", (), 4, ("parallel.defer_update=false",)),
    ("zeropp", (), 4, ("train.remat=full",))])
def test_compiled_collectives_are_the_step_collectives_list(compiled, plan, tp, micro, extra):
    """The engine's own list of the step's collectives (ParallelLayout.collectives,
    sharding/step_collectives.py) against the compiled program, kind by kind and level by
    level: the same calls (one per fetch unit and bucket, sharding/bucket.py, not one per
    weight) and the same bytes, exactly. Left out: scalar sums (the loss; the clip's norm,
    which XLA splits by how the partial sums vary) and, under BTP, the collectives inside the
    TP group (the layout's own, tp/specs.py)."""
    if tp:
        extra += (f"parallel.tp_axes=[{','.join(tp)}]", "parallel.tp_mode=btp")
    b, r = compiled(plan, micro, *extra)
    want = _per_level((c.kind, c.level, c.calls, c.sent) for c in b.engine.layout.collectives()
                      if c.what != "grad norm")
    got = _per_level((c.kind, c.level, c.trip_count, c.bytes_per_step) for c in r.collectives
                     if not (tp and set(c.axes) <= set(tp))
                     and not (c.kind == "all-reduce" and set(c.shapes) == {"f32[]"}))
    assert set(got) == set(want), r.table()
    for key, (calls, sent) in got.items():
        assert (calls, sent) == pytest.approx(tuple(want[key]), rel=1e-9), (key, r.table())


@pytest.mark.parametrize("plan,schedule,virtual", [
    ("hierarchical", "gpipe", 1), ("zeropp", "gpipe", 1), ("zero3", "1f1b", 2)])
def test_compiled_pipeline_collectives_are_the_step_collectives_list(plan, schedule, virtual):
    """With pipeline stages (2 stages on pair x node x global x stage = 2x1x2x2, 2 layers per
    chunk, 4 micro-batches) the engine's own list (ParallelLayout.collectives: its schedule's
    ticks) against the compiled step, kind by kind and level by level: the same calls and the
    same bytes, exactly. Left out: the stage sends and the scalar sums (test_pipeline.py), the
    clip's norm. The one difference: in a 1f1b tick that runs F and B, XLA 0.10 merges the two
    gathers of the embedding (one computation, one operand), one call per such tick less;
    0.11 runs both, as listed. The head's weights are gathered by B alone (F runs no head)."""
    from boost_jax.mesh import level_of

    mesh = make_mesh("cpu", (2, 1, 4), stages=2)
    cfg = load_config(None, TINY + [
        f"parallel.plan={plan}", "train.micro_batches=4", "parallel.pp_stages=2",
        f"parallel.pp_schedule={schedule}", f"parallel.pp_virtual={virtual}",
        f"model.n_layers={4 * virtual}"])
    b = build_step(cfg, mesh, fast_compile_options())
    with jax.set_mesh(mesh):
        r = analyze_compiled(b.train_step.lower(b.abstract_state, b.abstract_batch()).compile(),
                             mesh)
    layout = b.engine.layout
    listed = layout.collectives()
    sch = layout.pipeline
    merged = sum(n for n, f, bw, _ in sch.phases if f and bw)  # ticks with F and B
    merged *= jax.__version_info__ < (0, 11)
    want = _per_level(
        (c.kind, level_of(tuple(a for a in c.axes if mesh.shape[a] > 1)), c.calls - m,
         c.sent * (1 - m / c.calls))
        for c in listed if c.what != "grad norm"
        for m in [merged if c.what == "gather" and c.leaf.startswith("embed") else 0])
    got = _per_level((c.kind, c.level, c.trip_count, c.bytes_per_step) for c in r.collectives
                     if "stage" not in c.axes and not (c.kind == "all-reduce"
                                                       and set(c.shapes) == {"f32[]"}))
    assert set(got) == set(want), r.table()
    for key, (calls, sent) in got.items():
        assert (calls, sent) == pytest.approx(tuple(want[key]), rel=1e-9), (key, r.table())
    assert sum(sent for _, sent in got.values()) > 0


def test_quantized_cross_node_legs_leave_the_node_less_than_zeropp(compiled):
    """With its cross-node legs quantized, hierarchical at four micro-batches sends fewer bytes
    out of each node per step than ZeRO++ on the same layout — in the compiled step and in the
    step's list as the cost model times it, which agree."""
    from boost_jax.mesh import get_topology
    from boost_jax.plan.costmodel import predict

    out = {}
    for plan, extra in (("hierarchical", XQ), ("zeropp", ()), ("hierarchical", ())):
        b, r = compiled(plan, 4, *extra)
        cfg = load_config(None, TINY + [f"parallel.plan={plan}", "train.micro_batches=4", *extra])
        listed = sum(predict(cfg, get_topology("cpu"), dict(b.mesh.shape)).node_egress.values())
        assert r.node_egress == pytest.approx(listed, rel=0.10), (plan, extra, r.table())
        out[(plan, extra)] = r.node_egress
    assert out[("hierarchical", XQ)] <= out[("zeropp", ())]
    assert out[("hierarchical", XQ)] < 0.7 * out[("hierarchical", ())]  # it did quantize
