"""Model layers: one LowRankLinear family (full/svd/cola/lax), GQA attention, SwiGLU, LlamaModel.

Pure functions (rms_norm, apply_rope, causal_attention, lowrank_apply, lax_cross, ...) take
plain arrays so tensor-parallel code can reuse them on sharded weights inside shard_map.
"""

from boost_jax.layers.attention import ATTN_PROJ, Attention, causal_attention
from boost_jax.layers.linear import (KINDS, LATENT_NAME, LowRankLinear, finish_latent,
                                     latent_activation, lax_cross, lowrank_apply,
                                     lowrank_init_std, matmul)
from boost_jax.layers.mlp import MLP, MLP_PROJ
from boost_jax.layers.model import (LATENT_KEYS, LOWRANK_POLICY, RESIDUAL_NAME, Block,
                                    LlamaModel, abstract_model, build_model, count_params,
                                    fast_compile_options, jit_init)
from boost_jax.layers.norms import RMSNorm, rms_norm
from boost_jax.layers.rope import apply_rope, rope_cos_sin, rope_frequencies

__all__ = [
    "ATTN_PROJ", "Attention", "causal_attention", "KINDS", "LATENT_NAME", "LowRankLinear",
    "finish_latent", "latent_activation", "lax_cross", "lowrank_apply", "lowrank_init_std",
    "matmul", "MLP", "MLP_PROJ", "LATENT_KEYS", "LOWRANK_POLICY", "RESIDUAL_NAME", "Block",
    "LlamaModel", "abstract_model", "build_model", "count_params", "fast_compile_options",
    "jit_init", "RMSNorm", "rms_norm", "apply_rope", "rope_cos_sin", "rope_frequencies",
]
