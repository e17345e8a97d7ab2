"""Open a training run for use: its config, tokenizer and the weights of one checkpoint.

A checkpoint stores the working weights in the layout of the plan that trained it: sharded over
its mesh, a dim zero-padded at its end where it did not divide (boost_jax/sharding/layout.py).
Only `state.params` is read (orbax partial restore: the optimizer state stays on disk), straight
into the logical (unpadded) shapes on one device: orbax reassembles the shards and
`strict=False` drops the padding. So a checkpoint saved under any plan, TP layout, mesh or
process count loads on whatever device is present. Every file of the step is checked against
the CRC-32 recorded when it was written (checkpoints/seal.py) and the restored weights against the
checksums saved with them (checkpoints/store.py), so any changed byte is refused, not sampled.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Optional

from boost_jax.config import Config, config_from_dict
from boost_jax.data.tokenizers import ByteTokenizer, HFTokenizer, Tokenizer, tokenizer_file
from boost_jax.errors import UserError
from boost_jax.names import CHECKPOINTS_DIR



@dataclass
class Run:
    path: str
    cfg: Config  # the config that trained the checkpoint
    step: int
    params: Any  # logical (unpadded) weights on one device, model.param_dtype
    tokenizer: Tokenizer
    inputs: dict = field(default_factory=dict)  # the step's input identities (meta)

    def check_input(self, key: str, path: str, fix: str) -> None:
        """A one-line error if input file `key` (data/fingerprint.py) at `path` is not the one
        the step was trained on (a step from before fingerprints records none)."""
        from boost_jax.data.fingerprint import identity

        want = self.inputs.get(key)
        if want is not None and identity(key, path) != want:
            raise UserError(f"checkpoint step {self.step} of run {self.path!r} was trained on "
                            f"{key} {path!r} as it was then, and that file has changed since "
                            f"(or another file has its name here); {fix}")


def quiet_libraries() -> None:
    """absl (orbax) warnings about read-only managers and the like are noise on a CLI."""
    from absl import logging as absl_logging  # absl comes with orbax

    absl_logging.set_verbosity(absl_logging.ERROR)


def _manager(ckpt_dir: str):
    import orbax.checkpoint as ocp

    handlers = {"state": ocp.PyTreeCheckpointHandler(), "meta": ocp.JsonCheckpointHandler(),
                "data": ocp.JsonCheckpointHandler()}
    return ocp.CheckpointManager(ckpt_dir, item_handlers=handlers,
                                 options=ocp.CheckpointManagerOptions(read_only=True))


def _holds_files(path: str) -> bool:
    try:
        return bool(os.listdir(path))
    except OSError:  # a file, or unreadable
        return False


def checkpoint_steps(run_dir: str) -> tuple[str, list[int]]:
    """(checkpoint directory, its finalised steps); a one-line error if there are none."""
    if not os.path.isdir(run_dir):
        raise UserError(f"no run at {run_dir!r} (no such directory); pass --run the out_dir of "
                        "a training run, e.g. --run runs/demo")
    ckpt_dir = os.path.join(os.path.abspath(run_dir), CHECKPOINTS_DIR)
    # an empty step folder (a save that never began writing) is no step
    steps = sorted(int(n) for n in os.listdir(ckpt_dir)
                   if n.isdigit() and _holds_files(os.path.join(ckpt_dir, n))) \
        if os.path.isdir(ckpt_dir) else []
    if not steps:
        raise UserError(f"run {run_dir!r} has no checkpoint (nothing in {ckpt_dir}); train it "
                        f"first (python train.py ... out_dir={run_dir}) or pass another --run")
    return ckpt_dir, steps


def pick_step(run_dir: str, steps: list[int], step: Optional[int]) -> int:
    if step is None:
        return steps[-1]
    if step not in steps:
        raise UserError(f"run {run_dir!r} has no checkpoint step {step} (it has steps "
                        f"{steps}); pass one of them, or leave out --step for the latest")
    return step


def _saved_config(ckpt_dir: str, step: int, meta) -> Config:
    """The config the step was saved with (its meta item). Never config.yaml instead: that may
    describe other shapes, which orbax would read the saved arrays cut or padded into."""
    if not isinstance(meta, dict) or not isinstance(meta.get("config"), dict):
        raise UserError(f"checkpoint step {step} in {ckpt_dir} lacks its meta item (the config "
                        "and checksums it was saved with), so it is incomplete; pass another "
                        "--step")
    return config_from_dict(meta["config"])


def restore_params(mngr, step: int, cfg: Config, device=None, meta: Optional[dict] = None):
    """The logical weights of checkpoint `step`, on `device` (default: the first device)."""
    import jax
    import orbax.checkpoint as ocp

    from boost_jax.checkpoints import restage
    from boost_jax.checkpoints.store import checksum_mismatch, state_checksums
    from boost_jax.step.build import abstract_params

    sharding = jax.sharding.SingleDeviceSharding(device or jax.devices()[0])
    _, logical = abstract_params(cfg.model, cfg.train)
    dtype = cfg.model.param_dtype
    want = {"params": jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, dtype, sharding=sharding), logical)}
    stages = (cfg.parallel.pp_stages, cfg.parallel.pp_virtual)
    try:
        item = want
        if stages[0] > 1:  # end weights stacked over stages (boost_jax/checkpoints/restage.py)
            saved = restage.saved_shapes(os.path.join(str(mngr.directory), str(step)))
            item = restage.restore_target(want, saved, stages, (1, 1))
        args = jax.tree.map(lambda x: ocp.ArrayRestoreArgs(
            sharding=sharding, global_shape=x.shape, dtype=x.dtype, strict=False), item)
        restore = ocp.args.PyTreeRestore(item, restore_args=args, partial_restore=True)
        state = mngr.restore(step, args=ocp.args.Composite(state=restore))["state"]
        state = restage.convert(state, want, stages, (1, 1))
    except Exception as e:  # noqa: BLE001 - orbax/tensorstore raise many types
        from boost_jax.checkpoints.store import error_reason

        raise UserError(f"checkpoint step {step} in {mngr.directory} cannot be read "
                        f"({error_reason(e)}); pass another --step") from None
    bad = checksum_mismatch(state_checksums(state)[0], meta or {})
    if bad:
        raise UserError(f"checkpoint step {step} in {mngr.directory} is corrupted ({bad}); pass "
                        "another --step")
    return state["params"]


def check_step_files(ckpt_dir: str, step: int, meta: dict) -> None:
    """A one-line error if any file of the step differs from its seal (checkpoints/seal.py); a
    step saved before seals were written has none and is read unchecked."""
    from boost_jax.checkpoints.seal import check_seal, sealed

    step_dir = os.path.join(ckpt_dir, str(step))
    if not sealed(step_dir, meta):
        return
    bad = check_seal(step_dir)
    if bad:
        raise UserError(f"checkpoint step {step} in {ckpt_dir} is corrupted ({bad}); pass "
                        "another --step")


def run_tokenizer(cfg: Config, run_dir: str) -> Tokenizer:
    """The tokenizer the run trained with (a BPE trained by the run lives in its out_dir)."""
    kind, path = cfg.data.tokenizer, tokenizer_file(cfg.data.tokenizer, run_dir)
    if path is None:
        return ByteTokenizer()
    if not os.path.isfile(path):
        raise UserError(f"run {run_dir!r} was trained with the tokenizer {path!r}, which no "
                        "longer exists; put it back (the ids must match the model's)")
    tok = HFTokenizer.from_file(path)
    # a BPE the run trained has at most data.bpe_vocab_size ids, and no tokenizer more than
    # the model embeds: more is another tokenizer
    limits = [n for n in (cfg.model.vocab_size, cfg.data.bpe_vocab_size if kind == "bpe"
                          else None) if n]
    most = min(limits, default=tok.vocab_size)
    if tok.vocab_size > most:
        raise UserError(f"the tokenizer {path!r} has {tok.vocab_size} ids but run {run_dir!r} "
                        f"was trained with at most {most}: it is not the one the run trained "
                        "with; put that one back (the ids must match the model's)")
    return tok


def open_run(run_dir: str, step: Optional[int] = None, device=None) -> Run:
    """Config, tokenizer and logical weights of checkpoint `step` (default: the latest)."""
    import orbax.checkpoint as ocp

    ckpt_dir, steps = checkpoint_steps(run_dir)
    step = pick_step(run_dir, steps, step)
    mngr = _manager(ckpt_dir)
    try:
        meta = mngr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
    except Exception:  # noqa: BLE001
        meta = {}
    check_step_files(ckpt_dir, step, meta if isinstance(meta, dict) else {})  # corrupted first
    cfg = _saved_config(ckpt_dir, step, meta)
    tokenizer = run_tokenizer(cfg, run_dir)
    inputs = meta.get("inputs")
    run = Run(os.path.abspath(run_dir), cfg, step, None, tokenizer,
              inputs if isinstance(inputs, dict) else {})
    if cfg.data.tokenizer != "byte":
        run.check_input("data.tokenizer", tokenizer_file(cfg.data.tokenizer, run_dir),
                        "its ids would not match the model's: put back the tokenizer it was "
                        "trained with")
    run.params = restore_params(mngr, step, cfg, device, meta)
    mngr.close()
    return run
