"""Causal self-attention with GQA: the score/softmax math and the q, k, v, o projections' params
(LowRankLinear of the model's arch). The sub-layer itself is boost_jax.layers.forward.attention.

`model.attention` (auto | dense | flash) picks the implementation; `attention_impl` is the one
place that decides, at trace time, from the platform, the length and the dtype:

    dense      the [sq, sk] fp32 score matrix, masked (dense_attention below)
    blockwise  online-softmax tiles in XLA, block-wise backward (flash.py): CPU, TPU, and the
               KV-cache decoder everywhere (its causal offset)
    cudnn      cuDNN's fused flash attention via jax.nn.dot_product_attention (NVIDIA, bf16/fp16)
    pallas     the Pallas (Triton) flash kernel (boost_jax/pallas/flash.py): ROCm, and NVIDIA
               where cuDNN does not apply (fp32, head dims cuDNN rejects)

auto is flash on GPUs and, on CPU, blockwise from CPU_FLASH_FROM keys up (measured: README).
"""

from __future__ import annotations

import math
import jax
import jax.numpy as jnp
from flax import nnx

from boost_jax.errors import ConfigError
from boost_jax.layers.flash import flash_attention
from boost_jax.layers.linear import LowRankLinear
from boost_jax.pallas.common import align_vma
from boost_jax.pallas.dispatch import interpret_mode, platform
from boost_jax.pallas.flash import flash_attention as pallas_flash

KINDS = ("auto", "dense", "flash")
# On CPU the blockwise path beats dense from this many keys on (forward+backward, measured by
# benchmarks/attention.py on a 2-core machine; README.md, "Attention", has the table)
CPU_FLASH_FROM = 256


# Dense attention's score GEMM: fp32 output, so its backward runs in fp32 (kept: the fused
# kernels that a GPU picks are not affected, and tests name it as the one fp32 GEMM)
SCORES = "bqkgd,bskd->bkgqs"

def attention_impl(kind: str, seq_len: int, platform: str, dtype="float32", head_dim: int = 64,
                   offset: bool = False) -> str:
    """'dense' | 'blockwise' | 'cudnn' | 'pallas' for `model.attention=kind` on `platform`
    ('cuda' | 'rocm' | 'cpu' | 'tpu') with `seq_len` keys; `offset`: a KV-cache decoder call."""
    if kind not in KINDS:
        raise ConfigError(f"model.attention={kind!r}; choose one of {list(KINDS)}")
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


class Attention(nnx.Module):
    """Params: q/k/v/o each a LowRankLinear (see linear.py for their param names)."""

    def __init__(self, cfg, *, rngs: nnx.Rngs):
        d, hd = cfg.d_model, cfg.head_dim
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.kv_heads, hd
        self.rope_theta = cfg.rope_theta
        mk = lambda i, o: LowRankLinear.from_config(cfg, i, o, rngs=rngs)  # noqa: E731
        self.q = mk(d, cfg.n_heads * hd)
        self.k = mk(d, cfg.kv_heads * hd)
        self.v = mk(d, cfg.kv_heads * hd)
        self.o = mk(cfg.n_heads * hd, d)
