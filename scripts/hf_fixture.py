"""Write tests/fixtures/hf/{full,svd,cola,lax,gpt_neox,gpt2}: tiny models exported by
boost_jax/hf.py, the logits Hugging Face transformers computes for them (tokens.npy →
logits.npy) and its greedy continuation of a prompt (greedy.npy): LlamaForCausalLM for full and
svd, the export's own remote code (boost_jax/hf_remote/) for cola and lax, GPTNeoXForCausalLM
and GPT2LMHeadModel for the GPT families (full and svd; `<arch>_<family>` names the others).

tests/unit/test_hf.py checks boost_jax's logits against these files when torch is not installed
(CI), and against transformers directly when it is. A cola / lax fixture keeps the sha256 of the
remote code transformers ran (remote_code.sha256, sha256sum's format), not a copy of it: the test
fails once boost_jax/hf_remote/ differs, until the fixture is made again (to load one in
transformers, copy boost_jax/hf_remote/*.py into it, as export does). torch and transformers are
not dependencies of the project; make the fixture in an environment that has them besides
boost_jax's own:

    make .venv-hf/.installed  # or: pip install -e '.[test,hf-live]' (pyproject.toml's pins)
    .venv-hf/bin/python scripts/hf_fixture.py [--out tests/fixtures/hf] [full svd cola lax ...]
"""

from __future__ import annotations

import argparse
import hashlib
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
    # cola and lax load through the export's own modeling code (trust_remote_code); lax with
    # the r x r gate, GQA and three blocks, so two crossings per projection are checked
    "cola": dict(arch="cola", vocab_size=256, d_model=32, n_layers=2, n_heads=4, d_ff=64,
                 rank=8, max_seq_len=32, init_std=0.2),
    "lax": dict(arch="lax", vocab_size=256, d_model=32, n_layers=3, n_heads=4, n_kv_heads=2,
                d_ff=64, rank=8, lax_gate="gate", max_seq_len=32, init_std=0.2),
    # NeoX: LayerNorm, parallel residual, RoPE on half of each head, its own head; GPT-2:
    # learned positions, tied head. Biases and norm params are randomised (they start at 0, 1).
    "gpt_neox": dict(arch="full", family="gpt_neox", vocab_size=256, d_model=32, n_layers=2,
                     n_heads=4, d_ff=128, max_seq_len=32, init_std=0.2, rotary_pct=0.5,
                     rope_theta=500.0, norm_eps=1e-5),
    "gpt2": dict(arch="full", family="gpt2", vocab_size=256, d_model=32, n_layers=2, n_heads=4,
                 d_ff=128, max_seq_len=32, init_std=0.2, tie_embeddings=True, norm_eps=1e-5),
}
# every other arch x GPT family: svd loads as the family's transformers class (merged), cola and
# lax through the export's remote code; lax with the r x r gate, three blocks and GQA
for _fam in ("gpt_neox", "gpt2"):
    for _arch, _extra in (("svd", {}), ("cola", {}),
                          ("lax", dict(n_layers=3, lax_gate="gate", n_kv_heads=2))):
        MODELS[f"{_arch}_{_fam}"] = dict(MODELS[_fam], arch=_arch, rank=8, **_extra)
REMOTE_DIGEST = "remote_code.sha256"  # what a cola / lax fixture keeps of its remote code
GREEDY_NEW = 8  # tokens transformers' generate() continues TOKENS[:, :PROMPT] by, greedily
PROMPT = 6
TOKENS = np.array([[0, 100, 101, 102, 32, 40, 41, 58, 10, 32, 32, 32, 32, 114, 101, 116]],
                  np.int64)


def transformers_model(model_dir: str):
    """The export loaded as transformers loads it: LlamaForCausalLM for full and svd, the
    export's own modeling code (trust_remote_code) for cola and lax; fp32, eval mode."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                 trust_remote_code=True)
    return model.eval()


def transformers_logits(model_dir: str, tokens: np.ndarray) -> np.ndarray:
    """fp32 logits [b, s, V] of the export, computed by transformers."""
    import torch

    with torch.no_grad():
        out = transformers_model(model_dir)(torch.as_tensor(tokens), use_cache=False).logits
    return out.float().numpy()


def transformers_greedy(model_dir: str, prompt: np.ndarray, new: int) -> np.ndarray:
    """generate()'s greedy continuation (KV cache on), prompt included: [b, len + new]."""
    import torch

    with torch.no_grad():
        ids = torch.as_tensor(prompt)
        # an explicit mask: id 0 (our document start) would otherwise be read as padding
        out = transformers_model(model_dir).generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False,
            min_new_tokens=new, eos_token_id=None, pad_token_id=0)
    return out.numpy()


def export_model(name: str, out_dir: str, seed: int = 0) -> None:
    """A randomly initialised model of MODELS[name] written by hf.write into out_dir."""
    from boost_jax import hf
    from boost_jax.config import ModelConfig
    from boost_jax.layers.model import build_model

    cfg = ModelConfig(**MODELS[name])
    params = _perturb(build_model(cfg, seed=seed).params(), seed)
    os.makedirs(out_dir, exist_ok=True)
    hf.write(out_dir, cfg, params, {"tokenizer": "byte", "tokenizer_fingerprint": "byte"})


def _perturb(params, seed: int):
    """Biases N(0, 0.1) and LayerNorm scales 1 + N(0, 0.1), so the fixture exercises them."""
    import jax

    rng = np.random.default_rng(seed)

    def f(path, x):
        name, parent = str(path[-1].key), str(path[-2].key) if len(path) > 1 else ""
        x = np.asarray(x)
        if name == "bias" or (name == "scale" and "norm" in parent):
            base = 1.0 if name == "scale" else 0.0
            return (base + 0.1 * rng.standard_normal(x.shape)).astype(x.dtype) if (
                name == "bias" or "bias" in _siblings(params, path)) else x
        return x

    return jax.tree_util.tree_map_with_path(f, params)


def _siblings(tree, path):
    for k in path[:-1]:
        tree = tree[k.key]
    return tree


def remote_code_digests(folder: str) -> dict:
    """{name: sha256 hex} of the remote code files (hf.REMOTE_CODE) in `folder`."""
    from boost_jax.hf import REMOTE_CODE

    out = {}
    for name in REMOTE_CODE:
        with open(os.path.join(folder, name), "rb") as f:
            out[name] = hashlib.sha256(f.read()).hexdigest()
    return out


def read_digests(folder: str) -> dict:
    """A fixture's REMOTE_DIGEST file as {name: sha256 hex}."""
    with open(os.path.join(folder, REMOTE_DIGEST)) as f:
        return {name: digest for digest, name in (line.split() for line in f if line.strip())}


def keep_digests_only(folder: str) -> None:
    """Replace the export's copies of the remote code in `folder` by their digests."""
    digests = remote_code_digests(folder)
    with open(os.path.join(folder, REMOTE_DIGEST), "w") as f:
        f.writelines(f"{digest}  {name}\n" for name, digest in digests.items())
    for name in digests:
        os.remove(os.path.join(folder, name))


FIXTURE_FILES = ("tokens.npy", "logits.npy", "greedy.npy")  # what only this script writes


def is_fixture(folder: str) -> bool:
    """A folder this script wrote (replaced on the next run): it holds FIXTURE_FILES."""
    return os.path.isdir(folder) and not os.path.islink(folder) and all(
        os.path.isfile(os.path.join(folder, f)) for f in FIXTURE_FILES)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.path.join(ROOT, "tests", "fixtures", "hf"))
    p.add_argument("names", nargs="*", default=list(MODELS), choices=list(MODELS))
    p.add_argument("--force", action="store_true",
                   help="replace an --out/NAME folder that is not a fixture this script wrote")
    args = p.parse_args(argv)
    theirs = [d for d in (os.path.join(args.out, n) for n in args.names)
              if os.path.lexists(d) and not is_fixture(d)]
    if theirs and not args.force:
        d = theirs[0]
        why = ("a link" if os.path.islink(d) else "not a folder" if not os.path.isdir(d) else
               "no " + ", ".join(f for f in FIXTURE_FILES
                                 if not os.path.isfile(os.path.join(d, f))))
        print(f"error: {d} exists and is not a fixture this script wrote ({why}); choose "
              "another --out or pass --force", file=sys.stderr)
        return 2
    for name in args.names:
        d = os.path.join(args.out, name)
        if os.path.isdir(d) and not os.path.islink(d):
            shutil.rmtree(d)
        elif os.path.lexists(d):
            os.remove(d)
        export_model(name, d)
        np.save(os.path.join(d, "tokens.npy"), TOKENS)
        np.save(os.path.join(d, "logits.npy"), transformers_logits(d, TOKENS).astype(np.float32))
        np.save(os.path.join(d, "greedy.npy"), transformers_greedy(d, TOKENS[:, :PROMPT],
                                                                   GREEDY_NEW))
        if MODELS[name]["arch"] in ("cola", "lax"):  # after transformers has run it
            keep_digests_only(d)
        print(f"wrote {d}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    sys.path.insert(0, ROOT)
    sys.exit(main())
