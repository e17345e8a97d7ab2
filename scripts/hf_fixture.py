"""Write tests/fixtures/hf/{full,svd}: tiny models exported by boost_jax/hf.py and the logits
Hugging Face transformers' LlamaForCausalLM computes for them (tokens.npy → logits.npy).

tests/test_hf.py checks boost_jax's logits against these files when torch is not installed (CI),
and against transformers directly when it is. torch and transformers are not dependencies of the
project; make the fixture in an environment that has them besides boost_jax's own:

    python3 -m venv /tmp/venv-hf
    /tmp/venv-hf/bin/pip install -e . torch==2.13.0 transformers
    /tmp/venv-hf/bin/python scripts/hf_fixture.py [--out tests/fixtures/hf]
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# arch=full with GQA and its own head; arch=svd merged, tied to the embedding. init_std=0.2
# gives logits of order 1, so a layout mistake shows far above the 1e-4 tolerance.
MODELS = {
    "full": dict(arch="full", vocab_size=256, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                 d_ff=64, max_seq_len=32, init_std=0.2, rope_theta=500.0),
    "svd": dict(arch="svd", vocab_size=256, d_model=32, n_layers=2, n_heads=4, d_ff=64,
                rank=8, max_seq_len=32, init_std=0.2, tie_embeddings=True),
}
TOKENS = np.array([[0, 100, 101, 102, 32, 40, 41, 58, 10, 32, 32, 32, 32, 114, 101, 116]],
                  np.int64)


def transformers_logits(model_dir: str, tokens: np.ndarray) -> np.ndarray:
    """fp32 logits [b, s, V] of LlamaForCausalLM loaded from model_dir."""
    import torch
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        out = model(torch.as_tensor(tokens), use_cache=False).logits
    return out.float().numpy()


def export_model(name: str, out_dir: str, seed: int = 0) -> None:
    """A randomly initialised model of MODELS[name] written by hf.write into out_dir."""
    from boost_jax import hf
    from boost_jax.config import ModelConfig
    from boost_jax.layers.model import build_model

    cfg = ModelConfig(**MODELS[name])
    params = build_model(cfg, seed=seed).params()
    os.makedirs(out_dir, exist_ok=True)
    hf.write(out_dir, cfg, params, {"tokenizer": "byte", "tokenizer_fingerprint": "byte"})


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.path.join(ROOT, "tests", "fixtures", "hf"))
    args = p.parse_args(argv)
    for name in MODELS:
        d = os.path.join(args.out, name)
        shutil.rmtree(d, ignore_errors=True)
        export_model(name, d)
        np.save(os.path.join(d, "tokens.npy"), TOKENS)
        np.save(os.path.join(d, "logits.npy"), transformers_logits(d, TOKENS).astype(np.float32))
        print(f"wrote {d}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    sys.path.insert(0, ROOT)
    sys.exit(main())
