"""The secondary copy's dtype decided per layout (boost_jax/plan/secondary.py): the faster of
bfloat16 and int8 that fits, int8 where only it fits, a dtype the config sets kept, and the
choice carried explicitly into the emitted config."""

import dataclasses

import pytest

from boost_jax.config import load_config
from boost_jax.mesh import get_topology
from boost_jax.plan import costmodel as C
from boost_jax.plan import secondary as S
from boost_jax.plan.search import search
from plan_tiny import TINY, cfg7b

FRONTIER, SIZES = get_topology("frontier"), {"pair": 2, "node": 4, "global": 48}


def layout(plan: str, tp_axes: str, **kw):
    return C.with_overrides(cfg7b("cola", "btp", tp_axes), **{
        "parallel.plan": plan, "train.global_batch": 768, "train.micro_batches": 1,
        "data.seq_len": 256, **kw})


def test_bfloat16_where_it_fits_and_int8_is_slower():
    """hierarchical with TP over the node: the pair copy in int8 saves pair bytes that the
    compute hides, and costs its (de)quantization and memory: bfloat16 is kept."""
    preds = S._both(layout("hierarchical", "[node]"), FRONTIER, SIZES, None)
    assert all(p.fits for p in preds.values())
    assert preds["int8"].step_time > preds["bfloat16"].step_time
    assert preds["int8"].comm_bytes["pair"] < preds["bfloat16"].comm_bytes["pair"]
    assert preds["int8"].memory["total"] > preds["bfloat16"].memory["total"]
    pred, choice = S.choose(layout("hierarchical", "[node]"), FRONTIER, SIZES, None)
    assert choice.dtype == "bfloat16" and choice.source == "search"
    assert pred.step_time == preds["bfloat16"].step_time
    assert choice.line.startswith("secondary dtype bfloat16 (chosen by the planner): int8 "
                                  "would move") and "slower" in choice.line


def test_int8_where_it_saves_more_link_time_than_its_kernels_cost():
    """TP over the pair re-homes hierarchical's weights onto the node link: there the int8
    copy's bytes saved outweigh its kernels."""
    pred, choice = S.choose(layout("hierarchical", "[pair]"), FRONTIER, SIZES, None)
    assert choice.dtype == "int8"
    assert pred.layout["placement"]["int8_secondary"]
    assert "bfloat16 would move" in choice.line and "more over node" in choice.line


def test_int8_where_only_it_fits():
    """zero3 keeping the forward's gathers whole (secondary_axes=[]): a bfloat16 copy is the
    whole layer stack, int8 a quarter of fp32 weights. With the limit between the two, the
    slower int8 is chosen because bfloat16 does not fit."""
    cfg = layout("zero3", "[pair]", **{"parallel.secondary_axes": [],
                                       "model.param_dtype": "float32"})
    preds = S._both(cfg, FRONTIER, SIZES, None)
    lo, hi = sorted(p.memory["total"] for p in preds.values())
    assert preds["int8"].memory["total"] == lo
    a = C.Assumptions()
    a = dataclasses.replace(a, hbm_usable=(lo + hi) / 2 * (1 + a.memory_margin)
                            / FRONTIER.hbm_bytes)
    tight = S._both(cfg, FRONTIER, SIZES, a)
    assert not tight["bfloat16"].fits and tight["int8"].fits
    assert tight["int8"].step_time > tight["bfloat16"].step_time  # faster does not win
    pred, choice = S.choose(cfg, FRONTIER, SIZES, a)
    assert choice.dtype == "int8" and pred.fits and "and not fit" in choice.line
    assert S.choose(cfg, FRONTIER, SIZES, None)[1].dtype == "bfloat16"  # roomy: the faster


def test_the_rule_on_ties_and_when_nothing_fits():
    def pred(t, mem, fits):
        return type("P", (), dict(step_time=t, memory={"total": mem}, fits=fits))()

    assert S.pick({"bfloat16": pred(1.0, 2, True), "int8": pred(1.0, 1, True)}) == "bfloat16"
    assert S.pick({"bfloat16": pred(1.0, 2, False), "int8": pred(2.0, 1, False)}) == "int8"
    assert S.pick({"bfloat16": pred(1.0, 1, True), "int8": pred(0.5, 2, False)}) == "bfloat16"


def test_only_layouts_whose_copy_the_dtype_changes_have_a_choice():
    assert S.matters(layout("hierarchical", "[node]"))
    assert S.matters(layout("zero3", "[node]", **{"parallel.secondary_axes": []}))
    # zeropp's qwZ makes its copy int8 either way; zero3 and ddp keep none
    for plan in ("zeropp", "zero3", "ddp"):
        assert not S.matters(layout(plan, "[node]")), plan
        assert S.explain(layout(plan, "[node]"), FRONTIER, SIZES, None) is None


def test_search_costs_both_unless_the_config_sets_it():
    cfg = load_config(None, [*TINY, "train.global_batch=64"])
    sizes = {"pair": 2, "node": 4, "global": 2}
    res = search(cfg, FRONTIER, sizes)
    hier = [c for c in res.candidates if c.plan == "hierarchical" and c.error is None]
    assert hier and all(c.secondary and c.secondary.source == "search" for c in hier)
    assert all(c.secondary is None for c in res.candidates if c.plan in ("zeropp", "ddp"))
    for c in hier[:6]:
        both = S._both(dataclasses.replace(c, secondary=None).config(cfg), FRONTIER, c.sizes,
                       None)
        assert c.secondary.dtype == S.pick(both)
        assert c.prediction.step_time == both[c.secondary.dtype].step_time
        assert c.key().removesuffix("/xq").endswith(
            f"/{'int8' if c.secondary.dtype == 'int8' else 'bf16'}sec")
        assert c.config(cfg).parallel.secondary_dtype == c.secondary.dtype
    fixed = search(C.with_overrides(cfg, **{"parallel.secondary_dtype": "int8"}), FRONTIER, sizes)
    hier = [c for c in fixed.candidates if c.plan == "hierarchical" and c.error is None]
    assert hier and all(c.secondary is None for c in fixed.candidates)
    assert all(c.prediction.layout["placement"]["int8_secondary"] for c in hier)


def test_the_emitted_config_runs_what_was_ranked(tmp_path):
    """--emit-config of a layout whose dtype the search chose: the file sets it, says why in
    its header, and re-plans to the same prediction."""
    from boost_jax.plan.__main__ import emit_config
    from boost_jax.plan.search import Candidate

    base = layout("hierarchical", "[node]")
    cases = []
    for axes in (("node",), ("pair",)):  # bfloat16 kept, int8 kept (the tests above)
        c = Candidate("hierarchical", "btp", axes, 1, 1, "full", sizes=SIZES)
        c.prediction, c.secondary = S.choose(c.config(base), FRONTIER, SIZES, None)
        cases.append(c)
    assert [c.secondary.dtype for c in cases] == ["bfloat16", "int8"]
    for c in cases:
        path = tmp_path / f"{c.secondary.dtype}.yaml"
        emit_config(str(path), c.config(base), c.prediction, FRONTIER, "test",
                    secondary=c.secondary)
        assert f"# {c.secondary.line}" in path.read_text()
        assert "\n# predicted (analytic): " in path.read_text()
        back = load_config(str(path), [])
        assert back.parallel.secondary_dtype == c.secondary.dtype
        again = C.predict(back, FRONTIER, SIZES)
        assert again.step_time == pytest.approx(c.prediction.step_time, rel=1e-12)
        assert S.choose(back, FRONTIER, SIZES, None)[1] is None  # explicit now: kept
        assert S.explain(back, FRONTIER, SIZES, None).source == "config"
    # a compiled plan's memory holds the CPU program's temporaries: the header says so
    pred = dataclasses.replace(cases[0].prediction,
                               memory=dict(cases[0].prediction.memory, temp_compiled=1.0))
    emit_config(str(tmp_path / "c.yaml"), cases[0].config(base), pred, FRONTIER, "test")
    assert "\n# predicted (memory with the temporaries of the step compiled for CPU): " in (
        tmp_path / "c.yaml").read_text()
