"""optim.name and optim.schedule: each optimizer's sharded, padded step (zero3 on 8 devices)
against the same optax optimizer on one device and unpadded weights, the schedules' shapes,
and the one-line refusals."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from boost_jax.backends.cpu import fast_compile_options
from boost_jax.config import load_config
from boost_jax.errors import ConfigError, UserError
from boost_jax.layers import forward
from boost_jax.mesh import mesh_from_config
from boost_jax.names import OPTIMIZERS
from boost_jax.sharding.layout import LeafLayout
from boost_jax.step.build import build_step
from boost_jax.step.optim import (check_factoring, lr_schedule, make_optimizer, transposed,
                                  update_count)

STEPS = 4
# d_model 132 and vocab 260 do not divide by 8: zero3 pads the embedding (dim 0) and the head
# (dim 1), the two weights Adafactor factors (both dims >= 128)
CFG = ["model.arch=cola", "model.d_model=132", "model.n_layers=2", "model.n_heads=2",
       "model.d_ff=140", "model.rank=8", "model.vocab_size=260", "model.max_seq_len=16",
       "model.dtype=float32", "model.param_dtype=float32", "data.seq_len=16",
       "train.global_batch=8", f"train.steps={STEPS}", "parallel.plan=zero3", "optim.lr=0.01",
       "optim.warmup_frac=0.25", "optim.clip_norm=0.5", "optim.weight_decay=0.1",
       "optim.eps=1e-3"]  # adamw: a small eps would amplify the gradients' reduction order


def _reference(cfg, p0, batches):
    """The same optax optimizer on one device, unpadded weights: the params after the batches."""
    tx = optax.chain(optax.clip_by_global_norm(cfg.optim.clip_norm),
                     make_optimizer(cfg.optim, STEPS))
    ops = forward.Local(cfg.model)

    @jax.jit
    def step(p, state, batch):
        g = jax.grad(lambda q: forward.loss(ops, cfg.model, q, batch))(p)
        updates, state = tx.update(g, state, p)
        return optax.apply_updates(p, updates), state

    p, state = p0, tx.init(p0)
    for b in batches:
        p, state = step(p, state, b)
    return p


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_sharded_padded_step_matches_one_device(name):
    cfg = load_config(None, CFG + [f"optim.name={name}"])
    bundle = build_step(cfg, mesh_from_config(cfg), fast_compile_options())
    assert any(lay.pad for lay in jax.tree.leaves(
        bundle.placement.layouts, is_leaf=lambda x: isinstance(x, LeafLayout)))
    state = bundle.init_state()
    p0 = jax.tree.map(np.asarray, jax.device_get(bundle.logical_params(state)))
    rng = np.random.default_rng(0)
    batches = [{k: rng.integers(0, 260, (8, 16), dtype=np.int32) for k in ("inputs", "targets")}
               for _ in range(STEPS)]
    for b in batches:
        state, _ = bundle.train_step(state, jax.device_put(b, bundle.batch_sharding))
    got = jax.device_get(bundle.logical_params(state))
    want = _reference(cfg, jax.tree.map(jnp.asarray, p0), batches)
    moved = jax.tree.map(lambda a, b: float(np.abs(a - b).max()), got, p0)
    assert min(jax.tree.leaves(moved)) > 0  # every weight was updated
    # adamw/adafactor divide by an RMS, which magnifies the gradients' reduction order where a
    # gradient is near 0: up to 2e-6 here (lr 0.01). The padded weights Adafactor factors are
    # held to 5e-7: its RMS-based options on padded weights (parameter scaling) move them 8e-6.
    for key in got:
        tol = 5e-7 if key in ("embed", "lm_head") else 5e-6
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=tol),
                     got[key], want[key])


def test_schedules_warm_up_then_follow_their_shape():
    """Update k (1..100) runs at f(k - 1): the warmup's first update above 0, its 10th at lr,
    the decay's end at the 100th, the last update there is."""
    lr, lo = 1.0, 0.1
    values = {}
    for s in ("cosine", "linear", "wsd", "constant"):
        cfg = load_config(None, [f"optim.schedule={s}", f"optim.lr={lr}", "optim.warmup_frac=0.1",
                                 "optim.decay_frac=0.2", f"optim.min_lr_ratio={lo}"])
        f = lr_schedule(cfg.optim, 100)
        values[s] = np.array([float(f(k - 1)) for k in range(1, 101)])  # index k - 1: update k
        np.testing.assert_allclose(values[s][:10], np.linspace(lr / 10, lr, 10), rtol=1e-6)
    np.testing.assert_allclose(values["constant"][9:], lr)
    np.testing.assert_allclose(values["wsd"][9:80], lr)  # stable until the last 20 updates
    np.testing.assert_allclose(values["wsd"][79:], np.linspace(lr, lo, 21), rtol=1e-6)
    np.testing.assert_allclose(values["linear"][9:], np.linspace(lr, lo, 91), rtol=1e-6)
    c = values["cosine"]
    assert c[99] == pytest.approx(lo) and c[9 + 45] == pytest.approx((lr + lo) / 2, rel=1e-6)
    assert np.all(np.diff(c[9:]) < 0)
    for s in ("cosine", "linear", "wsd", "constant"):  # no warmup: the first update runs at lr
        cfg = load_config(None, [f"optim.schedule={s}", f"optim.lr={lr}", "optim.warmup_frac=0",
                                 f"optim.min_lr_ratio={lo}"])
        f = lr_schedule(cfg.optim, 100)
        assert float(f(0)) == pytest.approx(lr) and float(f(99)) == pytest.approx(
            lr if s == "constant" else lo), s
        one = lr_schedule(cfg.optim, 1)  # a one-step run trains, at lr
        assert float(one(0)) == pytest.approx(lr), s
    flat = lr_schedule(load_config(None, ["optim.schedule=wsd", "optim.decay_frac=0",
                                          "optim.warmup_frac=0"]).optim, 10)
    assert float(flat(9)) == pytest.approx(float(flat(0)))  # no cooldown at all
    odd = lr_schedule(load_config(None, ["optim.warmup_frac=0.29", f"optim.lr={lr}"]).optim, 100)
    assert float(odd(27)) < lr and float(odd(28)) == pytest.approx(lr)  # update 29: 0.29 x 100


def test_the_logged_lr_is_the_one_applied_when_a_step_is_skipped():
    """train.skip_nonfinite keeps the optimizer's count, so the schedule waits; the logged lr
    is read from that count (update_count), not from the step counter."""
    cfg = load_config(None, ["optim.schedule=linear", "optim.warmup_frac=0", "optim.lr=1.0",
                             "optim.min_lr_ratio=0.0"])
    for name in OPTIMIZERS:
        tx = make_optimizer(dataclasses.replace(cfg.optim, name=name), 4)
        params = {"w": jnp.ones((3, 2))}
        state = tx.init(params)
        assert int(update_count(state)) == 0, name
        _, state = tx.update({"w": jnp.ones((3, 2))}, state, params)
        assert int(update_count(state)) == 1, name
    s = lr_schedule(cfg.optim, 4)
    assert [float(s(k)) for k in range(4)] == pytest.approx([1.0, 2 / 3, 1 / 3, 0.0])


def test_a_skipped_step_leaves_the_schedule_and_logs_the_lr_it_applies():
    cfg = load_config(None, CFG + ["train.skip_nonfinite=true", "optim.schedule=linear",
                                   "optim.warmup_frac=0", "optim.lr=1.0", "optim.min_lr_ratio=0",
                                   "parallel.plan=ddp"])
    bundle = build_step(cfg, mesh_from_config(cfg), fast_compile_options())
    rng = np.random.default_rng(0)
    batch = jax.device_put({k: rng.integers(0, 260, (8, 16), dtype=np.int32)
                            for k in ("inputs", "targets")}, bundle.batch_sharding)
    state, m = bundle.train_step(bundle.init_state(), batch)
    good = state["params"]
    nan = dict(state, params=jax.tree.map(lambda x: x * np.nan, good))
    state, skipped = bundle.train_step(nan, batch)  # skipped: the optimizer's count stays 1
    state, after = bundle.train_step(dict(state, params=good), batch)
    assert [bool(x["finite"]) for x in (m, skipped, after)] == [True, False, True]
    assert int(state["step"]) == 3 and int(update_count(state["opt_state"])) == 2
    assert [float(x["lr"]) for x in (m, skipped, after)] == pytest.approx([1.0, 2 / 3, 2 / 3])


def test_adafactor_refuses_a_padding_that_changes_its_factoring():
    cfg = load_config(None, ["optim.name=adafactor"]).optim
    ok = {"w": LeafLayout((256, 130), (256, 136), 1, ((), ()))}
    check_factoring(cfg, ok)  # padded along a factored dim: the statistics' factors cancel
    bad = {"w": LeafLayout((127, 256), (128, 256), 0, ((), ()))}
    with pytest.raises(ConfigError, match=r"optim\.name=adafactor: weight \['w'\] is padded "
                                          r"from \(127, 256\) to \(128, 256\)"):
        check_factoring(cfg, bad)
    check_factoring(load_config(None, ["optim.name=adamw"]).optim, bad)


@pytest.mark.parametrize("arg, msg", [
    ("optim.name=adam", "optim.name='adam' is not valid: expected one of 'adamw', 'adafactor', "
                        "'lion', 'sgd', 'sgd-momentum'"),
    ("optim.schedule=step", "optim.schedule='step' is not valid: expected one of 'cosine', "
                            "'linear', 'wsd', 'constant'"),
    ("optim.decay_frac=1.5", "optim.decay_frac=1.5 must be in [0, 1]")])
def test_bad_names_are_one_line_errors(arg, msg):
    with pytest.raises(ConfigError) as e:
        load_config(None, [arg])
    assert str(e.value) == msg


def test_the_learning_per_flop_study_names_its_optimizer():
    import sys

    from train_proc import ROOT
    sys.path.insert(0, ROOT)
    from benchmarks import convergence as conv

    base = load_config(conv.BASE_CONFIG, []).optim
    assert conv.optimizer_text(base).startswith("AdamW (weight decay 0.01, clip 0.5), warmup "
                                                "0.05 of the steps then cosine to 0.1× lr")
    assert conv.optimizer_text(base) in open(f"{ROOT}/benchmarks/results/convergence.md").read()
    wsd = load_config(conv.BASE_CONFIG, ["optim.name=lion", "optim.schedule=wsd"]).optim
    assert conv.optimizer_text(wsd).startswith("Lion (")
    assert "then constant, the last 0.2 linear to 0.1× lr" in conv.optimizer_text(wsd)


def test_the_planner_counts_each_optimizers_state():
    from boost_jax.mesh import get_topology
    from boost_jax.plan import costmodel as C
    from plan_tiny import TINY

    sizes = {"pair": 2, "node": 4, "global": 8}
    mem = {n: C.predict(load_config(None, [*TINY, "parallel.plan=zero3", "train.global_batch=64",
                                         f"optim.name={n}"]),
                        get_topology("frontier"), sizes).memory for n in OPTIMIZERS}
    assert mem["adamw"]["adam"] > 0  # two fp32 moments; Lion and SGD keep one
    for n in ("lion", "sgd-momentum", "adafactor"):
        assert mem[n]["adam"] == pytest.approx(mem["adamw"]["adam"] / 2), n
        assert mem["adamw"]["arguments"] - mem[n]["arguments"] == pytest.approx(
            mem[n]["adam"]), n
    assert mem["sgd"]["adam"] == 0  # plain SGD keeps no state


def test_one_moment_state_compiles_to_the_planners_bytes():
    """The dry run's argument bytes (memory_analysis of the compiled step) against the formula
    counting one fp32 moment for Lion (measured: 68172 compiled, 68160 formula; AdamW
    102124 / 102112: the 12 bytes are the step counters)."""
    from boost_jax.mesh import get_topology
    from boost_jax.plan.dryrun import dry_run
    from plan_tiny import TINY

    cfg = load_config(None, [*TINY, "train.global_batch=8", "mesh.shape=[2,2,2]",
                             "mesh.topology=cpu", "parallel.plan=zero3", "optim.name=lion"])
    mem = dry_run(cfg, get_topology("cpu"), None, jax.device_count(), full_layers_max=2).memory
    assert mem["arguments_compiled"] == pytest.approx(mem["arguments_formula"], abs=64)


def test_adafactor_state_restores_under_another_mesh_and_plan(tmp_path):
    """Adafactor's statistics add an epsilon to every squared gradient, the padding's zeros
    included, count the padding in their means and, for a d x d weight padded on one dim, swap
    rows and columns; the step stores them as the unpadded weights give them. So a zero3 state
    padded for 8 devices restores (with the checksums resume checks) into zero1 on 4 devices,
    unpadded, and trains on as the saved layout does."""
    from boost_jax.checkpoints.store import Checkpointer
    from boost_jax.config import CheckpointConfig
    from boost_jax.mesh import make_mesh

    run = CFG + ["model.arch=full", "optim.name=adafactor", "train.global_batch=40"]
    cfg = load_config(None, run)
    rng = np.random.default_rng(1)
    batches = [{k: rng.integers(0, 260, (40, 16), dtype=np.int32) for k in ("inputs", "targets")}
               for _ in range(STEPS)]

    def train(bundle, state, part):
        for b in part:
            state, _ = bundle.train_step(state, jax.device_put(b, bundle.batch_sharding))
        return state

    saved = build_step(cfg, mesh_from_config(cfg), fast_compile_options())
    state = train(saved, saved.init_state(), batches[:2])
    ck = Checkpointer(str(tmp_path), CheckpointConfig(async_save=False))
    ck.save(2, state, {}, {"config": cfg.to_dict()}, force=True)
    want = jax.device_get(saved.logical_params(train(saved, state, batches[2:])))

    other = load_config(None, run + ["parallel.plan=zero1"])
    bundle = build_step(other, make_mesh("cpu", (1, 1, 4)), fast_compile_options())
    layouts = lambda b: jax.tree.leaves(  # noqa: E731
        b.placement.layouts, is_leaf=lambda x: isinstance(x, LeafLayout))
    assert any(lay.pad for lay in layouts(saved)) and not any(lay.pad for lay in layouts(bundle))
    # the 132 x 132 weights padded to 136 x 132: optax factors them the other way round
    assert any(transposed(lay) for lay in layouts(saved))
    step, restored, _, _ = ck.restore_latest(bundle.abstract_state)
    ck.close()
    assert step == 2  # the checksums held: nothing was set aside
    got = jax.device_get(bundle.logical_params(train(bundle, restored, batches[2:])))
    # the two layouts reduce in another order: 8e-7 apart over 4 steps without a checkpoint
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=2e-6), got, want)

def test_adafactor_statistics_are_stored_as_the_unpadded_weights_give_them():
    """The step's Adafactor makes optax's updates, and stores optax's statistics zeroed in the
    padding and rescaled to means over the real elements: what rescale_statistics makes of an
    older step's state (in optax's counts), and what the unpadded weights give."""
    from boost_jax.sharding.layout import pad_tree, unpad_tree
    from boost_jax.step.optim import rescale_statistics, transpose_statistics

    layouts = {"w": LeafLayout((130, 140), (136, 140), 0, ((), ())),  # factored, dim 0 padded
               "q": LeafLayout((132, 132), (136, 132), 0, ((), ())),  # factored the other way
               "b": LeafLayout((5,), (8,), 0, ((),))}  # unfactored
    cfg = load_config(None, ["optim.name=adafactor"]).optim
    txs = {"optax": make_optimizer(cfg, STEPS), "ours": make_optimizer(cfg, STEPS, layouts),
           "unpadded": make_optimizer(cfg, STEPS)}
    rng = np.random.default_rng(0)
    logical = {k: jnp.asarray(rng.normal(size=lay.shape), jnp.float32)
               for k, lay in layouts.items()}
    params = {"unpadded": logical, "optax": pad_tree(layouts, logical)}
    params["ours"] = params["optax"]
    states = {k: tx.init(params[k]) for k, tx in txs.items()}
    for _ in range(3):
        g = {k: jnp.asarray(rng.normal(size=lay.shape), jnp.float32)
             for k, lay in layouts.items()}
        grads = {"unpadded": g, "optax": pad_tree(layouts, g), "ours": pad_tree(layouts, g)}
        ups = {}
        for k, tx in txs.items():
            ups[k], states[k] = tx.update(grads[k], states[k], params[k])
        # updates of about 1e-2: float32 rounding of the rescaled statistics, 1e-9 at most
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-6, atol=1e-8),
                     ups["ours"], ups["optax"])
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-6, atol=1e-8),
                     unpad_tree(layouts, ups["ours"]), ups["unpadded"])
    ours = states["ours"][0]
    converted = transpose_statistics(rescale_statistics(states["optax"], layouts, False),
                                     layouts)[0]
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6), converted, ours)
    assert not ours.v_row["w"][130:].any() and not ours.v["b"][5:].any()
    assert not np.asarray(states["optax"][0].v["b"][5:] == 0).any()  # optax's: epsilon there
    # v_col averages the padded dim: over its 130 real rows, as the unpadded weight's does
    np.testing.assert_allclose(ours.v_col["w"], states["unpadded"][0].v_col["w"], rtol=1e-6)
    np.testing.assert_allclose(ours.v_row["w"][:130], states["unpadded"][0].v_row["w"],
                               rtol=1e-6)
    assert transposed(layouts["q"]) and ours.v_row["q"].shape == (136,)  # rows: dim 0
    np.testing.assert_allclose(ours.v_row["q"][:132], states["unpadded"][0].v_row["q"], rtol=1e-6)
    np.testing.assert_allclose(ours.v_col["q"], states["unpadded"][0].v_col["q"], rtol=1e-6)


def test_an_older_adafactor_step_resumes_only_under_the_layout_that_saved_it():
    """A step saved before the statistics were stored layout-free holds optax's epsilon in the
    layout's padding: under another mesh, plan or pipeline split its resume is one line naming
    the change, before any step is restored or moved aside; newer steps and other optimizers
    restore under any layout."""
    from boost_jax.checkpoints.run_config import (LAYOUT_FREE, OPTAX_ORDER,
                                                  check_adafactor_layout, in_optax_counts)

    base = ["optim.name=adafactor", "parallel.plan=zero3"]
    old = {"config": load_config(None, base).to_dict(), "mesh": [2, 2, 2]}
    check_adafactor_layout(old, {"mesh": [2, 2, 2]}, load_config(None, base), 5, "runs/x")
    for extra, mesh, change in (([], [2, 1, 3], r"the device mesh \[2, 2, 2\] -> \[2, 1, 3\]"),
                                (["parallel.plan=hierarchical"], [2, 2, 2],
                                 r"parallel\.plan 'zero3' -> 'hierarchical'"),
                                (["parallel.pp_stages=2"], [2, 2, 2],
                                 r"parallel\.pp_stages 1 -> 2")):
        other = load_config(None, base + extra)
        with pytest.raises(UserError, match=rf"^checkpoint step 5 in runs/x holds optim\.name="
                                            rf"adafactor state saved by an older boost_jax under "
                                            rf"another layout \({change}\), .*: set those back "
                                            rf"to resume"):
            check_adafactor_layout(old, {"mesh": mesh}, other, 5, "runs/x")
        check_adafactor_layout(dict(old, adafactor_statistics=LAYOUT_FREE), {"mesh": mesh},
                               other, 5, "runs/x")
    # where this layout pads a d x d weight, optax kept its rows and columns the other way
    with pytest.raises(UserError, match=r"^checkpoint step 5 in runs/x holds optim\.name=adafactor "
                                        r"state saved by an older boost_jax, which kept the row "
                                        r"and column statistics of \['q'\] \(padded by this "
                                        r"layout\) the other way round: resume it with the "
                                        r"boost_jax that saved it, or use a new out_dir$"):
        check_adafactor_layout(old, {"mesh": [2, 2, 2]}, load_config(None, base), 5, "runs/x",
                               ("['q']",))
    check_adafactor_layout(dict(old, adafactor_statistics=LAYOUT_FREE), {"mesh": [2, 2, 2]},
                           load_config(None, base), 5, "runs/x", ("['q']",))
    # one development commit stored them layout-free but in optax's order: as old where a
    # weight is transposed or the layout changed, else as new (no counts to convert)
    mid = dict(old, adafactor_statistics=OPTAX_ORDER)
    with pytest.raises(UserError, match=r"kept the row and column statistics of \['q'\]"):
        check_adafactor_layout(mid, {"mesh": [2, 2, 2]}, load_config(None, base), 5, "runs/x",
                               ("['q']",))
    with pytest.raises(UserError, match=r"under another layout \(the device mesh"):
        check_adafactor_layout(mid, {"mesh": [2, 1, 3]}, load_config(None, base), 5, "runs/x")
    check_adafactor_layout(mid, {"mesh": [2, 2, 2]}, load_config(None, base), 5, "runs/x")
    assert not in_optax_counts(mid, load_config(None, base))
    assert in_optax_counts(old, load_config(None, base))
    adam = {"config": load_config(None, ["parallel.plan=zero3"]).to_dict(), "mesh": [2, 2, 2]}
    check_adafactor_layout(adam, {"mesh": [2, 1, 3]},
                           load_config(None, ["parallel.plan=hierarchical"]), 5, "runs/x",
                           ("['q']",))
