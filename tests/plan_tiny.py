"""The tiny model the planner tests plan and compile, in-process and through the CLI alike."""

TINY = ["model.d_model=64", "model.n_layers=2", "model.n_heads=4", "model.d_ff=128",
        "model.rank=16", "model.max_seq_len=32", "data.seq_len=32"]
