"""Tensor parallelism (megatron / vanilla / btp) equals the single-device model.

Loss and every gradient leaf of the TP loss (one shard_map over the TP axes, data parallel on
the remaining axes of the 2x2x2 CPU mesh) are compared with the plain LlamaModel in fp32.
Compile time dominates: each case is one compile (fast XLA options), references are cached
per model config, and the default run covers every arch and every TP degree (2, 4, 8) on a
diagonal; BOOST_TP_FULL=1 runs the full arch x degree x mode product.
"""

import functools
import itertools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from boost_jax.config import Config, ModelConfig, ParallelConfig
from boost_jax.errors import ConfigError
from boost_jax.layers.model import LlamaModel, fast_compile_options
from boost_jax.layers.norms import rms_norm
from boost_jax.mesh import make_mesh
from boost_jax.sharding.tensor_parallel import (
    abstract_params, build_tp_loss_fn, tp_param_specs, tp_shardings, validate_tp)

from weights import random_weights

B, S = 4, 8
BASE = dict(vocab_size=64, d_model=32, n_layers=2, n_heads=8, d_ff=64, rank=8, max_seq_len=S,
            lax_gate="gate")
AXES = {2: ("pair",), 4: ("pair", "node"), 8: ("pair", "node", "global")}
FAST = fast_compile_options()


@pytest.fixture(scope="module")
def mesh():
    return make_mesh("cpu", shape=[2, 2, 2])


def make_cfg(mode, arch, t=2, remat="none", **model) -> Config:
    cfg = Config()
    cfg.model = ModelConfig(**{**BASE, "arch": arch, **model})
    cfg.parallel = ParallelConfig(tp_mode=mode, tp_axes=list(AXES[t]) if mode != "none" else [])
    cfg.train.remat = remat
    cfg.data.tokenizer = "bpe"  # allow vocab 64
    cfg.data.seq_len = S
    return cfg.validate()


def _model_key(cfg):
    return tuple(sorted(vars(cfg.model).items()))


@functools.lru_cache(maxsize=None)
def _params_and_batch(key):
    """Random NumPy weights (norm scales/gates near init, so every code path is exercised)."""
    mc = ModelConfig(**dict(key))
    cfg = Config()
    cfg.model = mc
    params = random_weights(abstract_params(cfg), 0, np.float32)
    toks = np.asarray(jax.random.randint(jax.random.key(1), (B, S + 1), 0, mc.vocab_size))
    return params, {"inputs": toks[:, :-1], "targets": toks[:, 1:]}


@functools.lru_cache(maxsize=None)
def _reference_fn(key):
    mc = ModelConfig(**dict(key))
    graphdef, abs_state = nnx.split(
        nnx.eval_shape(lambda: LlamaModel(mc, rngs=nnx.Rngs(0))), nnx.Param)

    def loss(p, batch):
        st = jax.tree.map(lambda x: x, abs_state)
        nnx.replace_by_pure_dict(st, p)
        logits = nnx.merge(graphdef, st)(batch["inputs"])
        logz = jax.nn.logsumexp(logits, -1)
        gold = jnp.take_along_axis(logits, batch["targets"][..., None], -1)[..., 0]
        return jnp.mean(logz - gold)

    return jax.jit(jax.value_and_grad(loss), compiler_options=FAST)


def reference(key, params=None):
    """(loss, grads) of the single-device model (no shard_map) on the test params."""
    p, batch = _params_and_batch(key)
    return jax.device_get(_reference_fn(key)(p if params is None else params, batch))


@functools.lru_cache(maxsize=None)
def tp_run(mode, arch, t, remat="none", zero=False, **model):
    """(loss, grads, compiled) of the TP loss on the 8-device mesh; DP over the other axes.

    zero=True also shards every param over the data-parallel axes (ZeRO-3-like placement:
    tp_shardings(..., dp_axes)), which XLA gathers at the shard_map boundary."""
    mesh_ = make_mesh("cpu", shape=[2, 2, 2])
    cfg = make_cfg(mode, arch, t, remat, **model)
    params, batch = _params_and_batch(_model_key(cfg))
    dp = tuple(a for a in ("pair", "node", "global") if a not in AXES[t])
    psh = tp_shardings(cfg, mesh_, params, dp_axes=dp if zero else ())
    bsh = NamedSharding(mesh_, P(dp or None))
    f = jax.jit(jax.value_and_grad(build_tp_loss_fn(cfg, None, mesh_)),
                in_shardings=(psh, {"inputs": bsh, "targets": bsh}))
    with jax.set_mesh(mesh_):
        compiled = f.lower(params, batch).compile(compiler_options=FAST)
        loss, grads = compiled(params, batch)
    return jax.device_get(loss), jax.device_get(grads), compiled, cfg


def assert_same(ref, got, rtol=1e-5):
    (l0, g0), (l1, g1) = ref, got
    np.testing.assert_allclose(l1, l0, rtol=rtol)
    flat0 = jax.tree_util.tree_flatten_with_path(g0)[0]
    flat1 = dict((jax.tree_util.keystr(p), x) for p, x in jax.tree_util.tree_flatten_with_path(g1)[0])
    assert len(flat0) == len(flat1)
    for path, a in flat0:
        b = flat1[jax.tree_util.keystr(path)]
        assert a.shape == b.shape, path
        scale = float(np.max(np.abs(a))) or 1.0
        np.testing.assert_allclose(b, a, rtol=rtol, atol=rtol * scale,
                                   err_msg=jax.tree_util.keystr(path))


# (mode, arch, TP degree, remat, zero, extra model kwargs): every arch at every degree across
# the modes, remat none/full/lowrank, ZeRO-style DP placement, GQA and tied embeddings.
CASES = [
    ("btp", "svd", 2, "none", True, {}),
    ("btp", "cola", 4, "none", False, dict(vocab_size=256)),
    ("btp", "lax", 8, "lowrank", False, {}),
    ("btp", "cola", 2, "full", False, {}),
    ("btp", "lax", 4, "none", True, dict(n_kv_heads=4, tie_embeddings=True)),
    ("vanilla", "svd", 8, "none", False, {}),
    ("vanilla", "cola", 2, "lowrank", True, {}),
    ("vanilla", "lax", 4, "full", False, {}),
    ("megatron", "full", 2, "none", False, {}),
    ("megatron", "full", 4, "lowrank", True, dict(n_kv_heads=4, tie_embeddings=True)),
    ("megatron", "full", 8, "full", False, {}),
]
if os.environ.get("BOOST_TP_FULL"):
    CASES += [(m, a, t, "none", False, {}) for m, a, t in itertools.product(
        ("btp", "vanilla"), ("svd", "cola", "lax"), (2, 4, 8))]
    CASES += [("megatron", "full", t, "none", True, {}) for t in (2, 4, 8)]


@pytest.mark.parametrize("mode,arch,t,remat,zero,extra", CASES,
                         ids=[f"{c[0]}-{c[1]}-tp{c[2]}-{c[3]}{'-zero' if c[4] else ''}"
                              + "".join(f"-{k}={v}" for k, v in c[5].items()) for c in CASES])
def test_tp_equals_single_device(mode, arch, t, remat, zero, extra):
    loss, grads, _, cfg = tp_run(mode, arch, t, remat, zero, **extra)
    assert_same(reference(_model_key(cfg)), (loss, grads))


def test_btp_head_is_vocab_parallel_and_data_parallel():
    """BTP loss+grad program: no TP collective carries logits ([b,s,V] or its 1/t); outside
    the layer loop the TP traffic is the h gather (b·s·d) forward and its cotangent backward,
    plus the CE statistics — all on the per-DP-rank batch (b/2 here), never the whole batch."""
    from boost_jax.analysis.comm import analyze_compiled

    *_, compiled, cfg = tp_run("btp", "cola", 4, vocab_size=256)
    rep = analyze_compiled(compiled, make_mesh("cpu", shape=[2, 2, 2]))
    tp = {"pair", "node"}
    tokens = B // 2 * S  # the batch is split over `global`
    d, V = cfg.model.d_model, cfg.model.vocab_size
    mine = [c for c in rep.collectives if c.axes and set(c.axes) <= tp]
    for c in mine:
        assert c.kind == "all-reduce", c
        assert c.result_bytes / 4 <= tokens * d < tokens * V // 4, c  # logits slice: V/4
    head = [c for c in mine if not c.in_loop and c.result_bytes == tokens * d * 4]
    assert len(head) == 2  # forward gather of h, backward cotangent of the normed h
    stats = [c for c in mine if not c.in_loop and c.result_bytes < tokens * d * 4]
    assert sorted(c.result_bytes for c in stats) == [tokens * 4, 2 * tokens * 4]


# --------------------------------------------------------------------------- Online-RMSNorm


def _norm_down_fn(mesh, dtype):
    """The BTP block's [Online-RMSNorm + A_qkv] chunk on x sharded along d over (pair, node)."""
    from boost_jax.sharding.tp_btp import norm_down
    from boost_jax.sharding.tp_common import make_context

    cfg = make_cfg("btp", "cola", 4, dtype=dtype, param_dtype="float32")
    ctx = make_context(cfg, mesh)
    ax = AXES[4]
    f = jax.shard_map(lambda x, g, a: norm_down(ctx, x, g, a), mesh=mesh,
                      in_specs=(P(None, None, ax), P(ax), P(ax, None)), out_specs=P(),
                      axis_names=frozenset(ax), check_vma=True)
    return jax.jit(f, compiler_options=FAST), cfg


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_online_rmsnorm_inside_btp(mesh, dtype):
    f, cfg = _norm_down_fn(mesh, dtype)
    d, r = cfg.model.d_model, cfg.model.r
    rng = np.random.default_rng(3)
    x = rng.normal(size=(B, S, d)).astype(np.float32)
    x[..., : d // 4] *= 1e3  # shard 0 is 1000x larger than the others
    x[0, 0, d // 4:] *= 1e-3  # and one token's other shards are tiny
    gamma = (1 + 0.1 * rng.normal(size=(d,))).astype(np.float32)
    a = (rng.normal(size=(d, 3 * r)) / np.sqrt(d)).astype(np.float32)
    with jax.set_mesh(mesh):
        got = np.asarray(f(jnp.asarray(x, dtype), gamma, a), np.float32)
    want = np.asarray(rms_norm(jnp.asarray(x), jnp.asarray(gamma), cfg.model.norm_eps)
                      @ jnp.asarray(a, jnp.float32), np.float32)
    if dtype == "float32":
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6 * np.abs(want).max())
    else:  # inputs, weights and output rounded to bf16 (8 bits): a few bf16 ulps
        xb = np.asarray(jnp.asarray(x, jnp.bfloat16), np.float32)
        want_b = np.asarray(rms_norm(jnp.asarray(xb), jnp.asarray(gamma), cfg.model.norm_eps)
                            @ jnp.asarray(a, jnp.bfloat16).astype(jnp.float32))
        err = np.abs(got - want_b) / (np.abs(want_b).max(axis=-1, keepdims=True))
        assert err.max() < 3e-2, err.max()
        assert np.median(err) < 4e-3


# --------------------------------------------------------------------------- specs, validation


def test_param_specs_per_mode():
    def spec_of(mode, arch, path, **kw):
        cfg = make_cfg(mode, arch, 4, **kw)
        specs = tp_param_specs(cfg, abstract_params(cfg))
        node = specs
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
    cfg = make_cfg("btp", "cola", 2)
    cfg.train.scan_layers = False
    model = nnx.eval_shape(lambda: LlamaModel(cfg.model, rngs=nnx.Rngs(0), scan_layers=False))
    specs = tp_param_specs(cfg, nnx.to_pure_dict(nnx.split(model, nnx.Param)[1]))
    assert specs["blocks"][1]["attn"]["q"]["a"] == P(("pair",), None)


@pytest.mark.parametrize("mode,arch,t,kw,needle", [
    ("megatron", "cola", 2, {}, "parallel.tp_mode=megatron cuts full-rank layers"),
    ("btp", "full", 2, {}, "needs a low-rank model.arch"),
    ("vanilla", "full", 2, {}, "needs a low-rank model.arch"),
    ("btp", "cola", 8, dict(n_heads=4), "model.n_heads=4 is not divisible by the tensor-parallel "
                                        "degree 8"),
    ("btp", "cola", 4, dict(n_kv_heads=2), "model.n_kv_heads=2"),
    ("btp", "cola", 8, dict(d_ff=60), "model.d_ff=60"),
    ("vanilla", "cola", 4, dict(rank=6), "model.rank=6"),
    ("megatron", "full", 8, dict(vocab_size=60), "model.vocab_size=60"),
])
def test_validate_tp_rejects(mesh, mode, arch, t, kw, needle):
    cfg = make_cfg("none", arch, t, **kw)
    cfg.parallel = ParallelConfig(tp_mode=mode, tp_axes=list(AXES[t]))
    with pytest.raises(ConfigError) as e:
        validate_tp(cfg, mesh)
    msg = str(e.value)
    assert needle in msg and "\n" not in msg
    assert "use" in msg or "make" in msg  # names the fix


def test_validate_tp_accepts(mesh):
    validate_tp(make_cfg("btp", "cola", 8), mesh)
    validate_tp(make_cfg("vanilla", "lax", 8, n_heads=4), mesh)  # vanilla needs only r | t
    validate_tp(make_cfg("btp", "cola", 4, rank=6), mesh)  # btp replicates the rank


# --------------------------------------------------------------------------- with the plans


@pytest.mark.parametrize("plan,mode,t", [("zero3", "btp", 2), ("hierarchical", "vanilla", 2)])
def test_tp_with_placement_plan(plan, mode, t):
    """The step's loss (boost_jax.train.step.build_loss_fn): params stored in the plan's layout
    (TP split from tp_param_specs plus the plan's data-parallel split, padded where needed),
    gathered over the DP axes, then our TP loss — loss and every gradient leaf equal the
    single-device model."""
    from boost_jax.sharding.plans import make_placement
    from boost_jax.sharding.secondary import pad_tree, unpad_tree
    from boost_jax.train.step import build_loss_fn

    if plan == "hierarchical":  # its preset puts params on `pair`: keep TP off that axis
        cfg = make_cfg(mode, "cola", t)
        cfg.parallel.tp_axes = ["global"]
        cfg.parallel.secondary_dtype = "bfloat16"  # the int8 secondary is not exact
    else:
        cfg = make_cfg(mode, "cola", t)
    cfg.parallel.plan = plan
    cfg.train.global_batch = B
    mesh_ = make_mesh("cpu", shape=[2, 2, 2])
    key = _model_key(cfg)
    params, batch = _params_and_batch(key)
    pl = make_placement(cfg, mesh_, abstract_params(cfg))
    loss_fn = build_loss_fn(cfg, None, mesh_, pl)
    f = jax.jit(lambda p, b: jax.value_and_grad(loss_fn)(pad_tree(pl, p), b),
                in_shardings=(pl.full_shardings(), pl.batch_sharding()))
    with jax.set_mesh(mesh_):
        loss, grads = f.lower(params, batch).compile(compiler_options=FAST)(params, batch)
        grads = jax.jit(lambda g: unpad_tree(pl, g))(grads)
    assert_same(reference(key), jax.device_get((loss, grads)))


def test_btp_bf16_matches_single_device_bf16():
    """bf16 compute (LaX, tied embeddings, GQA: every collective path, incl. the CPU fp32
    promotion of 16-bit all-reduces): TP error vs the fp32 model is that of the single-device
    bf16 model."""
    cfg = make_cfg("btp", "lax", 4, n_kv_heads=4, tie_embeddings=True)
    key = _model_key(cfg)
    params, batch = _params_and_batch(key)
    l32, g32 = reference(key)
    cfg.model.dtype = "bfloat16"
    l16, g16 = jax.device_get(_reference_fn(_model_key(cfg))(params, batch))
    mesh_ = make_mesh("cpu", shape=[2, 2, 2])
    bsh = NamedSharding(mesh_, P("global"))
    f = jax.jit(jax.value_and_grad(build_tp_loss_fn(cfg, None, mesh_)),
                in_shardings=(tp_shardings(cfg, mesh_, params), {"inputs": bsh, "targets": bsh}))
    with jax.set_mesh(mesh_):
        lt, gt = jax.device_get(f.lower(params, batch).compile(compiler_options=FAST)(params, batch))

    def rel(a, b):
        return float(np.linalg.norm(a - b) / np.linalg.norm(a))

    assert abs(lt - l32) <= 2 * abs(l16 - l32) + 1e-3
    for a, b, c in zip(jax.tree.leaves(g32), jax.tree.leaves(g16), jax.tree.leaves(gt)):
        assert rel(a, c) <= 1.5 * rel(a, b) + 0.02
