"""The training run: data, state (fresh or resumed), the step loop, eval, checkpoints, outputs."""

from __future__ import annotations

import json
import math
import os
import signal
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


def _check_writable(out_dir: str) -> None:
    try:
        os.makedirs(out_dir, exist_ok=True)
        probe = os.path.join(out_dir, ".write_test")
        with open(probe, "w") as f:
            f.write("ok")
        os.remove(probe)
    except OSError as e:
        raise UserError(f"out_dir {out_dir!r} is not writable ({e.strerror}); "
                        "choose another out_dir=...") from None


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


def evaluate(bundle, params, val_batches) -> float:
    losses = [bundle.eval_step(params, _to_device(b, bundle.batch_sharding)) for b in val_batches]
    return float(np.mean([float(x) for x in losses]))


def run(cfg: Config) -> dict:
    from boost_jax.analysis.flops import flops_per_token
    from boost_jax.data import build_data
    from boost_jax.train.distributed import maybe_initialize

    maybe_initialize(cfg)
    pid, nproc = jax.process_index(), jax.process_count()
    main_proc = pid == 0
    out_dir = os.path.abspath(cfg.out_dir)
    _check_writable(out_dir)
    mesh = mesh_from_config(cfg)
    topo = get_topology(cfg.mesh.topology)
    tcfg = cfg.train

    # build_data checks batch divisibility over processes and the tokenizer's vocab size
    data = build_data(cfg, pid, nproc, os.path.join(out_dir, "tokenizer"))

    bundle = build_step(cfg, mesh)
    ckpt = Checkpointer(os.path.join(out_dir, "checkpoints"), cfg.checkpoint)
    logger = MetricsLogger(out_dir, cfg.logging.tensorboard, cfg.logging.progress, main_proc)
    if main_proc:
        with open(os.path.join(out_dir, "config.yaml"), "w") as f:
            f.write(config_to_yaml(cfg))

    meta = {"model": _model_signature(cfg), "mesh": list(mesh.devices.shape),
            "plan": cfg.parallel.plan, "tp_mode": cfg.parallel.tp_mode}
    start = ckpt.latest_step() if cfg.checkpoint.resume else None
    if start is not None:
        saved = ckpt.restore_meta(start)
        if saved.get("model") != meta["model"]:
            diff = {k: (saved.get("model", {}).get(k), v) for k, v in meta["model"].items()
                    if saved.get("model", {}).get(k) != v}
            raise UserError(f"checkpoint step {start} in {out_dir} has a different model "
                            f"(saved vs config: {diff}); use a new out_dir or checkpoint.resume=false")
        state, data_state, _ = ckpt.restore(start, bundle.abstract_state)
        data.train_iter.set_state(data_state)
        logger.line(f"resumed from step {start} in {out_dir}")
    else:
        state = bundle.init_state()
        start = 0

    n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(bundle.abstract_state["params"]))
    tokens_per_step = tcfg.global_batch * cfg.data.seq_len
    fpt = flops_per_token(cfg.model, cfg.data.seq_len)["train"]
    thr = Throughput(tokens_per_step, fpt * tokens_per_step, mesh.size, topo.peak_flops)
    logger.line(f"{cfg.name}: {cfg.model.arch} d={cfg.model.d_model} L={cfg.model.n_layers} "
                f"params={n_params / 1e6:.2f}M | mesh {dict(mesh.shape)} plan={cfg.parallel.plan} "
                f"tp={cfg.parallel.tp_mode} | {data.n_train_tokens / 1e6:.2f}M train tokens | "
                f"{tokens_per_step} tokens/step")

    summary = {"start_step": start, "params": n_params}
    if start == 0:
        val = evaluate(bundle, state["params"], data.val_batches)
        logger.log(0, {"val_loss": val, "val_ppl": math.exp(min(val, 50))})
        logger.line(f"step 0 | val_loss {val:.4f}")
        summary["initial_val_loss"] = val

    pending_finite = []

    def check_finite(step: int, m: Optional[dict] = None) -> None:
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
                val = evaluate(bundle, state["params"], data.val_batches)
                row.update(val_loss=val, val_ppl=math.exp(min(val, 50)))
                logger.line(f"step {step} | val_loss {val:.4f} | val_ppl {math.exp(min(val, 50)):.2f}")
                thr.reset()
            if row:
                logger.log(step, row)
            if step % cfg.checkpoint.every == 0 or step == tcfg.steps:
                save(step)
            if tcfg.stop_after is not None and step - start >= tcfg.stop_after and step < tcfg.steps:
                save(step, force=True)
                logger.line(f"stop_after={tcfg.stop_after}: saved step {step}, exiting")
                break
            if stop.received is not None:
                save(step, force=True)
                logger.line(f"signal {stop.received}: saved step {step}, exiting")
                summary["stopped_by_signal"] = int(stop.received)
                break
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
