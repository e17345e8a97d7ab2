"""Sample from a trained run: python -m boost_jax.generate --run runs/demo --prompt "def "

Loads the run's checkpoint (the latest, or --step N) whatever plan, TP layout or mesh saved it,
onto the first device present (boost_jax/infer/load.py), prefills the prompt in one pass and
decodes with a KV cache in a jitted step (boost_jax/infer/decode.py). The text streams to
stdout as it is decoded; the timing line (prefill, decode tokens/s) goes to stderr. The prompt
follows a document boundary (EOS), as documents do in training; decoding stops at the next EOS,
after --max-new-tokens, or at model.max_seq_len.
"""

from __future__ import annotations

import sys

from boost_jax.cli import Parser
from boost_jax.errors import UserError, cli_main, lone_surrogate


TEMPERATURES = (1e-3, 1e3)


def parse_args(argv=None):
    p = Parser(prog="python -m boost_jax.generate", description=__doc__)
    p.add_argument("--run", required=True, help="the training run's out_dir, e.g. runs/demo")
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: latest)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="the text to continue")
    src.add_argument("--prompt-file", help="a UTF-8 file holding the text to continue")
    p.add_argument("--max-new-tokens", type=int, default=200)
    p.add_argument("--temperature", type=float, default=0.8, help="0: greedy")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest (0: all)")
    p.add_argument("--top-p", type=float, default=1.0,
                   help="sample from the smallest set of probability >= p (1: all)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.max_new_tokens < 1:
        p.error(f"--max-new-tokens {args.max_new_tokens} must be >= 1")
    if not 0 <= args.seed < 2**32:
        p.error(f"--seed {args.seed} must be in 0..{2**32 - 1}")
    t = args.temperature
    # logits / t runs in float32: outside this range it overflows to inf or rounds t to 0
    if not (t == 0 or TEMPERATURES[0] <= t <= TEMPERATURES[1]):
        p.error(f"--temperature {t} must be 0 (greedy) or between {TEMPERATURES[0]:g} and "
                f"{TEMPERATURES[1]:g}")
    if args.top_k < 0:
        p.error(f"--top-k {args.top_k} must be >= 0 (0: all)")
    if not 0 < args.top_p <= 1:
        p.error(f"--top-p {args.top_p} must be in (0, 1] (1: all)")
    return args


PROMPT_LIMIT = 16 << 20  # far more than any model here reads


def read_prompt(args) -> str:
    if args.prompt is not None:
        if lone_surrogate(args.prompt) is not None:  # argv bytes that do not decode as UTF-8
            raise UserError("--prompt is not UTF-8 text; pass UTF-8 text, or the text in a "
                            "UTF-8 file with --prompt-file FILE")
        return args.prompt
    from boost_jax.file_kind import read_regular

    raw = read_regular(args.prompt_file, "--prompt-file", PROMPT_LIMIT)  # no FIFO, no /dev/zero
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        raise UserError(f"cannot read --prompt-file {args.prompt_file!r} (not UTF-8 text); pass "
                        "a UTF-8 text file or --prompt TEXT") from None


class TextStream:
    """Writes decoded text as ids arrive, holding back an incomplete UTF-8 character (a byte
    tokenizer emits multi-byte characters one byte at a time). The new ids are decoded after
    the prompt's last `CONTEXT` ids, whose text is already shown: a tokenizer may decode a
    token differently at the start of a text (SentencePiece's Metaspace drops its leading
    space); a few ids are enough for that, and keep each token's decode short."""

    CONTEXT = 8

    def __init__(self, tokenizer, prompt_ids=(), out=sys.stdout):
        tail = [int(i) for i in prompt_ids[-self.CONTEXT:]]
        self.tok, self.out, self.ids = tokenizer, out, tail
        self.shown = len(tokenizer.decode(tail))

    def __call__(self, token: int) -> None:
        self.ids.append(token)
        text = self.tok.decode(self.ids)
        stable = len(text) - 1 if text.endswith("\ufffd") else len(text)
        if stable > self.shown:
            self.out.write(text[self.shown:stable])
            self.out.flush()
            self.shown = stable

    def close(self) -> None:
        text = self.tok.decode(self.ids)
        self.out.write(text[self.shown:] + "\n")
        self.out.flush()


def encode_prompt(tokenizer, text: str, max_seq_len: int, run: str):
    import numpy as np

    ids = np.concatenate([[tokenizer.eos_id], tokenizer.encode(text)]).astype(np.int32)
    if len(ids) >= max_seq_len:
        raise UserError(f"the prompt is {len(ids) - 1} tokens but the model of {run!r} reads at "
                        f"most model.max_seq_len={max_seq_len} (the document start included), "
                        f"leaving no room to generate; shorten it to under {max_seq_len - 1} "
                        "tokens")
    return ids


@cli_main
def main(argv=None):
    args = parse_args(argv)
    text = read_prompt(args)
    from boost_jax.infer.load import open_run, quiet_libraries

    quiet_libraries()
    run = open_run(args.run, args.step)
    cfg = run.cfg.model
    prompt = encode_prompt(run.tokenizer, text, cfg.max_seq_len, args.run)
    from boost_jax.infer.decode import Decoder, Sampling

    length = min(cfg.max_seq_len, len(prompt) + args.max_new_tokens)
    if len(prompt) + args.max_new_tokens > cfg.max_seq_len:
        print(f"note: stopping at model.max_seq_len={cfg.max_seq_len} tokens "
              f"({length - len(prompt)} new)", file=sys.stderr)
    sampling = Sampling(args.temperature, args.top_k, args.top_p, args.seed)
    decoder = Decoder(cfg, run.params, length, sampling, run.tokenizer.vocab_size)
    sys.stdout.write(text)
    stream = TextStream(run.tokenizer, prompt)
    _, _, st = decoder.generate(prompt, args.max_new_tokens, run.tokenizer.eos_id, stream)
    stream.close()
    import jax

    # the first new token comes from the prefill: a rate needs two or more
    rate = (f" at {st.decode_tokens_per_s:.1f} tokens/s" if st.new_tokens > 1 else
            " (from the prefill)")
    print(f"{args.run} step {run.step} ({cfg.arch}) on {jax.devices()[0].platform}: prefill "
          f"{st.prompt_tokens} tokens in {st.prefill_s * 1e3:.1f} ms, decoded {st.new_tokens} "
          f"token{'s' if st.new_tokens != 1 else ''}{rate} (compile {st.compile_s:.1f} s)",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
