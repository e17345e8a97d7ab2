"""Configuration of a boost_jax CoLA or LaX export, for transformers' remote code.

Copied next to the weights by `python -m boost_jax.export`; transformers loads it with
`AutoModelForCausalLM.from_pretrained(dir, trust_remote_code=True)`. It imports torch and
transformers only, never boost_jax. The fields of config.json are those of the family's
transformers config (LlamaConfig, GPTNeoXConfig, GPT2Config); the low-rank ones sit in its
"boost_jax" section ("model": rank, arch, lax_gate, norm_eps).
"""

from transformers import GPT2Config, GPTNeoXConfig, LlamaConfig


def _config(name: str, family_config, arch: str):
    """The config class of a low-rank `arch` export of one family: the family's transformers
    config under our model_type (each is named in config.json's auto_map)."""
    return type(name, (family_config,), {"model_type": f"boost_jax_{arch}"})


BoostJaxColaConfig = _config("BoostJaxColaConfig", LlamaConfig, "cola")
BoostJaxLaxConfig = _config("BoostJaxLaxConfig", LlamaConfig, "lax")
BoostJaxColaGptNeoxConfig = _config("BoostJaxColaGptNeoxConfig", GPTNeoXConfig, "cola")
BoostJaxLaxGptNeoxConfig = _config("BoostJaxLaxGptNeoxConfig", GPTNeoXConfig, "lax")
BoostJaxColaGpt2Config = _config("BoostJaxColaGpt2Config", GPT2Config, "cola")
BoostJaxLaxGpt2Config = _config("BoostJaxLaxGpt2Config", GPT2Config, "lax")
