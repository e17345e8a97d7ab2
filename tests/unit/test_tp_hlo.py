"""Per-layer communication of megatron / vanilla / btp, read from compiled HLO.

A 7B-shaped decoder stack (d=4096, d_ff=11008, r=1024, 32 heads, L=2 scanned layers) under
TP 4 on a 4-device CPU mesh, lowered from ShapeDtypeStructs (nothing allocated), compiled
with XLA's CPU all-reduce combiner disabled so every logical collective stays visible, and
read with boost_jax.analysis.comm. Layer-only programs (analysis.tp_layers.layers_program) keep
the embedding and head out of the counts. fp32, so elements = bytes / 4. The formulas are in
boost_jax/sharding/tp/ (btp.py, vanilla.py, megatron.py).
"""

import functools

import jax

from boost_jax.analysis import hlo as H
from boost_jax.analysis.comm import analyze_compiled
from boost_jax.backends.cpu import fast_compile_options
from boost_jax.config import Config, ModelConfig, ParallelConfig
from boost_jax.mesh import make_mesh
from boost_jax.analysis.tp_layers import block_saved_residuals, layers_program

D, DFF, R, HEADS, L = 4096, 11008, 1024, 32, 2
BATCH, SEQ = 1, 16
T = BATCH * SEQ
TP = 4
OPTS = {**fast_compile_options(), "xla_disable_hlo_passes": "cpu-all-reduce-combiner"}


def cfg_7b(mode, remat="none") -> Config:
    cfg = Config()
    cfg.model = ModelConfig(arch="full" if mode == "megatron" else "cola", vocab_size=256,
                            d_model=D, n_layers=L, n_heads=HEADS, d_ff=DFF, rank=R,
                            max_seq_len=SEQ)
    cfg.parallel = ParallelConfig(tp_mode=mode, tp_axes=["pair", "node"])
    cfg.train.remat = remat
    cfg.data.seq_len = SEQ
    return cfg.validate()


@functools.lru_cache(maxsize=None)
def mesh4():
    return make_mesh("cpu", shape=[2, 2, 1])


@functools.lru_cache(maxsize=None)
def comm(mode, backward=False, remat="none"):
    """(collectives per layer, element counts per token of each, all collectives)."""
    mesh = mesh4()
    fn, args = layers_program(cfg_7b(mode, remat), mesh, BATCH, SEQ, backward=backward)
    with jax.set_mesh(mesh):
        compiled = fn.lower(*args).compile(compiler_options=OPTS)
    rep = analyze_compiled(compiled, mesh)
    per_layer = []
    for c in rep.collectives:
        assert c.in_loop and c.trip_count == L, c  # every collective is in a layer loop
        assert c.group_size == TP and set(c.axes) == {"pair", "node"}, c
        per_layer.append(tuple(H.parse_shape(s)[0].elements // T for s in c.shapes))
    return sorted(per_layer), rep


def totals(mode, backward=False, remat="none"):
    per_layer, _ = comm(mode, backward, remat)
    return len(per_layer), sum(sum(c) for c in per_layer)


# --------------------------------------------------------------------------- forward


def test_megatron_forward_two_allreduces_of_d():
    per_layer, rep = comm("megatron")
    assert per_layer == [(D,), (D,)]
    assert all(c.kind == "all-reduce" for c in rep.collectives)


def test_vanilla_forward_seven_allreduces():
    per_layer, _ = comm("vanilla")
    assert per_layer == sorted([(D,)] * 5 + [(DFF,)] * 2)  # q k v o down, gate up
    assert totals("vanilla") == (7, 5 * D + 2 * DFF)


def test_btp_forward_four_allreduces_of_latents_with_stats():
    per_layer, rep = comm("btp")
    # [U_qkv | S] and [U_gu | S] carry the fp32 Σx² in the same collective; o and down: r
    assert per_layer == sorted([(3 * R + 1,), (R,), (2 * R + 1,), (R,)])
    assert totals("btp") == (4, 7 * R + 2)
    assert all(c.kind == "all-reduce" and c.dtypes == ["f32"] for c in rep.collectives)


def test_btp_forward_bytes_ratios():
    btp, van, meg = totals("btp")[1], totals("vanilla")[1], totals("megatron")[1]
    assert van / btp >= 5.8  # 42496 / 7170 = 5.93
    assert abs(btp / meg - 0.875) < 1e-3  # (7r + 2) / 2d


# --------------------------------------------------------------------------- backward


def backward_only(mode, remat="none"):
    n_all, e_all = totals(mode, True, remat)
    n_f, e_f = totals(mode)
    return n_all - n_f, e_all - e_f


def test_backward_counts_and_bytes():
    assert backward_only("megatron") == (2, 2 * D)  # dx of q|k|v and gate|up inputs
    assert backward_only("vanilla") == (7, 6 * D + DFF)  # dx of the 7 column-parallel A
    assert backward_only("btp") == (4, 7 * R)  # cotangents of the 4 reduced latents


# --------------------------------------------------------------------------- remat


def test_lowrank_remat_replays_no_collective():
    assert comm("btp", True, "lowrank")[0] == comm("btp", True, "none")[0]


def test_full_remat_replays_forward_allreduces():
    none, full = comm("btp", True, "none")[0], comm("btp", True, "full")[0]
    fwd = comm("btp")[0]
    assert sorted(none + fwd) == full  # all 4 forward all-reduces run again in backward


def test_saved_residuals_per_layer():
    """What one BTP block keeps for backward (per device, fp32): lowrank = 2 residual shards
    (d/t each) + the reduced latents (7r + 2 per token); full = the block input only."""
    mesh = mesh4()
    saved = {rm: block_saved_residuals(cfg_7b("btp", rm), mesh, BATCH, SEQ)
             for rm in ("none", "full", "lowrank")}
    act = {rm: sum(b for t, b, src in v if not t.startswith("i32")) for rm, v in saved.items()}
    assert act["lowrank"] == 4 * T * (2 * D // TP + 7 * R + 2)
    assert act["full"] == 4 * T * D // TP
    assert act["none"] > 3 * act["lowrank"]
    named = [src for t, b, src in saved["lowrank"] if not t.startswith("i32")]
    assert all("named 'lowrank_latent'" in s or "named 'residual'" in s for s in named), named


# --------------------------------------------------------------------------- GPT family


def gpt_cfg(remat="none") -> Config:
    """gpt_neox at d=4096 (4·d MLP, LayerNorm, parallel residual) under BTP, TP 4."""
    cfg = cfg_7b("btp", remat)
    cfg.model.family, cfg.model.d_ff, cfg.model.rotary_pct = "gpt_neox", 4 * D, 0.25
    return cfg.validate()


@functools.lru_cache(maxsize=None)
def gpt_comm(backward=False, remat="none"):
    """[(count, elements) of each all-reduce in one layer] of the GPT BTP layer program."""
    mesh = mesh4()
    fn, args = layers_program(gpt_cfg(remat), mesh, BATCH, SEQ, backward=backward)
    with jax.set_mesh(mesh):
        rep = analyze_compiled(fn.lower(*args).compile(compiler_options=OPTS), mesh)
    out = []
    for c in rep.collectives:
        assert c.in_loop and c.trip_count == L and set(c.axes) == {"pair", "node"}, c
        assert c.kind == "all-reduce" and c.dtypes == ["f32"], c
        out.append(sum(H.parse_shape(s)[0].elements for s in c.shapes))
    return sorted(out)


def test_gpt_btp_online_layernorm_rides_the_latent_allreduce():
    """Online-LayerNorm adds no collective: GPT BTP runs LLaMA's 4 + 4 all-reduces per layer.
    The two norm'd ones carry per token the latent, M2 and the t slot means (1 + t), plus the
    weights-only γ·A and β·A ((t + 1)·n) once."""
    fwd = gpt_comm()
    assert len(fwd) == len(comm("btp")[0]) == 4
    stats = lambda n: T * (n + 1 + TP) + (TP + 1) * n  # noqa: E731
    assert fwd == sorted([stats(3 * R), T * R, stats(R), T * R])  # qkv, o, up, down
    bwd = gpt_comm(True)
    assert len(bwd) - len(fwd) == backward_only("btp")[0] == 4
    assert sum(bwd) - sum(fwd) == T * 6 * R  # cotangents of the 6 reduced latents
    assert gpt_comm(True, "lowrank") == bwd  # remat=lowrank replays none
    # the planner's roofline prices the same payloads (fp32: 4 bytes an element)
    from boost_jax.plan.roofline import block_model

    bm = block_model(gpt_cfg().model, BATCH, SEQ, "btp", TP)
    assert sorted(int(c.payload) // 4 for c in bm.fwd) == fwd
    assert int(sum(c.payload for c in bm.bwd)) // 4 == sum(bwd) - sum(fwd)
