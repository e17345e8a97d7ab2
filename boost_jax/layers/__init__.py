"""The model, in two files: forward.py, the decoder forward written once with all the math it
runs (norms, the LowRankLinear family full/svd/cola/lax, RoPE, GQA attention, SwiGLU/GELU MLP,
remat policies; the Ops protocol its layouts implement), and model.py, CausalLM's params and
init. flash.py is the blockwise (XLA) flash attention for CPU and the KV-cache decoder."""
