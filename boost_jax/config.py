"""Typed run configuration: YAML file plus dotted `key=value` overrides, strictly validated.

Every mistake is a ConfigError whose message names the key and the fix (unknown keys get the
closest valid spelling), so `train.py` can print one line and exit 2.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field
from typing import Literal, Optional

import yaml

from boost_jax.config_read import (all_keys, build, parse_overrides, read_yaml, set_dotted,
                                   unknown_key)
from boost_jax.errors import ConfigError, UserError
from boost_jax.names import (ARCHS, FAMILIES, MESH_AXES, OPTIMIZERS, PLANS, REMAT_MODES,
                             SCHEDULES, TP_MODES)



@dataclass
class ModelConfig:
    arch: Literal[ARCHS] = "cola"
    # llama: RMSNorm, SwiGLU, RoPE, no biases. gpt_neox: LayerNorm, GELU MLP, parallel
    # residual, RoPE on rotary_pct of the head dim, biases. gpt2: LayerNorm, tanh-GELU MLP,
    # sequential residual, learned absolute positions, biases. (d_ff: 4·d_model for the GPTs.)
    family: Literal[FAMILIES] = "llama"
    # fraction of each head's dims that RoPE rotates; None: the family's (gpt_neox 0.25, else 1)
    rotary_pct: Optional[float] = None
    # None: follows data.tokenizer (see resolve_vocab_size); set it to fix the embedding size
    vocab_size: Optional[int] = None
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: Optional[int] = None  # GQA; None means n_heads
    d_ff: int = 344
    rank: Optional[int] = None  # None means d_model // 4 (CoLA default)
    lax_gate: Literal["identity", "gate"] = "identity"
    max_seq_len: int = 128
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    param_dtype: Literal["float32", "bfloat16"] = "float32"
    dtype: Literal["float32", "bfloat16"] = "float32"  # compute dtype
    tie_embeddings: bool = False
    init_std: float = 0.02
    # auto: flash on GPUs, and on CPU from the length where the blockwise path is faster;
    # dense: the [s, s] score matrix; flash: never builds it (layers/forward.attention_impl)
    attention: Literal["auto", "dense", "flash"] = "auto"
    # start from these weights (a folder written by python -m boost_jax.export, or a Hugging
    # Face LlamaForCausalLM for arch=full) instead of a random init; see boost_jax/hf.py
    init_from: Optional[str] = None

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def r(self) -> int:
        return self.rank if self.rank is not None else self.d_model // 4

    @property
    def swiglu(self) -> bool:  # else the GELU MLP (up, down)
        return self.family == "llama"

    @property
    def bias(self) -> bool:  # LayerNorm (not RMSNorm) and biases on every projection
        return self.family != "llama"

    @property
    def parallel_residual(self) -> bool:
        return self.family == "gpt_neox"

    @property
    def learned_positions(self) -> bool:
        return self.family == "gpt2"

    @property
    def rotary_fraction(self) -> float:
        if self.rotary_pct is not None:
            return self.rotary_pct
        return 0.25 if self.family == "gpt_neox" else 1.0

    @property
    def rotary_dims(self) -> int:
        """Leading dims of each head that RoPE rotates (0: learned positions instead)."""
        return 0 if self.learned_positions else int(self.head_dim * self.rotary_fraction)

    def validate(self) -> None:
        for k in ("d_model", "n_layers", "n_heads", "d_ff", "max_seq_len", "rope_theta",
                  "norm_eps", "init_std"):
            _positive(f"model.{k}", getattr(self, k))
        if self.norm_eps < FP32_TINY:  # added in fp32 (GPUs may flush a subnormal to 0)
            raise ConfigError(f"model.norm_eps={self.norm_eps} is below float32's smallest "
                              "normal number (1.2e-38), 0 where the norms add it (a zero row "
                              "would divide by 0); use 1e-6 or another value above it")
        if self.n_kv_heads is not None:  # 0 would read as n_heads (kv_heads)
            _positive("model.n_kv_heads", self.n_kv_heads)
        if self.vocab_size is not None:
            _positive("model.vocab_size", self.vocab_size)
            if self.vocab_size > MAX_VOCAB:  # token ids are int32
                raise ConfigError(f"model.vocab_size={self.vocab_size} is above {MAX_VOCAB} "
                                  "(int32 token ids); use the tokenizer's size")
        if self.max_seq_len > MAX_SEQ_LEN:
            raise ConfigError(f"model.max_seq_len={self.max_seq_len} is above {MAX_SEQ_LEN} (2^20) "
                              "tokens; use the sequence length the model will see")
        if self.init_std > 1.0:
            raise ConfigError(f"model.init_std={self.init_std} is far above any useful scale "
                              "(0.02 is usual); use a value of at most 1")
        if self.d_model % self.n_heads:
            raise ConfigError(
                f"model.d_model={self.d_model} is not divisible by model.n_heads={self.n_heads}; "
                "choose n_heads that divides d_model")
        if self.kv_heads <= 0 or self.n_heads % self.kv_heads:
            raise ConfigError(
                f"model.n_kv_heads={self.kv_heads} must divide model.n_heads={self.n_heads}")
        if not 0.0 < self.rotary_fraction <= 1.0:
            raise ConfigError(f"model.rotary_pct={self.rotary_pct} must be in (0, 1]")
        if not self.learned_positions and self.rotary_dims == 0:  # no positions at all
            raise ConfigError(
                f"model.rotary_pct={self.rotary_fraction} rotates {self.rotary_dims} of the "
                f"{self.head_dim} dims of a head, so RoPE encodes no position; use at least "
                f"2/head_dim = {2 / self.head_dim:.4g}")
        if self.rotary_dims % 2:
            raise ConfigError(
                f"RoPE rotates head_dim·rotary_pct={self.rotary_dims} dims, which must be even; "
                "change model.rotary_pct or model.n_heads")
        if self.arch != "full" and not 0 < self.r <= min(self.d_model, self.d_ff):
            raise ConfigError(
                f"model.rank={self.r} must be in 1..min(d_model, d_ff)={min(self.d_model, self.d_ff)}")


@dataclass
class MeshConfig:
    topology: str = "cpu"  # a profile in boost_jax.mesh.TOPOLOGIES
    shape: Optional[list[int]] = None  # explicit [pair, node, global]; None: from the topology
    nodes: Optional[int] = None  # number of hosts (size of `global`); None: all devices present

    def validate(self) -> None:
        if self.shape is not None:
            if len(self.shape) != 3 or any(s <= 0 for s in self.shape):
                raise ConfigError(
                    f"mesh.shape={self.shape} must be three positive sizes [pair, node, global]")
        if self.nodes is not None:
            _positive("mesh.nodes", self.nodes)

    def check_nodes_agree(self) -> None:
        """For the planner and the launcher, which size a run by its nodes: mesh.shape's third
        size and mesh.nodes must agree (train.py reads the shape; a saved run that set both
        still loads)."""
        if self.shape is not None and self.nodes is not None and self.nodes != self.shape[2]:
            raise ConfigError(
                f"mesh.shape={self.shape} has {self.shape[2]} nodes but mesh.nodes={self.nodes}; "
                "set mesh.nodes=null or make them agree")


@dataclass
class ParallelConfig:
    plan: Literal[PLANS] = "ddp"
    tp_mode: Literal[TP_MODES] = "none"
    tp_axes: list[str] = field(default_factory=list)
    # Role overrides (None: the plan's preset). Axes named here must not be TP axes.
    batch_axes: Optional[list[str]] = None
    params_axes: Optional[list[str]] = None
    grads_axes: Optional[list[str]] = None
    opt_state_axes: Optional[list[str]] = None
    # backward (hpZ) partition; None: the preset; []: keep the forward's gather whole
    secondary_axes: Optional[list[str]] = None
    # Secondary partition dtype: bfloat16 = unquantized (the working-weight dtype), int8 = int8
    # blocks + fp32 scales. None: the preset (int8 for hierarchical, bfloat16 otherwise);
    # the planner's --search costs both and sets the faster that fits (plan/secondary.py).
    secondary_dtype: Optional[Literal["bfloat16", "int8"]] = None
    # int8 weight gathers (qwZ); None: the preset (true for zeropp). Implies an int8 secondary.
    quantize_gather: Optional[bool] = None
    # int4 gradient reduce-scatter by all-to-all, inside the node then across (ZeRO++'s qgZ);
    # None: the preset (on for zeropp, off for the others). Needs sharded gradients.
    quantize_grads: Optional[bool] = None
    quant_block: int = 256
    # The updated weights' gather from the optimizer's sharding to the params sharding (the
    # hierarchical plan's cross-node leg) run per layer in the next step's first forward
    # (true), or once per step after the optimizer (false). None: wherever it applies.
    defer_update: Optional[bool] = None
    # Quantize the plan's cross-node legs (hierarchical): the deferred update's gather across
    # nodes in int8 blocks with fp32 scales, the gradient's reduce-scatter across nodes (per
    # layer in the last backward, or once per step) as an all-to-all of int8 or int4 blocks.
    quantize_cross_node_weights: Literal["none", "int8"] = "none"
    quantize_cross_node_grads: Literal["none", "int8", "int4"] = "none"
    # dtype of the micro-batch gradient accumulator (sharded over grads axes)
    grad_accum_dtype: Literal["float32", "bfloat16"] = "float32"
    kernels: Literal["auto", "pallas", "xla"] = "auto"
    # Pipeline stages, carved out of the `global` axis (boost_jax/sharding/stages.py) and the
    # schedule over train.micro_batches (boost_jax/step/pipeline.py)
    pp_stages: int = 1
    pp_schedule: Literal["1f1b", "gpipe"] = "1f1b"
    pp_virtual: int = 1  # interleaved virtual stages per device (chunks of layers)
    # data-parallel collectives spanning hosts and a node: one flat group, or rank-aligned
    # stages over `global` and inside the node (boost_jax/sharding/bucket.py); log_step: those,
    # with gathers and reduce-scatters over hosts alone as log2 exchanges; auto: per call
    collectives: Literal["flat", "two_level", "log_step", "auto"] = "flat"

    def validate(self) -> None:
        _positive("parallel.pp_stages", self.pp_stages)
        _positive("parallel.pp_virtual", self.pp_virtual)
        if self.pp_virtual > 1 and self.pp_stages == 1:
            raise ConfigError(f"parallel.pp_virtual={self.pp_virtual} needs pipeline stages; "
                              "set parallel.pp_stages>1 or parallel.pp_virtual=1")
        for name in ("tp_axes", "batch_axes", "params_axes", "grads_axes", "opt_state_axes",
                     "secondary_axes"):
            axes = getattr(self, name)
            for a in axes or []:
                if a not in MESH_AXES:
                    raise ConfigError(
                        f"parallel.{name} has unknown mesh axis {a!r}; valid axes: {list(MESH_AXES)}")
        if self.tp_mode != "none" and not self.tp_axes:
            raise ConfigError(
                f"parallel.tp_mode={self.tp_mode} needs parallel.tp_axes, e.g. parallel.tp_axes=[pair]")
        if self.tp_mode == "none" and self.tp_axes:
            raise ConfigError("parallel.tp_axes is set but parallel.tp_mode=none; set a tp_mode")
        _positive("parallel.quant_block", self.quant_block)


@dataclass
class SourceSpec:
    """One corpus of a mixture: a .bin written by python -m boost_jax.data.prepare, drawn with
    probability weight / (sum of the weights)."""
    path: str
    weight: float = 1.0


@dataclass
class DataConfig:
    source: str = "stdlib"  # stdlib | text file | folder | .jsonl | .bin (pre-tokenized)
    # A weighted mixture of prepared .bin corpora instead of data.source (data/mixture.py):
    # data.sources=[{path: a.bin, weight: 0.7}, {path: b.bin, weight: 0.3}]
    sources: Optional[list[SourceSpec]] = None
    tokenizer: str = "byte"  # byte | bpe (trained on the corpus) | path/to/tokenizer.json
    bpe_vocab_size: int = 4096
    seq_len: int = 128
    val_fraction: float = 0.05
    max_bytes: Optional[int] = 8_000_000  # cap on corpus bytes read (None: everything)
    bin_dtype: Literal["uint16", "uint32", "int32"] = "uint16"
    seed: int = 0
    workers: int = 0  # grain processes tokenizing a streaming source (0: two threads)

    def validate(self) -> None:
        if self.sources is not None:
            self._validate_sources()
        _positive("data.seq_len", self.seq_len)
        if self.tokenizer == "bpe":
            from boost_jax.data.tokenizers import check_bpe_vocab_size

            check_bpe_vocab_size(self.bpe_vocab_size)
        if not 0.0 < self.val_fraction < 1.0:
            raise ConfigError(f"data.val_fraction={self.val_fraction} must be in (0, 1)")
        if self.max_bytes is not None:
            _positive("data.max_bytes", self.max_bytes)
        if self.seed < 0:
            raise ConfigError(f"data.seed={self.seed} must be >= 0")
        if self.workers < 0:
            raise ConfigError(f"data.workers={self.workers} must be >= 0 (0: tokenize a "
                              "streaming source in two threads of the training process)")
        self._check_input_kinds()

    def _check_input_kinds(self) -> None:
        """No device, FIFO or socket as a corpus, its metadata or the tokenizer (read, each
        blocks or never ends); files inside a folder are checked as they are read."""
        from boost_jax.file_kind import check_input

        files = [("data.source", self.source)] if self.source != "stdlib" else []
        files += [(f"data.sources[{i}].path", s.path) for i, s in enumerate(self.sources or [])]
        if self.tokenizer not in ("byte", "bpe"):
            files.append(("data.tokenizer", self.tokenizer))
        for label, path in list(files):
            if path.endswith(".bin"):
                stem = os.path.splitext(path)[0]
                files += [(f"the metadata of {label}", stem + ".json")]
        for label, path in files:
            try:
                check_input(path, label)
            except UserError as e:
                raise ConfigError(str(e)) from None

    def _validate_sources(self) -> None:
        example = "e.g. data.sources=[{path: a.bin, weight: 0.7}, {path: b.bin, weight: 0.3}]"
        if not self.sources:
            raise ConfigError(f"data.sources is an empty list; name at least one .bin, {example}")
        if self.source != "stdlib":
            raise ConfigError(f"data.source={self.source!r} and data.sources are both set; keep "
                              "one (a single corpus is data.sources with one entry)")
        if self.tokenizer == "bpe":
            raise ConfigError("data.sources are pre-tokenized or streamed, so data.tokenizer=bpe "
                              "cannot be trained on them; set data.tokenizer to a tokenizer.json "
                              "(the one they were prepared with) or byte")
        from boost_jax.data.shards import is_streaming

        for i, s in enumerate(self.sources):
            if is_streaming(s.path) and len(self.sources) > 1:
                raise ConfigError(f"data.sources[{i}].path={s.path!r} streams parquet/arrow "
                                  "shards, which is possible for a single source only; prepare "
                                  "each source of a mixture with python -m boost_jax.data.prepare")
            if not s.path.endswith(".bin") and not is_streaming(s.path):
                raise ConfigError(f"data.sources[{i}].path={s.path!r} is neither a .bin nor "
                                  "parquet/arrow shards; prepare it with python -m "
                                  "boost_jax.data.prepare SOURCE OUT.bin")
            if not s.weight > 0:
                raise ConfigError(f"data.sources[{i}].weight={s.weight} must be > 0, {example}")
        total = sum(s.weight for s in self.sources)
        if not math.isfinite(total) or min(s.weight for s in self.sources) / total < 1e-12:
            weights = ", ".join(str(s.weight) for s in self.sources)
            raise ConfigError(f"data.sources' weights ({weights}) are out of scale (only their "
                              f"ratios matter); {example}")


@dataclass
class OptimConfig:
    name: Literal[OPTIMIZERS] = "adamw"  # optax's; boost_jax/step/optim.py
    schedule: Literal[SCHEDULES] = "cosine"  # each after a linear warmup
    lr: float = 3e-3
    min_lr_ratio: float = 0.1  # cosine, linear and wsd decay to lr * min_lr_ratio
    warmup_frac: float = 0.1
    decay_frac: float = 0.2  # wsd: the final fraction of the steps that decays
    weight_decay: float = 0.01
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    clip_norm: float = 0.5  # 0 disables clipping

    @property
    def state_per_param(self) -> int:
        """fp32 optimizer-state elements per weight element. Adafactor: its unfactored leaves'
        full second moment, an upper bound (a factored one keeps rows + cols)."""
        return {"adamw": 2, "lion": 1, "sgd": 0, "sgd-momentum": 1, "adafactor": 1}[self.name]

    def validate(self) -> None:
        _positive("optim.lr", self.lr)
        _positive("optim.eps", self.eps)
        for k, lo, hi, closed in (("warmup_frac", 0.0, 1.0, False), ("b1", 0.0, 1.0, False),
                                  ("decay_frac", 0.0, 1.0, True),
                                  ("b2", 0.0, 1.0, False), ("min_lr_ratio", 0.0, 1.0, True)):
            v = getattr(self, k)
            if not (lo <= v <= hi if closed else lo <= v < hi):
                raise ConfigError(f"optim.{k}={v} must be in [{lo:g}, {hi:g}{']' if closed else ')'}")
        if self.weight_decay < 0:
            raise ConfigError(f"optim.weight_decay={self.weight_decay} must be >= 0")
        if self.clip_norm < 0:
            raise ConfigError(f"optim.clip_norm={self.clip_norm} must be >= 0 (0 disables)")


@dataclass
class TrainConfig:
    steps: int = 300
    global_batch: int = 16  # sequences per optimizer step, all devices together
    micro_batches: int = 1  # gradient accumulation steps per optimizer step
    remat: Literal[REMAT_MODES] = "none"
    scan_layers: bool = True
    eval_every: int = 100
    eval_batches: int = 4
    log_every: int = 10
    seed: int = 0
    skip_nonfinite: bool = False
    # with skip_nonfinite: this many non-finite steps in a row stop the run as diverged (a state
    # whose every batch gives NaN would otherwise skip to the end)
    skip_nonfinite_limit: int = 50
    # Save and exit after this many steps of this invocation (job time limits); None: run on.
    stop_after: Optional[int] = None
    # [first, last]: a jax.profiler trace of those steps in out_dir/profile (train/profile.py)
    profile_steps: Optional[list[int]] = None

    def validate(self) -> None:
        for k in ("steps", "global_batch", "micro_batches", "eval_every", "eval_batches",
                  "log_every", "skip_nonfinite_limit"):
            _positive(f"train.{k}", getattr(self, k))
        if self.stop_after is not None:
            _positive("train.stop_after", self.stop_after)
        p = self.profile_steps
        if p is not None and (len(p) != 2 or not 1 <= p[0] <= p[1]):
            raise ConfigError(f"train.profile_steps={p} must be [first, last] with "
                              "1 <= first <= last, e.g. train.profile_steps=[3,5]")
        if p is not None and p[1] > self.steps:  # the trace would never start, or never stop
            raise ConfigError(f"train.profile_steps={p} reaches past the run's last step "
                              f"(train.steps={self.steps}), so no whole trace would be written; "
                              f"choose steps within 1..{self.steps}")
        if self.steps > STEP_MAX:
            raise ConfigError(f"train.steps={self.steps} is more steps than a run can count "
                              f"(int32); use at most {STEP_MAX}")
        if self.seed < 0:
            raise ConfigError(f"train.seed={self.seed} must be >= 0")
        if self.global_batch % self.micro_batches:
            raise ConfigError(
                f"train.global_batch={self.global_batch} is not divisible by "
                f"train.micro_batches={self.micro_batches}")


@dataclass
class CheckpointConfig:
    every: int = 100  # steps between saves; the last step is always saved
    keep: int = 3
    async_save: bool = True
    resume: bool = True  # resume from the latest checkpoint in out_dir if present
    # Keys (or whole sections, e.g. data) whose change on resume is accepted on purpose although
    # it redefines the model or the data stream (see boost_jax/checkpoints/run_config.py)
    accept_changes: list[str] = field(default_factory=list)

    def validate(self) -> None:
        _positive("checkpoint.every", self.every)
        _positive("checkpoint.keep", self.keep)
        sections = {f.name for f in dataclasses.fields(Config)}
        for key in self.accept_changes:
            if key not in sections and key not in all_keys(Config):
                raise unknown_key(Config, key, "checkpoint.accept_changes names an ")


@dataclass
class LoggingConfig:
    tensorboard: bool = True
    plot: bool = True
    # stderr: the header, live progress line, eval lines and the final 'done:' line; false
    # keeps only resume, stop and warning lines (metrics.jsonl is written either way)
    progress: bool = True
    # Weights & Biases (the wandb extra): the rows of metrics.jsonl, from process 0
    wandb: bool = False
    wandb_project: str = "boost_jax"
    wandb_entity: Optional[str] = None  # W&B user or team (default: the login's)
    wandb_mode: Literal["online", "offline"] = "online"  # offline: no network, `wandb sync` later


@dataclass
class DistributedConfig:
    # auto: initialise jax.distributed when SLURM / Open MPI / JAX_COORDINATOR_ADDRESS say so
    mode: Literal["auto", "off", "explicit"] = "auto"
    coordinator: Optional[str] = None  # host:port for mode=explicit
    num_processes: Optional[int] = None
    process_id: Optional[int] = None
    local_cpu_devices: Optional[int] = None  # CPU devices per process (development)
    # Seconds a process waits for the coordinator and its peers before giving up (JAX's default)
    init_timeout_s: int = 300

    def validate(self) -> None:
        if not 1 <= self.init_timeout_s <= MAX_TIMEOUT_S:  # JAX takes an int32 of seconds
            raise ConfigError(f"distributed.init_timeout_s={self.init_timeout_s} must be in "
                              f"1..{MAX_TIMEOUT_S} seconds")
        for k in ("num_processes", "local_cpu_devices"):
            if getattr(self, k) is not None:
                _positive(f"distributed.{k}", getattr(self, k))
        if self.process_id is not None and self.process_id < 0:
            raise ConfigError(f"distributed.process_id={self.process_id} must be >= 0")
        given = [k for k in ("num_processes", "process_id") if getattr(self, k) is not None]
        if given and self.mode != "explicit":  # auto reads the launcher's, off starts alone
            raise ConfigError(f"distributed.{given[0]} is read only with distributed.mode="
                              f"explicit (mode is {self.mode}); set that mode or drop it")


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    mesh: MeshConfig = field(default_factory=MeshConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    out_dir: str = "runs/demo"
    name: str = "run"

    def validate(self) -> "Config":
        for key, example in (("name", "demo"), ("out_dir", "runs/demo"), ("data.source", "stdlib"),
                             ("data.tokenizer", "byte"), ("mesh.topology", "cpu")):
            value = self
            for part in key.split("."):
                value = getattr(value, part)
            if not value.strip():  # out_dir= would train into the current directory
                raise ConfigError(f"{key} is empty; set it, e.g. {key}={example}")
        for f in dataclasses.fields(self):
            sub = getattr(self, f.name)
            if hasattr(sub, "validate"):
                sub.validate()
        m = self.model
        if m.vocab_size is None:
            m.vocab_size = resolve_vocab_size(self.data)
        if self.data.tokenizer == "byte" and m.vocab_size < 256:
            raise ConfigError(
                f"model.vocab_size={m.vocab_size} is smaller than the byte tokenizer's 256; "
                "set model.vocab_size=256")
        if self.data.seq_len > m.max_seq_len:
            fix = (f"set model.max_seq_len={self.data.seq_len} or a data.seq_len <= "
                   f"{m.max_seq_len}" if self.data.seq_len <= MAX_SEQ_LEN else
                   f"set a data.seq_len <= {m.max_seq_len} (model.max_seq_len can go up to "
                   f"{MAX_SEQ_LEN}, 2^20)")
            raise ConfigError(f"data.seq_len={self.data.seq_len} exceeds model.max_seq_len="
                              f"{m.max_seq_len}; {fix}")
        t = self.train
        held = t.eval_batches * t.global_batch * (self.data.seq_len + 1)
        if held > MAX_EVAL_TOKENS:  # the eval batches are held in memory (data/pipeline.py)
            raise ConfigError(
                f"train.eval_batches={t.eval_batches} holds {held:,} tokens of eval batches "
                f"(x train.global_batch x data.seq_len+1), above {MAX_EVAL_TOKENS:,}; "
                + _fewer_eval_tokens(held // t.eval_batches))
        # what needs the model and the mesh together (pipeline split, TP cut) is
        # sharding/parallel.check's, run by train.py, the planner and the launcher
        return self

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


# --------------------------------------------------------------------------- loading


STEP_MAX = 2**31 - 1  # the step counter of the training state is int32
VOCAB_MULTIPLE = 128  # an automatic vocabulary is padded to this (TP degrees, aligned matmuls)


def resolve_vocab_size(data: DataConfig) -> int:
    """model.vocab_size when it is not set: the tokenizer's vocabulary (byte: 256; bpe:
    data.bpe_vocab_size; a tokenizer.json: its size with EOS) rounded up to VOCAB_MULTIPLE.
    Known before any corpus is read, so the planner and a resumed run get the same size."""
    if data.tokenizer == "byte":
        n = 256
    elif data.tokenizer == "bpe":
        n = data.bpe_vocab_size
    else:
        from boost_jax.data.tokenizers import HFTokenizer

        n = HFTokenizer.from_file(data.tokenizer).vocab_size
    return -(-n // VOCAB_MULTIPLE) * VOCAB_MULTIPLE


def _fewer_eval_tokens(per_batch: int) -> str:
    """The fix for too many held eval tokens: fewer batches, or (one batch already too many)
    a smaller batch or sequence."""
    if per_batch <= MAX_EVAL_TOKENS:
        return f"use at most {MAX_EVAL_TOKENS // per_batch} eval batches"
    return "one batch alone holds too many: use a smaller train.global_batch or data.seq_len"


MAX_SEQ_LEN = 2**20  # a million positions: beyond it a table or a mask no longer fits a device
FP32_TINY = 1.1754944e-38  # float32's smallest normal number
MAX_VOCAB = 2**31 - 1  # token ids are int32
MAX_TIMEOUT_S = 2**31 - 1  # JAX's distributed client takes an int32 of seconds
MAX_EVAL_TOKENS = 2**30  # 4 GiB of int32 eval batches held in memory


def _positive(key: str, value) -> None:
    if value is None or value <= 0:
        raise ConfigError(f"{key}={value} must be > 0")


def load_config(path: Optional[str] = None, overrides: Optional[list[str]] = None,
                validate: bool = True) -> Config:
    """Load YAML at `path` (None: all defaults), apply `key=value` overrides, validate."""
    tree = read_yaml(path) if path is not None else {}
    for key, value in parse_overrides(overrides or [], Config):
        set_dotted(Config, tree, key, value)
    cfg = build(Config, tree)
    return cfg.validate() if validate else cfg


def config_from_dict(tree: dict, validate: bool = True) -> Config:
    """A Config from its to_dict() form (e.g. the copy a checkpoint keeps of its config)."""
    cfg = build(Config, tree)
    return cfg.validate() if validate else cfg


def config_to_yaml(cfg: Config) -> str:
    return yaml.safe_dump(cfg.to_dict(), sort_keys=False)

