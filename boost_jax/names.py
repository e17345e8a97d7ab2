"""The project's vocabulary, each name said once: mesh axes, the config's choices and the names
a run writes under out_dir. Constants only, in a leaf (no imports) so that any module can use
them: config.py cannot hold them, as it lazily imports data modules that need them. The
checkpoint_name tags live with the remat policy that selects by them (layers/forward.py)."""

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

# how reports name parallel.secondary_axes=[] (planner, job header, run line)
KEPT_SECONDARY = "the forward's gather kept"

# what a run writes under out_dir
CHECKPOINTS_DIR = "checkpoints"
UNUSABLE_DIR = "checkpoints_unusable"  # steps that failed their checks, moved aside
CONFIG_FILE = "config.yaml"  # the latest invocation's config
TOKENIZER_DIR = "tokenizer"  # out_dir/tokenizer/tokenizer.json: the BPE a run trained
LOCK_FILE = ".lock"  # held by the run for its whole life (train/run_lock.py)
