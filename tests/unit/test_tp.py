"""Every plan × TP layout × arch equals the single-device model, through the one step engine.

Loss and every gradient leaf of boost_jax.step.engine (one shard_map over every axis of the
2x2x2 CPU mesh: micro-batches, per-layer gathers, TP collectives, deferred reduction) are
compared with the plain single-device forward in fp32 (rtol 1e-5). The matrix uses shapes that
force zero padding (d_model=36, vocab 66, rank 6 do not divide the data-parallel devices);
quantized gathers are switched off there (int8 is not exact: tests/unit/test_plans.py bounds it).
Compile time dominates: each case is one compile with the fast XLA options, and references
are cached per model config.
"""

import functools
import itertools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from boost_jax.backends.cpu import fast_compile_options
from boost_jax.config import Config, ModelConfig, ParallelConfig
from boost_jax.errors import ConfigError
from boost_jax.layers import forward
from boost_jax.layers.model import CausalLM
from boost_jax.mesh import make_mesh
from boost_jax.sharding.layout import pad_tree, unpad_tree
from boost_jax.sharding.tp.specs import tp_param_specs, validate_tp
from boost_jax.step.build import abstract_params, build_step

from weights import random_weights

B, S = 16, 8
PAD = dict(vocab_size=66, d_model=36, n_layers=2, n_heads=2, d_ff=60, rank=6, max_seq_len=S,
           lax_gate="gate")
WIDE = dict(vocab_size=64, d_model=32, n_layers=2, n_heads=8, d_ff=64, rank=8, max_seq_len=S,
            lax_gate="gate")
AXES = {2: ("pair",), 4: ("pair", "node"), 8: ("pair", "node", "global")}
FAST = fast_compile_options()
PLANS = ("ddp", "zero1", "zero3", "zeropp", "hierarchical")
ARCHS = {"none": ("full", "svd", "cola", "lax"), "megatron": ("full",),
         "vanilla": ("svd", "cola", "lax"), "btp": ("svd", "cola", "lax")}


@pytest.fixture(scope="module")
def mesh():
    return make_mesh("cpu", shape=[2, 2, 2])


def make_cfg(mode, arch, tp_axes=(), plan="ddp", remat="none", model=PAD, **kw) -> Config:
    cfg = Config()
    cfg.model = ModelConfig(**{**model, "arch": arch, **kw})
    cfg.parallel = ParallelConfig(plan=plan, tp_mode=mode, tp_axes=list(tp_axes),
                                  quantize_gather=False, quantize_grads=False,
                                  secondary_dtype="bfloat16")
    cfg.train.remat = remat
    cfg.train.global_batch = B
    cfg.train.micro_batches = 2
    cfg.data.tokenizer = "bpe"  # allow small vocabularies
    cfg.data.seq_len = S
    return cfg.validate()


def _model_key(cfg):
    return tuple(sorted(vars(cfg.model).items()))


@functools.lru_cache(maxsize=None)
def _params_and_batch(key):
    """Random NumPy weights (norm scales/gates near init, so every code path is exercised)."""
    cfg = Config()
    cfg.model = ModelConfig(**dict(key))
    params = random_weights(abstract_params(cfg.model, cfg.train)[1], 0, np.float32)
    toks = np.asarray(jax.random.randint(jax.random.key(1), (B, S + 1), 0, cfg.model.vocab_size))
    return params, {"inputs": toks[:, :-1], "targets": toks[:, 1:]}


@functools.lru_cache(maxsize=None)
def reference(key):
    """(loss, grads) of the single-device forward (layers/forward.py with Local ops)."""
    mc = ModelConfig(**dict(key))
    params, batch = _params_and_batch(key)
    f = jax.jit(jax.value_and_grad(lambda p: forward.loss(forward.Local(mc), mc, p, batch)),
                compiler_options=FAST)
    return jax.device_get(f(params))


def engine_run(cfg, mesh):
    """(loss, grads, compiled) of the step's loss-and-gradient program, grads unpadded."""
    params, batch = _params_and_batch(_model_key(cfg))
    bundle = build_step(cfg, mesh, FAST)
    pl = bundle.placement
    stored = stored_params(pl, params)
    gf = jax.jit(bundle.engine.grads_fn(cfg.train.micro_batches))
    with jax.set_mesh(mesh):
        compiled = gf.lower(stored, batch).compile(compiler_options=FAST)
        loss, grads = compiled(stored, batch)
    return jax.device_get(loss), unpad_tree(pl.layouts, jax.device_get(grads)), compiled


def stored_params(pl, params):
    """Logical weights padded on the host and put on the mesh: no sharded program to compile
    but the step's (unpadding the gradients is host slicing too)."""
    return jax.device_put(pad_tree(pl.layouts, jax.tree.map(np.asarray, params)),
                          pl.params_shardings())


def assert_same(ref, got, rtol=1e-5):
    (l0, g0), (l1, g1) = ref, got
    np.testing.assert_allclose(l1, l0, rtol=rtol)
    flat0 = jax.tree_util.tree_flatten_with_path(g0)[0]
    flat1 = dict((jax.tree_util.keystr(p), x) for p, x in jax.tree_util.tree_flatten_with_path(g1)[0])
    assert len(flat0) == len(flat1)
    for path, a in flat0:
        b = flat1[jax.tree_util.keystr(path)]
        assert a.shape == b.shape, path
        # floor: a gradient that is zero in exact math (the key bias: softmax ignores it) is
        # rounding noise on both sides
        scale = max(float(np.max(np.abs(a))), 1e-3)
        np.testing.assert_allclose(b, a, rtol=rtol, atol=rtol * scale,
                                   err_msg=jax.tree_util.keystr(path))


# (plan, mode, arch, TP axes, remat): the whole matrix; TP over pair, node or global and the
# three remat modes rotate along it.
MATRIX = []
for i, (plan, (mode, arch)) in enumerate(itertools.product(
        PLANS, [(m, a) for m, archs in ARCHS.items() for a in archs])):
    tp = () if mode == "none" else (("pair",), ("node",), ("global",))[i % 3]
    MATRIX.append((plan, mode, arch, tp, ("none", "lowrank", "full")[i % 3]))


@pytest.mark.parametrize("plan,mode,arch,tp,remat", MATRIX,
                         ids=[f"{p}-{m}-{a}{'-' + '+'.join(t) if t else ''}-{r}"
                              for p, m, a, t, r in MATRIX])
def test_every_layout_equals_single_device(mesh, plan, mode, arch, tp, remat):
    cfg = make_cfg(mode, arch, tp, plan, remat)
    loss, grads, _ = engine_run(cfg, mesh)
    assert_same(reference(_model_key(cfg)), (loss, grads))


# wider TP degrees (4, 8), GQA and tied embeddings, on a model whose heads divide by 8
WIDER = [
    ("hierarchical", "btp", "lax", 4, "lowrank", dict(n_kv_heads=4, tie_embeddings=True)),
    ("zero3", "btp", "cola", 8, "none", {}),
    ("ddp", "vanilla", "svd", 8, "full", {}),
    ("zero1", "megatron", "full", 4, "lowrank", dict(n_kv_heads=4, tie_embeddings=True)),
]


@pytest.mark.parametrize("plan,mode,arch,t,remat,extra", WIDER,
                         ids=[f"{c[0]}-{c[1]}-{c[2]}-tp{c[3]}-{c[4]}" for c in WIDER])
def test_wider_tp_equals_single_device(mesh, plan, mode, arch, t, remat, extra):
    cfg = make_cfg(mode, arch, AXES[t], plan, remat, model=WIDE, **extra)
    loss, grads, _ = engine_run(cfg, mesh)
    assert_same(reference(_model_key(cfg)), (loss, grads))


# the GPT families (LayerNorm + biases, GELU MLP; gpt_neox: parallel residual, partial RoPE;
# gpt2: learned positions) across plans, modes, archs and remat, on the padded shapes
GPT = [
    ("hierarchical", "btp", "lax", ("pair",), "lowrank", dict(family="gpt_neox", rotary_pct=0.25)),
    ("zero3", "megatron", "full", ("node",), "full", dict(family="gpt2", tie_embeddings=True)),
    ("zeropp", "vanilla", "cola", ("global",), "none", dict(family="gpt2")),
    ("zero1", "btp", "svd", ("node",), "full", dict(family="gpt2", tie_embeddings=True)),
]


@pytest.mark.parametrize("plan,mode,arch,tp,remat,extra", GPT,
                         ids=[f"{c[5]['family']}-{c[0]}-{c[1]}-{c[2]}-{c[4]}" for c in GPT])
def test_gpt_families_equal_single_device(mesh, plan, mode, arch, tp, remat, extra):
    cfg = make_cfg(mode, arch, tp, plan, remat, **extra)
    loss, grads, _ = engine_run(cfg, mesh)
    assert_same(reference(_model_key(cfg)), (loss, grads))


# one micro-batch, no pipeline: the plans with deferred axes (ddp, zero1, hierarchical) reduce
# each layer's gradient over them in the backward (Placement.reduce_in_backward)
ONE_MICRO = [
    ("ddp", "none", "full", (), "none"),
    ("zero1", "btp", "cola", ("pair",), "lowrank"),
    ("hierarchical", "none", "lax", (), "full"),
    ("hierarchical", "btp", "svd", ("pair",), "lowrank"),
    ("hierarchical", "megatron", "full", ("node",), "none"),
]


@pytest.mark.parametrize("plan,mode,arch,tp,remat", ONE_MICRO,
                         ids=[f"{p}-{m}-{a}-{r}" for p, m, a, t, r in ONE_MICRO])
def test_one_micro_batch_reduces_in_the_backward_and_equals_single_device(
        mesh, plan, mode, arch, tp, remat):
    cfg = make_cfg(mode, arch, tp, plan, remat)
    cfg.train.micro_batches = 1
    assert build_step(cfg, mesh, FAST).placement.reduce_in_backward
    loss, grads, _ = engine_run(cfg, mesh)
    assert_same(reference(_model_key(cfg)), (loss, grads))


def test_btp_head_is_vocab_parallel(mesh):
    """BTP (TP over pair+node, data parallel over global): no TP collective carries logits
    ([b,s,V] or its 1/t); outside the layers the TP traffic is the h all-gather (b·s·d)
    forward and the reduce-scatter of its cotangent backward, plus the CE statistics and the
    final norm scale's gradient — all on this device's rows, never the whole batch."""
    from boost_jax.analysis.comm import analyze_compiled

    cfg = make_cfg("btp", "cola", AXES[4], model=WIDE, vocab_size=256)
    cfg.train.micro_batches = 1
    *_, compiled = engine_run(cfg, mesh)
    rep = analyze_compiled(compiled, mesh)
    tokens = B // 2 * S  # the batch is split over `global`
    d, V = cfg.model.d_model, cfg.model.vocab_size
    mine = [c for c in rep.collectives if c.axes and set(c.axes) == {"pair", "node"}]
    depth = max(len(c.loops) for c in mine)
    t = 4
    full = {c.name: c.result_bytes * (t if c.kind == "reduce-scatter" else 1) for c in mine}
    for c in mine:
        assert c.kind in ("all-reduce", "all-gather", "reduce-scatter"), c
        assert full[c.name] / 4 <= tokens * d < tokens * V // 4, c  # logits slice: V/4
    head = [c for c in mine if len(c.loops) < depth and full[c.name] == tokens * d * 4]
    assert sorted(c.kind for c in head) == ["all-gather", "reduce-scatter"]  # h, its cotangent
    stats = [c for c in mine if len(c.loops) < depth and full[c.name] < tokens * d * 4]
    # CE max and (sum-exp, gold) statistics, and the final norm scale's gradient (d floats)
    assert sorted(c.result_bytes for c in stats) == sorted([tokens * 4, 2 * tokens * 4, d * 4])


def test_btp_bf16_matches_single_device_bf16(mesh):
    """bf16 compute (LaX, tied embeddings, GQA, hierarchical): the engine's error vs the fp32
    model is that of the single-device bf16 model."""
    cfg = make_cfg("btp", "lax", AXES[4], "hierarchical", model=WIDE, n_kv_heads=4,
                   tie_embeddings=True)
    l32, g32 = reference(_model_key(cfg))
    cfg.model.dtype = "bfloat16"
    l16, g16 = reference(_model_key(cfg))
    lt, gt, _ = engine_run(cfg, mesh)

    def rel(a, b):
        return float(np.linalg.norm(a - b) / np.linalg.norm(a))

    assert abs(lt - l32) <= 2 * abs(l16 - l32) + 1e-3
    for a, b, c in zip(jax.tree.leaves(g32), jax.tree.leaves(g16), jax.tree.leaves(gt)):
        assert rel(a, c) <= 1.5 * rel(a, b) + 0.02



@pytest.mark.parametrize("mode,arch", [("none", "cola"), ("btp", "cola"), ("btp", "lax"),
                                       ("megatron", "full"), ("vanilla", "svd")])
def test_bf16_step_multiplies_in_bf16(mesh, mode, arch):
    """A bf16 model's loss-and-gradient program runs every GEMM on bf16 operands (fp32
    accumulation): neither the fp32 master weights nor an fp32-output GEMM's cotangent may turn
    a projection, Online-RMSNorm's A or the head into an fp32 GEMM (on an H200 that made a BTP
    step 2.4x slower, benchmarks/README.md §7). Dense attention's scores are the one exception."""
    cfg = make_cfg(mode, arch, AXES[2] if mode != "none" else (), model=WIDE)
    cfg.model.dtype = "bfloat16"
    params, batch = _params_and_batch(_model_key(cfg))
    bundle = build_step(cfg, mesh, FAST)
    pl = bundle.placement
    stored = jax.jit(lambda p: pad_tree(pl.layouts, p), out_shardings=pl.params_shardings())(
        params)
    with jax.set_mesh(mesh):
        txt = jax.jit(bundle.engine.grads_fn(2)).lower(stored, batch).as_text(debug_info=True)
    locs = dict(re.findall(r"^(#loc\d+) = (loc\(.*\))$", txt, re.M))
    dots = [line for line in txt.splitlines() if "stablehlo.dot_general" in line]
    fp32 = [line for line in dots if re.search(r"xf32>[,)]", line.split(" : ")[-1].split("->")[0])
            and forward.SCORES not in locs.get(re.findall(r"loc\((#loc\d+)\)", line)[-1], "")]
    assert len(dots) > 20 and not fp32, "\n".join(fp32)


# --------------------------------------------------------------------------- Online-RMSNorm


def _norm_down_fn(mesh, dtype, layer=False):
    """The BTP block's [Online norm + A_qkv] chunk on x sharded along d over (pair, node),
    manual over every axis as in the step (layer: LayerNorm with its bias, GPT families)."""
    from boost_jax.sharding.tp.btp import norm_down
    from boost_jax.sharding.tp.common import make_context

    cfg = make_cfg("btp", "cola", AXES[4], model=WIDE, dtype=dtype, param_dtype="float32")
    ctx = make_context(cfg, mesh)
    ax = AXES[4]
    f = jax.shard_map(lambda x, g, b, a: norm_down(ctx, x, {"scale": g} | ({"bias": b} if layer
                                                                         else {}), a),
                      mesh=mesh, in_specs=(P(None, None, ax), P(ax), P(ax), P(ax, None)),
                      out_specs=P(), check_vma=True)
    return jax.jit(f, compiler_options=FAST), cfg


@pytest.mark.parametrize("dtype,norm", [("float32", "rms"), ("bfloat16", "rms"),
                                        ("float32", "layer"), ("bfloat16", "layer")])
def test_online_norm_inside_btp(mesh, dtype, norm):
    """Online-RMSNorm and Online-LayerNorm equal the norm then A on ill-scaled shards; the
    LayerNorm case adds a mean 1e3 times its spread (Σx² − dμ² would lose every digit)."""
    layer = norm == "layer"
    f, cfg = _norm_down_fn(mesh, dtype, layer)
    d, r = cfg.model.d_model, cfg.model.r
    rng = np.random.default_rng(3)
    x = rng.normal(size=(B, S, d)).astype(np.float32)
    x[..., : d // 4] *= 1e3  # shard 0 is 1000x larger than the others
    x[0, 0, d // 4:] *= 1e-3  # and one token's other shards are tiny
    if layer:
        x[1] = rng.normal(size=(S, d)) + 1e3  # a large common offset
    gamma = (1 + 0.1 * rng.normal(size=(d,))).astype(np.float32)
    beta = (0.1 * rng.normal(size=(d,))).astype(np.float32) if layer else np.zeros(d, np.float32)
    a = (rng.normal(size=(d, 3 * r)) / np.sqrt(d)).astype(np.float32)
    eps = cfg.model.norm_eps

    def ref(xs, a_):  # float64 numpy: the fp32 input is exact, the reference math too
        xs, a_ = np.asarray(xs, np.float64), np.asarray(a_, np.float64)
        c = xs - xs.mean(-1, keepdims=True) if layer else xs
        y = c / np.sqrt((c * c).mean(-1, keepdims=True) + eps) * gamma + beta
        return (y @ a_).astype(np.float32)

    with jax.set_mesh(mesh):
        got = np.asarray(f(jnp.asarray(x, dtype), gamma, beta, a), np.float32)
    if dtype == "float32" and layer:  # as close as the one-device fp32 LayerNorm; naive fails
        want, x32 = ref(x, a), jnp.asarray(x)
        one = np.asarray(forward.layer_norm(x32, gamma, beta, eps) @ a)
        xc = x32 - jnp.mean(x32, -1, keepdims=True)  # Σx²/d − μ² in fp32: loses the variance
        naive = (xc * jax.lax.rsqrt(jnp.mean(x32 * x32, -1, keepdims=True)
                                    - jnp.mean(x32, -1, keepdims=True) ** 2 + eps)) * gamma + beta
        err = lambda y: float(np.abs(np.asarray(y) - want).max())  # noqa: E731
        assert err(got) <= 2 * err(one) + 1e-6 * np.abs(want).max(), (err(got), err(one))
        assert err(naive @ a) > 100 * err(got)
    elif dtype == "float32":
        want = ref(x, a)
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6 * np.abs(want).max())
    else:  # inputs, weights and output rounded to bf16 (8 bits): a few bf16 ulps
        xb = np.asarray(jnp.asarray(x, jnp.bfloat16), np.float32)
        want_b = ref(xb, jnp.asarray(a, jnp.bfloat16).astype(jnp.float32))
        err = np.abs(got - want_b) / (np.abs(want_b).max(axis=-1, keepdims=True))
        assert err.max() < 3e-2, err.max()
        assert np.median(err) < 4e-3


# --------------------------------------------------------------------------- specs, validation


def test_param_specs_per_mode():
    def spec_of(mode, arch, path, **kw):
        cfg = make_cfg(mode, arch, AXES[4], model=WIDE, **kw)
        node = tp_param_specs(cfg, abstract_params(cfg.model, cfg.train)[1])
        for k in path.split("/"):
            node = node[k]
        return node

    tp = ("pair", "node")
    assert spec_of("btp", "lax", "blocks/attn/q/a") == P(None, tp, None)  # rows along d
    assert spec_of("btp", "lax", "blocks/attn/q/b") == P(None, None, tp)  # columns = heads
    assert spec_of("btp", "lax", "blocks/attn/o/a") == P(None, tp, None)  # rows = heads
    assert spec_of("btp", "lax", "blocks/attn/o/b") == P(None, None, tp)  # columns along d
    assert spec_of("btp", "lax", "blocks/mlp/down/a") == P(None, tp, None)  # rows d_ff/t
    assert spec_of("btp", "lax", "blocks/attn_norm/scale") == P(None, tp)
    assert spec_of("btp", "lax", "blocks/attn/q/latent_scale") == P()
    assert spec_of("btp", "lax", "blocks/attn/q/g") == P()
    assert spec_of("btp", "lax", "embed/embedding") == P(None, tp)  # along d
    assert spec_of("btp", "lax", "embed/embedding", tie_embeddings=True) == P(tp, None)
    assert spec_of("btp", "lax", "lm_head/w") == P(None, tp)  # vocab-parallel
    assert spec_of("btp", "lax", "final_norm/scale") == P()
    assert spec_of("vanilla", "cola", "blocks/mlp/up/a") == P(None, None, tp)  # r columns
    assert spec_of("vanilla", "cola", "blocks/mlp/up/b") == P(None, tp, None)  # r rows
    assert spec_of("vanilla", "cola", "blocks/mlp_norm/scale") == P()
    assert spec_of("vanilla", "cola", "embed/embedding") == P(tp, None)
    assert spec_of("megatron", "full", "blocks/attn/k/w") == P(None, None, tp)
    assert spec_of("megatron", "full", "blocks/mlp/down/w") == P(None, tp, None)


def test_param_specs_unstacked():
    cfg = make_cfg("btp", "cola", AXES[2], model=WIDE)
    cfg.train.scan_layers = False
    model = nnx.eval_shape(lambda: CausalLM(cfg.model, rngs=nnx.Rngs(0), scan_layers=False))
    specs = tp_param_specs(cfg, nnx.to_pure_dict(nnx.split(model, nnx.Param)[1]))
    assert specs["blocks"][1]["attn"]["q"]["a"] == P(("pair",), None)


def test_unstacked_layers_equal_single_device(mesh):
    """scan_layers=False (a Python loop of layers, each fetched on its own) under zero3+btp."""
    cfg = make_cfg("btp", "cola", AXES[2], "zero3", "lowrank", model=WIDE)
    cfg.train.scan_layers = False
    params, batch = _params_and_batch(_model_key(cfg))
    bundle = build_step(cfg, mesh, FAST)
    pl = bundle.placement
    unstack = lambda t: {i: jax.tree.map(lambda x: x[i], t) for i in range(2)}  # noqa: E731
    p = dict(params, blocks=unstack(params["blocks"]))
    stored = jax.jit(lambda p: pad_tree(pl.layouts, p), out_shardings=pl.params_shardings())(p)
    with jax.set_mesh(mesh):
        loss, g = jax.jit(bundle.engine.grads_fn(2), compiler_options=FAST)(stored, batch)
        g = jax.device_get(jax.jit(lambda g: unpad_tree(pl.layouts, g))(g))
    g["blocks"] = jax.tree.map(lambda *x: np.stack(x), *[g["blocks"][i] for i in range(2)])
    assert_same(reference(_model_key(cfg)), (loss, g))


@pytest.mark.parametrize("mode,arch,t,kw,needle", [
    ("megatron", "cola", 2, {}, "parallel.tp_mode=megatron cuts full-rank layers"),
    ("btp", "full", 2, {}, "needs a low-rank model.arch"),
    ("vanilla", "full", 2, {}, "needs a low-rank model.arch"),
    ("btp", "cola", 8, dict(n_heads=4), "model.n_heads=4 is not divisible by the tensor-parallel "
                                        "degree 8"),
    ("btp", "cola", 4, dict(n_kv_heads=2), "model.n_kv_heads=2"),
    ("btp", "cola", 8, dict(d_ff=60), "model.d_ff=60"),
    ("btp", "cola", 8, dict(n_heads=4, d_ff=60), "model.n_heads=4 and model.d_ff=60 are not "
                                                 "divisible by the tensor-parallel degree 8 "
                                                 "(parallel.tp_axes"),
    ("vanilla", "cola", 4, dict(rank=6), "model.rank=6"),
    ("megatron", "full", 8, dict(vocab_size=60), "model.vocab_size=60"),
])
def test_validate_tp_rejects(mesh, mode, arch, t, kw, needle):
    cfg = make_cfg("none", arch, model=WIDE, **kw)
    cfg.parallel = ParallelConfig(tp_mode=mode, tp_axes=list(AXES[t]))
    with pytest.raises(ConfigError) as e:
        validate_tp(cfg, mesh)
    msg = str(e.value)
    assert needle in msg and "\n" not in msg
    assert "use" in msg or "make" in msg  # names the fix


def test_validate_tp_accepts(mesh):
    validate_tp(make_cfg("btp", "cola", AXES[8], model=WIDE), mesh)
    validate_tp(make_cfg("vanilla", "lax", AXES[8], model=WIDE, n_heads=4), mesh)  # r | t only
    validate_tp(make_cfg("btp", "cola", AXES[4], model=WIDE, rank=6), mesh)  # rank replicated
