"""Run outputs: metrics.jsonl, TensorBoard events, the live progress line, the loss-curve PNG."""

from __future__ import annotations

import json
import math
import os
import sys
import time
from typing import Optional


class MetricsLogger:
    """Writes from process 0 only; other processes get a no-op logger."""

    def __init__(self, out_dir: str, tensorboard: bool = True, progress: bool = True,
                 enabled: bool = True):
        self.enabled = enabled
        self.progress = progress and enabled
        self.path = os.path.join(out_dir, "metrics.jsonl")
        self._f = open(self.path, "a") if enabled else None
        self._tb = None
        if enabled and tensorboard:
            from tensorboardX import SummaryWriter

            self._tb = SummaryWriter(os.path.join(out_dir, "tb"))

    def log(self, step: int, metrics: dict) -> None:
        if not self.enabled:
            return
        row = {"step": int(step), **{k: _plain(v) for k, v in metrics.items()}}
        self._f.write(json.dumps(row) + "\n")
        self._f.flush()
        if self._tb is not None:
            for k, v in row.items():
                if k != "step" and isinstance(v, (int, float)) and math.isfinite(v):
                    self._tb.add_scalar(k, v, step)

    def line(self, text: str) -> None:
        if self.progress:
            print(text, file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._f:
            self._f.close()
        if self._tb is not None:
            self._tb.close()


def _plain(v):
    try:
        v = v.item()
    except AttributeError:
        pass
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
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
    ax.set_title(title or "loss")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out_png, dpi=110)
    plt.close(fig)
    return out_png
