"""Run outputs: metrics.jsonl, TensorBoard events, an optional tracker (W&B), the live progress
line, the loss-curve PNG."""

from __future__ import annotations

import itertools
import json
import math
import os
import sys
import time
from typing import Optional

from boost_jax.cli import NONFINITE, json_dumps, json_finite


_FILE_SEQ = itertools.count()  # event file names carry pid + sequence: runs never share one


class EventFile:
    """TensorBoard scalars written synchronously, one flushed event per logged row, so a killed
    run keeps every step it logged (tensorboardX's SummaryWriter queues events for a background
    thread that flushes every two minutes). `purge_step` tells TensorBoard to drop events of
    earlier files from that step on: the steps a resumed run re-does."""

    def __init__(self, logdir: str, purge_step: Optional[int] = None):
        from tensorboardX.event_file_writer import EventsWriter
        from tensorboardX.proto.event_pb2 import Event, SessionLog

        os.makedirs(logdir, exist_ok=True)
        self._Event = Event
        self._w = EventsWriter(os.path.join(logdir, "events"), f".{os.getpid()}.{next(_FILE_SEQ)}")
        if purge_step is not None:
            self._w.write_event(Event(wall_time=time.time(), step=purge_step,
                                      session_log=SessionLog(status=SessionLog.START)))
        self._w.flush()

    def add_scalars(self, step: int, values: dict) -> None:
        from tensorboardX.proto.summary_pb2 import Summary

        vals = [Summary.Value(tag=k, simple_value=float(v)) for k, v in values.items()]
        self._w.write_event(self._Event(wall_time=time.time(), step=int(step),
                                        summary=Summary(value=vals)))
        self._w.flush()

    def close(self) -> None:
        self._w.close()


class MetricsLogger:
    """Writes from process 0 only; other processes get a no-op logger. Every row reaches the disk
    when it is logged (metrics.jsonl and TensorBoard alike) and, when given, `tracker` (an
    object with log(row) and close(failed)) gets the same row as metrics.jsonl."""

    def __init__(self, out_dir: str, tensorboard: bool = True, progress: bool = True,
                 enabled: bool = True, purge_step: Optional[int] = None, tracker=None):
        self.enabled = enabled
        self.progress = progress and enabled
        self.path = os.path.join(out_dir, "metrics.jsonl")
        self._f = open(self.path, "a") if enabled else None
        self._tb = EventFile(os.path.join(out_dir, "tb"), purge_step) if (
            enabled and tensorboard) else None
        self._tracker = tracker if enabled else None

    def log(self, step: int, metrics: dict) -> None:
        if not self.enabled:
            return
        # a non-finite value: null plus a `<key>_nonfinite` flag (bare NaN is not JSON)
        row = json_finite({"step": int(step), **{k: _plain(v) for k, v in metrics.items()}})
        # TensorBoard first: a run killed between the two writes then has every metrics.jsonl
        # row in its event file too (the rows past the restored step are re-done on resume)
        if self._tb is not None:
            self._tb.add_scalars(step, {k: v for k, v in row.items() if k != "step" and isinstance(
                v, (int, float)) and not isinstance(v, bool)})
        self._f.write(json_dumps(row) + "\n")
        self._f.flush()
        if self._tracker is not None:
            self._tracker.log(row)

    def line(self, text: str) -> None:
        if self.progress:
            print(text, file=sys.stderr, flush=True)

    def close(self, failed: bool = False) -> None:
        """Close both files and the tracker (marked failed if the run failed); the first error
        (a full disk) is raised after all are closed."""
        first = None
        if self._tracker is not None:
            try:
                self._tracker.close(failed)
            except OSError as e:
                first = e
        for f in (self._f, self._tb):
            if f is None:
                continue
            try:
                f.close()
            except OSError as e:
                first = first or e
        self._f = self._tb = self._tracker = None
        if first is not None:
            raise first


def summarize(metrics_path: str, final_step: int) -> dict:
    """Validation losses from metrics.jsonl: the step-0 one (whichever invocation logged it), the
    one at final_step (None if that step was not evaluated, e.g. a signal stop) and the latest.
    A loss that was not finite is NaN here (written as null plus a `_nonfinite` flag)."""
    vals = {}
    with open(metrics_path) as f:
        for line in f:
            row = json.loads(line)
            if isinstance(row.get("val_loss"), (int, float)):
                vals[row["step"]] = float(row["val_loss"])
            elif row.get("val_loss" + NONFINITE) or row.get("val_loss") in ("nan", "inf"):
                vals[row["step"]] = math.nan  # also the strings older runs wrote
    last = max(vals) if vals else None
    return {"initial_val_loss": vals.get(0), "final_val_loss": vals.get(final_step),
            "last_val_loss": vals[last] if vals else None, "last_val_step": last}


def _plain(v):
    try:
        return v.item()
    except AttributeError:
        return v


def format_eta(seconds: float) -> str:
    if not math.isfinite(seconds) or seconds < 0:
        return "?"
    m, s = divmod(int(seconds), 60)
    h, m = divmod(m, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s"


class Throughput:
    """Tokens/s, TFLOP/s per device and MFU over the window since the last report."""

    def __init__(self, tokens_per_step: int, flops_per_step: float, n_devices: int,
                 peak_flops: float):
        self.tokens_per_step = tokens_per_step
        self.flops_per_step = flops_per_step
        self.n_devices = n_devices
        self.peak = peak_flops
        self.t0 = time.perf_counter()
        self.steps = 0

    def reset(self) -> None:
        self.t0 = time.perf_counter()
        self.steps = 0

    def skip(self, seconds: float) -> None:
        """Leave `seconds` of host work (writing a trace) out of the window."""
        self.t0 += seconds

    def tick(self) -> None:
        self.steps += 1

    def report(self) -> dict:
        dt = max(time.perf_counter() - self.t0, 1e-9)
        sps = self.steps / dt
        tflops = sps * self.flops_per_step / self.n_devices / 1e12
        return {"tokens_per_s": sps * self.tokens_per_step, "step_time_s": 1.0 / max(sps, 1e-9),
                "tflops_per_device": tflops, "mfu": tflops * 1e12 / self.peak}


def plot_losses(metrics_path: str, out_png: str, title: Optional[str] = None) -> Optional[str]:
    if not os.path.exists(metrics_path):
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train, val = [], []
    with open(metrics_path) as f:
        for line in f:
            row = json.loads(line)
            if isinstance(row.get("loss"), (int, float)):
                train.append((row["step"], row["loss"]))
            if isinstance(row.get("val_loss"), (int, float)):
                val.append((row["step"], row["val_loss"]))
    fig, ax = plt.subplots(figsize=(7, 4))
    if train:
        ax.plot(*zip(*train), label="train loss")
    if val:
        ax.plot(*zip(*val), "o-", label="validation loss")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    # bounded and literal: the run's name is user text ($ would start matplotlib's math mode)
    ax.set_title((title or "loss")[:120].replace("$", r"\$"))
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out_png, dpi=110)
    plt.close(fig)
    return out_png
