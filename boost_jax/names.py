"""The project's vocabulary, each name said once: mesh axes, plan names, remat modes, the
checkpoint_name tags remat policies select by, and the names a run writes under out_dir.
A leaf module (no imports), so any module can use it."""

# device mesh: data-parallel axes innermost first by link speed, and the pipeline's stage axis
MESH_AXES = ("pair", "node", "global")
STAGE_AXIS = "stage"  # split off `global` (mesh.make_mesh), never a data-parallel role

# config choices (config.py validates against these)
ARCHS = ("full", "svd", "cola", "lax")
FAMILIES = ("llama", "gpt_neox", "gpt2")
TP_MODES = ("none", "megatron", "vanilla", "btp")
PLANS = ("ddp", "zero1", "zero3", "zeropp", "hierarchical")
REMAT_MODES = ("none", "full", "lowrank")
OPTIMIZERS = ("adamw", "adafactor", "lion", "sgd", "sgd-momentum")
SCHEDULES = ("cosine", "linear", "wsd", "constant")

# jax.ad_checkpoint.checkpoint_name tags: what a remat policy may save (layers/forward.remat_wrapper)
LATENT_NAME = "lowrank_latent"  # every rank-r latent (remat="lowrank")
RESIDUAL_NAME = "residual"  # the residual stream at each sub-layer input
# TP all-reduce outputs that are not rank-r latents (kept by remat="none" under a sharded plan,
# so no collective is replayed there either)
REDUCED_NAME = "tp_reduced"
SECONDARY_NAME = "zero_secondary"  # every saved secondary (hpZ) partition
# how reports name parallel.secondary_axes=[] (planner, job header, run line)
KEPT_SECONDARY = "the forward's gather kept"



def path_keys(path) -> tuple:
    """The keys of a jax tree path: dict keys, attribute names and sequence indices."""
    return tuple(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k))) for k in path)


# what a run writes under out_dir
CHECKPOINTS_DIR = "checkpoints"
UNUSABLE_DIR = "checkpoints_unusable"  # steps that failed their checks, moved aside
CONFIG_FILE = "config.yaml"  # the latest invocation's config
LOCK_FILE = ".lock"  # held by the run for its whole life (train/run_lock.py)
