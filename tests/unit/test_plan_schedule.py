"""The step's one list of data-parallel collectives (sharding/step_collectives.py) and its
readers: the byte formulas count it, the cost model times it, the compiled step runs it —
per level and per phase, for every preset plan x TP mode, with and without pipeline stages
and at one micro-batch (whose layer stack is reduced over the deferred axes in the backward)."""

import jax
import pytest

from boost_jax.config import load_config
from boost_jax.mesh import get_topology
from boost_jax.plan import collectives as N, costmodel as C

DRIFT = ["model.d_model=256", "model.n_layers=2", "model.n_heads=4", "model.d_ff=512",
         "model.rank=64", "model.vocab_size=256", "model.max_seq_len=32", "data.seq_len=32",
         "data.tokenizer=bpe", "train.global_batch=32", "train.micro_batches=2",
         "model.param_dtype=bfloat16", "model.dtype=bfloat16", "mesh.shape=[2,2,2]",
         "mesh.topology=cpu"]


@pytest.mark.parametrize("plan", ["ddp", "zero1", "zero3", "zeropp", "hierarchical"])
def test_analytic_bytes_per_level_match_the_compiled_step(plan):
    """The cost model's bytes per level (what --search ranks by) against the compiled step's,
    for every plan under BTP (TP's activation collectives and the data-parallel list;
    tests/unit/test_plans_hlo.py checks that list without TP kind by kind): a drift between the
    model and the engine fails here."""
    from boost_jax.plan.dryrun import dry_run

    extra = ["parallel.tp_mode=btp", "parallel.tp_axes=[pair]"]
    cfg = load_config(None, [*DRIFT, f"parallel.plan={plan}", *extra])
    dr = dry_run(cfg, get_topology("cpu"), None, jax.device_count(), full_layers_max=4)
    analytic = dr.prediction.memory["analytic_comm_bytes"]
    for lv in ("pair", "node", "global"):
        got, want = analytic[lv], dr.prediction.comm_bytes[lv]
        assert got == pytest.approx(want, rel=0.10, abs=2e4), (lv, got, want)
    # bytes leaving a node per step: the schedule's against the compiled step's
    got = dr.prediction.memory["analytic_node_egress"]
    want = sum(dr.prediction.node_egress.values())
    assert got == pytest.approx(want, rel=0.10, abs=2e4), (got, want)


@pytest.mark.parametrize("plan", ["ddp", "zero1", "zero3", "zeropp", "hierarchical"])
@pytest.mark.parametrize("tp", ["none", "megatron", "vanilla", "btp"])
def test_formulas_and_cost_model_read_the_one_collective_list(plan, tp):
    """The step's own list (sharding/step_collectives.py; what the engine runs, checked against
    compiled programs in test_plans_hlo.py) is what the byte formulas count and what the cost
    model times, for every preset plan x TP mode, with and without pipeline stages, with four
    micro-batches and with one (whose reduction over the deferred axes runs in the backward):
    the same bytes per level and per phase."""
    from boost_jax.sharding.formulas import comm_per_step
    from boost_jax.sharding.stages import Schedule
    from boost_jax.sharding.step_collectives import Passes, bytes_by_level, step_collectives

    arch = "full" if tp == "megatron" else "cola"
    mode = [f"parallel.tp_mode={tp}", "parallel.tp_axes=[pair]"] if tp != "none" else []
    pp = ["parallel.pp_stages=2", "parallel.pp_virtual=2", "model.n_layers=7"]
    for extra, micro in (([], 4), (pp, 4), ([], 1)):
        cfg = load_config(None, [*DRIFT, f"parallel.plan={plan}", f"model.arch={arch}", *mode,
                                 f"train.micro_batches={micro}", "train.global_batch=256",
                                 *extra])
        sizes = C.with_stages(cfg, {"pair": 2, "node": 4, "global": 8})
        _, pl = C.state_sizes(cfg, sizes)
        # the engine's schedule (ParallelLayout.collectives, Pipeline.run)
        sch = Schedule.of(cfg.parallel, micro)
        listed = step_collectives(pl, Passes.of(micro, sch))
        want = bytes_by_level(listed)
        timed = C.dp_collectives(cfg, sizes, pl)
        got = N.per_level_bytes(timed)
        counted = comm_per_step(pl, micro, schedule=sch)
        for lv in ("pair", "node", "global"):
            assert got[lv] == pytest.approx(want[lv]), (lv, extra, micro)
            assert counted[lv] == pytest.approx(want[lv]), (lv, extra, micro)
        for ph in ("dp", "step"):
            assert sum(c.bytes_per_step for c in timed if c.phase == ph) == pytest.approx(
                sum(c.sent for c in listed if c.phase == ph)), (ph, extra, micro)
        assert sum(want.values()) > 0


@pytest.mark.parametrize("plan", ["ddp", "zero1", "hierarchical"])
@pytest.mark.parametrize("tied", [False, True])
def test_the_reduction_over_the_deferred_axes_moves_the_same_bytes_at_one_micro_batch(plan, tied):
    """With one micro-batch the reduction over R of the layer stack and of what follows it
    (final norm, untied head) runs in the backward (phase dp), the embedding's stays once per
    step (fetched twice when tied, reduced once): the same bytes as with two micro-batches."""
    from boost_jax.sharding.step_collectives import Passes, step_collectives

    sent = {}
    for micro in (1, 2):
        cfg = load_config(None, [*DRIFT, f"parallel.plan={plan}", f"train.micro_batches={micro}",
                                 f"model.tie_embeddings={str(tied).lower()}",
                                 "train.global_batch=256"])
        sizes = {"pair": 2, "node": 4, "global": 8}
        _, pl = C.state_sizes(cfg, sizes)
        reduce = [c for c in step_collectives(pl, Passes.of(micro), tied) if c.what == "reduce"]
        sent[micro] = sum(c.sent for c in reduce)
        if micro == 1:
            late = ("blocks", "final_norm") + (() if tied else ("lm_head",))
            assert {c.phase for c in reduce if c.leaf.startswith(late)} == {"dp"}
            assert {c.phase for c in reduce if c.leaf.startswith("embed")} == {"step"}
            assert {c.leaf.split("/")[0] for c in reduce} == set(late) | {"embed"}
    assert sent[1] == pytest.approx(sent[2]) and sent[1] > 0


@pytest.mark.parametrize("extra", [["parallel.plan=zero3"], ["parallel.plan=zero3",
                                                              "parallel.secondary_axes=[]"],
                                   ["parallel.plan=zeropp"], ["parallel.plan=hierarchical"],
                                   ["parallel.plan=zero3", "parallel.secondary_axes=[pair]",
                                    "parallel.params_axes=[pair]"],
                                   ["parallel.plan=zeropp", "parallel.secondary_axes=[]"]])
def test_the_memory_rule_for_secondaries_is_the_engines(extra):
    """keeps_secondary (what the formulas and the planner charge memory for) is true for a
    layer weight exactly when the engine saves a secondary for it (gather.secondaries)."""
    from boost_jax.sharding.gather import LeafFetch
    from boost_jax.sharding.step_collectives import keeps_secondary, leaves

    cfg = load_config(None, [*DRIFT, *extra])
    _, pl = C.state_sizes(cfg, {"pair": 2, "node": 2, "global": 2})
    blocks = [lay for path, lay in leaves(pl) if path[0] == "blocks"]
    engine = [LeafFetch.of(pl, lay).is_gathered and pl.secondary_axes is not None
              for lay in blocks]
    assert [keeps_secondary(pl, lay, "blocks") for lay in blocks] == engine
    assert any(engine) == (pl.secondary_axes is not None and bool(pl.params_axes))


@pytest.mark.parametrize("extra", [["parallel.plan=zero3"],
                                   ["parallel.plan=zero3", "parallel.quantize_gather=true"],
                                   ["parallel.plan=zeropp"],
                                   ["parallel.plan=zeropp", "train.remat=full"],
                                   ["parallel.plan=zeropp", "parallel.secondary_axes=[]"],
                                   ["parallel.plan=zeropp", "parallel.secondary_axes=[pair]",
                                    "train.remat=full", "parallel.quantize_gather=false",
                                    "parallel.secondary_dtype=int8"],
                                   ["parallel.plan=hierarchical"],
                                   ["parallel.plan=hierarchical", "parallel.secondary_axes=[]"]])
def test_the_cost_models_int8_decodes_are_the_lists_int8_gathers(extra):
    """The int8 copies the cost model times a dequantize kernel for (Int8Copies.int8_decodes,
    one question asked of the placement and of each leaf's fetch alike) are the layer weights'
    gathers the list moves in int8: every listed int8 gather is decoded, and every decode
    of a gather the list holds is of an int8 one."""
    from boost_jax.sharding.gather import LeafFetch
    from boost_jax.sharding.step_collectives import (Passes, itemsize, leaf_collectives,
                                                     leaves, tp_local, device_layers)

    cfg = load_config(None, [*DRIFT, *extra])
    _, pl = C.state_sizes(cfg, {"pair": 2, "node": 2, "global": 2})
    gathers = ("gather", "gather(S)", "regather", "regather(S)")
    seen = 0
    for path, lay in leaves(pl):
        f = LeafFetch.of(pl, lay)
        if path[0] != "blocks" or not f.is_gathered:
            continue
        assert f.int8_decodes == pl.int8_decodes and f.cuts_int8_secondary == pl.cuts_int8_secondary
        whole = tp_local(f, lay) / device_layers(f, lay) * itemsize(pl.param_dtype)
        colls = [c for c in leaf_collectives(pl, path, lay, Passes.of(2)) if c.what in gathers]
        int8 = {c.what for c in colls if c.payload < 0.6 * whole}
        assert set(f.int8_decodes) & {c.what for c in colls} == int8, (path, f.int8_decodes)
        seen += len(f.int8_decodes)
    assert (seen > 0) == (pl.quantize_gather or pl.int8_secondary)
