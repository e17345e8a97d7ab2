"""Weights & Biases as one more sink of the metrics rows (logging.wandb=true; the wandb extra).

Each row is the exact dict written to metrics.jsonl, its `step` key the x-axis of every chart
(define_metric), so W&B holds one history row per metrics.jsonl row. The run id is kept in
out_dir/wandb_run_id: a resumed training run continues the same W&B run (offline, each
invocation writes out_dir/wandb/offline-run-*-ID; `wandb sync` of them fills one run). The
steps a resumed run re-does after its last checkpoint are logged again (metrics.jsonl drops the
killed run's rows; W&B cannot), with the same values when the resume is exact.
"""

from __future__ import annotations

import importlib.util
import os
import secrets
import shutil

from boost_jax.errors import UserError

RUN_ID_FILE = "wandb_run_id"


def require_wandb(cfg) -> None:
    """Fail before any work (before config.yaml is written) when a tracker that is on cannot be
    used: its package is missing or fails to import (a broken install raises anything)."""
    trackers = [("logging.wandb", "wandb", cfg.logging.wandb, "the extra (pip install -e "
                 "'.[wandb]')"), ("logging.tensorboard", "tensorboardX", cfg.logging.tensorboard,
                                  "tensorboardX")]
    for key, package, on, what in trackers:
        if not on:
            continue
        if importlib.util.find_spec(package) is None:
            raise UserError(f"{key}=true but the {package} package is not installed; install "
                            f"{what} or set {key}=false")
        try:
            importlib.import_module(package)
        except Exception as e:  # noqa: BLE001 - whatever its import raises
            why = (str(e).strip().splitlines() or [""])[0][:160]
            raise UserError(f"{key}=true but the {package} package fails to import "
                            f"({type(e).__name__}: {why}); reinstall {what} or set "
                            f"{key}=false") from None


def _run_id(out_dir: str, resumed: bool) -> tuple[str, bool]:
    """(the id saved in out_dir when resuming, else a new one; whether it is new)."""
    path = os.path.join(out_dir, RUN_ID_FILE)
    if resumed and os.path.isfile(path):
        with open(path) as f:
            saved = f.read().strip()
        if saved:
            return saved, False
    return secrets.token_hex(4), True  # W&B's form: 8 lowercase letters and digits


def _save_run_id(out_dir: str, run_id: str) -> None:
    """For the next resume; written once W&B has started."""
    with open(os.path.join(out_dir, RUN_ID_FILE), "w") as f:
        f.write(run_id + "\n")


class WandbSink:
    """One W&B run fed the metrics rows; process 0 only (MetricsLogger holds it)."""

    def __init__(self, cfg, out_dir: str, resumed: bool):
        import wandb

        lg = cfg.logging
        self.id, new = _run_id(out_dir, resumed)
        settings = wandb.Settings(console="off", quiet=True, silent=True)
        folder, had_folder = os.path.join(out_dir, "wandb"), os.path.lexists(
            os.path.join(out_dir, "wandb"))
        try:
            self._run = wandb.init(project=lg.wandb_project, entity=lg.wandb_entity,
                                   name=cfg.name, id=self.id, resume="allow", mode=lg.wandb_mode,
                                   dir=out_dir, config=cfg.to_dict(), settings=settings)
        except wandb.errors.Error as e:  # no login, no network, no such entity
            if not had_folder:  # what W&B began to write: an input mistake leaves nothing
                shutil.rmtree(folder, ignore_errors=True)
            reason = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise UserError(f"logging.wandb=true but W&B did not start ({reason}); run "
                            "wandb login, or set logging.wandb_mode=offline (no network; "
                            "wandb sync later)") from None
        if new:
            _save_run_id(out_dir, self.id)
        self._run.define_metric("step")
        self._run.define_metric("*", step_metric="step")

    def log(self, row: dict) -> None:
        self._run.log(dict(row))

    def close(self, failed: bool = False) -> None:
        run, self._run = self._run, None
        if run is not None:
            run.finish(exit_code=1 if failed else 0)


def open_sink(cfg, out_dir: str, resumed: bool):
    """A WandbSink when logging.wandb is on, else None."""
    return WandbSink(cfg, out_dir, resumed) if cfg.logging.wandb else None
