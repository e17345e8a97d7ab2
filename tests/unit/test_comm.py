"""Communication analyzer: programs whose collectives we know, parsers against hand-computed groups."""

import sys

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from boost_jax.analysis import comm, hlo
from boost_jax.analysis.comm import analyze, classify_group, ring_bytes
from boost_jax.mesh import make_mesh


@pytest.fixture(scope="module")
def mesh():
    return make_mesh("cpu", (2, 2, 2))


def smap(mesh, f, i, o):
    return jax.shard_map(f, mesh=mesh, in_specs=i, out_specs=o, check_vma=False)


X = jnp.ones((8, 16), jnp.float32)


def only(report, **kw):
    cs = report.filter(**kw) if kw else report.collectives
    assert len(cs) == 1, report.table()
    return cs[0]


def groups_as_sets(c):
    return sorted(sorted(g) for g in c.groups)


# --------------------------------------------------------------------------- known programs


def test_psum_pair(mesh):
    r = analyze(smap(mesh, lambda a: jax.lax.psum(a, "pair"), P("pair"), P()), (X,), mesh)
    c = only(r)
    assert (c.kind, c.level, c.group_size, c.in_loop, c.axes) == ("all-reduce", "pair", 2, False,
                                                                 ("pair",))
    # partition k is mesh.devices.flat[k]: row-major (pair, node, global) → pair stride 4
    assert groups_as_sets(c) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert c.payload_bytes == 4 * 16 * 4 and c.bytes_per_step == pytest.approx(c.payload_bytes)
    assert r.per_level()["pair"] == {"bytes": c.payload_bytes, "count": 1, "calls": 1}
    assert r.per_level()["global"]["count"] == 0


def test_psum_pair_node_is_node_level(mesh):
    f = smap(mesh, lambda a: jax.lax.psum(a, ("pair", "node")), P(("pair", "node")), P())
    c = only(analyze(f, (X,), mesh))
    assert (c.kind, c.level, c.group_size) == ("all-reduce", "node", 4)
    assert c.bytes_per_step == pytest.approx(2 * 3 / 4 * 2 * 16 * 4)


def test_all_gather_global(mesh):
    f = smap(mesh, lambda a: jax.lax.all_gather(a, "global", tiled=True), P("global"), P())
    c = only(analyze(f, (X,), mesh))
    assert (c.kind, c.level, c.group_size, c.shapes) == ("all-gather", "global", 2, ["f32[8,16]"])
    assert c.bytes_per_step == pytest.approx(0.5 * 8 * 16 * 4)


def test_psum_scatter_is_reduce_scatter(mesh):
    f = smap(mesh, lambda a: jax.lax.psum_scatter(a, "node", tiled=True), P(), P("node"))
    c = only(analyze(f, (X,), mesh))
    assert (c.kind, c.level, c.group_size) == ("reduce-scatter", "node", 2)
    assert c.payload_bytes == 8 * 16 * 4  # the input, not the scattered output
    assert c.bytes_per_step == pytest.approx(0.5 * 8 * 16 * 4)


def row_parallel_matmul(mesh, dtype, out_spec):
    """x @ w contracted over the sharded (pair, global) dim, output constrained to out_spec."""
    s = lambda *spec: NamedSharding(mesh, P(*spec))  # noqa: E731
    x = jax.ShapeDtypeStruct((16, 64), dtype, sharding=s(None, ("pair", "global")))
    w = jax.ShapeDtypeStruct((64, 32), dtype, sharding=s(("pair", "global"), None))
    return analyze(lambda x, w: jax.lax.with_sharding_constraint(x @ w, s(*out_spec)), (x, w), mesh)


def test_cpu_all_reduce_plus_dynamic_slice_is_reduce_scatter(mesh):
    # A row-parallel matmul whose output is constrained sharded: on CPU XLA emits all-reduce
    # followed by a (fused) dynamic-slice of 1/n of it.
    c = only(row_parallel_matmul(mesh, jnp.float32, [("pair", "global")]))
    assert c.opcode == "all-reduce" and c.kind == "reduce-scatter"
    assert c.lowered_as == "all-reduce+dynamic-slice"
    assert c.level == "global" and c.group_size == 4 and c.axes == ("pair", "global")
    assert groups_as_sets(c) == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert c.shapes == ["f32[4,32]"] and c.payload_bytes == 16 * 32 * 4
    assert c.bytes_per_step == pytest.approx(3 / 4 * 16 * 32 * 4)
    assert c.raw_bytes_per_step == pytest.approx(2 * 3 / 4 * 16 * 32 * 4)  # the all-reduce
    # the same matmul with a replicated output stays an all-reduce
    assert only(row_parallel_matmul(mesh, jnp.float32, [])).kind == "all-reduce"


def test_bf16_psum_counts_16_bit_payload(mesh):
    # XLA:CPU runs the bf16 reduction in fp32 (convert → all-reduce with a *_promoted reducer)
    xb = X.astype(jnp.bfloat16)
    c = only(analyze(smap(mesh, lambda a: jax.lax.psum(a, "pair"), P("pair"), P()), (xb,), mesh))
    assert (c.kind, c.level, c.group_size, c.dtypes) == ("all-reduce", "pair", 2, ["f32"])
    assert c.cpu_fixes == ("fp32-promoted",)
    assert c.payload_bytes == 4 * 16 * 2 and c.bytes_per_step == pytest.approx(4 * 16 * 2)
    assert c.raw_bytes_per_step == pytest.approx(4 * 16 * 4)


def test_bf16_psum_scatter_counts_16_bit_payload(mesh):
    f = smap(mesh, lambda a: jax.lax.psum_scatter(a, "node", tiled=True), P(), P("node"))
    r = analyze(f, (X.astype(jnp.bfloat16),), mesh)
    c = only(r)
    assert (c.kind, c.level, c.group_size) == ("reduce-scatter", "node", 2)
    assert c.cpu_fixes == ("fp32-promoted",)
    assert c.payload_bytes == 8 * 16 * 2 and c.bytes_per_step == pytest.approx(0.5 * 8 * 16 * 2)
    assert r.per_level(raw=True)["node"]["bytes"] == pytest.approx(0.5 * 8 * 16 * 4)


def test_bf16_reduce_scatter_behind_a_convert(mesh):
    # bf16 row-parallel matmul, output constrained sharded: XLA:CPU emits a promoted fp32
    # all-reduce, a convert back to bf16, then the 1/n dynamic-slice (fused with a convert)
    r = row_parallel_matmul(mesh, jnp.bfloat16, [("pair", "global")])
    c = only(r)
    assert c.opcode == "all-reduce" and c.kind == "reduce-scatter"
    assert c.cpu_fixes == ("fp32-promoted", "sliced")
    assert c.level == "global" and c.group_size == 4
    assert c.payload_bytes == 16 * 32 * 2
    assert c.bytes_per_step == pytest.approx(3 / 4 * 16 * 32 * 2)
    assert c.raw_bytes_per_step == pytest.approx(2 * 3 / 4 * 16 * 32 * 4)
    assert r.per_level()["global"]["bytes"] == pytest.approx(c.bytes_per_step)
    assert r.per_level(raw=True)["global"]["bytes"] == pytest.approx(c.raw_bytes_per_step)
    # replicated output: stays an all-reduce, only the fp32 promotion is undone
    c = only(row_parallel_matmul(mesh, jnp.bfloat16, []))
    assert c.kind == "all-reduce" and c.cpu_fixes == ("fp32-promoted",)
    assert c.bytes_per_step == pytest.approx(2 * 3 / 4 * 16 * 32 * 2)


def test_psum_in_scan_is_in_loop_with_trip_count(mesh):
    def loop(a):
        def body(c, _):
            return c + 0.5 * jax.lax.psum(c, "pair"), None
        return jax.lax.scan(body, a, None, length=5)[0]

    r = analyze(smap(mesh, loop, P("pair"), P("pair")), (X,), mesh)
    c = only(r)
    assert c.in_loop and c.trip_count == 5 and c.loops and c.computation != "main"
    assert c.bytes_per_step == pytest.approx(5 * c.bytes_per_call)
    assert r.per_level()["pair"]["calls"] == 5
    assert r.filter(in_loop=True, level=("node", "global")) == []


def test_fori_loop_and_outside_collective(mesh):
    def f(a):
        a = jax.lax.fori_loop(0, 3, lambda i, c: c + jax.lax.psum(c, "node"), a)
        return jax.lax.psum(a, "global")

    r = analyze(smap(mesh, f, P(), P()), (X,), mesh)
    inner = only(r, in_loop=True)
    outer = only(r, in_loop=False)
    assert (inner.level, inner.trip_count) == ("node", 3)
    assert (outer.level, outer.trip_count) == ("global", 1)
    assert r.filter(in_loop=True, level="global") == []


def test_variadic_all_reduce_counts_all_operands(mesh):
    f = smap(mesh, lambda a, b: jax.lax.psum((a, b), "pair"), (P("pair"),) * 2, (P(), P()))
    r = analyze(f, (X, 2 * X), mesh)
    c = only(r)
    assert len(c.shapes) == 2 and c.payload_bytes == 2 * 4 * 16 * 4


def test_all_to_all_and_permute(mesh):
    a2a = smap(mesh, lambda a: jax.lax.all_to_all(a, "node", 0, 1, tiled=True),
               P("node"), P("node"))
    c = only(analyze(a2a, (X,), mesh))
    assert (c.kind, c.level, c.group_size) == ("all-to-all", "node", 2)
    assert c.bytes_per_step == pytest.approx(0.5 * 4 * 16 * 4)
    perm = smap(mesh, lambda a: jax.lax.ppermute(a, "global", [(0, 1), (1, 0)]),
                P("global"), P("global"))
    c = only(analyze(perm, (X,), mesh))
    assert (c.kind, c.level) == ("collective-permute", "global")
    assert c.bytes_per_step == 4 * 16 * 4


def test_report_outputs_and_memory(mesh):
    r = analyze(smap(mesh, lambda a: jax.lax.psum(a, "pair"), P("pair"), P()), (X,), mesh)
    d = r.to_dict()
    assert d["per_level"]["pair"]["count"] == 1 and d["collectives"][0]["kind"] == "all-reduce"
    assert "pair" in r.table() and "all-reduce" in r.table()
    assert set(r.memory) >= {"argument", "output", "temp", "alias", "generated_code", "total"}
    assert r.memory["argument"] == 4 * 16 * 4
    rows = comm.compare_memory(r.memory, {"argument": 256, "output": 512})
    assert rows["argument"]["ok"] and not rows["output"]["ok"]
    with pytest.raises(ValueError, match="unknown memory keys"):
        comm.compare_memory(r.memory, {"params": 1})
    pred = {"weights": 200, "adam": 56}
    rows = comm.compare_memory(r.memory, pred, combine={"argument": ["weights", "adam"]},
                               rtol=0.01)
    assert rows["argument"]["predicted"] == 256 and rows["argument"]["ok"]
    with pytest.raises(ValueError, match="padding"):  # a role nobody placed is an error
        comm.compare_memory(r.memory, {**pred, "padding": 9},
                            combine={"argument": ["weights", "adam"]})


# --------------------------------------------------------------------------- parsers & formulas


def test_iota_groups_hand_computed():
    # iota(8).reshape(2,2,2).transpose(0,2,1) = [[[0,2],[1,3]],[[4,6],[5,7]]]
    assert hlo.parse_replica_groups("[4,2]<=[2,2,2]T(0,2,1)", 8) == [[0, 2], [1, 3], [4, 6],
                                                                    [5, 7]]
    assert hlo.parse_replica_groups("[2,4]<=[8]", 8) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert hlo.parse_replica_groups("[2,4]<=[4,2]T(1,0)", 8) == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert hlo.parse_replica_groups("[1,8]<=[8]", 8) == [list(range(8))]


def test_explicit_and_empty_groups():
    assert hlo.parse_replica_groups("{{0,4},{1,5},{2,6},{3,7}}", 8) == [[0, 4], [1, 5], [2, 6],
                                                                       [3, 7]]
    assert hlo.parse_replica_groups("{}", 4) == [[0, 1, 2, 3]]
    assert hlo.parse_replica_groups(None, 2) == [[0, 1]]


def test_mesh_axes_groups():
    # seen in this JAX for a contraction over (pair, global)
    t = "mesh['axis_0'=4,'axis_1'=1,'axis_2'=2], device_ids=([2,2,2]T(0,2,1)) {'axis_0'}"
    assert hlo.parse_replica_groups(t, 8) == [[0, 1, 4, 5], [2, 3, 6, 7]]
    # device ids [2,4]T(1,0) = [0,4,1,5,2,6,3,7]
    t = "mesh['axis_0'=4,'axis_1'=1,'axis_2'=2], device_ids=([2,4]T(1,0)) {'axis_0'}"
    assert hlo.parse_replica_groups(t, 8) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert hlo.parse_replica_groups("mesh['a'=2,'b'=4] {'b'}", 8) == [[0, 1, 2, 3],
                                                                      [4, 5, 6, 7]]
    assert hlo.parse_replica_groups("mesh['a'=2,'b'=4] {'a'}", 8) == [[0, 4], [1, 5], [2, 6],
                                                                      [3, 7]]
    # sub-axis b:(1)2 is the major half of b: [2,4] → [2,1,2,2], group over that dim
    assert hlo.parse_replica_groups("mesh['a'=2,'b'=4] {'b':(1)2}", 8) == [
        [0, 2], [1, 3], [4, 6], [5, 7]]
    assert hlo.parse_replica_groups("mesh['a'=2,'b'=4] {'b':(2)2, 'a'}", 8) == [
        [0, 4, 1, 5], [2, 6, 3, 7]]


def test_classify_group(mesh):
    # partition ids are row-major (pair, node, global): strides 4, 2, 1
    assert classify_group([0, 4], mesh) == ("pair", ("pair",))
    assert classify_group([0, 2], mesh) == ("node", ("node",))
    assert classify_group([0, 2, 4, 6], mesh) == ("node", ("pair", "node"))
    assert classify_group([0, 1], mesh) == ("global", ("global",))
    assert classify_group([3], mesh) == ("none", ())


def test_ring_bytes():
    assert ring_bytes("all-reduce", 4, 1000) == pytest.approx(1500)
    assert ring_bytes("all-gather", 4, 1000) == pytest.approx(750)
    assert ring_bytes("reduce-scatter", 8, 800) == pytest.approx(700)
    assert ring_bytes("all-to-all", 2, 100) == pytest.approx(50)
    assert ring_bytes("all-reduce", 1, 1000) == 0


SYNTH = """HloModule synth, num_partitions=4

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%cond (p: (s32[], f32[8])) -> pred[] {
  %p = (s32[], f32[8]{0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %n = s32[] constant(7)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

%body (p.1: (s32[], f32[8])) -> (s32[], f32[8]) {
  %p.1 = (s32[], f32[8]{0}) parameter(0)
  %x = f32[8]{0} get-tuple-element(%p.1), index=1
  %ars = f32[8]{0} all-reduce-start(%x), channel_id=2, replica_groups=[2,2]<=[4], use_global_device_ids=true, to_apply=%add
  %ard = f32[8]{0} all-reduce-done(%ars)
  %j = s32[] get-tuple-element(%p.1), index=0
  ROOT %t = (s32[], f32[8]{0}) tuple(%j, %ard)
}

ENTRY %main (x.1: bf16[4,8]) -> (s32[], f32[8]) {
  %x.1 = bf16[4,8]{1,0} parameter(0)
  %ags = (bf16[4,8]{1,0}, bf16[16,8]{1,0}) all-gather-start(%x.1), channel_id=1, replica_groups={{0,1,2,3}}, dimensions={0}, use_global_device_ids=true
  %agd = bf16[16,8]{1,0} all-gather-done(%ags)
  %z = s32[] constant(0)
  %v = f32[8]{0} constant({0,0,0,0,0,0,0,0})
  %t0 = (s32[], f32[8]{0}) tuple(%z, %v)
  ROOT %w = (s32[], f32[8]{0}) while(%t0), condition=%cond, body=%body
}
"""


def test_synthetic_async_pairs_and_guessed_trip_count():
    mesh = make_mesh("cpu", (2, 2, 1), devices=jax.devices()[:4])
    r = comm.analyze_hlo_text(SYNTH, mesh)
    assert len(r.collectives) == 2  # start/done pairs count once
    ag = only(r, kind="all-gather")
    assert ag.shapes == ["bf16[16,8]"] and ag.payload_bytes == 16 * 8 * 2 and not ag.in_loop
    assert ag.level == "node" and ag.group_size == 4
    ar = only(r, kind="all-reduce")
    assert ar.in_loop and ar.trip_count == 7 and ar.reduction == "add"  # from `i < 7`
    assert groups_as_sets(ar) == [[0, 1], [2, 3]] and ar.level == "node"
    assert ar.bytes_per_step == pytest.approx(7 * 2 * 0.5 * 32)


def test_cli_with_step_builder(monkeypatch, capsys):
    import types

    def build(cfg, mesh):
        f = jax.shard_map(lambda a: jax.lax.psum(a, "node"), mesh=mesh, in_specs=P("node"),
                          out_specs=P(), check_vma=False)
        return jax.jit(f), (jax.ShapeDtypeStruct((8, 4), jnp.float32),)

    monkeypatch.setitem(sys.modules, "boost_jax.step.build",
                        types.SimpleNamespace(build_step_for_analysis=build))
    assert comm.main(["--json", "mesh.shape=[2,2,2]"]) == 0
    import json

    d = json.loads(capsys.readouterr().out)
    assert d["per_level"]["node"]["count"] == 1 and d["collectives"][0]["level"] == "node"
    with pytest.raises(SystemExit) as e:
        comm.main(["train.stesp=3"])
    assert e.value.code == 2


# --------------------------------------------------------------------------- all-reduce + slice rule
# On CPU an all-reduce counts as a reduce-scatter only if its result is used solely through a
# 1/n dynamic-slice of that very result.

RS_AXES = ("pair", "global")  # 4 devices per group


def _slice_mine(v):
    return jax.lax.dynamic_slice_in_dim(v, jax.lax.axis_index(RS_AXES) * 4, 4, 0)


def _rule(mesh, f, n_args, out):
    fn = smap(mesh, f, (P(),) * n_args, out)
    args = (jnp.ones((16, 32), jnp.float32),) * n_args
    return only(comm.analyze_compiled(comm.compile_fn(fn, args, mesh), mesh))


def test_psum_only_sliced_is_reduce_scatter(mesh):
    c = _rule(mesh, lambda a: _slice_mine(jax.lax.psum(a, RS_AXES)), 1, P())
    assert c.kind == "reduce-scatter" and c.group_size == 4
    assert c.bytes_per_step == pytest.approx(3 / 4 * 16 * 32 * 4)  # half the all-reduce's


def test_psum_also_used_whole_stays_all_reduce(mesh):
    def f(a):
        s = jax.lax.psum(a, RS_AXES)
        return _slice_mine(s), s.sum()

    c = _rule(mesh, f, 1, (P(), P()))
    assert c.kind == "all-reduce" and "sliced" not in c.cpu_fixes
    assert c.bytes_per_step == pytest.approx(2 * 3 / 4 * 16 * 32 * 4)


def test_slice_of_another_value_in_the_fusion_is_not_a_reduce_scatter(mesh):
    # XLA fuses the slice of b and the (static) use of the psum into one fusion
    def f(a, b):
        s = jax.lax.psum(a, RS_AXES)
        return _slice_mine(b * 2) + s[:4] * 3

    c = _rule(mesh, f, 2, P())
    assert c.kind == "all-reduce" and "sliced" not in c.cpu_fixes
    assert c.bytes_per_step == pytest.approx(2 * 3 / 4 * 16 * 32 * 4)
