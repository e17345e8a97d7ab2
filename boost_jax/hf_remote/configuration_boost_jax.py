"""Configuration of a boost_jax CoLA or LaX export, for transformers' remote code.

Copied next to the weights by `python -m boost_jax.export`; transformers loads it with
`AutoModelForCausalLM.from_pretrained(dir, trust_remote_code=True)`. It imports torch and
transformers only, never boost_jax. The fields of config.json are those of the family's
transformers config (LlamaConfig, GPTNeoXConfig, GPT2Config); the low-rank ones sit in its
"boost_jax" section ("model": rank, arch, lax_gate, norm_eps).
"""

from transformers import GPT2Config, GPTNeoXConfig, LlamaConfig


class BoostJaxColaConfig(LlamaConfig):
    model_type = "boost_jax_cola"


class BoostJaxLaxConfig(LlamaConfig):
    model_type = "boost_jax_lax"


class BoostJaxColaGptNeoxConfig(GPTNeoXConfig):
    model_type = "boost_jax_cola"


class BoostJaxLaxGptNeoxConfig(GPTNeoXConfig):
    model_type = "boost_jax_lax"


class BoostJaxColaGpt2Config(GPT2Config):
    model_type = "boost_jax_cola"


class BoostJaxLaxGpt2Config(GPT2Config):
    model_type = "boost_jax_lax"
