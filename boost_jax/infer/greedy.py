"""Greedy decoding for many prompts of different lengths (evaluation harnesses), on the cached
forward of decode.py.

decode.Decoder compiles its prefill for each exact prompt length, which suits one prompt. Here
all but the prompt's last token are prefilled in a window padded to a multiple of PAD_TO, so
prompts of nearby lengths share a program: the padding's k, v land in cache slots the first
decode step (the last prompt token, at its true position) and every later one overwrite before
they attend to them (causal_attention masks the slots past the position).
"""

from __future__ import annotations

from typing import Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from boost_jax.infer.decode import forward_cached, init_cache, sample
from boost_jax.layers import forward

PAD_TO = 16


class Greedy:
    """Greedy decoding, batch 1, with a cache of `length` slots (prompt + new tokens)."""

    def __init__(self, cfg, params: dict, length: int, n_valid: int):
        self.cfg, self.params, self.length = cfg, params, length
        ops = forward.Local(cfg)

        def step(params, cache, tokens, pos):
            logits, cache = forward_cached(ops, cfg, params, cache, tokens, pos)
            return sample(logits, None, 0.0, n_valid=n_valid), cache

        self._step = jax.jit(step, donate_argnums=(1,))

    def tokens(self, prompt: Sequence[int], max_new: int) -> Iterator[int]:
        """Yields up to max_new greedy ids after prompt (len(prompt) + max_new <= length)."""
        n = len(prompt)
        if n < 1 or n + max_new > self.length:
            raise ValueError(f"prompt of {n} + {max_new} new tokens exceeds {self.length}")
        cache = init_cache(self.cfg, 1, self.length)
        if n > 1:
            head = np.zeros((1, min(-(-(n - 1) // PAD_TO) * PAD_TO, self.length)), np.int32)
            head[0, :n - 1] = prompt[:-1]
            _, cache = self._step(self.params, cache, jnp.asarray(head), jnp.int32(0))
        last = jnp.asarray([[prompt[-1]]], jnp.int32)
        tok, cache = self._step(self.params, cache, last, jnp.int32(n - 1))
        for i in range(max_new):
            yield int(tok[0])
            if i == max_new - 1:
                return
            tok, cache = self._step(self.params, cache, tok[:, None], jnp.int32(n + i))
