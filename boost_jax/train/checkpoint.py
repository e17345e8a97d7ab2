"""Checkpoints with orbax: train state, data-iterator state and run metadata, saved together.

Restoring into abstract arrays that carry shardings reshards on the fly, so a checkpoint written
under one plan or mesh shape restores under another.
"""

from __future__ import annotations

import os
from typing import Any, Optional

import orbax.checkpoint as ocp

from boost_jax.config import CheckpointConfig
from boost_jax.errors import UserError


class Checkpointer:
    def __init__(self, directory: str, cfg: CheckpointConfig):
        self.directory = os.path.abspath(directory)
        options = ocp.CheckpointManagerOptions(
            max_to_keep=cfg.keep, enable_async_checkpointing=cfg.async_save, create=True)
        try:
            self.mngr = ocp.CheckpointManager(self.directory, options=options,
                                              item_names=("state", "data", "meta"))
        except PermissionError as e:
            raise UserError(f"cannot create checkpoint directory {self.directory!r} ({e.strerror}); "
                            "choose a writable out_dir") from None

    def latest_step(self) -> Optional[int]:
        return self.mngr.latest_step()

    def all_steps(self) -> list[int]:
        return list(self.mngr.all_steps())

    def save(self, step: int, state: Any, data_state: dict, meta: dict, force: bool = False) -> bool:
        return self.mngr.save(step, args=ocp.args.Composite(
            state=ocp.args.StandardSave(state), data=ocp.args.JsonSave(data_state),
            meta=ocp.args.JsonSave(meta)), force=force)

    def restore(self, step: int, abstract_state: Any):
        out = self.mngr.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract_state), data=ocp.args.JsonRestore(),
            meta=ocp.args.JsonRestore()))
        return out["state"], out["data"], out["meta"]

    def restore_meta(self, step: int) -> dict:
        return self.mngr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]

    def wait(self) -> None:
        self.mngr.wait_until_finished()

    def close(self) -> None:
        self.mngr.wait_until_finished()
        self.mngr.close()
