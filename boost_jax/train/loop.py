"""The training run: data, state (fresh or resumed), the step loop, eval, checkpoints, outputs.

One process or many (jax.distributed, see boost_jax/train/distributed.py): every process runs
this same loop on its own share of each global batch; checkpoints are written and restored by
all processes together; metrics, TensorBoard, config.yaml, summary.json and log lines come from
process 0 only. Decisions that change the control flow (stop on a signal, stop on a non-finite
loss, fall back to an older checkpoint) are taken identically on every process so no process is
left waiting in a collective.

Crash safety: a run killed at any moment resumes from the last finalised checkpoint with the
data iterator at the same position, so the losses continue exactly as an uninterrupted run's
(metrics.jsonl rows past the restored step are dropped on resume). See
boost_jax/checkpoints/store.py for incomplete, corrupted and failed saves.
"""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Optional

import jax
import numpy as np

from boost_jax.backends.cpu import dev_compile_options
from boost_jax.checkpoints import run_config
from boost_jax.checkpoints.store import CheckpointSaveError, Checkpointer
from boost_jax.cli import flop_rate, json_dumps
from boost_jax.config import Config
from boost_jax.data.fingerprint import check_unchanged, identities
from boost_jax.errors import UserError, counted, out_of_memory
from boost_jax.mesh import get_topology, mesh_from_config
from boost_jax.names import CHECKPOINTS_DIR, CONFIG_FILE, KEPT_SECONDARY, TOKENIZER_DIR
from boost_jax.safe_write import write_text
from boost_jax.train.metrics import (MetricsLogger, Throughput, format_eta, plot_losses,
                                     summarize)
from boost_jax.train.run_lock import fresh_dirs, hold_out_dir
from boost_jax.train.profile import StepProfiler
from boost_jax.train.run_log import RunLog
from boost_jax.train.stop_signal import StopSignal, agree_stop
from boost_jax.sharding.placement import process_rows
from boost_jax.step.build import build_step
from boost_jax.train.wandb_sink import open_sink, require_wandb


class NonFiniteError(UserError):
    pass


class OutputWriteError(UserError):
    """A run output (metrics, TensorBoard, summary) could not be written: disk full, quota."""


def _check_writable(out_dir: str) -> None:
    """out_dir (and its checkpoints/, which a resume writes into) can take a new file: found at
    the start, not at the first save. The probe has a name no other file can have."""
    if os.path.islink(out_dir) and not os.path.exists(out_dir):
        raise UserError(f"out_dir {out_dir!r} is a link to {os.readlink(out_dir)!r}, which does "
                        "not exist; create that folder or choose another out_dir=...")
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise UserError(f"out_dir {out_dir!r} is a file, not a folder; choose another "
                        "out_dir=...")
    folder = out_dir
    try:
        os.makedirs(out_dir, exist_ok=True)
        for folder in (out_dir, os.path.join(out_dir, CHECKPOINTS_DIR)):
            if os.path.isdir(folder):
                fd, probe = tempfile.mkstemp(prefix=".write_test.", dir=folder)
                os.close(fd)
                os.remove(probe)
    except OSError as e:
        fix = ("free space on it or choose another out_dir=..." if e.errno in (
            errno.ENOSPC, errno.EDQUOT) else "choose another out_dir=...")
        raise UserError(f"{'out_dir' if folder == out_dir else 'the checkpoint folder'} "
                        f"{folder!r} is not writable ({e.strerror}); {fix}") from None


def _printer(enabled: bool, prefix: str = ""):
    """Lines that matter whatever logging.progress says (resume, stop, warnings): process 0."""

    def say(msg: str) -> None:
        if enabled:
            print(f"{prefix}{msg}", file=sys.stderr, flush=True)

    return say


def _trim_metrics(path: str, last_step: int) -> int:
    """Drop metrics.jsonl rows past `last_step` (written by a run that died after its last
    checkpoint; they are re-done now) and any half-written last line. Returns rows dropped."""
    if not os.path.exists(path):
        return 0
    kept, dropped = [], 0
    with open(path) as f:
        for line in f:
            try:
                row = json.loads(line)
                ok = line.endswith("\n") and int(row["step"]) <= last_step
            except (ValueError, KeyError, TypeError, RecursionError):
                ok = False
            if ok:
                kept.append(line)
            else:
                dropped += 1
    if dropped:
        write_text(path, "".join(kept), force=True)  # whole or not at all: a kill may land now
    return dropped


def _to_device(batch: dict, sharding, rows: int) -> dict:
    """This process's rows of a batch of `rows`: the global shape is given, so a process that
    fed too few rows fails here instead of training on a smaller batch."""
    return {k: jax.make_array_from_process_local_data(
        sharding, np.asarray(v, np.int32), (rows,) + np.shape(v)[1:]) for k, v in batch.items()}


def evaluate(bundle, params, val_batches) -> float:
    rows = bundle.train.global_batch
    losses = [bundle.eval_step(params, _to_device(b, bundle.batch_sharding, rows))
              for b in val_batches]
    return float(np.mean([float(x) for x in losses]))


def _compiler_options(given: Optional[dict]) -> Optional[dict]:
    """`given`, else XLA's fast-compile options when BOOST_JAX_FAST_COMPILE=1 (development and
    tests on CPU: the step compiles ~5x faster and runs slower), else the defaults."""
    return given if given is not None else dev_compile_options()


def run(cfg: Config, compiler_options: Optional[dict] = None, cli: bool = False,
        force: bool = False, config_path: Optional[str] = None) -> dict:
    """Train as `cfg` says; returns the summary. `compiler_options` go to the train/eval step's
    jit (see _compiler_options). The run holds out_dir's lock (run_lock.py) throughout and sends
    library logging to out_dir/run.log (run_log.py); with `cli` (train.py, about to exit) a
    failed run leaves that in place until the process ends. An out_dir holding files that are no
    run of ours is refused unless `force`, and so is one where the run would replace
    `config_path`, the --config it was read from (run_config.check_out_dir)."""
    from boost_jax.train.distributed import maybe_initialize

    maybe_initialize(cfg)  # no-op when train.py already started jax.distributed
    pid, nproc = jax.process_index(), jax.process_count()
    out_dir = os.path.abspath(cfg.out_dir)
    run_config.check_inputs(cfg, out_dir)
    fresh = fresh_dirs(out_dir)  # missing or empty: a refused run leaves it so
    _check_writable(out_dir)
    with hold_out_dir(out_dir, pid == 0, nproc, _printer(pid == 0, "warning: "),
                      check=lambda: run_config.check_out_dir(out_dir, force, config_path),
                      fresh=fresh):
        with RunLog(out_dir, pid, keep_after_error=cli) as log:
            summary = _run(cfg, out_dir, log, compiler_options)
            if nproc > 1:  # the others wait for process 0's last files (a 143 exit kills all)
                from jax.experimental import multihost_utils

                multihost_utils.sync_global_devices("boost_jax:run_end")
            return summary


def _resume_check(cfg: Config, out_dir: str, meta: dict, accepted: list, layouts):
    """check_meta for Checkpointer.restore_latest: the saved config (checkpoints/run_config.py), then the
    model shapes the checkpoint holds."""
    from boost_jax.step.optim import transposed_weights

    legacy = run_config.load_saved(os.path.join(out_dir, CONFIG_FILE))

    def check_meta(step: int, saved: dict) -> None:
        accepted[:] = run_config.check_resume(saved.get("config") or legacy, cfg, step, out_dir)
        check_unchanged(saved.get("inputs"), meta["inputs"], cfg, step, out_dir)
        run_config.check_adafactor_layout(saved, meta, cfg, step, out_dir,
                                          transposed_weights(layouts))
        if saved.get("model") != meta["model"]:
            diff = {k: (saved.get("model", {}).get(k), v) for k, v in meta["model"].items()
                    if saved.get("model", {}).get(k) != v}
            back = " ".join(f"model.{k}={old}" for k, (old, _) in diff.items())
            raise UserError(f"checkpoint step {step} in {out_dir} has a different model "
                            f"(saved vs config: {diff}); use a new out_dir, or set the saved "
                            f"values back ({back}) to resume")

    return check_meta


def _write_failed(e: OSError, ckpt, log: RunLog) -> OutputWriteError:
    steps = ckpt.steps_on_disk()
    keep = (f"checkpoints up to step {steps[-1]} in {ckpt.directory} are intact; free space and "
            f"rerun the same command to resume" if steps else "no checkpoint was written yet")
    what = f"writing {e.filename}" if e.filename else "writing the run's outputs"
    return OutputWriteError(f"{what} failed ({e.strerror or e}); {keep}; details in {log.path}")


@dataclass
class _RunCtx:
    """What the step loop works with; fixed for the whole run."""

    cfg: Config
    bundle: Any  # build_step's StepBundle: train/eval steps, shardings, state init
    data: Any  # build_data's iterators and tokenizer
    ckpt: Checkpointer
    logger: MetricsLogger
    thr: Throughput
    meta: dict  # saved with every checkpoint
    say: Callable[[str], None]
    nproc: int


def _build(cfg: Config, out_dir: str, pid: int, nproc: int, compiler_options: Optional[dict],
           say):
    """(mesh, topology, data, step bundle); cheap checks first, compilation last."""
    from boost_jax.data import build_data

    mesh = mesh_from_config(cfg)
    # the parallel layout's checks (TP cut, pipeline split, batch over the data-parallel
    # devices) fail before reading data; build_step is lazy: jax.jit compiles on first call
    copts = _compiler_options(compiler_options)
    bundle = build_step(cfg, mesh, copts) if copts else build_step(cfg, mesh)
    topo = get_topology(cfg.mesh.topology)
    topo.peak_flops  # the CPU's peak is probed or read from the environment: refused here
    require_wandb(cfg)

    # the rows each process feeds: processes holding the same rows (TP or stages across
    # processes) read the same windows; build_data checks the batch divides over the groups
    group, groups = process_rows(bundle.batch_sharding, (cfg.train.global_batch,
                                                         cfg.data.seq_len))
    data = build_data(cfg, group, groups, os.path.join(out_dir, TOKENIZER_DIR))
    for note in bundle.placement.notes:  # roles TP took
        say(note)
    return mesh, topo, data, bundle


def foreign_topology(topo, backend: str) -> Optional[str]:
    """The warning for a GPU cluster's topology on CPU devices (MFU against the GPU's peak)."""
    if topo.job is None or topo.job.platform == "cpu" or backend != "cpu":
        return None
    return (f"mesh.topology={topo.name} describes {topo.device} devices but this run has CPU "
            f"devices: MFU is against the {topo.device}'s peak")


def _open_checkpointer(cfg: Config, out_dir: str, warn) -> tuple[Checkpointer, list]:
    """The run's Checkpointer and the steps it holds (refused unless checkpoint.resume)."""
    ckpt_dir = os.path.join(out_dir, CHECKPOINTS_DIR)
    ckpt = Checkpointer(ckpt_dir, cfg.checkpoint, warn=warn,
                        stages=(cfg.parallel.pp_stages, cfg.parallel.pp_virtual))
    existing = ckpt.all_steps()
    if existing and not cfg.checkpoint.resume:
        raise UserError(f"{ckpt_dir} already holds checkpoints (steps {existing}) and "
                        "checkpoint.resume=false would overwrite them; use a new out_dir, or "
                        "checkpoint.resume=true to continue")
    return ckpt, existing


def _resume_or_init(cfg: Config, out_dir: str, bundle, data, ckpt: Checkpointer,
                    existing: list, meta: dict, say):
    """(start step, state, resumed, accepted config changes): the latest checkpoint that
    restores (with the data iterator's position), else a fresh or model.init_from state."""
    accepted: list = []
    check_meta = _resume_check(cfg, out_dir, meta, accepted, bundle.placement.layouts)
    restored = ckpt.restore_latest(bundle.abstract_state, check_meta) if existing else None
    if restored is not None:
        start, state, data_state, saved = restored
        data.train_iter.set_state(run_config.data_position(data_state, saved))
        if run_config.in_optax_counts(saved, cfg):
            state = _layout_free(bundle, state)
        return start, state, True, accepted
    state = bundle.init_state()
    if cfg.model.init_from:
        from boost_jax import hf

        hf.check_tokenizer(cfg.model.init_from, data.tokenizer)
        state = hf.init_state_from(bundle, state, cfg.model.init_from)
        say(f"initialised from {cfg.model.init_from}")
    return 0, state, False, accepted


def _layout_free(bundle, state) -> dict:
    """A state whose Adafactor statistics an older step saved in optax's counts, converted to
    what this run's step stores (step/optim.py: layout_free_statistics)."""
    from boost_jax.backends.cpu import dev_compile_options
    from boost_jax.step.optim import rescale_statistics

    sh = bundle.state_shardings["opt_state"]
    fn = jax.jit(lambda s: rescale_statistics(s, bundle.placement.layouts, False),
                 out_shardings=sh, compiler_options=dev_compile_options())
    return dict(state, opt_state=fn(state["opt_state"]))


def _open_logger(cfg: Config, out_dir: str, start: int, resumed: bool, accepted: list,
                 main_proc: bool, nproc: int, say) -> MetricsLogger:
    """metrics.jsonl trimmed to the restored step, config recorded, the tracker opened."""
    logger_path = os.path.join(out_dir, "metrics.jsonl")
    # the tracker first: a W&B start that fails (no login) is an input mistake, so nothing of
    # the run is written or trimmed before it
    tracker = open_sink(cfg, out_dir, resumed) if main_proc else None
    if main_proc:
        dropped = _trim_metrics(logger_path, start if resumed else -1)
        if dropped and start:
            say(f"dropped {dropped} metrics.jsonl rows past step {start} (from a run that "
                "stopped after its last checkpoint; those steps are re-done now)")
        run_config.record(out_dir, cfg, start)
    logger = MetricsLogger(out_dir, cfg.logging.tensorboard, cfg.logging.progress, main_proc,
                           purge_step=start + 1 if resumed else 0, tracker=tracker)
    if resumed:
        changed = (f" with changed settings: {run_config.describe(accepted)} (configs kept in "
                   f"{os.path.join(out_dir, run_config.HISTORY_DIR)})" if accepted else "")
        say(f"resumed from step {start} in {out_dir}{changed}")
        moved = _schedule_moved(cfg, start, accepted)
        if moved:
            say(f"warning: {moved}")
    if nproc > 1:
        logger.line(f"{nproc} processes x {counted(jax.local_device_count(), 'device')} "
                    f"({jax.devices()[0].platform})")
    return logger


def _schedule_moved(cfg: Config, start: int, accepted: list) -> Optional[str]:
    """The line for a resume whose train.steps or optim settings moved the learning rate: the
    schedule is re-spread over the new total (e.g. a finished cosine run extended climbs back
    up), which the run's config alone does not show."""
    from boost_jax.step.optim import SCHEDULE_KEYS, resumed_lr

    old = {k: v for k, v, _ in accepted if k == "train.steps" or k in SCHEDULE_KEYS}
    if not old:
        return None
    was = replace(cfg.optim, **{k[len("optim."):]: v for k, v in old.items()
                                if k.startswith("optim.")})
    before, now = resumed_lr(was, old.get("train.steps", cfg.train.steps), cfg.optim,
                             cfg.train.steps, start)
    if abs(now - before) <= 1e-3 * abs(before):
        return None
    return (f"{', '.join(old)} changed, so optim.schedule={cfg.optim.schedule} now spans "
            f"train.steps={cfg.train.steps}: update {start + 1} runs at lr {now:.3g}, where the "
            f"saved run's schedule gives {before:.3g}")


def _throughput(cfg: Config, mesh, topo, bundle, data, logger: MetricsLogger) -> Throughput:
    """The throughput meter (model FLOPs of the attention that compiles); logs the run line."""
    from boost_jax.analysis.flops import flops_per_token
    from boost_jax.layers.forward import compiled_impl

    tokens_per_step = cfg.train.global_batch * cfg.data.seq_len
    attn = compiled_impl(cfg.model, cfg.data.seq_len)
    fpt = flops_per_token(cfg.model, cfg.data.seq_len, attn)["train"]
    thr = Throughput(tokens_per_step, fpt * tokens_per_step, mesh.size, topo.peak_flops)
    logger.line(f"{cfg.name}: {cfg.model.family} {cfg.model.arch} d={cfg.model.d_model} "
                f"L={cfg.model.n_layers} "
                f"params={bundle.n_params / 1e6:.2f}M | mesh {dict(mesh.shape)} "
                f"plan={cfg.parallel.plan}"
                f"{f' ({KEPT_SECONDARY})' if bundle.placement.secondary_axes == () else ''}"
                f" tp={cfg.parallel.tp_mode} attention={attn} | "
                f"{data.size} | "
                f"{tokens_per_step} tokens/step")
    return thr


def _train_and_close(ctx: _RunCtx, log: RunLog, state, start: int, summary: dict,
                     stop: StopSignal) -> int:
    """_train, then close the checkpointer (a failed last async save fails here too); on any
    failure the outputs are closed and a save or write error becomes one line with details."""
    ckpt = ctx.ckpt
    try:
        step = _train(ctx, state, start, summary, stop)
        ckpt.close()  # inside: a failed last (async) save is handled like any other
    except BaseException as e:
        ckpt.abandon()  # a save still running in the background is valid: let it finish
        _close_quietly(ctx.logger, log)
        if isinstance(e, CheckpointSaveError):
            ckpt.discard_failed()  # frees the space a full disk needs for the details below
            log.exception(str(e), getattr(e, "detail", e))
            raise CheckpointSaveError(f"{e}; details in {log.path}") from None
        if isinstance(e, OSError):
            log.exception("writing a run output failed", e)
            raise _write_failed(e, ckpt, log) from None
        if (oom := out_of_memory(e)) is not None:  # XLA's buffer list goes to run.log
            log.exception("the devices ran out of memory", e)
            raise UserError(f"{oom}; details in {log.path}") from None
        raise
    return step


def _run(cfg: Config, out_dir: str, log: RunLog, compiler_options: Optional[dict]) -> dict:
    """Inside out_dir's lock and run log: set up, resume or init, train, write the outputs."""
    pid, nproc = jax.process_index(), jax.process_count()
    main_proc = pid == 0
    say, warn = _printer(main_proc), _printer(main_proc, "warning: ")
    mesh, topo, data, bundle = _build(cfg, out_dir, pid, nproc, compiler_options, say)
    if (other := foreign_topology(topo, jax.default_backend())) is not None:
        warn(other)
    ckpt, existing = _open_checkpointer(cfg, out_dir, warn)
    meta = {"model": run_config.model_signature(cfg), "mesh": list(mesh.devices.shape),
            "plan": cfg.parallel.plan, "tp_mode": cfg.parallel.tp_mode, "processes": nproc,
            "config": cfg.to_dict(), "inputs": identities(cfg),
            "adafactor_statistics": run_config.LAYOUT_FREE}
    start, state, resumed, accepted = _resume_or_init(cfg, out_dir, bundle, data, ckpt,
                                                      existing, meta, say)
    if resumed and start >= cfg.train.steps:  # e.g. the same command again: nothing written
        _nothing_to_train(cfg, out_dir, start, ckpt, say)
        if main_proc:
            _finish_interrupted(cfg, out_dir, start, bundle.n_params, say)
        return {"start_step": start, "final_step": start}
    try:
        logger = _open_logger(cfg, out_dir, start, resumed, accepted, main_proc, nproc, say)
    except OSError as e:  # trimming metrics.jsonl, recording the config: a full disk
        log.exception("opening the run's outputs failed", e)
        raise _write_failed(e, ckpt, log) from None
    thr = _throughput(cfg, mesh, topo, bundle, data, logger)

    summary = {"start_step": start, "params": bundle.n_params}
    ctx = _RunCtx(cfg, bundle, data, ckpt, logger, thr, meta, say, nproc)
    # a signal is held from the first step to the last output: during the loop it stops the
    # run at a step boundary; after the last step (its save, the plot, summary.json) the run
    # is finished, and it ends as one (exit 0: a batch script must not requeue it)
    with StopSignal() as stop:
        summary["final_step"] = _train_and_close(ctx, log, state, start, summary, stop)
        if main_proc:
            try:
                _finish(cfg, out_dir, logger, summary)
            except OSError as e:
                log.exception("writing the run's final outputs failed", e)
                raise _write_failed(e, ckpt, log) from None
    if stop.received is not None and summary["final_step"] >= cfg.train.steps:
        say(f"signal {stop.received} after the last step: the run is finished")
    return summary


def _nothing_to_train(cfg: Config, out_dir: str, start: int, ckpt: Checkpointer, say) -> None:
    """The latest step is at or past train.steps: say so and leave every output as it is."""
    ckpt.close()
    steps = cfg.train.steps
    if start > steps:
        raise UserError(f"{out_dir} holds step {start}, past train.steps={steps}; use "
                        f"train.steps={start} or more to continue it, or another out_dir=...")
    say(f"{out_dir} holds step {start} of train.steps={steps}: nothing to train; raise "
        "train.steps to continue it, or choose another out_dir=...")


def _finish_interrupted(cfg: Config, out_dir: str, step: int, n_params: int, say) -> None:
    """A finished run killed while it wrote its final outputs (after its last save) lacks
    summary.json, and loss.png when the kill came first: written now from metrics.jsonl,
    which holds every row."""
    path, metrics = os.path.join(out_dir, "summary.json"), os.path.join(out_dir, "metrics.jsonl")
    plot = os.path.join(out_dir, "loss.png")
    if os.path.exists(path) or not os.path.isfile(metrics):
        return
    if cfg.logging.plot and not os.path.exists(plot):
        plot_losses(metrics, plot, cfg.name)
    summary = {"start_step": None, "params": n_params, "final_step": step,
               "written_after": "the run stopped while writing its final outputs",
               **summarize(metrics, step)}
    _write_summary(path, summary)
    say(f"wrote the missing {path} from metrics.jsonl (the run stopped while writing its "
        "final outputs)")


def _close_quietly(logger: MetricsLogger, log: RunLog) -> None:
    try:
        logger.close(failed=True)
    except OSError as e:
        log.exception("closing metrics.jsonl / TensorBoard failed", e)


def _finish(cfg: Config, out_dir: str, logger: MetricsLogger, summary: dict) -> None:
    """Process 0: close the logs, plot, write summary.json."""
    logger.close()
    if cfg.logging.plot:
        plot_losses(logger.path, os.path.join(out_dir, "loss.png"), cfg.name)
    summary.update(summarize(logger.path, summary["final_step"]))
    _write_summary(os.path.join(out_dir, "summary.json"), summary)
    logger.line(_done_line(out_dir, summary))


def _write_summary(path: str, summary: dict) -> None:
    write_text(path, json_dumps(summary, indent=2), force=True)  # whole: a kill may land now


def _done_line(out_dir: str, summary: dict) -> str:
    """The final line; a step that was not evaluated (a stop by signal) is said to be."""
    last, at = summary.get("last_val_loss"), summary.get("last_val_step")
    if not isinstance(last, float):
        val = ""
    elif at == summary["final_step"]:
        val = f", val_loss {last:.4f}"
    else:
        val = f" (not evaluated; the last evaluation was at step {at}: val_loss {last:.4f})"
    return f"done: step {summary['final_step']}{val}; summary in {os.path.join(out_dir, 'summary.json')}"


@contextlib.contextmanager
def _closing(prof: StepProfiler):
    try:
        yield prof
    finally:
        prof.stop()  # a trace cut short by a stop or an error is still written


@dataclass
class _LoopState:
    """What the step loop changes as it goes."""

    state: Any  # the train state: params, optimizer state, step counter
    step: int  # last step trained
    start: int  # the step this process started (or resumed) from
    saved_steps: set  # steps with a checkpoint: never saved twice
    t_start: float  # perf_counter when the loop started
    first_step_s: float = 0.0  # the first step's time, compilation included
    pending_finite: list = field(default_factory=list)  # device flags not yet checked
    nonfinite_run: int = 0  # non-finite steps in a row up to the last check


def _check_finite(ctx: _RunCtx, ls: _LoopState) -> None:
    """Fetch the finite flags since the last check (one sync); stop at the first bad step."""
    flags = [bool(f) for f in jax.device_get(ls.pending_finite)]
    ls.pending_finite.clear()
    first = ls.step - len(flags) + 1  # the step of flags[0]
    if not all(flags) and not ctx.cfg.train.skip_nonfinite:
        bad = first + flags.index(False)
        raise NonFiniteError(
            f"non-finite loss or gradient at step {bad}; no checkpoint was written after it "
            "(lower optim.lr, check the data, or set train.skip_nonfinite=true)")
    limit = ctx.cfg.train.skip_nonfinite_limit
    for i, ok in enumerate(flags):
        ls.nonfinite_run = 0 if ok else ls.nonfinite_run + 1
        if ls.nonfinite_run >= limit:  # the skipped updates left the state as it was before
            step = first + i
            raise NonFiniteError(
                f"{counted(limit, 'step')} in a row {'was' if limit == 1 else 'were'} non-finite "
                f"and skipped (steps {step - limit + 1}-{step}, train.skip_nonfinite_limit="
                f"{limit}): the run has diverged; no checkpoint was written after them (lower "
                "optim.lr or optim.clip_norm, check the data, or resume from an earlier step)")


def _save(ctx: _RunCtx, ls: _LoopState, force: bool = False) -> None:
    if ls.step in ls.saved_steps:
        return
    _check_finite(ctx, ls)
    ctx.ckpt.save(ls.step, ls.state, ctx.data.train_iter.get_state(), ctx.meta, force=force)
    ls.saved_steps.add(ls.step)


def _take_step(ctx: _RunCtx, ls: _LoopState, prof: StepProfiler, summary: dict) -> dict:
    """One train step on the next batch; returns its (device) metrics."""
    batch = _to_device(next(ctx.data.train_iter), ctx.bundle.batch_sharding,
                       ctx.cfg.train.global_batch)
    prof.before(ls.step + 1)
    ls.state, m = ctx.bundle.train_step(ls.state, batch)
    ls.step += 1
    ls.pending_finite.append(m["finite"])
    ctx.thr.tick()
    if (trace := prof.after(ls.step, m["loss"])) is not None:
        ctx.say(f"profile of steps {prof.first}-{ls.step} written to {trace}")
        ctx.thr.skip(prof.write_s)  # writing the trace is not training
    if ls.step == ls.start + 1:  # the first step includes compilation: timed on its own
        jax.block_until_ready(m["loss"])
        ls.first_step_s = summary["first_step_s"] = time.perf_counter() - ls.t_start
        ctx.thr.reset()
    return m


def _maybe_log_metrics(ctx: _RunCtx, ls: _LoopState, m: dict, row: dict) -> None:
    tcfg, step, thr = ctx.cfg.train, ls.step, ctx.thr
    if not (step % tcfg.log_every == 0 or step == tcfg.steps):
        return
    m = jax.device_get(m)
    _check_finite(ctx, ls)
    perf = thr.report() if thr.steps else {}
    row.update(loss=float(m["loss"]), grad_norm=float(m["grad_norm"]),
               lr=float(m["lr"]), **perf)
    if perf:
        eta = (tcfg.steps - step) * perf["step_time_s"]
        speed = (f"{perf['tokens_per_s']:,.0f} tok/s | "
                 f"{flop_rate(perf['tflops_per_device'] * 1e12)}/dev | MFU {perf['mfu']:.1%} | "
                 f"ETA {format_eta(eta)}")
    else:  # the first step since the start: its time is mostly compilation
        speed = f"first step {ls.first_step_s:.1f} s, compilation included"
    ctx.logger.line(f"step {step}/{tcfg.steps} | loss {row['loss']:.4f} | {speed}")
    thr.reset()


def _maybe_evaluate(ctx: _RunCtx, ls: _LoopState, row: dict) -> None:
    tcfg = ctx.cfg.train
    if ls.step % tcfg.eval_every == 0 or ls.step == tcfg.steps:
        val = evaluate(ctx.bundle, ctx.bundle.eval_params(ls.state), ctx.data.val_batches)
        row.update(val_loss=val, val_ppl=math.exp(min(val, 50)))
        ctx.logger.line(f"step {ls.step} | val_loss {val:.4f} | "
                        f"val_ppl {math.exp(min(val, 50)):.2f}")
        ctx.thr.reset()


def _maybe_save(ctx: _RunCtx, ls: _LoopState) -> None:
    if ls.step % ctx.cfg.checkpoint.every == 0 or ls.step == ctx.cfg.train.steps:
        _save(ctx, ls)
        ctx.thr.reset()  # the save's blocking part is not training


def _should_stop(ctx: _RunCtx, ls: _LoopState, stop: StopSignal, summary: dict) -> bool:
    """train.stop_after reached, or a signal on any process: save and stop (all together)."""
    tcfg, step = ctx.cfg.train, ls.step
    if tcfg.stop_after is not None and step - ls.start >= tcfg.stop_after and step < tcfg.steps:
        _save(ctx, ls, force=True)
        ctx.say(f"stop_after={tcfg.stop_after}: saved step {step}, exiting")
        return True
    if step >= tcfg.steps:  # finished (saved, evaluated): nothing for a rerun to resume
        return False
    signum = agree_stop(stop.received, ctx.nproc)
    if signum is not None:
        _save(ctx, ls, force=True)
        ctx.say(f"signal {signum}: saved step {step}, exiting; rerun the same command "
                "to resume")
        summary["stopped_by_signal"] = int(signum)
        return True
    return False


def _train(ctx: _RunCtx, state, start: int, summary: dict, stop: StopSignal) -> int:
    """The step loop from `start`; returns the last step trained. Fills summary."""
    tcfg = ctx.cfg.train
    if start == 0:
        val = evaluate(ctx.bundle, ctx.bundle.eval_params(state), ctx.data.val_batches)
        ctx.logger.log(0, {"val_loss": val, "val_ppl": math.exp(min(val, 50))})
        ctx.logger.line(f"step 0 | val_loss {val:.4f}")
    ls = _LoopState(state, start, start, saved_steps=set(ctx.ckpt.all_steps()),
                    t_start=time.perf_counter())
    prof = StepProfiler(os.path.abspath(ctx.cfg.out_dir), tcfg.profile_steps)
    if tcfg.profile_steps and tcfg.profile_steps[0] <= start:  # a resume went past them
        ctx.say(f"warning: train.profile_steps={list(tcfg.profile_steps)} starts at or before "
                f"step {start}, where this run resumes; no trace is written (choose steps after "
                f"{start})")
    with _closing(prof):
        while ls.step < tcfg.steps:
            m = _take_step(ctx, ls, prof, summary)
            row: dict = {}  # this step's metrics.jsonl row, if any
            _maybe_log_metrics(ctx, ls, m, row)
            _maybe_evaluate(ctx, ls, row)
            if row:
                ctx.logger.log(ls.step, row)
            _maybe_save(ctx, ls)
            if _should_stop(ctx, ls, stop, summary):
                break
    summary["wall_s"] = time.perf_counter() - ls.t_start
    return ls.step

