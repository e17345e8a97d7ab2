"""The decoder forward, written once: embedding → blocks → final norm → head and loss, with
every piece of math it runs (norms, the low-rank linear family, RoPE, attention, remat policy).
model.py holds the params; this module is pure functions on plain arrays.

Pre-norm block, in model terms (model.family picks a few choices inside `block`):

    h += o(attention(rope(q, k, v)))   with (q, k, v) = project_in(Norm(h))
    h += down(silu(gate) · up)         with (gate, up) = project_in(Norm(h))      llama
    h += down(gelu(up))                with up = project_in(Norm(h))              gpt_neox, gpt2

llama: Norm = RMSNorm, RoPE on the whole head, no biases. gpt_neox and gpt2: Norm = LayerNorm,
every projection adds its bias after whatever collective produced its output (with_bias).
gpt_neox: parallel residual h += attn(Norm₁(h)) + mlp(Norm₂(h)), RoPE on rotary_pct of each
head. gpt2: sequential residual, learned absolute positions added to the embedding, no RoPE.
Every projection is one of the low-rank family (lowrank_apply: full, svd, cola, lax).

Whatever depends on where an array lives or which collective runs is a call on `ops`, an `Ops`:
`Local` here (one device: CausalLM, and the step's plans without TP), the TP layouts in
boost_jax/sharding/tp/. Params are read only through `ops.fetch(weights, path)`, so the training
step gathers a layer's weights just before use (sharding/gather.py). Each layer runs inside the
remat policy's jax.checkpoint (remat_wrapper, the one place policies are built), which saves
values by checkpoint_name. Adding, say, QK-norm is an edit of `attention` below.
"""

from __future__ import annotations

import math
from functools import partial
from typing import Callable, Optional, Protocol

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from boost_jax.errors import ConfigError
from boost_jax.layers.flash import flash_attention
from boost_jax.names import ARCHS
from boost_jax.pallas.common import align_vma
from boost_jax.pallas.dispatch import interpret_mode, platform
from boost_jax.pallas.flash import flash_attention as pallas_flash

QKV = ("q", "k", "v")
GATE_UP = ("gate", "up")
LATENT_KEYS = ("q", "k", "v", "o", "gate", "up", "down")  # the 7 latents a lax block passes on
GPT_LATENT_KEYS = ("q", "k", "v", "o", "up", "down")  # GELU MLP: no gate

# jax.ad_checkpoint.checkpoint_name tags: what a remat policy may save (remat_wrapper)
LATENT_NAME = "lowrank_latent"  # every rank-r latent (remat="lowrank")
RESIDUAL_NAME = "residual"  # the residual stream at each sub-layer input
# TP all-reduce outputs that are not rank-r latents (kept by remat="none" under a sharded plan,
# so no collective is replayed there either)
REDUCED_NAME = "tp_reduced"
SECONDARY_NAME = "zero_secondary"  # every saved secondary (hpZ) partition


def latent_keys(cfg) -> tuple:
    return LATENT_KEYS if cfg.swiglu else GPT_LATENT_KEYS


def with_bias(y, proj: dict):
    """y + the projection's bias (GPT families), laid out like y under every TP mode."""
    return y + proj["bias"].astype(y.dtype) if "bias" in proj else y


def cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """Mean token cross-entropy of fp32 logits [..., V]."""
    logits = logits.astype(jnp.float32)
    logz = jax.nn.logsumexp(logits, axis=-1)
    # a one-hot mask, not a gather: the backward stays one elementwise fusion that writes the
    # gradient in the compute dtype (a gather's transpose scatters into a second fp32 array)
    hit = jnp.arange(logits.shape[-1], dtype=targets.dtype) == targets[..., None]
    gold = jnp.sum(jnp.where(hit, logits, 0.0), axis=-1)
    return jnp.mean(logz - gold)


def first_latents(tokens, rank: int, dtype, keys=LATENT_KEYS) -> dict:
    """Zero latents [b, s, r] for the first LaX block; derived from `tokens` so that they carry
    the same (vma) type as the latents later blocks pass on."""
    z = jnp.broadcast_to((tokens[..., None] * 0).astype(dtype), (*tokens.shape, rank))
    return {k: z for k in keys}


# --------------------------------------------------------------------------- norms
# Statistics in fp32 whatever the compute dtype (a bf16 mean of squares loses digits).


def rms_norm(x: jax.Array, scale: jax.Array, eps: float = 1e-6, dtype=None) -> jax.Array:
    """x / sqrt(mean(x², -1) + eps) · scale in fp32, returned in `dtype` (default x.dtype)."""
    out_dtype = dtype or x.dtype
    xf = x.astype(jnp.float32)
    inv = jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (xf * inv * scale.astype(jnp.float32)).astype(out_dtype)


def layer_norm(x: jax.Array, scale: jax.Array, bias: jax.Array, eps: float = 1e-5,
               dtype=None) -> jax.Array:
    """(x − mean) / sqrt(var + eps) · scale + bias over the last axis, fp32 inside."""
    out_dtype = dtype or x.dtype
    xf = x.astype(jnp.float32)
    c = xf - jnp.mean(xf, axis=-1, keepdims=True)
    inv = jax.lax.rsqrt(jnp.mean(c * c, axis=-1, keepdims=True) + eps)
    y = c * inv * scale.astype(jnp.float32) + bias.astype(jnp.float32)
    return y.astype(out_dtype)


def apply_norm(x: jax.Array, p: dict, eps: float, dtype=None) -> jax.Array:
    """The norm whose params are `p`: LayerNorm when it has a bias, else RMSNorm."""
    if "bias" in p:
        return layer_norm(x, p["scale"], p["bias"], eps, dtype)
    return rms_norm(x, p["scale"], eps, dtype)


# --------------------------------------------------------------------------- low-rank linear
# One family for every arch (lowrank_apply): pure functions on plain arrays, so the TP layouts
# run the same pieces on sharded weights; model.LowRankLinear only holds the params.


@jax.custom_vjp
def logits_matmul(x, w):
    """x [..., d] @ w [d, V] -> fp32 logits: the GEMM in x's (compute) dtype with fp32
    accumulation. Its backward rounds the fp32 cotangent to x's dtype once, so both backward
    GEMMs run in the compute dtype too (plain autodiff runs them in fp32: on an H200 they took
    13 of a CoLA-1B step's 57 ms, benchmarks/README.md §7); dw comes back in w's dtype."""
    return jnp.einsum("...d,dv->...v", x, w.astype(x.dtype), preferred_element_type=jnp.float32)


def _logits_fwd(x, w):
    return logits_matmul(x, w), (x, w)


def _logits_bwd(res, g):
    x, w = res
    g = g.astype(x.dtype)
    dx = jnp.einsum("...v,dv->...d", g, w.astype(x.dtype), preferred_element_type=jnp.float32)
    # one contracting dim: XLA:CPU runs no bf16 x bf16 = f32 dot over several
    dw = jnp.einsum("td,tv->dv", x.reshape(-1, x.shape[-1]), g.reshape(-1, g.shape[-1]),
                    preferred_element_type=jnp.float32)
    return dx.astype(x.dtype), dw.astype(w.dtype)


logits_matmul.defvjp(_logits_fwd, _logits_bwd)


def matmul(x: jax.Array, w: jax.Array, dtype=None) -> jax.Array:
    """x @ w with both operands cast to the compute dtype (params may be stored wider)."""
    dtype = dtype or x.dtype
    return jnp.matmul(x.astype(dtype), w.astype(dtype))


def lax_cross(z: jax.Array, prev: Optional[jax.Array], params: dict, eps: float = 1e-6
              ) -> jax.Array:
    """Norm_r(z + G(prev)): the add and the norm in fp32, result in z.dtype."""
    zf = z.astype(jnp.float32)
    if prev is not None:
        g = params.get("g")
        cross = prev if g is None else matmul(prev, g, z.dtype)
        zf = zf + cross.astype(jnp.float32)
    return rms_norm(zf, params["latent_scale"], eps, z.dtype)


def finish_latent(kind: str, z: jax.Array, prev: Optional[jax.Array], params: dict,
                  eps: float = 1e-6) -> jax.Array:
    """The (fully reduced) down-projection z → the latent that is saved and carried.

    lax applies the crossing; every low-rank kind tags the result for remat="lowrank".
    """
    if kind == "lax":
        z = lax_cross(z, prev, params, eps)
    return checkpoint_name(z, LATENT_NAME)


def latent_activation(kind: str, z: jax.Array) -> jax.Array:
    """σ between the factors: identity for svd, SiLU for cola and lax."""
    return z if kind == "svd" else jax.nn.silu(z)


def lowrank_apply(kind: str, params: dict, x: jax.Array, prev: Optional[jax.Array] = None,
                  *, eps: float = 1e-6, dtype=None) -> tuple[jax.Array, Optional[jax.Array]]:
    """One projection of `kind` (the model's arch) on x [..., d_in] → (y [..., d_out], latent
    [..., r] or None):

        full: y = x @ w
        svd:  z = x @ a;                      y = z @ b
        cola: z = x @ a;                      y = silu(z) @ b
        lax:  z = Norm_r(x @ a + G(z_prev));  y = silu(z) @ b

    G is the identity (lax_gate="identity") or z_prev @ g (lax_gate="gate"; g starts as the
    identity, so both start as the identity crossing); z_prev is the same projection's latent in
    the previous block, None (first block) meaning zeros. Any kind may carry a bias, added by
    the caller (with_bias) after whatever collective produced y. The TP layouts reuse the pieces
    on sharded weights inside shard_map: down-projection, [collective], finish_latent, σ,
    up-projection."""
    if kind not in ARCHS:
        raise ValueError(f"unknown linear kind {kind!r}; expected one of {ARCHS}")
    dtype = dtype or x.dtype
    if kind == "full":
        return matmul(x, params["w"], dtype), None
    z = finish_latent(kind, matmul(x, params["a"], dtype), prev, params, eps)
    y = matmul(latent_activation(kind, z), params["b"], dtype)
    return y, z


# --------------------------------------------------------------------------- RoPE
# Half-split "rotate_half" convention (HF LLaMA, MaxText); explicit absolute positions, so a
# sequence-sharded caller or a KV-cache decoder passes its own.


def rope_frequencies(head_dim: int, theta: float = 10000.0) -> jax.Array:
    """Inverse frequencies theta^(-2i/head_dim), i < head_dim/2, fp32."""
    if head_dim % 2:
        raise ValueError(f"RoPE needs an even head_dim, got {head_dim}")
    return theta ** (-jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)


def rope_cos_sin(positions: jax.Array, head_dim: int, theta: float = 10000.0):
    """cos, sin of shape positions.shape + [head_dim/2] (fp32)."""
    angles = positions.astype(jnp.float32)[..., None] * rope_frequencies(head_dim, theta)
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x: jax.Array, positions: jax.Array, theta: float = 10000.0) -> jax.Array:
    """Rotate x [b, s, heads, head_dim] by `positions` ([s] or [b, s]); fp32 math, x.dtype out.

    Pair (x[i], x[i + head_dim/2]) is rotated by angle pos·theta^(-2i/head_dim).
    """
    cos, sin = rope_cos_sin(positions, x.shape[-1], theta)
    if cos.ndim == 2:  # [s, hd/2] → broadcast over batch
        cos, sin = cos[None], sin[None]
    cos, sin = cos[:, :, None, :], sin[:, :, None, :]  # broadcast over heads
    xf = x.astype(jnp.float32)
    x1, x2 = jnp.split(xf, 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


def apply_rotary(x: jax.Array, positions: jax.Array, theta: float, dims: int) -> jax.Array:
    """RoPE on the leading `dims` of each head (GPT-NeoX's rotary_pct), the rest passed through;
    frequencies as for a head of size `dims`. dims=0: x unchanged (learned positions)."""
    if dims == 0:
        return x
    if dims == x.shape[-1]:
        return apply_rope(x, positions, theta)
    rot = apply_rope(x[..., :dims], positions, theta)
    return jnp.concatenate([rot, x[..., dims:]], axis=-1)


# --------------------------------------------------------------------------- attention

ATTENTION_KINDS = ("auto", "dense", "flash")  # model.attention
# On CPU the blockwise path beats dense from this many keys on (forward+backward, measured by
# benchmarks/attention.py on a 2-core machine; README.md, "Attention", has the table)
CPU_FLASH_FROM = 256


# Dense attention's score GEMM: fp32 output, so its backward runs in fp32 (kept: the fused
# kernels that a GPU picks are not affected, and tests name it as the one fp32 GEMM)
SCORES = "bqkgd,bskd->bkgqs"


def attention_impl(kind: str, seq_len: int, platform: str, dtype="float32", head_dim: int = 64,
                   offset: bool = False) -> str:
    """The implementation `model.attention=kind` (auto | dense | flash) runs on `platform`
    ('cuda' | 'rocm' | 'cpu' | 'tpu') with `seq_len` keys; `offset`: a KV-cache decoder call.
    The one place that decides, at trace time:

        dense      the [sq, sk] fp32 score matrix, masked (dense_attention)
        blockwise  online-softmax tiles in XLA, block-wise backward (layers/flash.py): CPU,
                   TPU, and the KV-cache decoder everywhere (its causal offset)
        cudnn      cuDNN's fused flash attention via jax.nn.dot_product_attention (NVIDIA,
                   bf16/fp16)
        pallas     the Pallas (Triton) flash kernel (boost_jax/pallas/flash.py): ROCm, and
                   NVIDIA where cuDNN does not apply (fp32, head dims cuDNN rejects)

    auto is flash on GPUs and, on CPU, blockwise from CPU_FLASH_FROM keys up."""
    if kind not in ATTENTION_KINDS:
        raise ConfigError(f"model.attention={kind!r}; choose one of {list(ATTENTION_KINDS)}")
    gpu = platform in ("cuda", "rocm")
    if kind == "dense" or (kind == "auto" and not gpu and seq_len < CPU_FLASH_FROM):
        return "dense"
    if not gpu or offset:
        return "blockwise"
    cudnn_ok = jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16) and head_dim % 8 == 0 \
        and head_dim <= 128
    return "cudnn" if platform == "cuda" and cudnn_ok else "pallas"


def compiled_impl(cfg, seq_len: int) -> str:
    """What the training step compiles on this backend for model config `cfg` (flops.py)."""
    return attention_impl(cfg.attention, seq_len, platform(), cfg.dtype, cfg.head_dim)


def causal_attention(q, k, v, offset=None, kind: str = "dense"):
    """Causal GQA attention (contract: dense_attention) by the implementation attention_impl
    picks for `kind` on this backend."""
    impl = attention_impl(kind, k.shape[1], platform(), q.dtype, q.shape[-1], offset is not None)
    if impl == "dense":
        return dense_attention(q, k, v, offset)
    if impl == "blockwise":
        return flash_attention(q, k, v, offset)
    if impl == "cudnn":  # its outputs take the operands' varying axes: give them one set
        q, k, v = align_vma(q, k, v)
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")
    return pallas_flash(q, k, v, interpret=interpret_mode())


def dense_attention(q: jax.Array, k: jax.Array, v: jax.Array, offset=None) -> jax.Array:
    """softmax(q·kᵀ/√hd + causal) · v with GQA.

    q [b, sq, H, hd]; k, v [b, sk, K, hd] with K | H (query head h uses kv head h // (H/K)).
    Query i sits at key position offset + i and sees keys 0..offset + i. By default
    offset = sk - sq: when sq < sk the queries are the last sq positions (KV-cache style).
    A fixed-size KV cache passes the number of keys filled before these queries (may be
    traced), so the unfilled slots after them are masked.
    Scores and softmax in fp32; the full [sq, sk] score matrix is computed and masked, which
    is also what flops.py counts.
    """
    b, sq, H, hd = q.shape
    sk, K = k.shape[1], k.shape[2]
    qg = q.reshape(b, sq, K, H // K, hd)
    scores = jnp.einsum(SCORES, qg, k, preferred_element_type=jnp.float32)
    scores = scores * (1.0 / math.sqrt(hd))
    offset = sk - sq if offset is None else offset
    mask = (jnp.arange(sq)[:, None] + offset) >= jnp.arange(sk)[None, :]
    scores = jnp.where(mask, scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bkgqs,bskd->bqkgd", probs, v)
    return out.reshape(b, sq, H, hd)


# --------------------------------------------------------------------------- where arrays live


class Ops(Protocol):
    """What the forward asks of where arrays live and which collectives run: `Local` (one
    device) and the tensor-parallel layouts (boost_jax/sharding/tp/: TPOps and its subclasses)
    implement it."""

    def fetch(self, weights, path):
        """The params at `path` (("embed",), ("blocks",) for one layer of a stack,
        ("blocks", i), ("final_norm",), ("lm_head",)) → the weights to compute with (the
        training step stores them sharded, and gathers them here)."""

    def embed(self, table, tokens):
        """→ the residual stream h [b, s, d] (btp: its d-slice)."""

    def init_prev(self, tokens) -> Optional[dict]:
        """LaX: the latents the first block crosses with (else None)."""

    def project_in(self, h, norm, projs, prevs) -> tuple[list, list]:
        """The norm (params `norm`: {scale[, bias]}) + the projections reading its output
        → ([y per proj], [latent per proj])."""

    def project_out(self, x, proj, prev):
        """One projection whose output joins the residual → (y, latent)."""

    def head_loss(self, h, norm, w, targets):
        """Final norm + LM head → mean cross-entropy."""


class Local:
    """Single-device ops (an `Ops`): every weight is whole and nothing is communicated; also
    logits(h, norm, w), the final norm + LM head → fp32 logits, for decoding."""

    def __init__(self, cfg, fetch=None):
        self._fetch = fetch
        self.arch, self.eps = cfg.arch, cfg.norm_eps
        self.dtype = jnp.dtype(cfg.dtype)
        self.rank, self.tie = cfg.r, cfg.tie_embeddings
        self.latent_keys = latent_keys(cfg)

    def fetch(self, weights, path):
        return weights if self._fetch is None else self._fetch(weights, path)

    def embed(self, table, tokens):
        return jnp.take(table, tokens, axis=0).astype(self.dtype)

    def init_prev(self, tokens) -> Optional[dict]:
        if self.arch != "lax":
            return None
        return first_latents(tokens, self.rank, self.dtype, self.latent_keys)

    def project_in(self, h, norm, projs, prevs):
        x = apply_norm(h, norm, self.eps, self.dtype)
        outs = [lowrank_apply(self.arch, p, x, z, eps=self.eps, dtype=self.dtype)
                for p, z in zip(projs, prevs)]
        return [y for y, _ in outs], [z for _, z in outs]

    def project_out(self, x, proj, prev):
        return lowrank_apply(self.arch, proj, x, prev, eps=self.eps, dtype=self.dtype)

    def logits(self, h, norm, w):
        x = apply_norm(h, norm, self.eps, self.dtype)
        return logits_matmul(x, w)

    def head_loss(self, h, norm, w, targets):
        return cross_entropy(self.logits(h, norm, w), targets)


# --------------------------------------------------------------------------- one block


def attention(ops: Ops, cfg, p: dict, h, positions, prev: dict, attend: Optional[Callable] = None):
    """The attention sub-layer's addend to the residual, and its latents.

    `attend(q, k, v)` (rotated q, k and v as [b, s, heads, hd]) is, by default, causal
    attention over these s positions by the implementation model.attention picks; a KV-cache
    decoder (boost_jax/infer/decode.py) passes one that writes k, v into its cache and attends
    over everything cached so far."""
    attend = attend or partial(causal_attention, kind=cfg.attention)
    projs = [p["attn"][n] for n in QKV]
    ys, zs = ops.project_in(h, p["attn_norm"], projs, [prev.get(n) for n in QKV])
    q, k, v = (with_bias(y, w) for y, w in zip(ys, projs))
    b, s, hd = q.shape[0], q.shape[1], cfg.head_dim
    q = apply_rotary(q.reshape(b, s, -1, hd), positions, cfg.rope_theta, cfg.rotary_dims)
    k = apply_rotary(k.reshape(b, s, -1, hd), positions, cfg.rope_theta, cfg.rotary_dims)
    o = attend(q, k, v.reshape(b, s, -1, hd))
    y, zo = ops.project_out(o.reshape(b, s, -1), p["attn"]["o"], prev.get("o"))
    return with_bias(y, p["attn"]["o"]), dict(zip(QKV, zs)) | {"o": zo}


def mlp(ops: Ops, cfg, p: dict, h, prev: dict):
    """The MLP sub-layer's addend to the residual (SwiGLU or GELU), and its latents."""
    names = GATE_UP if cfg.swiglu else ("up",)
    projs = [p["mlp"][n] for n in names]
    ys, zs = ops.project_in(h, p["mlp_norm"], projs, [prev.get(n) for n in names])
    ys = [with_bias(y, w) for y, w in zip(ys, projs)]
    if cfg.swiglu:
        a = jax.nn.silu(ys[0]) * ys[1]
    else:  # gpt2 uses the tanh approximation ("gelu_new"), gpt_neox the exact erf form
        a = jax.nn.gelu(ys[0], approximate=cfg.family == "gpt2")
    y, zd = ops.project_out(a, p["mlp"]["down"], prev.get("down"))
    return with_bias(y, p["mlp"]["down"]), dict(zip(names, zs)) | {"down": zd}


def block(ops: Ops, cfg, p: dict, h, positions, prev: Optional[dict],
          attend: Optional[Callable] = None):
    """h → h + attention → + mlp (parallel residual: h + attention(h) + mlp(h)); returns
    (h, latents for the next lax block or None)."""
    prev = prev or {}
    h = checkpoint_name(h, RESIDUAL_NAME)
    y, lat_a = attention(ops, cfg, p, h, positions, prev, attend)
    if cfg.parallel_residual:
        y2, lat_m = mlp(ops, cfg, p, h, prev)
        h = h + (y.astype(h.dtype) + y2.astype(h.dtype))
    else:
        h = checkpoint_name(h + y.astype(h.dtype), RESIDUAL_NAME)
        y, lat_m = mlp(ops, cfg, p, h, prev)
        h = h + y.astype(h.dtype)
    return h, (lat_a | lat_m if cfg.arch == "lax" else None)


# --------------------------------------------------------------------------- the stack


def remat_wrapper(remat: str, gathers: bool = False, prevent_cse: bool = False) -> Callable:
    """The per-layer jax.checkpoint for train.remat (none | full | lowrank), for CausalLM and
    the sharded engine alike.

    With gathered weights the gathered copy is never saved (backward re-fetches it), so
    remat="none" saves every matmul output plus the named values instead (weights are inputs
    of matmuls, never outputs). prevent_cse: jax.checkpoint's, for layers not inside a scan
    (sharding/parallel.ParallelLayout.checkpoint says why; XLA:CPU drops the barriers before
    its CSE, so a CPU program merges the replay all the same)."""
    cp = jax.checkpoint_policies
    saved = {"none": (LATENT_NAME, RESIDUAL_NAME, REDUCED_NAME), "full": (),
             "lowrank": (LATENT_NAME, RESIDUAL_NAME)}
    if remat not in saved:
        raise ValueError(f"train.remat={remat!r}; expected none, full or lowrank")
    names = saved[remat] + ((SECONDARY_NAME,) if gathers else ())
    if remat == "none":
        if not gathers:
            return lambda f: f
        policy = cp.save_from_both_policies(cp.dots_saveable, cp.save_only_these_names(*names))
    else:
        policy = cp.save_only_these_names(*names) if names else None
    return lambda f: jax.checkpoint(f, policy=policy, prevent_cse=prevent_cse)


def path_keys(path) -> tuple:
    """The keys of a jax tree path: dict keys, attribute names and sequence indices."""
    return tuple(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k))) for k in path)


def is_stacked(blocks) -> bool:
    """Unstacked (scan_layers=False) blocks are a dict keyed by layer index; anything else is
    one stack of layers (a dict keyed by name, or a pytree the caller built around one)."""
    return not (isinstance(blocks, dict) and all(
        isinstance(k, int) or (isinstance(k, str) and k.isdigit()) for k in blocks))


def run_blocks(ops: Ops, cfg, blocks, h, positions, prev, checkpoint: Callable, active=None):
    """All layers: lax.scan over stacked params (one compiled layer), else a Python loop.

    Each layer fetches its weights inside `checkpoint` (a jax.checkpoint wrapper or the
    identity; it wraps layer(weights, h, prev)), so only one layer's gathered weights live at
    a time and backward re-fetches. `active` (bool per stacked layer, pipeline stages) skips a
    layer where false: its output is its input, so its (zero-padded) weights get no gradient.
    """
    def layer(lp, h, prev, path=("blocks",)):
        return block(ops, cfg, ops.fetch(lp, path), h, positions, prev)

    if is_stacked(blocks):
        layer = checkpoint(layer)

        def body(carry, xs):
            out = layer(xs[0], *carry)
            if active is not None:
                out = jax.tree.map(lambda new, old: jnp.where(xs[1], new, old), out, carry)
            return out, None

        xs = (blocks,) if active is None else (blocks, active)
        (h, prev), _ = jax.lax.scan(body, (h, prev), xs)
        return h, prev
    for key in sorted(blocks, key=int):
        fn = checkpoint(lambda lp, h, prev, key=key: layer(lp, h, prev, ("blocks", key)))
        h, prev = fn(blocks[key], h, prev)
    return h, prev


def embed(ops: Ops, emb: dict, tokens, positions):
    """The residual stream's start: token embedding (+ learned positions, gpt2). The position
    table is laid out like the residual (btp: its d-slice), so the add needs no collective."""
    h = ops.embed(emb["embedding"], tokens)
    if "positions" in emb:
        h = h + jnp.take(emb["positions"], positions, axis=0).astype(h.dtype)
    return h


def hidden(ops: Ops, cfg, params: dict, tokens, positions=None,
           checkpoint: Callable = lambda f: f):
    """tokens [b, s] → the residual stream after the last block (before the final norm)."""
    if positions is None:
        positions = jnp.arange(tokens.shape[1], dtype=jnp.int32)
    h = embed(ops, ops.fetch(params["embed"], ("embed",)), tokens, positions)
    h, _ = run_blocks(ops, cfg, params["blocks"], h, positions, ops.init_prev(tokens),
                      checkpoint)
    return h


def head_weights(ops: Ops, cfg, params: dict):
    """(final norm params, [d, V] output projection) fetched for use (tied: the table's T)."""
    norm = ops.fetch(params["final_norm"], ("final_norm",))
    if cfg.tie_embeddings:
        w = ops.fetch(params["embed"], ("embed",))["embedding"].T
    else:
        w = ops.fetch(params["lm_head"], ("lm_head",))["w"]
    return norm, w


def loss(ops: Ops, cfg, params: dict, batch: dict, checkpoint: Callable = lambda f: f):
    """Mean cross-entropy of batch["targets"] given batch["inputs"] (int32 [b, s])."""
    h = hidden(ops, cfg, params, batch["inputs"], checkpoint=checkpoint)
    norm, w = head_weights(ops, cfg, params)
    return ops.head_loss(h, norm, w, batch["targets"])


def logits(ops: Ops, cfg, params: dict, tokens, positions=None, checkpoint: Callable = lambda f: f):
    """tokens [b, s] → fp32 logits [b, s, V] (single device)."""
    h = hidden(ops, cfg, params, tokens, positions, checkpoint=checkpoint)
    return ops.logits(h, *head_weights(ops, cfg, params))
