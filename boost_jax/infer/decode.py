"""Autoregressive decoding with a KV cache, on the forward written once (layers/forward.py).

The cache holds every layer's rotated keys and values in fixed-size buffers [L, b, T, K, hd]
(T: prompt plus new tokens, at most model.max_seq_len), so one compiled program serves every
step. `forward_cached` runs tokens [b, s] at positions pos..pos+s-1 through forward.block with
an `attend` that writes their k, v into slots pos..pos+s-1 and attends over slots 0..pos+s-1
(causal attention with offset=pos masks the slots not yet filled; model.attention=flash runs
it block by block, boost_jax/layers/flash.py, so a long prompt's prefill never builds [s, T]):

    prefill   the whole prompt in one pass (pos = 0, s = prompt length)
    decode    one token per step (s = 1), jitted once, the cache donated and updated in place

LaX: a block's crossing reads the previous block's latent *at the same position*
(forward.lax_cross), which the step computes on its way up the stack like the training forward
does, so nothing but k and v needs caching.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np

from boost_jax.layers import forward


def init_cache(cfg, batch: int, length: int) -> dict:
    """Zero k and v buffers [n_layers, batch, length, kv_heads, head_dim] in the compute dtype."""
    shape = (cfg.n_layers, batch, length, cfg.kv_heads, cfg.head_dim)
    return {"k": jnp.zeros(shape, cfg.dtype), "v": jnp.zeros(shape, cfg.dtype)}


def _cached_block(ops, cfg, lp, h, positions, prev, ck, cv, pos):
    """One block whose attention writes its k, v at slot `pos` of ck, cv and reads 0..pos+s-1."""
    new = {}

    def attend(q, k, v):
        new["k"] = jax.lax.dynamic_update_slice_in_dim(ck, k.astype(ck.dtype), pos, axis=1)
        new["v"] = jax.lax.dynamic_update_slice_in_dim(cv, v.astype(cv.dtype), pos, axis=1)
        return forward.causal_attention(q, new["k"], new["v"], offset=pos, kind=cfg.attention)

    h, prev = forward.block(ops, cfg, lp, h, positions, prev, attend)
    return h, prev, new["k"], new["v"]


def forward_cached(ops, cfg, params: dict, cache: dict, tokens, pos):
    """tokens [b, s] at positions pos.. → (fp32 logits of the last position [b, V], new cache)."""
    positions = pos + jnp.arange(tokens.shape[1], dtype=jnp.int32)
    h = forward.embed(ops, params["embed"], tokens, positions)
    prev = ops.init_prev(tokens)
    blocks = params["blocks"]
    if forward.is_stacked(blocks):
        def body(carry, xs):
            h, prev, k, v = _cached_block(ops, cfg, xs[0], carry[0], positions, carry[1],
                                          xs[1], xs[2], pos)
            return (h, prev), (k, v)

        (h, _), (ks, vs) = jax.lax.scan(body, (h, prev), (blocks, cache["k"], cache["v"]))
    else:
        ks, vs = [], []
        for i, key in enumerate(sorted(blocks, key=int)):
            h, prev, k, v = _cached_block(ops, cfg, blocks[key], h, positions, prev,
                                          cache["k"][i], cache["v"][i], pos)
            ks.append(k)
            vs.append(v)
        ks, vs = jnp.stack(ks), jnp.stack(vs)
    logits = ops.logits(h[:, -1:], *forward.head_weights(ops, cfg, params))
    return logits[:, 0], {"k": ks, "v": vs}


def sample(logits, key, temperature: float, top_k: int = 0, top_p: float = 1.0,
           n_valid: Optional[int] = None):
    """Next ids [b] from fp32 logits [b, V]: greedy at temperature 0, else a draw from
    softmax(logits / temperature) restricted to the top_k ids (0: all) and to the smallest set
    whose probability reaches top_p (1: all). Ids >= n_valid (the embedding's padding past the
    tokenizer's vocabulary) are never drawn."""
    neg = jnp.finfo(jnp.float32).min
    if n_valid is not None and n_valid < logits.shape[-1]:
        logits = jnp.where(jnp.arange(logits.shape[-1]) < n_valid, logits, neg)
    if temperature <= 0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits / temperature
    if top_k and top_k < logits.shape[-1]:
        kth = jax.lax.top_k(logits, top_k)[0][:, -1:]
        logits = jnp.where(logits < kth, neg, logits)
    if top_p < 1.0:
        order = jnp.argsort(-logits, axis=-1)
        probs = jax.nn.softmax(jnp.take_along_axis(logits, order, axis=-1), axis=-1)
        keep_sorted = jnp.cumsum(probs, axis=-1) - probs < top_p  # the first is always kept
        keep = jnp.zeros_like(keep_sorted).at[jnp.arange(logits.shape[0])[:, None], order].set(
            keep_sorted)
        logits = jnp.where(keep, logits, neg)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


@dataclass
class Sampling:
    temperature: float = 0.8
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0


@dataclass
class Stats:
    prompt_tokens: int
    new_tokens: int
    compile_s: float
    prefill_s: float
    decode_s: float

    @property
    def decode_tokens_per_s(self) -> float:
        # the first new token comes from the prefill; decode steps made the rest
        steps = max(self.new_tokens - 1, 0)
        return steps / self.decode_s if self.decode_s > 0 else float("nan")


class Decoder:
    """Prefill + cached decode for one model (single device, batch 1), compiled ahead of time
    for a total length `length`. The timed loop runs those two programs and nothing else that
    compiles: each step draws its key inside (the base key folded with the position), takes
    the previous step's [1, 1] ids as they are, and the host reads results with numpy."""

    def __init__(self, cfg, params: dict, length: int, sampling: Sampling,
                 n_valid: Optional[int] = None, compiler_options: Optional[dict] = None):
        self.cfg, self.params, self.length, self.s = cfg, params, length, sampling
        ops = forward.Local(cfg)

        def step(params, cache, tokens, pos, key):
            logits, cache = forward_cached(ops, cfg, params, cache, tokens, pos)
            ids = sample(logits, jax.random.fold_in(key, pos), sampling.temperature,
                         sampling.top_k, sampling.top_p, n_valid)
            return ids[:, None], logits, cache

        self._step = jax.jit(step, donate_argnums=(1,), compiler_options=compiler_options)
        self._programs: dict = {}

    def _compiled(self, cache, s: int):
        """The step compiled for s tokens (kept: later prompts of that length reuse it)."""
        if s not in self._programs:
            args = (self.params, cache, jax.ShapeDtypeStruct((1, s), jnp.int32),
                    jnp.zeros((), jnp.int32), jax.random.key(0))
            self._programs[s] = self._step.lower(*args).compile()
        return self._programs[s]

    def generate(self, prompt: np.ndarray, max_new: int, eos_id: Optional[int] = None,
                 on_token: Callable[[int], None] = lambda i: None):
        """(new ids, their logits [n, V], Stats): prompt ids [n] → up to max_new ids, stopping
        after eos_id. on_token(id) is called as each id is known (streaming)."""
        n = len(prompt)
        max_new = min(max_new, self.length - n)
        t0 = time.perf_counter()
        cache = init_cache(self.cfg, 1, self.length)
        prefill, decode = self._compiled(cache, n), self._compiled(cache, 1)
        compile_s = time.perf_counter() - t0
        key, prompt = jax.random.key(self.s.seed), np.asarray(prompt, np.int32)[None]
        ids, logits = [], []
        t0 = time.perf_counter()
        tok, lg, cache = prefill(self.params, cache, prompt, np.int32(0), key)
        tok.block_until_ready()
        prefill_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        for i in range(max_new):
            t = int(np.asarray(tok)[0, 0])  # the host needs it anyway: to stream it, stop at EOS
            ids.append(t)
            logits.append(lg)
            on_token(t)
            if t == eos_id or i == max_new - 1:
                break
            tok, lg, cache = decode(self.params, cache, tok, np.int32(n + i), key)
        decode_s = time.perf_counter() - t0
        stats = Stats(n, len(ids), compile_s, prefill_s, decode_s)
        return np.array(ids, np.int32), np.concatenate([np.asarray(x) for x in logits]), stats
