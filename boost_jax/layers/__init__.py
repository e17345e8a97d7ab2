"""Model layers, in model terms: one LowRankLinear family (full/svd/cola/lax), GQA attention,
SwiGLU, RMSNorm, RoPE, the decoder forward written once (forward.py, with the Ops protocol its
layouts implement, and the per-layer remat policies) that CausalLM and every parallel layout
run."""
