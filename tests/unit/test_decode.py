"""KV-cache decoding (boost_jax/infer/decode.py) against the forward written once.

Greedy decoding with the cache must pick, at every step, what recomputing the whole forward on
the sequence so far picks. Because the forward is causal, one forward over the final sequence
gives every step's recomputed logits at once (position t sees tokens 0..t only), so the test
compares the cached logits of each step with that row."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from boost_jax.backends.cpu import fast_compile_options
from boost_jax.config import ModelConfig
from boost_jax.infer.decode import Decoder, Sampling, sample
from boost_jax.layers import forward
from boost_jax.layers.model import build_model

FAST = fast_compile_options()

PROMPT = np.array([0, 100, 101, 102, 32, 40, 41, 58], np.int32)


def _model(arch, scan=True, **kw):
    base = dict(arch=arch, vocab_size=256, d_model=32, n_layers=3, n_heads=4, n_kv_heads=2,
                d_ff=64, rank=8, max_seq_len=24, init_std=0.3)
    cfg = ModelConfig(**(base | kw))
    params = build_model(cfg, seed=1, scan_layers=scan).params()
    return cfg, _random_biases(params)


def _random_biases(params):
    """GPT families: nonzero biases (they start at zero), so the decoder must carry them."""
    keys = iter(jax.random.split(jax.random.key(5), 256))
    return jax.tree_util.tree_map_with_path(
        lambda p, x: x + 0.1 * jax.random.normal(next(keys), x.shape, x.dtype)
        if str(getattr(p[-1], "key", "")) == "bias" else x, params)


@pytest.mark.parametrize("arch,scan,extra", [
    ("full", True, {}), ("svd", False, {}), ("cola", True, {"tie_embeddings": True}),
    ("lax", False, {"lax_gate": "gate"}),
    ("lax", True, {"family": "gpt_neox", "rotary_pct": 0.5}),
    ("full", False, {"family": "gpt2", "tie_embeddings": True})])
def test_cached_greedy_equals_full_forward(arch, scan, extra):
    cfg, params = _model(arch, scan, **extra)
    dec = Decoder(cfg, params, cfg.max_seq_len, Sampling(temperature=0.0), compiler_options=FAST)
    ids, logits, stats = dec.generate(PROMPT, 100)
    assert stats.new_tokens == cfg.max_seq_len - len(PROMPT)  # capped by the cache length
    seq = np.concatenate([PROMPT, ids])
    full = jax.jit(lambda p, t: forward.logits(forward.Local(cfg), cfg, p, t),
                   compiler_options=FAST)(params, jnp.asarray(seq[None, :-1]))[0]
    ref = np.asarray(full)[len(PROMPT) - 1:]
    np.testing.assert_allclose(logits, ref, atol=2e-5, rtol=1e-5)
    assert (ids == ref.argmax(-1)).all()
    if not cfg.tie_embeddings:  # tied random models repeat the last token
        assert len(set(ids.tolist())) > 1  # a real sequence, not one token repeated


def test_stops_at_eos():
    cfg, params = _model("cola", n_layers=1)
    dec = Decoder(cfg, params, 20, Sampling(temperature=0.0), compiler_options=FAST)
    first = dec.generate(PROMPT, 5)[0]
    ids, _, stats = dec.generate(PROMPT, 5, eos_id=int(first[1]))
    assert list(ids) == list(first[:2]) and stats.new_tokens == 2


def test_sample_filters():
    logits = jnp.asarray(np.random.default_rng(0).normal(size=(4, 300)).astype(np.float32))
    greedy = np.asarray(jnp.argmax(logits[:, :256], -1))
    key = jax.random.key(3)
    assert (np.asarray(sample(logits, key, 0.0, n_valid=256)) == greedy).all()
    assert (np.asarray(sample(logits, key, 1.0, top_k=1, n_valid=256)) == greedy).all()
    assert (np.asarray(sample(logits, key, 1.0, top_p=1e-6, n_valid=256)) == greedy).all()
    draws = np.stack([np.asarray(sample(logits, jax.random.key(s), 1.0, top_k=5, n_valid=256))
                      for s in range(40)])
    top5 = np.argsort(-np.asarray(logits[:, :256]), -1)[:, :5]
    assert all(set(draws[:, r]) <= set(top5[r]) for r in range(4))
    assert len(set(draws[:, 0])) > 1  # it does sample
    wide = np.stack([np.asarray(sample(logits, jax.random.key(s), 5.0)) for s in range(60)])
    masked = np.stack([np.asarray(sample(logits, jax.random.key(s), 5.0, n_valid=256))
                       for s in range(60)])
    assert (wide >= 256).any() and (masked < 256).all()


def test_streamed_text_is_the_text_of_prompt_and_new_ids_together():
    """generate prints the prompt, then what the new ids add to it: decoded after the prompt,
    not alone, since SentencePiece's Metaspace decoder drops a text's leading space."""
    import io

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from boost_jax.data.tokenizers import HFTokenizer
    from boost_jax.generate import TextStream

    vocab = {"<|endoftext|>": 0, "\u2581import": 1, "\u2581os": 2, "\u2581": 3, "\u2581sys": 4}
    raw = Tokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>"))
    raw.pre_tokenizer = pre_tokenizers.Metaspace()
    raw.decoder = decoders.Metaspace()
    raw.add_special_tokens(["<|endoftext|>"])
    tok = HFTokenizer(raw)
    prompt = np.concatenate([[tok.eos_id], tok.encode("import os")])
    assert tok.decode(prompt) == "import os" and tok.decode([4]) == "sys"  # alone: no space
    out = io.StringIO()
    stream = TextStream(tok, prompt, out)
    for i in (3, 3, 4):
        stream(i)
    stream.close()
    assert out.getvalue() == "   sys\n"
    assert tok.decode([*prompt, 3, 3, 4]) == "import os   sys"
    long = np.concatenate([prompt, np.tile([1, 2, 4], 40)])  # past the stream's context
    out = io.StringIO()
    stream = TextStream(tok, long, out)
    for i in (4, 3, 1):
        stream(i)
    stream.close()
    assert out.getvalue() == tok.decode([*long, 4, 3, 1])[len(tok.decode(long)):] + "\n"
    assert out.getvalue() == " sys  import\n"
