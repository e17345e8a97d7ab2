"""Pipeline stages (parallel.pp_stages) equal the single-device model, send only activations
across stages, keep 1f1b's memory flat in the micro-batches, and restore across stage counts.

8 simulated devices: 2 stages on a 2x2x2 mesh (stage x pair x node) and 4 stages on 2x1x4
(stage x pair). Layer counts that do not divide (3 layers over 2 stages) exercise the padded,
skipped layer. tests/e2e/test_pipeline_train.py: the same through train.py.
"""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from boost_jax.analysis import comm
from boost_jax.analysis.hlo import parse_module
from boost_jax.backends.cpu import fast_compile_options
from boost_jax.infer.load import _manager, restore_params
from boost_jax.mesh import get_topology, make_mesh
from boost_jax.config import load_config
from boost_jax.plan.costmodel import predict
from boost_jax.plan.dryrun import dry_run
from boost_jax.plan.search import search
from boost_jax.checkpoints.store import Checkpointer, state_checksums
from boost_jax.compat import cpu_collectives_need_one_order
from boost_jax.sharding.stages import Schedule
from boost_jax.step.build import build_step

from test_tp import (_model_key, _params_and_batch, assert_same, engine_run, make_cfg,
                     reference, stored_params)

FAST = fast_compile_options()
SHAPES = {2: [2, 2, 2], 4: [2, 1, 4]}
LAYERS = {2: 3, 4: 4}
TP = {"none": ("none", "cola", ()), "btp": ("btp", "cola", ("pair",))}


def pp_cfg(stages, schedule, plan="ddp", tp="none", micro=4, **model):
    mode, arch, axes = TP[tp]
    cfg = make_cfg(mode, model.pop("arch", arch), axes, plan=plan, n_layers=model.pop("n_layers", LAYERS[stages]),
                   **model)
    cfg.parallel.pp_stages, cfg.parallel.pp_schedule = stages, schedule
    cfg.train.micro_batches = micro
    return cfg.validate()


def mesh_of(stages):
    return make_mesh("cpu", shape=SHAPES[stages], stages=stages)


@pytest.mark.parametrize("plan,mode,arch,schedule", [
    ("zeropp", "btp", "svd", "1f1b"), ("zero1", "none", "full", "1f1b"),
    ("zero3", "btp", "lax", "1f1b"), ("zero3", "vanilla", "cola", "1f1b"),
    ("hierarchical", "megatron", "full", "gpipe"), ("zeropp", "vanilla", "svd", "gpipe"),
    ("zero3-keep", "btp", "cola", "1f1b")])
def test_pipeline_composes_with_plans_and_tp(plan, mode, arch, schedule):
    """Every TP mode inside a stage. vanilla/zero3/1f1b stalled XLA:CPU's default thread pool
    (devices blocked in collectives starved their peers) before mesh.set_cpu_devices sized it;
    under JAX 0.11 every case aborted on a rendezvous timeout until it turned XLA:CPU's
    concurrency-optimized scheduler off (compat.cpu_collectives_need_one_order).
    `-keep`: the backward uses the forward's gathered weights (parallel.secondary_axes=[])."""
    cfg = make_cfg(mode, arch, ("pair",) if mode != "none" else (), plan=plan.split("-")[0],
                   n_layers=3)
    cfg.parallel.pp_stages, cfg.parallel.pp_schedule, cfg.train.micro_batches = 2, schedule, 2
    if plan.endswith("-keep"):
        cfg.parallel.secondary_axes = []
    cfg = cfg.validate()
    assert_same(reference(_model_key(cfg)), engine_run(cfg, mesh_of(2))[:2])


# half of the 2^4 product (odd parity): every pair of the four settings meets in all four
# combinations, at half the compiles
CASES = [c for i, c in enumerate(itertools.product((2, 4), ("gpipe", "1f1b"), ("none", "btp"),
                                                   ("ddp", "hierarchical")))
         if bin(i).count("1") % 2 == 1]
COMPILED = {}


@pytest.mark.parametrize("stages,schedule,tp,plan", CASES,
                         ids=["-".join(map(str, c)) for c in CASES])
def test_pipeline_equals_single_device(stages, schedule, tp, plan):
    cfg = pp_cfg(stages, schedule, plan, tp)
    loss, grads, compiled = engine_run(cfg, mesh_of(stages))
    assert_same(reference(_model_key(cfg)), (loss, grads))
    COMPILED[(stages, schedule, tp, plan)] = (cfg, compiled)


VIRTUAL = [(2, "1f1b", "btp", "hierarchical", 2, 4, 4), (4, "gpipe", "none", "ddp", 2, 8, 4),
           (2, "1f1b", "none", "zero3", 3, 11, 2), (2, "gpipe", "btp", "zeropp", 2, 7, 8)]


@pytest.mark.parametrize("stages,schedule,tp,plan,virtual,layers,micro", VIRTUAL,
                         ids=["-".join(map(str, c)) for c in VIRTUAL])
def test_interleaved_virtual_stages_equal_single_device(stages, schedule, tp, plan, virtual,
                                                        layers, micro):
    """parallel.pp_virtual=V: each device runs V chunks (virtual stages s, s+P, …), sends
    wrap from the last stage to the first; 11 layers over 2x3, 7 over 2x2 chunks leave padded
    layers; 8 micro-batches make 4 groups of P."""
    cfg = pp_cfg(stages, schedule, plan, tp, micro=micro, n_layers=layers)
    cfg.parallel.pp_virtual = virtual
    loss, grads, compiled = engine_run(cfg.validate(), mesh_of(stages))
    ref = reference(_model_key(cfg))
    assert_same(ref, (loss, grads))
    COMPILED[(stages, schedule, tp, plan, "float32", virtual)] = (cfg, compiled)
    # evaluation runs the whole batch as one micro-batch: a group of P with P−1 masked
    np.testing.assert_allclose(eval_loss(cfg, mesh_of(stages)), ref[0], rtol=1e-5)


def eval_loss(cfg, mesh) -> float:
    """The forward-only loss program (train.py's evaluation) on the reference weights."""
    params, batch = _params_and_batch(_model_key(cfg))
    bundle = build_step(cfg, mesh, FAST)
    pl = bundle.placement
    stored = stored_params(pl, params)
    with jax.set_mesh(mesh):
        return float(jax.jit(bundle.engine.loss_fn())(stored, batch))


@pytest.mark.parametrize("arch,virtual", [("lax", 1), ("full", 1), ("lax", 2)])
def test_pipeline_latents_and_other_archs(arch, virtual):
    """LaX passes its 7 latents across stages along with the residual stream (and from the
    last stage back to the first between virtual chunks); full rank."""
    cfg = pp_cfg(2, "1f1b", "zero3", micro=2, arch=arch, n_layers=3 if virtual == 1 else 7)
    cfg.parallel.pp_virtual = virtual
    cfg = cfg.validate()
    assert_same(reference(_model_key(cfg)), engine_run(cfg, mesh_of(2))[:2])


@pytest.mark.parametrize("key", [(2, "1f1b", "btp", "hierarchical"), (4, "gpipe", "none", "ddp"),
                                 (2, "gpipe", "btp", "ddp", "bfloat16"),
                                 (2, "1f1b", "btp", "hierarchical", "float32", 2)])
def test_only_activation_sends_cross_stages(key):
    """From the compiled program: every collective whose group spans stages is a
    collective-permute of one micro-batch's [rows, s, d] activations (or its gradient), as many
    per step as the schedule's ticks with a forward plus those with a backward, less the final
    tick's; the rest crossing stages is the step's scalar loss. The cost model charges the
    same bytes. In bf16, XLA:CPU moves the send in fp32; the analyzer counts it at 16 bits.
    With V virtual stages: 2(V·m+P−1)−1 sends."""
    if key not in COMPILED:  # compiled here when run apart from the tests that fill COMPILED
        stages, schedule, tp, plan = key[:4]
        cfg = pp_cfg(stages, schedule, plan, tp)
        if len(key) > 4:
            cfg.model.dtype = key[4]
        if len(key) > 5:
            (*_, layers, micro), = [c for c in VIRTUAL if c[:5] == (*key[:4], key[5])]
            cfg = pp_cfg(stages, schedule, plan, tp, micro=micro, n_layers=layers)
            cfg.parallel.pp_virtual = key[5]
        COMPILED[key] = (cfg, engine_run(cfg.validate(), mesh_of(stages))[2])
    cfg, compiled = COMPILED[key]
    stages = cfg.parallel.pp_stages
    mesh = mesh_of(stages)
    colls = comm.extract_collectives(parse_module(compiled.as_text()), mesh)
    crossing = [c for c in colls if "stage" in c.axes]
    sends = [c for c in crossing if c.kind == "collective-permute"]
    others = [c for c in crossing if c.kind != "collective-permute"]
    assert all(c.result_bytes <= 8 for c in others), [(c.kind, c.shapes) for c in others]
    sizes = {a: mesh.shape[a] for a in ("pair", "node", "global")}
    dp = np.prod(list(sizes.values())) // (sizes["pair"] if cfg.parallel.tp_mode != "none" else 1)
    rows = cfg.train.global_batch // cfg.train.micro_batches // dp
    d_local = cfg.model.d_model // (sizes["pair"] if cfg.parallel.tp_mode == "btp" else 1)
    want = rows * cfg.data.seq_len * d_local * jnp.dtype(cfg.model.dtype).itemsize
    assert {c.payload_bytes for c in sends} == {want}
    assert all(c.level == "global" for c in sends)
    per_step = sum(c.trip_count for c in sends)
    V = cfg.parallel.pp_virtual
    sch = Schedule(cfg.parallel.pp_schedule, stages, cfg.train.micro_batches, V)
    assert per_step == sch.sends == 2 * (V * cfg.train.micro_batches + stages - 1) - 1
    pred = predict(cfg, get_topology("cpu"), {**sizes, "stage": stages})
    (model,) = [c for c in pred.collectives if c.name == "stage_send"]
    assert model.bytes_per_step == sum(c.bytes_per_step for c in sends)


def _temp_bytes(schedule, micro, cfg=None):
    if cfg is None:
        cfg = pp_cfg(2, schedule, "ddp", micro=micro, d_model=64, n_heads=2, d_ff=128, rank=16,
                     max_seq_len=64, vocab_size=64)
        cfg.data.seq_len = 64
        cfg.train.global_batch = 8 * micro  # 2 rows per data-parallel device per micro-batch
    mesh = mesh_of(2)
    bundle = build_step(cfg.validate(), mesh, FAST)
    gf = jax.jit(bundle.engine.grads_fn(micro))
    params = bundle.abstract_state["params"]
    with jax.set_mesh(mesh):
        compiled = gf.lower(params, bundle.abstract_batch()).compile(compiler_options=FAST)
    return compiled.memory_analysis().temp_size_in_bytes


def test_1f1b_memory_flat_gpipe_grows():
    """Temporaries per device as micro-batches go 4 → 8 at a fixed micro-batch size.

    temp(m) = C + depth(m)·A, A = one stage input (rows·s·d·4 bytes), C = one micro-batch's
    stage forward + backward: 1f1b keeps depth = min(m, 2P−1) stage inputs (flat in m), gpipe
    keeps all m (A more per micro-batch)."""
    A = 2 * 64 * 64 * 4
    f = {m: _temp_bytes("1f1b", m) for m in (4, 8)}
    g = {m: _temp_bytes("gpipe", m) for m in (4, 8)}
    assert f[8] <= 1.10 * f[4], f
    assert g[8] - g[4] == pytest.approx(4 * A, rel=0.1), g


@pytest.mark.skipif(cpu_collectives_need_one_order(),
                    reason="under the sequential CPU schedule JAX 0.11 runs the simulated "
                           "devices with, the temporaries barely move: test_gpu_compile holds "
                           "the A100 program to it")
def test_interleaved_backward_keeps_one_chunk_of_activations():
    """remat=none, 8 layers on 2 stages: a B tick replays and differentiates one chunk, so
    with 2 virtual stages a backward keeps 2 layers' saved activations, not the stage's 4. The
    planner's activations halve (costmodel.backward_layers), and the compiled temporaries drop
    by at least as much."""
    temps, acts = {}, {}
    for v in (1, 2):
        cfg = pp_cfg(2, "1f1b", "ddp", micro=4, n_layers=8, d_model=64, n_heads=2, d_ff=128,
                     rank=16, max_seq_len=64, vocab_size=64)
        cfg.data.seq_len, cfg.train.global_batch = 64, 32
        cfg.train.remat, cfg.parallel.pp_virtual = "none", v
        temps[v] = _temp_bytes("1f1b", 4, cfg)
        sizes = {"pair": 2, "node": 2, "global": 1, "stage": 2}
        acts[v] = predict(cfg.validate(), get_topology("cpu"), sizes).memory["activations"]
    assert acts[2] == pytest.approx(acts[1] / 2)
    assert temps[1] - temps[2] >= acts[1] - acts[2] > 0, (temps, acts)


def _train(cfg, mesh, steps, batches):
    bundle = build_step(cfg, mesh, FAST)
    state = bundle.init_state()
    losses = []
    for b in batches[:steps]:
        state, m = bundle.train_step(state, b)
        losses.append(float(m["loss"]))
    return bundle, state, losses


def test_training_and_restore_across_stage_counts(tmp_path):
    """5 optimizer steps with 2 stages (1f1b, hierarchical), and with 2 stages x 2 interleaved
    virtual stages, give the unpipelined losses; each checkpoint restores with other splits
    (1, 4, 2x2 / 2 stages) and onto one device to the same logical weights and optimizer
    state."""
    rng = np.random.default_rng(0)
    base = pp_cfg(2, "1f1b", "hierarchical", n_layers=7)  # 2 stages: 4+3, 4 stages: 2+2+2+1
    toks = rng.integers(0, base.model.vocab_size, (5, base.train.global_batch,
                                                    base.data.seq_len + 1)).astype(np.int32)
    batches = [{"inputs": t[:, :-1], "targets": t[:, 1:]} for t in toks]
    flat = pp_cfg(2, "1f1b", "hierarchical", micro=2, n_layers=7)  # 8 data-parallel devices
    flat.parallel.pp_stages = 1
    _, _, want = _train(flat.validate(), make_mesh("cpu", shape=[2, 2, 2]), 5, batches)
    virt = pp_cfg(2, "1f1b", "hierarchical", n_layers=7)  # chunks of 2 layers: 0,2 | 1,3
    virt.parallel.pp_virtual = 2
    runs = {}
    for name, cfg in (("2", base), ("2x2", virt.validate())):
        bundle, state, got = _train(cfg, mesh_of(2), 5, batches)
        np.testing.assert_allclose(got, want, rtol=1e-5, err_msg=name)
        runs[name] = (cfg, bundle, state)

    targets = {"2": ((1, 1, [2, 2, 2]), (4, 1, [2, 1, 4]), (2, 2, [2, 2, 2])),
               "2x2": ((4, 1, [2, 1, 4]), (2, 1, [2, 2, 2]))}
    for name, (saved_cfg, bundle, state) in runs.items():
        path = str(tmp_path / name)
        split = (saved_cfg.parallel.pp_stages, saved_cfg.parallel.pp_virtual)
        ck = Checkpointer(path, saved_cfg.checkpoint, stages=split)
        ck.save(5, state, {}, {"config": saved_cfg.to_dict()}, force=True)
        ck.wait()
        logical = jax.device_get(bundle.logical_params(state))
        # generate/evaluate/export read the logical weights onto one device
        one = restore_params(_manager(path), 5, saved_cfg)
        jax.tree.map(np.testing.assert_array_equal, jax.device_get(one), logical)
        for stages, virtual, shape in targets[name]:
            cfg = pp_cfg(4, "gpipe", "hierarchical", n_layers=7,
                         micro=2 if stages == 1 else 4)
            cfg.parallel.pp_stages, cfg.parallel.pp_virtual = stages, virtual
            other = build_step(cfg.validate(), make_mesh("cpu", shape=shape, stages=stages),
                               FAST)
            restored, _, _ = Checkpointer(path, saved_cfg.checkpoint, stages=(
                stages, virtual)).restore(5, other.abstract_state)
            got = jax.device_get(other.logical_params(restored))
            jax.tree.map(np.testing.assert_array_equal, got, logical)
            # Adam moments: the same exact checksums per array (they ignore where elements sit,
            # and zero slots and padding add nothing), as resume checks them
            want_d = state_checksums(state["opt_state"])[0]
            assert state_checksums(restored["opt_state"])[0] == want_d, name


def test_adafactor_state_restores_across_stage_counts(tmp_path):
    """Adafactor under 2 stages x 2 virtual stages (7 layers: one empty layer slot, stored
    interleaved; end weights in their owner's slot; (1,) placeholders for the unfactored
    weights' row and column statistics) restores into 1 stage with the same checksums resume
    checks, and the same logical weights."""
    cfg = pp_cfg(2, "1f1b", "zero3", n_layers=7)
    cfg.optim.name, cfg.parallel.pp_virtual = "adafactor", 2
    rng = np.random.default_rng(0)
    toks = rng.integers(0, cfg.model.vocab_size, (2, cfg.train.global_batch,
                                                  cfg.data.seq_len + 1)).astype(np.int32)
    batches = [{"inputs": t[:, :-1], "targets": t[:, 1:]} for t in toks]
    bundle, state, _ = _train(cfg.validate(), mesh_of(2), 2, batches)
    ck = Checkpointer(str(tmp_path), cfg.checkpoint, stages=(2, 2))
    ck.save(2, state, {}, {"config": cfg.to_dict()}, force=True)
    ck.wait()
    one = pp_cfg(2, "1f1b", "zero3", micro=2, n_layers=7)
    one.optim.name, one.parallel.pp_stages = "adafactor", 1
    other = build_step(one.validate(), make_mesh("cpu", shape=[2, 2, 2]), FAST)
    restored, _, _ = Checkpointer(str(tmp_path), cfg.checkpoint).restore(2, other.abstract_state)
    assert jax.tree.map(lambda x: x.shape, restored) == \
        jax.tree.map(lambda x: x.shape, other.abstract_state)
    assert state_checksums(restored["opt_state"])[0] == state_checksums(state["opt_state"])[0]
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(other.logical_params(restored)),
                 jax.device_get(bundle.logical_params(state)))


def test_planner_compiles_and_searches_stages():
    """The planner compiles the pipelined step (the sends it measures are what the cost model
    charges) and --search tries stage counts: on 4 Perlmutter nodes, CoLA-40B fits with them."""
    cfg = load_config("configs/demo.yaml", ["parallel.pp_stages=2", "train.micro_batches=4",
                                            "mesh.shape=[2,2,2]"])
    dr = dry_run(cfg, get_topology("cpu"), None, 8)
    assert dr.full_sizes == {"pair": 2, "node": 2, "global": 1, "stage": 2}
    analytic = predict(cfg, get_topology("cpu"), dr.full_sizes)
    assert dr.prediction.comm_bytes["global"] == pytest.approx(
        analytic.comm_bytes["global"], rel=1e-3)  # the sends; scalars differ by bytes
    big = load_config("configs/cola-40b.yaml", ["train.global_batch=32"])
    res = search(big, get_topology("perlmutter"), {"pair": 2, "node": 2, "global": 4})
    staged = [c for c in res.candidates if c.pp_stages > 1 and c.prediction is not None]
    assert {c.pp_stages for c in staged} == {2, 4}
    assert any(c.pp_stages > 1 for c in res.fitting)
    best = res.fitting[0]
    assert best.prediction.layout["pipeline_stages"] == best.pp_stages


@pytest.mark.parametrize("schedule,plan,tp,model", [
    ("1f1b", "hierarchical", "btp", dict(family="gpt_neox", arch="lax", rotary_pct=0.25)),
    ("gpipe", "zero3", "none", dict(family="gpt2", arch="full"))])
def test_pipeline_gpt_families(schedule, plan, tp, model):
    """GPT families across 2 stages: LayerNorm + biases (Online-LayerNorm under BTP), the
    neox parallel residual's 6 latents; gpt2's learned positions live with the first stage's
    embedding."""
    cfg = pp_cfg(2, schedule, plan, tp, micro=2, **model)
    assert_same(reference(_model_key(cfg)), engine_run(cfg, mesh_of(2))[:2])


def test_the_head_runs_forward_once_per_backward_tick():
    """A tick runs the same program on every stage, masked: F leaves out the head and B's
    re-run computes it (and the loss), so the compiled step's matmul FLOPs per device are
    ticks · T · (4·k·layer + 3·head): F's k layers, B's re-run of them with the head, and the
    backward at twice that (T tokens per micro-batch per device, k layers per stage). With
    the head in F too it was 4·head."""
    from boost_jax.analysis.flops import flops_per_token
    from boost_jax.analysis.hlo import matmul_flops
    from boost_jax.plan.costmodel import schedule

    cfg = pp_cfg(2, "1f1b", "ddp", micro=4, n_layers=4, arch="full", d_model=64, n_heads=2,
                 d_ff=128, max_seq_len=64, vocab_size=200)
    cfg.data.seq_len, cfg.train.global_batch, cfg.train.remat = 64, 16, "none"
    cfg = cfg.validate()
    mesh = mesh_of(2)
    bundle = build_step(cfg, mesh, FAST)
    with jax.set_mesh(mesh):
        compiled = jax.jit(bundle.engine.grads_fn(4)).lower(
            bundle.abstract_state["params"], bundle.abstract_batch()).compile(
                compiler_options=FAST)
    got, trips_known = matmul_flops(parse_module(compiled.as_text()))
    per_token = flops_per_token(cfg.model, 64)
    T = 64 * 16 // (4 * 4)  # tokens of a micro-batch on one of the 4 data-parallel devices
    assert trips_known
    assert got == schedule(cfg).ticks * T * (4 * 2 * per_token["per_layer"]
                                             + 3 * per_token["lm_head"])
