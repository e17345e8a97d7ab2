"""model.attention=flash equals dense: the blockwise kernel alone (awkward lengths, GQA, the
decoder's causal offset), the whole model's loss and every gradient for full/cola/lax, every TP
mode and a pipeline layout through the step engine, and the KV-cache decoder; plus the one
function that picks the implementation per platform.

Tiles of 3 (BLOCK is patched) make every length here span several tiles and end in a padded one.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from boost_jax.backends.cpu import fast_compile_options
from boost_jax.config import ModelConfig, load_config
from boost_jax.errors import ConfigError
from boost_jax.infer.decode import Decoder, Sampling
from boost_jax.layers import flash, forward
from boost_jax.layers.forward import CPU_FLASH_FROM, attention_impl, dense_attention
from boost_jax.layers.model import build_model
from boost_jax.mesh import make_mesh
from test_tp import WIDE, _model_key, assert_same, engine_run, make_cfg, reference

FAST = fast_compile_options()


@pytest.fixture(autouse=True)
def small_tiles(monkeypatch):
    monkeypatch.setattr(flash, "BLOCK", 3)


def _qkvw(b, sq, sk, H, K, hd, dtype=jnp.float32):
    ks = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(ks[0], (b, sq, H, hd), dtype)
    k, v = (jax.random.normal(x, (b, sk, K, hd), dtype) for x in ks[1:3])
    return q, k, v, jax.random.normal(ks[3], (b, sq, H, hd), dtype)


# (b, sq, sk, H, K, hd, tile, offset): training (sq = sk), GQA, a KV cache with unfilled slots
# after the queries (offset + sq < sk), one decode step, a tile larger than the sequence
CASES = [(2, 7, 7, 4, 2, 8, 3, None), (1, 5, 11, 2, 1, 4, 4, 3), (1, 1, 9, 2, 2, 4, 4, 4),
         (1, 6, 6, 2, 2, 4, 16, None)]


@pytest.mark.parametrize("b,sq,sk,H,K,hd,tile,off", CASES)
def test_blockwise_output_and_grads_equal_dense(b, sq, sk, H, K, hd, tile, off):
    q, k, v, w = _qkvw(b, sq, sk, H, K, hd)
    ref = lambda q, k, v: jnp.sum(dense_attention(q, k, v, off) * w)  # noqa: E731
    got = lambda q, k, v: jnp.sum(flash.flash_attention(q, k, v, off, tile) * w)  # noqa: E731
    # jitted: op by op, every small op of the blockwise loop would compile on its own
    np.testing.assert_allclose(jax.jit(lambda *a: flash.flash_attention(*a, off, tile))(q, k, v),
                               dense_attention(q, k, v, off), rtol=1e-5, atol=1e-6)
    g0 = jax.jit(jax.grad(ref, (0, 1, 2)))(q, k, v)
    g1 = jax.jit(jax.grad(got, (0, 1, 2)))(q, k, v)
    for a, c in zip(g0, g1):
        np.testing.assert_allclose(c, a, rtol=1e-5, atol=1e-5 * float(jnp.abs(a).max()))


def test_blockwise_traced_offset_and_bf16():
    q, k, v, _ = _qkvw(1, 4, 12, 4, 2, 8, jnp.bfloat16)
    f = jax.jit(lambda q, k, v, off: flash.flash_attention(q, k, v, off, 4))
    for off in (0, 5, 8):
        ref = dense_attention(q.astype(jnp.float32), k.astype(jnp.float32),
                              v.astype(jnp.float32), off)
        got = f(q, k, v, jnp.int32(off))
        assert got.dtype == jnp.bfloat16
        np.testing.assert_allclose(got.astype(jnp.float32), ref, atol=3e-2)


def test_no_score_matrix_in_the_blockwise_program():
    """No [sq, sk]-sized buffer in the compiled forward+backward (dense has several)."""
    q, k, v, w = _qkvw(1, 64, 64, 2, 2, 4)

    def sizes(fn):
        g = jax.jit(jax.grad(lambda q, k, v: jnp.sum(fn(q, k, v) * w), (0, 1, 2)))
        return g.lower(q, k, v).compile().memory_analysis().temp_size_in_bytes

    dense, blockwise = sizes(dense_attention), sizes(lambda q, k, v: flash.flash_attention(
        q, k, v, None, 8))
    assert dense >= 2 * 64 * 64 * 2 * 4  # at least scores and probabilities, fp32
    assert blockwise < 64 * 64 * 2 * 4  # not even one score matrix


@pytest.mark.parametrize("kind,seq,plat,dtype,hd,off,want", [
    ("flash", 128, "cuda", "bfloat16", 64, False, "cudnn"),
    ("auto", 4096, "cuda", "bfloat16", 128, False, "cudnn"),
    ("auto", 16, "cuda", "float32", 64, False, "pallas"),  # cuDNN has no fp32 flash attention
    ("flash", 128, "cuda", "bfloat16", 100, False, "pallas"),  # head dim cuDNN rejects
    ("auto", 4096, "rocm", "bfloat16", 128, False, "pallas"),
    ("flash", 128, "cuda", "bfloat16", 64, True, "blockwise"),  # decoder: causal offset
    ("flash", 16, "cpu", "float32", 64, False, "blockwise"),
    ("flash", 16, "tpu", "float32", 64, False, "blockwise"),
    ("dense", 4096, "cuda", "bfloat16", 64, False, "dense"),
    ("auto", CPU_FLASH_FROM - 1, "cpu", "float32", 64, False, "dense"),
    ("auto", CPU_FLASH_FROM, "cpu", "float32", 64, False, "blockwise"),
])
def test_selection(kind, seq, plat, dtype, hd, off, want):
    assert attention_impl(kind, seq, plat, dtype, hd, off) == want


def test_bad_kind_is_a_config_error():
    with pytest.raises(ConfigError, match="model.attention"):
        attention_impl("fast", 16, "cpu")
    with pytest.raises(ConfigError, match=r"model\.attention='fast' is not valid"):
        load_config(None, ["model.attention=fast"])


def _loss_and_grads(mc, params, batch):
    f = jax.value_and_grad(lambda p: forward.loss(forward.Local(mc), mc, p, batch))
    return jax.device_get(jax.jit(f, compiler_options=FAST)(params))


@pytest.mark.parametrize("arch,kv", [("full", 2), ("cola", 1), ("lax", 4)])
def test_model_loss_and_grads_equal_dense(arch, kv):
    base = dict(arch=arch, vocab_size=50, d_model=32, n_layers=2, n_heads=4, n_kv_heads=kv,
                d_ff=40, rank=6, max_seq_len=11, lax_gate="gate", init_std=0.3)
    dense_cfg, flash_cfg = ModelConfig(**base, attention="dense"), ModelConfig(**base,
                                                                               attention="flash")
    params = build_model(dense_cfg, seed=0).params()
    toks = np.asarray(jax.random.randint(jax.random.key(1), (3, 12), 0, 50))
    batch = {"inputs": toks[:, :-1], "targets": toks[:, 1:]}
    assert_same(_loss_and_grads(dense_cfg, params, batch),
                _loss_and_grads(flash_cfg, params, batch))


# every TP mode on 2x2x2 CPU devices, GQA (WIDE: 8 heads) where the mode allows, the remat modes
TP_CASES = [("zero3", "none", "lax", (), "full", {}),
            ("ddp", "megatron", "full", ("pair", "node"), "none", dict(n_kv_heads=4)),
            ("zero1", "vanilla", "cola", ("node",), "lowrank", {}),
            ("hierarchical", "btp", "cola", ("pair", "node"), "lowrank", dict(n_kv_heads=4))]


@pytest.mark.parametrize("plan,mode,arch,tp,remat,extra", TP_CASES,
                         ids=[f"{c[0]}-{c[1]}-{c[2]}" for c in TP_CASES])
def test_tp_layouts_with_flash_equal_dense_single_device(plan, mode, arch, tp, remat, extra):
    mesh = make_mesh("cpu", shape=[2, 2, 2])
    cfg = make_cfg(mode, arch, tp, plan, remat, model=WIDE, attention="flash", **extra)
    loss, grads, _ = engine_run(cfg, mesh)
    ref_key = tuple((k, "dense" if k == "attention" else v) for k, v in _model_key(cfg))
    assert_same(reference(ref_key), (loss, grads))


def test_pipeline_with_flash_equals_dense_single_device():
    from test_pipeline import mesh_of, pp_cfg

    cfg = pp_cfg(2, "1f1b", "zero1", "btp", attention="flash")
    loss, grads, _ = engine_run(cfg, mesh_of(2))
    ref_key = tuple((k, "dense" if k == "attention" else v) for k, v in _model_key(cfg))
    assert_same(reference(ref_key), (loss, grads))


@pytest.mark.parametrize("arch,scan", [("cola", True), ("lax", False)])
def test_kv_cache_decoder_with_flash_equals_dense(arch, scan):
    base = dict(arch=arch, vocab_size=256, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                d_ff=64, rank=8, max_seq_len=20, init_std=0.3, lax_gate="gate")
    prompt = np.array([0, 100, 101, 102, 32, 40, 41], np.int32)  # 7: prefill spans 3 tiles
    out = {}
    for kind in ("dense", "flash"):
        cfg = ModelConfig(**base, attention=kind)
        params = build_model(cfg, seed=1, scan_layers=scan).params()
        dec = Decoder(cfg, params, cfg.max_seq_len, Sampling(temperature=0.0),
                      compiler_options=FAST)
        out[kind] = dec.generate(prompt, 100)[:2]
    np.testing.assert_array_equal(out["flash"][0], out["dense"][0])
    np.testing.assert_allclose(out["flash"][1], out["dense"][1], rtol=1e-5, atol=2e-5)


def test_resume_may_switch_attention():
    """Same math computed another way: a resumed run may change model.attention."""
    from boost_jax.errors import UserError
    from boost_jax.checkpoints.run_config import check_resume

    saved = load_config(None, ["model.attention=dense"]).to_dict()
    diff = check_resume(saved, load_config(None, ["model.attention=flash"]), 3, "runs/x")
    assert diff == [("model.attention", "dense", "flash")]
    with pytest.raises(UserError, match="model.norm_eps"):
        check_resume(saved, load_config(None, ["model.norm_eps=0.001"]), 3, "runs/x")


def test_gpu_summary_shows_the_attention_rows(tmp_path):
    """benchmarks/gpu.sh's summary: one row per implementation, the one auto picks marked."""
    import json

    from benchmarks.gpu_summary import attention_section

    rows = [{"platform": "cuda", "seq": 4096, "impl": i, "auto": i == "cudnn", "ms": ms,
             "temp_bytes": mb * 2**20} for i, ms, mb in (("dense", 9.5, 4096), ("cudnn", 1.25, 8))]
    (tmp_path / "attention.json").write_text(json.dumps(rows))
    text = "\n".join(attention_section(tmp_path / "attention.json"))
    assert "| cuda | 4096 | cudnn (auto) | 1.25 | 8.0 |" in text
    assert "| cuda | 4096 | dense | 9.50 | 4096.0 |" in text
    assert attention_section(tmp_path / "none.json")[0].startswith("no none.json")
