"""Cluster jobs refuse the embedded demo corpus (data.source=stdlib: the Python standard
library's source, a few million tokens), which a multi-node run would read hundreds of times
over. `plan --emit-config` and `launch slurm` call `refuse_demo_corpus`; `--allow-demo-data`
lifts it (a smoke test of the cluster), and the `cpu` topology (simulated devices on this
machine) is exempt.
"""

from __future__ import annotations

from boost_jax.errors import UserError

FLAG = "--allow-demo-data"


def demo_tokens(data_cfg) -> int:
    """Training tokens of the demo corpus under this config (its cap and tokenizer)."""
    from boost_jax.data.sources import load_corpus

    return int(len(load_corpus(data_cfg).train))


def refuse_demo_corpus(cfg, nodes: int, topology: str, allow: bool) -> None:
    """One line naming data.source(s) and the epochs the run would make of the demo corpus."""
    d, t = cfg.data, cfg.train
    if allow or d.sources or d.source != "stdlib" or nodes <= 1 or topology == "cpu":
        return
    tokens = demo_tokens(d)
    epochs = t.steps * t.global_batch * d.seq_len / tokens
    raise UserError(
        f"data.source=stdlib is the embedded demo corpus ({tokens / 1e6:.1f} M training "
        f"tokens): {t.steps:,} steps x {t.global_batch} sequences x {d.seq_len} tokens on "
        f"{nodes} nodes would make {epochs:,.{0 if epochs >= 10 else 1}f} epochs of it; prepare a corpus "
        "(python -m boost_jax.data.prepare) and set data.sources=[{path: corpus.bin, weight: "
        f"1}}] (or data.source=corpus.bin), or pass {FLAG} to run on it anyway")
