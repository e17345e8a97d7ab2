"""The tiny model the planner tests plan and compile, in-process and through the CLI alike, and
the 7B shapes the cost-model tests price."""

from boost_jax.config import load_config

TINY = ["model.d_model=64", "model.n_layers=2", "model.n_heads=4", "model.d_ff=128",
        "model.rank=16", "model.max_seq_len=32", "data.seq_len=32"]


def cfg7b(arch, mode, axes="[pair,node]"):
    return load_config(None, [
        f"model.arch={arch}", "model.vocab_size=32000", "model.d_model=4096",
        "model.n_layers=32", "model.n_heads=32", "model.d_ff=11008", "model.rank=1024",
        "model.max_seq_len=4096", "data.seq_len=4096", "model.dtype=bfloat16",
        "model.param_dtype=bfloat16", f"parallel.tp_mode={mode}", f"parallel.tp_axes={axes}",
        "train.global_batch=4"])
