"""Scoring text with a trained run, as evaluation harnesses ask it (boost_jax/lm_eval_adapter.py).

    loglikelihood          log p(continuation | context), and whether greedy decoding
                           would have produced the continuation
    loglikelihood_rolling  log p(text) of a whole document, every token predicted once with as
                           much context as the model reads (model.max_seq_len, or max_length)
    generate_until         greedy continuation, cut at the first stop string

Every text is scored as a document start: EOS (the tokenizer's document separator, as the run
trained on joined documents) comes first, as in boost_jax.generate. Log-probabilities come from
the forward written once (layers/forward.py), normalised over the whole output layer like the
run's losses (boost_jax.evaluate); greedy choices skip the vocabulary's padding ids.
Sequences are padded to lengths in steps of PAD_TO and batched, so few programs compile.
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

PAD_TO = 16  # sequence-length bucket: compiled programs per distinct bucket, not per length


def _token_scores(cfg, n_valid: int):
    """jit: (params, tokens [b, s+1]) → (log p of each target [b, s] fp32, target == greedy)."""
    import jax
    import jax.numpy as jnp

    from boost_jax.layers import forward

    ops = forward.Local(cfg)

    def fn(params, tokens):
        logits = forward.logits(ops, cfg, params, tokens[:, :-1]).astype(jnp.float32)
        gold = jnp.take_along_axis(logits, tokens[:, 1:, None], axis=-1)[..., 0]
        logp = gold - jax.nn.logsumexp(logits, axis=-1)
        valid = jnp.arange(logits.shape[-1]) < n_valid
        best = jnp.argmax(jnp.where(valid, logits, -jnp.inf), axis=-1)
        return logp, best == tokens[:, 1:]

    return jax.jit(fn)


def rolling_windows(ids: Sequence[int], prefix: int, max_len: int) -> list:
    """[(window, n_scored)]: prefix + ids cut into windows of at most max_len + 1 tokens whose
    last n_scored targets together predict every id once; each window is as long as it can be
    (the last one reaches back for a full context)."""
    full = [prefix, *ids]
    out = []
    for a in range(0, len(ids), max_len):
        b = min(a + max_len, len(ids))
        out.append((full[max(0, b - max_len):b + 1], b - a))
    return out


def _bucket(n: int, cap: int) -> int:
    return min(-(-n // PAD_TO) * PAD_TO, cap)


class Scorer:
    """The three queries on one opened run (boost_jax.infer.load.open_run)."""

    def __init__(self, run, batch_size: int = 8, max_length: Optional[int] = None):
        cfg = run.cfg.model
        self.run, self.tok, self.batch_size = run, run.tokenizer, int(batch_size)
        self.max_len = int(max_length or cfg.max_seq_len)
        if not 2 <= self.max_len <= cfg.max_seq_len:
            from boost_jax.errors import UserError

            raise UserError(f"max_length={self.max_len} must be in 2..{cfg.max_seq_len} (the "
                            "run's model.max_seq_len)")
        self.n_valid = min(int(self.tok.vocab_size), cfg.vocab_size)
        self._fn = _token_scores(cfg, self.n_valid)
        self._decoder = None

    def score_tokens(self, seqs: Sequence[tuple]) -> list:
        """[(sum of log p, all greedy)] of the last n targets of each (ids, n), len(ids) <=
        max_len + 1; batched by length bucket, longest first."""
        order = sorted(range(len(seqs)), key=lambda i: -len(seqs[i][0]))
        out: list = [None] * len(seqs)
        for s in range(0, len(order), self.batch_size):
            idx = order[s:s + self.batch_size]
            width = _bucket(len(seqs[idx[0]][0]), self.max_len + 1)
            rows = np.full((self.batch_size, width), self.tok.eos_id, np.int32)
            for r, i in enumerate(idx):
                rows[r, :len(seqs[i][0])] = seqs[i][0]
            logp, greedy = (np.asarray(x) for x in self._fn(self.run.params, rows))
            for r, i in enumerate(idx):
                ids, n = seqs[i]
                span = slice(len(ids) - 1 - n, len(ids) - 1)  # targets ids[-n:]
                out[i] = (float(np.sum(logp[r, span], dtype=np.float64)),
                          bool(np.all(greedy[r, span])))
        return out

    def encode_pair(self, context: str, continuation: str) -> tuple:
        """(EOS + context ids, continuation ids): the pair encoded whole and split where the
        context's own encoding ends; trailing spaces of the context go to the continuation."""
        n = len(context) - len(context.rstrip())
        if n:
            context, continuation = context[:-n], context[-n:] + continuation
        ctx = [int(i) for i in self.tok.encode(context)] if context else []
        whole = [int(i) for i in self.tok.encode(context + continuation)]
        return [self.tok.eos_id, *ctx], whole[len(ctx):]

    def loglikelihood(self, pairs: Sequence[tuple]) -> list:
        """[(log p(continuation | context), greedy)] for (context, continuation) strings; a
        context too long for the model loses its start (a continuation longer than max_len is
        scored on its last max_len tokens, as lm_eval's own models do)."""
        seqs = []
        for context, continuation in pairs:
            ctx, cont = self.encode_pair(context, continuation)
            seqs.append(((ctx + cont)[-(self.max_len + 1):], min(len(cont), self.max_len)))
        return self.score_tokens(seqs)

    def loglikelihood_rolling(self, texts: Sequence[str]) -> list:
        """[log p(text)] of whole documents, in windows of max_len (rolling_windows)."""
        spans, seqs = [], []
        for text in texts:
            wins = rolling_windows([int(i) for i in self.tok.encode(text)], self.tok.eos_id,
                                   self.max_len)
            spans.append((len(seqs), len(seqs) + len(wins)))
            seqs.extend(wins)
        scores = self.score_tokens(seqs)
        return [sum(lp for lp, _ in scores[a:b]) for a, b in spans]

    def generate_until(self, context: str, until: Sequence[str] = (),
                       max_gen_toks: int = 256) -> str:
        """Greedy continuation of context: at most max_gen_toks tokens, ended by EOS or cut
        before the first of the `until` strings. The context comes first: the continuation
        gets the positions of max_len it leaves (fewer tokens than asked when they run out),
        and a context that alone fills max_len loses its start, leaving one."""
        from boost_jax.infer.greedy import Greedy

        if self._decoder is None:
            self._decoder = Greedy(self.run.cfg.model, self.run.params, self.max_len,
                                   self.n_valid)
        prompt = [self.tok.eos_id, *(int(i) for i in self.tok.encode(context))]
        prompt = prompt[-(self.max_len - 1):]
        max_new = max(1, min(int(max_gen_toks), self.max_len - len(prompt)))
        stops = [s for s in until if s]
        ids: list = []
        for t in self._decoder.tokens(prompt, max_new):
            if t == self.tok.eos_id:
                break
            ids.append(t)
            text = self.tok.decode(ids)
            cut = min((text.find(s) for s in stops if s in text), default=-1)
            if cut >= 0:
                return text[:cut]
        return self.tok.decode(ids)
