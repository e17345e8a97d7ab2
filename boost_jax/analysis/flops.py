"""Analytic FLOPs and parameter count for CausalLM (boost_jax.layers.model).

Conventions (chosen to match XLA's cost_analysis, which counts a dot as 2·M·N·K):
- per token, forward, matmuls only: norms, RoPE, softmax, SiLU and adds are ignored (they are
  O(d) per token against O(d·r) for the matmuls);
- a low-rank projection d_in→d_out costs 2·(d_in + d_out)·r, plus 2·r² for the lax gate g
  (computed in every block, also the first where z_prev = 0); full rank costs 2·d_in·d_out;
- attention: q·kᵀ and p·v each 2·s_att·(H·hd) per token, 4·s_att·d per token per layer,
  where s_att is the keys each query's compiled work covers. Dense: the FULL s (the causal mask is
  applied to a computed [s, s] matrix, so XLA counts no saving). Flash (blockwise, Pallas,
  cuDNN; model.attention): only the kv tiles at or below the causal diagonal are computed,
  t²·n(n+1)/2 score entries for n = ⌈s/t⌉ tiles of t, ≈ s/2 + t/2 per query. The flash
  backward's recompute of the scores is not counted, as remat's is not;
- LM head 2·d·V; the embedding is a gather (0 FLOPs);
- train = 3 · forward (backward = grads w.r.t. activations + grads w.r.t. weights).
Compare with XLA on a scan_layers=False model: cost_analysis counts a scan (while-loop) body
once, not n_layers times. Measured agreement (tests/unit/test_flops.py): within 2% at d=256.
"""

from __future__ import annotations


def projection_shapes(cfg) -> dict[str, tuple[int, int]]:
    """(d_in, d_out) of the projections of one block (7; 6 in the GPT families: no gate)."""
    d, hd = cfg.d_model, cfg.head_dim
    q, kv = cfg.n_heads * hd, cfg.kv_heads * hd
    gate = {"gate": (d, cfg.d_ff)} if cfg.swiglu else {}
    return {"q": (d, q), "k": (d, kv), "v": (d, kv), "o": (q, d),
            **gate, "up": (d, cfg.d_ff), "down": (cfg.d_ff, d)}


def linear_flops(cfg, d_in: int, d_out: int) -> int:
    """Forward FLOPs per token of one projection."""
    if cfg.arch == "full":
        return 2 * d_in * d_out
    r = cfg.r
    gate = 2 * r * r if cfg.arch == "lax" and cfg.lax_gate == "gate" else 0
    return 2 * (d_in + d_out) * r + gate


def linear_params(cfg, d_in: int, d_out: int) -> int:
    if cfg.arch == "full":
        return d_in * d_out
    r = cfg.r
    extra = 0
    if cfg.arch == "lax":
        extra = r + (r * r if cfg.lax_gate == "gate" else 0)  # latent_scale (+ g)
    return (d_in + d_out) * r + extra


# the tile of each flash implementation (layers/flash.py, pallas/flash.py; cuDNN's is ~128)
FLASH_TILES = {"blockwise": 256, "pallas": 64, "cudnn": 128}


def attention_keys(seq_len: int, impl: str = "dense") -> float:
    """Keys per query the compiled attention computes scores for (s_att above); "flash": the
    causal half, as the planner costs a flash kernel whose tiles it does not know."""
    if impl == "dense":
        return float(seq_len)
    if impl == "flash":
        return seq_len / 2
    t = min(FLASH_TILES[impl], seq_len)
    n = -(-seq_len // t)
    return t * t * n * (n + 1) / 2 / seq_len


def flops_per_token(cfg, seq_len: int, attention: str = "dense") -> dict:
    """Per-token FLOPs: {'projections', 'attention', 'lm_head', 'per_layer', 'forward', 'train'}.
    `attention`: the compiled implementation (layers.forward.attention_impl's answer)."""
    proj = sum(linear_flops(cfg, i, o) for i, o in projection_shapes(cfg).values())
    attn = round(4 * attention_keys(seq_len, attention) * cfg.n_heads * cfg.head_dim)
    head = 2 * cfg.d_model * cfg.vocab_size
    L = cfg.n_layers
    forward = L * (proj + attn) + head
    return {"projections": L * proj, "attention": L * attn, "lm_head": head,
            "per_layer": proj + attn, "forward": forward, "train": 3 * forward}


def param_count(cfg) -> int:
    """Exact parameter count of CausalLM(cfg) (== layers.model.count_params)."""
    d, V = cfg.d_model, cfg.vocab_size
    shapes = projection_shapes(cfg).values()
    norm = 2 * d if cfg.bias else d  # LayerNorm scale and bias (GPT families)
    bias = sum(o for _, o in shapes) if cfg.bias else 0
    per_layer = 2 * norm + bias + sum(linear_params(cfg, i, o) for i, o in shapes)
    head = 0 if cfg.tie_embeddings else d * V
    positions = cfg.max_seq_len * d if cfg.learned_positions else 0
    return V * d + positions + cfg.n_layers * per_layer + norm + head
