"""The network model (plan/collectives.py): α–β time of a collective on the links it crosses,
a ring leaving each node once, the NICs' bus bandwidth, and the per-call latency reported apart
from the bytes."""

import dataclasses
import math

import pytest

from boost_jax.mesh import get_topology
from boost_jax.plan import collectives as N, costmodel as C
from plan_tiny import cfg7b


def test_collective_time_is_alpha_beta():
    topo = get_topology("frontier")
    a = C.Assumptions(eta_net=1.0)
    c = N.Coll("x", "all-reduce", 1e9, 8, "node", 2, "tp")
    t = N.coll_time(c, topo, a)
    assert t == pytest.approx(2 * (2 * 7 / 8 * 1e9 / topo.bw_node + 3 * topo.lat_node))


def test_a_ring_over_whole_nodes_leaves_each_node_once():
    """ZeRO-1 over 48 Frontier nodes: the ring's 8 GCDs on a node are contiguous, so the node's
    four NICs carry one GCD's ring bytes (2(n-1)/n·P), not eight GCDs' worth."""
    topo, a = get_topology("frontier"), C.Assumptions(eta_net=1.0)
    sizes = {"pair": 2, "node": 4, "global": 48}
    axes = ("pair", "node", "global")
    k, groups = N.host_split(axes, sizes)
    assert (k, groups) == (8, 1)
    P = 11.5e9
    c = N.Coll("ar", "all-reduce", P, 384, "global", 1, "step", axes, k, groups)
    ring = 2 * 383 / 384 * P
    assert c.egress_per_step(topo) == pytest.approx(ring)
    # 100 GB/s of NICs per node (4 x 25 GB/s Slingshot-11), not 12.5 GB/s per GCD for all
    # bytes; inside the node the ring runs over the package links (75 GB/s per GCD)
    assert N.coll_time(c, topo, a) == pytest.approx(max(ring / 100e9, ring / 75e9) + 1e-5 * 9)
    # the same bytes over a group with one member per node: every GCD's share of the NICs
    one = N.Coll("ar", "all-reduce", P, 48, "global", 1, "step", ("global",),
                 *N.host_split(("global",), sizes))
    assert one.egress_per_step(topo) == pytest.approx(8 * 2 * 47 / 48 * P)
    assert N.coll_time(one, topo, a) == pytest.approx(8 * 2 * 47 / 48 * P / 100e9 + 6e-5)


def test_per_call_latency_is_reported_apart_from_the_bytes():
    """ZeRO++ of CoLA-7B on 48 Frontier nodes runs a cross-node int4 all-to-all per layer (and
    TP group) and pass, each costing α·(n−1) whatever its size: the report says that part
    apart, and it is exactly what α = 0 removes."""
    from boost_jax.plan.critical_path import dp_latency_text

    topo, sizes = get_topology("frontier"), {"pair": 2, "node": 4, "global": 48}
    cfg = C.with_overrides(cfg7b("cola", "btp", "[pair]"), **{
        "data.seq_len": 256, "parallel.plan": "zeropp", "train.micro_batches": 1,
        "train.global_batch": 768, "parallel.grad_accum_dtype": "bfloat16"})
    p = C.predict(cfg, topo, sizes)
    want = 0.0
    for c in p.collectives:
        if c.phase == "dp" and c.n > 1:
            hops = c.n - 1 if c.kind == "all-to-all" else math.ceil(math.log2(c.n))
            want += c.calls * topo.latency(c.level) * hops
    assert p.time["dp_latency"] == pytest.approx(want)
    a2a = [c for c in p.collectives if c.kind == "all-to-all" and c.level == "global"]
    # one call per fetch unit and pass (sharding/bucket.py), not one per weight (14 a layer)
    assert a2a and all("/" not in c.name.split()[0] for c in a2a)
    assert sum(c.calls for c in a2a) <= 2 * cfg.model.n_layers + 3
    assert f"{want * 1e3:.1f} ms of it per-call latency" in dp_latency_text(p)
    # with α = 0 the same collectives cost only their bytes
    free = C.predict(cfg, dataclasses.replace(topo, lat_pair=0.0, lat_node=0.0, lat_global=0.0),
                     sizes)
    assert free.time["dp_latency"] == 0.0
    assert free.time["dp"] == pytest.approx(p.time["dp"] - want)


def test_bus_bandwidth_of_a_multi_node_all_reduce_is_the_node_link_not_the_device_share():
    """nccl-tests' bus bandwidth of a multi-node all-reduce, as modelled: bounded by a node's
    NICs (4 x 25 GB/s) or the links inside it, never by one device's NIC share (12.5 / 25)."""
    from benchmarks import published as V

    eta = V.VALIDATION_ASSUMPTIONS.eta_net
    for name, inside in (("frontier", 75e9), ("perlmutter", 300e9)):
        topo = get_topology(name)
        bw = V.bus_bandwidth(name, 48)
        assert bw == pytest.approx(eta * min(topo.nic_node, inside), rel=0.01)
        assert bw > 2 * eta * topo.bw_global


def test_a_gpu_judged_step_is_no_shorter_than_its_node_egress():
    """A GPU schedule that hides every collective (nothing exposed) cannot make a step shorter
    than its node's NICs need for the bytes that leave it: the judged step keeps that floor,
    the difference counted as exposed data-parallel time."""
    from boost_jax.plan.gpu_compile import GpuCompile, judged

    topo, sizes = get_topology("frontier"), {"pair": 2, "node": 4, "global": 48}
    cfg = C.with_overrides(cfg7b("cola", "btp", "[pair]"), **{
        "data.seq_len": 256, "parallel.plan": "zero1", "train.micro_batches": 1,
        "train.global_batch": 768, "parallel.grad_accum_dtype": "bfloat16"})
    p = C.predict(cfg, topo, sizes)
    hidden = GpuCompile("t", "GPU", sizes, [], {"total": 1e9}, 0.0, 0.0,
                        {"time_s_by_phase": {}}, {}, [])
    j = judged(p, hidden, p.assumptions, topo.hbm_bytes)
    rest = sum(p.time[k] for k in ("compute", "quant", "optimizer"))  # TP hidden here too
    assert p.time["nic"] > rest + p.time["tp"]  # egress-bound: the floor is the NICs'
    assert j.step_time == pytest.approx(p.time["nic"])
    assert j.time["dp_exposed"] == pytest.approx(p.time["nic"] - rest)
    assert j.mfu == pytest.approx(p.mfu * p.step_time / p.time["nic"])


def test_gathers_are_counted_as_xla_combines_them():
    """The engine issues a layer's all-gathers one per weight; XLA's GPU combiners merge them
    into calls of at most 30 MiB: the cost model times those calls, with the engine's bytes."""
    from boost_jax.plan.overlap import XLA_COMBINE_BYTES, XLA_COMBINED
    from boost_jax.sharding.step_collectives import bucketed, step_collectives

    sizes = {"pair": 2, "node": 4, "global": 48}
    cfg = C.with_overrides(cfg7b("cola", "btp", "[pair]"), **{
        "data.seq_len": 256, "parallel.plan": "zero3", "train.micro_batches": 1,
        "train.global_batch": 768})
    _, pl = C.state_sizes(cfg, sizes)
    listed = step_collectives(pl, C.passes(cfg))
    layer = [c for c in listed if c.what == "gather" and c.leaf.startswith("blocks/")]
    assert len(layer) > 10 and len({c.calls for c in layer}) == 1
    merged = [c for c in bucketed(listed, XLA_COMBINED, XLA_COMBINE_BYTES)
              if c.what == "gather" and c.leaf == "blocks"]
    total = sum(c.payload for c in layer)
    k = math.ceil(total / XLA_COMBINE_BYTES)
    assert k > 1 and len(merged) == 1
    assert merged[0].calls == layer[0].calls * k
    assert merged[0].payload == pytest.approx(total / k) and merged[0].payload <= 30 * 2**20
    timed = [c for c in C.dp_collectives(cfg, sizes, pl) if c.kind == "all-gather"]
    gathers = [c for c in listed if c.kind == "all-gather" and c.phase == "dp"]
    assert sum(c.calls for c in timed if c.phase == "dp") < sum(c.calls for c in gathers) / 3
    assert sum(c.calls * c.payload for c in timed if c.phase == "dp") == pytest.approx(
        sum(c.calls * c.payload for c in gathers))
