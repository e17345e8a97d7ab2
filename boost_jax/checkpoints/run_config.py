"""What a resumed run may change, and the record of every config a run used.

Each checkpoint carries the config it was trained with. On resume the new config is compared
with it:

* keys that define the model (``model.*``; ``train.seed``, the initial weights;
  ``train.scan_layers``, the layout of the saved parameters) or the data stream (``data.*``;
  ``train.global_batch``, which with the saved iterator position says where the stream
  continues) may not change silently: the run stops with one line listing the changes. A change
  that keeps the checkpoint loadable (a new corpus, another seed) can be made on purpose by
  naming the keys, or whole sections, in ``checkpoint.accept_changes``; a change of the model's
  shapes cannot (the saved arrays have the old ones).
* everything else (steps, eval and logging cadence, checkpoint cadence, parallel layout and
  mesh, optimizer settings) is accepted and reported in the resume line, except
  ``optim.name`` (another optimizer's state does not fit the saved one).

``out_dir/config.yaml`` is the config of the latest invocation and ``out_dir/configs/`` keeps
every distinct config the run has used, numbered, with the step it took over from.
"""

from __future__ import annotations

import os
import re
import socket
import time
from typing import Any, Optional

import yaml

from boost_jax.config import Config, config_to_yaml
from boost_jax.checkpoints.seal import ITEMS, SEAL_FILE
from boost_jax.errors import UserError
from boost_jax.names import CHECKPOINTS_DIR, CONFIG_FILE, LOCK_FILE, TOKENIZER_DIR, UNUSABLE_DIR

DEFINING = ("model", "data", "train.global_batch", "train.seed", "train.scan_layers")
# under DEFINING but the same math computed another way: a resume may change it freely
# (data.workers: how many processes tokenize a stream, which stays the same token for token)
SAME_MATH = ("model.attention", "data.workers")
# about this invocation only, never compared
PER_INVOCATION = ("out_dir", "checkpoint.resume", "checkpoint.accept_changes")
SHAPE_KEYS = ("arch", "vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff",
              "rank", "lax_gate", "tie_embeddings")
# not in a checkpoint's model signature (older steps lack them), but they too change the arrays
# the state holds: the family's biases and norms, bf16 weights' fp32 master copy
STATE_KEYS = ("family", "param_dtype")
HISTORY_DIR = "configs"
USED_FROM = "# used from step"  # the first line of a history entry `record` writes
# what a run writes into out_dir (train/run_log.py, train/metrics.py, store.py, data/tokenizers.py)
OUTPUTS = (CONFIG_FILE, HISTORY_DIR, "metrics.jsonl", "summary.json", "loss.png", "tb",
           CHECKPOINTS_DIR, "tokenizer", "run.log")
FOLDERS = (HISTORY_DIR, "tb", CHECKPOINTS_DIR, TOKENIZER_DIR)  # the other OUTPUTS are files
HISTORY_ENTRY = re.compile(r"^\d{3}-(earlier|edited|step\d+)\.yaml$")  # what `record` names them


def model_signature(cfg: Config) -> dict:
    """The model settings that fix the checkpoint's array shapes."""
    return {k: getattr(cfg.model, k) for k in SHAPE_KEYS}


def _under(key: str, names) -> bool:
    return any(key == n or key.startswith(n + ".") for n in names)


def flatten(tree: Any, prefix: str = "") -> dict:
    if not isinstance(tree, dict):
        return {prefix[:-1]: tree}
    out = {}
    for k, v in tree.items():
        out.update(flatten(v, f"{prefix}{k}."))
    return out


def changes(saved: dict, cfg: Config) -> list[tuple[str, Any, Any]]:
    """(key, saved, new) for every compared key both configs have and that differs."""
    old, new = flatten(saved), flatten(cfg.to_dict())
    return [(k, old[k], new[k]) for k in new
            if k in old and not _under(k, PER_INVOCATION) and _norm(old[k]) != _norm(new[k])]


def _norm(v):
    return list(v) if isinstance(v, tuple) else v


def describe(diff) -> str:
    return ", ".join(f"{k} {old!r} -> {new!r}" for k, old, new in diff)


def check_resume(saved: Optional[dict], cfg: Config, step: int, where: str):
    """Changes from the config that trained checkpoint `step` (None: not recorded); raises a
    UserError for a change that redefines the model or the data stream and is not accepted."""
    if not saved:
        return []
    _check_optimizer(saved, cfg, step, where)
    diff = changes(saved, cfg)
    # keys whose change gives the state other arrays: no accept_changes can restore it
    arrays = [f"model.{m}" for m in (*SHAPE_KEYS, *STATE_KEYS)] + (
        ["model.max_seq_len"] if cfg.model.learned_positions else [])  # gpt2's position table
    other = [c for c in diff if _under(c[0], arrays)]
    if other:
        raise UserError(f"checkpoint step {step} in {where} has a different model "
                        f"({describe(other)}); its arrays cannot take the new model: use a "
                        "new out_dir, or set those keys back to the saved values to resume")
    refused = [c for c in diff if _under(c[0], DEFINING) and not _under(c[0], SAME_MATH)
               and not _under(c[0], cfg.checkpoint.accept_changes)]
    if not refused:
        return diff
    keys = ",".join(k for k, _, _ in refused)
    raise UserError(f"checkpoint step {step} in {where} was trained with other settings that "
                    f"define the model or the data stream ({describe(refused)}); resuming would "
                    "mix them silently: set them back, use a new out_dir, or accept the change "
                    f"on purpose with checkpoint.accept_changes=[{keys}]")


def _check_optimizer(saved: dict, cfg: Config, step: int, where: str) -> None:
    """Another optim.name has other state arrays, and so has Adafactor between a zero and a
    non-zero weight decay: the checkpoint cannot be restored into it (configs from before
    optim.name were all adamw)."""
    flat = flatten(saved)
    was = flat.get("optim.name", "adamw")
    if was != cfg.optim.name:
        raise UserError(f"checkpoint step {step} in {where} holds the optimizer state of "
                        f"optim.name={was}, not {cfg.optim.name}: set optim.name={was} to "
                        "resume, or use a new out_dir")
    wd = flat.get("optim.weight_decay", cfg.optim.weight_decay)
    if was == "adafactor" and bool(wd) != bool(cfg.optim.weight_decay):
        # optax's adafactor has a decay stage only for a non-zero rate: another state tree
        raise UserError(f"checkpoint step {step} in {where} holds Adafactor's state "
                        f"{'with' if wd else 'without'} its weight-decay stage, which "
                        f"optim.weight_decay {wd} -> {cfg.optim.weight_decay} would "
                        f"{'drop' if wd else 'add'}: set it back to "
                        f"{'a non-zero value' if wd else '0'} to resume, or use a new out_dir")


# what decides each leaf's stored shape: its zero padding and its pipeline stacking
LAYOUT_KEYS = ("parallel.plan", "parallel.tp_mode", "parallel.tp_axes", "parallel.pp_stages",
               "parallel.pp_virtual")


# meta["adafactor_statistics"] of a step whose Adafactor statistics are stored as the unpadded
# weights give them (step/optim.py: layout_free_statistics). Older steps hold optax's counts
# (no value) or, written by one development commit, OPTAX_ORDER: zero padding and real means
# but optax's order of rows and columns.
LAYOUT_FREE = "logical"
OPTAX_ORDER = "layout-free"


def in_optax_counts(saved: dict, cfg: Config) -> bool:
    """Whether a checkpoint's metadata `saved` holds Adafactor statistics in optax's counts
    (written before they were stored layout-free), which a resume converts."""
    return cfg.optim.name == "adafactor" and saved.get("adafactor_statistics") is None


def check_adafactor_layout(saved: dict, meta: dict, cfg: Config, step: int, where: str,
                           transposed: tuple = ()) -> None:
    """An older step's Adafactor state (in optax's counts, with its epsilon in the layout's zero
    padding) restores only under the layout that saved it: another mesh, plan, TP or pipeline
    split drops or moves that padding, which its checksums then refuse (and a fall-back would
    move newer steps aside). Nor where this version stores a weight's row and column
    statistics the other way round (`transposed`: their names; step/optim.py). `saved`,
    `meta`: the checkpoint's metadata and this run's."""
    if cfg.optim.name != "adafactor" or saved.get("adafactor_statistics") == LAYOUT_FREE:
        return
    if transposed:
        raise UserError(f"checkpoint step {step} in {where} holds optim.name=adafactor state "
                        f"saved by an older boost_jax, which kept the row and column "
                        f"statistics of {transposed[0]} (padded by this layout) the other way "
                        "round: resume it with the boost_jax that saved it, or use a new "
                        "out_dir")
    if not saved.get("config"):
        return
    was, now = flatten(saved["config"]), flatten(cfg.to_dict())
    diff = [(k, was[k], now.get(k)) for k in LAYOUT_KEYS if k in was and was[k] != now.get(k)]
    if saved.get("mesh") is not None and list(saved["mesh"]) != list(meta["mesh"]):
        diff.append(("the device mesh", saved["mesh"], meta["mesh"]))
    if diff:
        raise UserError(f"checkpoint step {step} in {where} holds optim.name=adafactor state "
                        f"saved by an older boost_jax under another layout ({describe(diff)}), "
                        "which restores only under the layout that saved it: set those back "
                        "to resume (its next checkpoint restores under any layout), or use a "
                        "new out_dir")


def data_position(state: Any, saved: dict) -> Any:
    """The saved data position as this version reads it: an older step's `{"next_index": k}`
    (batches of the run's train.global_batch then) becomes the windows it had taken, so an
    accepted global_batch change continues where the stream stood (data/pipeline.py)."""
    batch = flatten((saved or {}).get("config") or {}).get("train.global_batch")
    if isinstance(state, dict) and set(state) == {"next_index"} and isinstance(batch, int):
        return {"windows": int(state["next_index"]) * batch}
    return state


def load_saved(path: str) -> Optional[dict]:
    """A config.yaml written by an earlier run (None if absent or unreadable)."""
    from boost_jax.config_read import CONFIG_LIMIT
    from boost_jax.file_kind import read_regular

    try:  # a regular file of sane size only: a FIFO or /dev/zero here must not hang a resume
        tree = yaml.safe_load(read_regular(path, "config file", CONFIG_LIMIT).decode("utf-8"))
    except (UserError, ValueError, yaml.YAMLError, RecursionError):  # ValueError: not UTF-8
        return None
    return tree if isinstance(tree, dict) else None


def _comparable(tree: dict) -> dict:
    return {k: v for k, v in flatten(tree).items() if not _under(k, PER_INVOCATION)}


def record(out_dir: str, cfg: Config, start: int) -> Optional[str]:
    """Write config.yaml and, if this config differs from the newest in configs/, a new numbered
    entry there (returned). A config.yaml from before configs/ existed is kept first, one edited
    by hand since the run wrote it as NNN-edited.yaml."""
    hist = os.path.join(out_dir, HISTORY_DIR)
    os.makedirs(hist, exist_ok=True)
    entries = sorted(n for n in os.listdir(hist) if n.endswith(".yaml") and n[:3].isdigit())
    current = os.path.join(out_dir, CONFIG_FILE)
    text = config_to_yaml(cfg)
    if not entries and os.path.exists(current):
        os.replace(current, os.path.join(hist, "000-earlier.yaml"))
        entries = ["000-earlier.yaml"]
    elif entries and _edited(current, os.path.join(hist, entries[-1]), text):
        name = f"{int(entries[-1][:3]) + 1:03d}-edited.yaml"  # a hand edit is kept, not lost
        os.replace(current, os.path.join(hist, name))
        entries.append(name)
    new_entry = None
    last = load_saved(os.path.join(hist, entries[-1])) if entries else None
    if last is None or _comparable(last) != _comparable(yaml.safe_load(text)):
        n = int(entries[-1][:3]) + 1 if entries else 0
        new_entry = os.path.join(hist, f"{n:03d}-step{start}.yaml")
        stamp = time.strftime("%Y-%m-%d %H:%M:%S")
        _write(new_entry, f"{USED_FROM} {start}, started {stamp} on {socket.gethostname()}"
                          f"\n{text}")
    _write(current, text)
    return new_entry


def _edited(current: str, newest: str, text: str) -> bool:
    """config.yaml holds neither what the run last recorded nor what it is about to write
    (someone edited it)."""
    try:
        with open(current, encoding="utf-8") as f:
            now = f.read()
        with open(newest, encoding="utf-8") as f:
            recorded = f.read()
    except (OSError, UnicodeDecodeError):
        return False
    if recorded.startswith(USED_FROM):
        recorded = recorded.split("\n", 1)[1] if "\n" in recorded else ""
    return now not in (recorded, text)


def _write(path: str, text: str) -> None:
    from boost_jax.safe_write import write_text

    write_text(path, text, force=True)


def refuse_pattern(out_dir: str) -> None:
    """orbax merges a saved step's per-process files with a glob under the step's path: a
    bracket pair or a backslash in it makes that glob match nothing, and the step, reported
    saved, can never be read back (measured; `*` and `?` alone match themselves and work)."""
    bad = "a backslash" if "\\" in out_dir else \
        f"[{m.group(1)}]" if (m := re.search(r"\[(.*)\]", out_dir)) else None
    if bad:
        raise UserError(f"out_dir {out_dir!r} holds {bad}, which the checkpoint library reads "
                        "as a file pattern: its saved steps could not be read back; choose an "
                        "out_dir without brackets around text or backslashes")


def check_inputs(cfg: Config, out_dir: str) -> None:
    """safe_write's rule for train.py's inputs: no output of the run may be, hold or lie inside
    data.source(s), their metadata and tokenizer files, data.tokenizer or model.init_from (the
    same on every process: paths only)."""
    from boost_jax.safe_write import refuse_inputs, refuse_special

    refuse_special(out_dir, f"out_dir {out_dir!r}", "choose another out_dir=...", folder=True)
    refuse_pattern(out_dir)
    inputs = run_inputs(cfg)
    for name in (*OUTPUTS, LOCK_FILE):
        target = os.path.join(out_dir, name)
        refuse_inputs(target, inputs, f"the run's {name} {target!r}",
                      "choose another out_dir=...")
    start = cfg.model.init_from
    # read only by a run that starts (a resume, or a checkpoint's copy of the config, may
    # outlive the folder)
    if start is not None and not os.path.isdir(start) and not _has_steps(out_dir):
        raise UserError(f"model.init_from {start!r} does not exist; point it at a folder "
                        "written by python -m boost_jax.export or a Hugging Face model folder")


def run_inputs(cfg) -> dict:
    """{label: path} of the files a run of `cfg` reads: data.source(s), their metadata and
    tokenizer files, data.tokenizer and model.init_from (what no writer may replace)."""
    inputs = {"model.init_from": cfg.model.init_from}
    if cfg.data.tokenizer not in ("byte", "bpe"):
        inputs["data.tokenizer"] = cfg.data.tokenizer
    sources = [("data.source", cfg.data.source)] if cfg.data.source != "stdlib" else []
    sources += [(f"data.sources[{i}]", s.path) for i, s in enumerate(cfg.data.sources or [])]
    for label, path in sources:
        inputs.update(_source_files(label, path))
    return inputs


def _source_files(label: str, path: Optional[str]) -> dict:
    """A corpus and, for a prepared .bin, the metadata and BPE files next to it."""
    if not path:
        return {}
    files = {label: path}
    stem = os.path.splitext(path)[0]
    if path.endswith(".bin"):
        files[f"the metadata of {label}"] = stem + ".json"
        files[f"the tokenizer of {label}"] = stem + ".tokenizer.json"
    return files


def _listing(folder: str) -> list[str]:
    try:
        return os.listdir(folder)
    except (FileNotFoundError, NotADirectoryError):
        return []


def holds_run(out_dir: str) -> bool:
    """A run of ours was here: its lock, a numbered entry of its config history, or a step of
    its checkpoints (a bare `configs/` or `checkpoints/` folder is anybody's)."""
    from boost_jax.train.run_lock import is_run_lock

    if is_run_lock(os.path.join(out_dir, LOCK_FILE)):
        return True
    if any(HISTORY_ENTRY.match(n) for n in _listing(os.path.join(out_dir, HISTORY_DIR))):
        return True
    return _has_steps(out_dir)


def _has_steps(out_dir: str) -> bool:
    """out_dir holds a checkpoint step our Checkpointer wrote."""
    ckpt = os.path.join(out_dir, CHECKPOINTS_DIR)
    return any(n.isdigit() and _our_step(os.path.join(ckpt, n)) for n in _listing(ckpt))


def _our_step(step_dir: str) -> bool:
    """A step our Checkpointer wrote: sealed, or (saved before seals) holding all its items."""
    return os.path.exists(os.path.join(step_dir, SEAL_FILE)) or \
        all(os.path.isdir(os.path.join(step_dir, item)) for item in ITEMS)


# written only with profile_steps / logging.wandb: checked for their kind, never a clash
SOMETIMES = {"profile": True, "wandb": True, "wandb_run_id": False,  # name: is a folder
             UNUSABLE_DIR: True}  # where a resume moves steps that failed their checks


def _refuse_odd_entries(out_dir: str) -> None:
    """What the run writes in out_dir must be a regular file or a folder as the run keeps it:
    never a device, FIFO or socket, nor a link a file would be written through."""
    from boost_jax.file_kind import special
    from boost_jax.safe_write import Refused, refuse_special

    names = {**{n: n in FOLDERS for n in (*OUTPUTS, LOCK_FILE)}, **SOMETIMES}
    for name, folder in names.items():
        path = os.path.join(out_dir, name)
        if special(path, folder=True):  # a device, FIFO or socket; a file for a folder below
            refuse_special(path, f"the run's {name} {path!r}", "move it away or choose another "
                           "out_dir=...", folder)
        if not folder and os.path.islink(path):  # appended or written through: not ours
            raise Refused(f"the run's {name} {path!r} is a link (to "
                          f"{os.path.realpath(path)!r}); a run writes its files itself: remove "
                          "the link or choose another out_dir=...")
        if os.path.lexists(path) and os.path.isdir(path) != folder:
            raise Refused(f"out_dir {out_dir!r} holds {name} as a {'file' if folder else 'folder'}"
                          f" where a run keeps a {'folder' if folder else 'file'}; move it away "
                          "or choose another out_dir=...")


def check_out_dir(out_dir: str, force: bool, config: Optional[str] = None) -> None:
    """safe_write's rule for train.py's out_dir: a folder that holds no run of ours but files a
    run would replace is refused without --force, and the run's outputs never replace its
    --config there (in a run of ours the config.yaml it reads is kept in its history)."""
    from boost_jax.safe_write import Refused, refuse_inputs

    _refuse_odd_entries(out_dir)
    lock = os.path.join(out_dir, LOCK_FILE)
    refuse_inputs(lock, {"--config": config}, f"the run's lock {lock!r}",
                  "keep the config elsewhere")
    if holds_run(out_dir):
        return
    for name in OUTPUTS:
        target = os.path.join(out_dir, name)
        refuse_inputs(target, {"--config": config}, f"the run's {name} {target!r}",
                      "choose another out_dir=... or keep the config elsewhere")
    present = set(_listing(out_dir))
    clash = sorted(present & set(OUTPUTS))
    if clash and not force:
        raise Refused(f"out_dir {out_dir!r} holds no boost_jax run but files the run would "
                      f"replace ({', '.join(clash)}); choose another out_dir=..., or pass "
                      "--force to train.py to let the run replace them")
