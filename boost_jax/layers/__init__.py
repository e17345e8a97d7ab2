"""Model layers, in model terms: one LowRankLinear family (full/svd/cola/lax), GQA attention,
SwiGLU, RMSNorm, RoPE, and the decoder forward written once (forward.py) that LlamaModel and
every parallel layout run."""
