"""The training run: data, state (fresh or resumed), the step loop, eval, checkpoints, outputs.

One process or many (jax.distributed, see boost_jax/train/distributed.py): every process runs
this same loop on its own share of each global batch; checkpoints are written and restored by
all processes together; metrics, TensorBoard, config.yaml, summary.json and log lines come from
process 0 only. Decisions that change the control flow (stop on a signal, stop on a non-finite
loss, fall back to an older checkpoint) are taken identically on every process so no process is
left waiting in a collective.

Crash safety: a run killed at any moment resumes from the last finalised checkpoint with the
data iterator at the same position, so the losses continue exactly as an uninterrupted run's
(metrics.jsonl rows past the restored step are dropped on resume). See checkpoint.py for
incomplete, corrupted and failed saves.
"""

from __future__ import annotations

import json
import math
import os
import signal
import sys
import time
from typing import Optional

import jax
import numpy as np

from boost_jax.config import Config, config_to_yaml
from boost_jax.errors import UserError
from boost_jax.mesh import get_topology, mesh_from_config
from boost_jax.train.checkpoint import Checkpointer
from boost_jax.train.metrics import MetricsLogger, Throughput, format_eta, plot_losses
from boost_jax.train.step import build_step


class NonFiniteError(UserError):
    pass


def _check_writable(out_dir: str, pid: int = 0) -> None:
    try:
        os.makedirs(out_dir, exist_ok=True)
        probe = os.path.join(out_dir, f".write_test.{pid}")
        with open(probe, "w") as f:
            f.write("ok")
        os.remove(probe)
    except OSError as e:
        raise UserError(f"out_dir {out_dir!r} is not writable ({e.strerror}); "
                        "choose another out_dir=...") from None


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
            except (ValueError, KeyError, TypeError):
                ok = False
            if ok:
                kept.append(line)
            else:
                dropped += 1
    if dropped:
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            f.writelines(kept)
        os.replace(tmp, path)
    return dropped


def _agree_stop(received: Optional[int], nproc: int) -> Optional[int]:
    """The signal any process received, on every process (all stop at the same step)."""
    if nproc == 1:
        return received
    from jax.experimental import multihost_utils

    flags = multihost_utils.process_allgather(np.array([received or 0], np.int32))
    return int(np.max(flags)) or None


def _to_device(batch: dict, sharding) -> dict:
    return {k: jax.make_array_from_process_local_data(sharding, np.asarray(v, np.int32))
            for k, v in batch.items()}


def _model_signature(cfg: Config) -> dict:
    m = cfg.model
    return {k: getattr(m, k) for k in ("arch", "vocab_size", "d_model", "n_layers", "n_heads",
                                       "n_kv_heads", "d_ff", "rank", "lax_gate", "tie_embeddings")}


class _StopSignal:
    """SIGTERM/SIGINT ask the loop to save and exit instead of dying mid-step."""

    def __init__(self):
        self.received: Optional[int] = None
        self._old = {}

    def __enter__(self):
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                self._old[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread
                pass
        return self

    def _handle(self, signum, frame):
        if self.received is not None:  # second signal: give up at once
            raise KeyboardInterrupt
        self.received = signum

    def __exit__(self, *exc):
        for sig, old in self._old.items():
            signal.signal(sig, old)


def _eval_params(bundle, state):
    """What eval_step takes (the bundle says, where it can)."""
    fn = getattr(bundle, "eval_params", None)
    return fn(state) if fn is not None else state["params"]


def evaluate(bundle, params, val_batches) -> float:
    losses = [bundle.eval_step(params, _to_device(b, bundle.batch_sharding)) for b in val_batches]
    return float(np.mean([float(x) for x in losses]))


def _compiler_options(given: Optional[dict]) -> Optional[dict]:
    """`given`, else XLA's fast-compile options when BOOST_JAX_FAST_COMPILE=1 (development and
    tests on CPU: the step compiles ~5x faster and runs slower), else the defaults."""
    if given is not None:
        return given
    if os.environ.get("BOOST_JAX_FAST_COMPILE", "") not in ("", "0"):
        from boost_jax.layers.model import fast_compile_options

        return fast_compile_options() or None
    return None


def run(cfg: Config, compiler_options: Optional[dict] = None) -> dict:
    """Train as `cfg` says; returns the summary. `compiler_options` go to the train/eval step's
    jit (see _compiler_options)."""
    from boost_jax.analysis.flops import flops_per_token
    from boost_jax.data import build_data
    from boost_jax.train.distributed import maybe_initialize

    maybe_initialize(cfg)  # no-op when train.py already started jax.distributed
    pid, nproc = jax.process_index(), jax.process_count()
    main_proc = pid == 0
    say, warn = _printer(main_proc), _printer(main_proc, "warning: ")
    out_dir = os.path.abspath(cfg.out_dir)
    _check_writable(out_dir, pid)
    mesh = mesh_from_config(cfg)
    try:  # tensor-parallel divisibility: fail before reading data or compiling
        from boost_jax.sharding.tp.specs import validate_tp
    except ImportError:
        validate_tp = None
    if validate_tp is not None:
        validate_tp(cfg, mesh)
    topo = get_topology(cfg.mesh.topology)
    tcfg = cfg.train

    # build_data checks batch divisibility over processes and the tokenizer's vocab size
    data = build_data(cfg, pid, nproc, os.path.join(out_dir, "tokenizer"))

    copts = _compiler_options(compiler_options)
    bundle = build_step(cfg, mesh, copts) if copts else build_step(cfg, mesh)
    ckpt_dir = os.path.join(out_dir, "checkpoints")
    ckpt = Checkpointer(ckpt_dir, cfg.checkpoint, warn=warn)
    existing = ckpt.all_steps()
    if existing and not cfg.checkpoint.resume:
        raise UserError(f"{ckpt_dir} already holds checkpoints (steps {existing}) and "
                        "checkpoint.resume=false would overwrite them; use a new out_dir, or "
                        "checkpoint.resume=true to continue")

    meta = {"model": _model_signature(cfg), "mesh": list(mesh.devices.shape),
            "plan": cfg.parallel.plan, "tp_mode": cfg.parallel.tp_mode, "processes": nproc}

    def check_meta(step: int, saved: dict) -> None:
        if saved.get("model") != meta["model"]:
            diff = {k: (saved.get("model", {}).get(k), v) for k, v in meta["model"].items()
                    if saved.get("model", {}).get(k) != v}
            raise UserError(f"checkpoint step {step} in {out_dir} has a different model "
                            f"(saved vs config: {diff}); use a new out_dir or "
                            "checkpoint.resume=false")

    restored = ckpt.restore_latest(bundle.abstract_state, check_meta) if existing else None
    if restored is not None:
        start, state, data_state, _ = restored
        data.train_iter.set_state(data_state)
    else:
        state = bundle.init_state()
        start = 0
    logger_path = os.path.join(out_dir, "metrics.jsonl")
    if main_proc:
        dropped = _trim_metrics(logger_path, start if restored is not None else -1)
        if dropped and start:
            say(f"dropped {dropped} metrics.jsonl rows past step {start} (from a run that "
                "stopped after its last checkpoint; those steps are re-done now)")
    logger = MetricsLogger(out_dir, cfg.logging.tensorboard, cfg.logging.progress, main_proc)
    if main_proc:
        with open(os.path.join(out_dir, "config.yaml"), "w") as f:
            f.write(config_to_yaml(cfg))
    if restored is not None:
        say(f"resumed from step {start} in {out_dir}")
    if nproc > 1:
        logger.line(f"{nproc} processes x {jax.local_device_count()} devices "
                    f"({jax.devices()[0].platform})")

    n_params = getattr(bundle, "n_params", 0) or sum(
        int(np.prod(x.shape)) for x in jax.tree.leaves(bundle.abstract_state["params"]))
    tokens_per_step = tcfg.global_batch * cfg.data.seq_len
    fpt = flops_per_token(cfg.model, cfg.data.seq_len)["train"]
    thr = Throughput(tokens_per_step, fpt * tokens_per_step, mesh.size, topo.peak_flops)
    logger.line(f"{cfg.name}: {cfg.model.arch} d={cfg.model.d_model} L={cfg.model.n_layers} "
                f"params={n_params / 1e6:.2f}M | mesh {dict(mesh.shape)} plan={cfg.parallel.plan} "
                f"tp={cfg.parallel.tp_mode} | {data.n_train_tokens / 1e6:.2f}M train tokens | "
                f"{tokens_per_step} tokens/step")

    summary = {"start_step": start, "params": n_params}
    if start == 0:
        val = evaluate(bundle, _eval_params(bundle, state), data.val_batches)
        logger.log(0, {"val_loss": val, "val_ppl": math.exp(min(val, 50))})
        logger.line(f"step 0 | val_loss {val:.4f}")
        summary["initial_val_loss"] = val

    pending_finite = []

    def check_finite(step: int) -> None:
        flags = [bool(f) for f in jax.device_get(pending_finite)]
        pending_finite.clear()
        if not all(flags) and not tcfg.skip_nonfinite:
            bad = step - len(flags) + flags.index(False) + 1
            raise NonFiniteError(
                f"non-finite loss or gradient at step {bad}; no checkpoint was written after it "
                "(lower optim.lr, check the data, or set train.skip_nonfinite=true)")

    saved_steps = set(ckpt.all_steps())

    def save(step: int, force: bool = False) -> None:
        if step in saved_steps:
            return
        check_finite(step)
        ckpt.save(step, state, data.train_iter.get_state(), meta, force=force)
        saved_steps.add(step)

    step = start
    t_start = time.perf_counter()
    try:
        with _StopSignal() as stop:
            while step < tcfg.steps:
                batch = _to_device(next(data.train_iter), bundle.batch_sharding)
                state, m = bundle.train_step(state, batch)
                step += 1
                pending_finite.append(m["finite"])
                thr.tick()
                if step == start + 1:
                    jax.block_until_ready(m["loss"])
                    summary["first_step_s"] = time.perf_counter() - t_start
                    thr.reset()
                row = {}
                if step % tcfg.log_every == 0 or step == tcfg.steps:
                    m = jax.device_get(m)
                    check_finite(step)
                    perf = thr.report() if thr.steps else {}
                    row.update(loss=float(m["loss"]), grad_norm=float(m["grad_norm"]),
                               lr=float(m["lr"]), **perf)
                    eta = (tcfg.steps - step) * perf.get("step_time_s", float("nan"))
                    logger.line(
                        f"step {step}/{tcfg.steps} | loss {row['loss']:.4f} | "
                        f"{perf.get('tokens_per_s', 0):,.0f} tok/s | "
                        f"{perf.get('tflops_per_device', 0):.3f} TFLOP/s/dev | "
                        f"MFU {perf.get('mfu', 0):.1%} | ETA {format_eta(eta)}")
                    thr.reset()
                if step % tcfg.eval_every == 0 or step == tcfg.steps:
                    val = evaluate(bundle, _eval_params(bundle, state), data.val_batches)
                    row.update(val_loss=val, val_ppl=math.exp(min(val, 50)))
                    logger.line(f"step {step} | val_loss {val:.4f} | "
                                f"val_ppl {math.exp(min(val, 50)):.2f}")
                    thr.reset()
                if row:
                    logger.log(step, row)
                if step % cfg.checkpoint.every == 0 or step == tcfg.steps:
                    save(step)
                if (tcfg.stop_after is not None and step - start >= tcfg.stop_after
                        and step < tcfg.steps):
                    save(step, force=True)
                    say(f"stop_after={tcfg.stop_after}: saved step {step}, exiting")
                    break
                signum = _agree_stop(stop.received, nproc)
                if signum is not None:
                    save(step, force=True)
                    say(f"signal {signum}: saved step {step}, exiting; rerun the same command "
                        "to resume")
                    summary["stopped_by_signal"] = int(signum)
                    break
    except BaseException:
        ckpt.abandon()  # a save still running in the background is valid: let it finish
        raise
    ckpt.close()
    summary.update(final_step=step, wall_s=time.perf_counter() - t_start)
    if main_proc:
        logger.close()
        if cfg.logging.plot:
            plot_losses(logger.path, os.path.join(out_dir, "loss.png"), cfg.name)
        rows = [json.loads(line) for line in open(logger.path)]
        vals = [r["val_loss"] for r in rows if isinstance(r.get("val_loss"), float)]
        summary["final_val_loss"] = vals[-1] if vals else None
        with open(os.path.join(out_dir, "summary.json"), "w") as f:
            json.dump(summary, f, indent=2)
        logger.line(f"done: {json.dumps(summary)}")
    return summary
