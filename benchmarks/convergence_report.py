"""Learning per FLOP, the analysis half: curves from each run's own outputs, the verdict, the
Markdown table and the plot. benchmarks/convergence.py trains the runs and calls this.

A run's training FLOPs come from the config it saved (out_dir/config.yaml) through
boost_jax.analysis.flops.flops_per_token, the same count train.py's MFU uses; its validation
losses and step times from out_dir/metrics.jsonl.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from typing import Optional

from benchmarks.common import markdown_table

ARCHS = ("full", "svd", "cola", "lax")
VERDICT_WORDS = {"match": "matches full rank", "better": "beats full rank",
                 "worse": "falls short of full rank", "unknown": "is not decided"}


@dataclass(frozen=True)
class Run:
    arch: str
    width: int
    seed: int
    lr: float
    steps: int
    phase: str  # "sweep" (learning-rate choice) or "main"

    @property
    def tag(self) -> str:
        return f"{self.phase}-d{self.width}-{self.arch}-lr{self.lr:g}-seed{self.seed}-n{self.steps}"


@dataclass
class Result:
    run: Run
    params: int
    train_flops_per_token: float
    tokens_per_step: int
    # (step, training FLOPs so far, training seconds so far, validation loss)
    points: list = field(default_factory=list)
    final: float = math.inf  # validation loss at the last step; inf: diverged or unfinished

    @property
    def total_flops(self) -> float:
        return self.run.steps * self.tokens_per_step * self.train_flops_per_token

    @property
    def train_s(self) -> float:
        return self.points[-1][2] if self.points else math.nan


def read_curve(metrics_path: str) -> list[tuple[int, float, float]]:
    """(step, training seconds so far, validation loss) at each evaluation.

    Training seconds add up the logged step_time_s over each logging window (train.py's
    throughput windows leave out compilation, evaluation and checkpoints). The first window's
    first step compiles and is not timed: it is counted at the window's mean."""
    out, wall, last_step = [], 0.0, 0
    with open(metrics_path) as f:
        for line in f:
            row = json.loads(line)
            step = int(row["step"])
            if isinstance(row.get("step_time_s"), (int, float)):
                wall += row["step_time_s"] * (step - last_step)
                last_step = step
            if "val_loss" in row:
                v = row["val_loss"]
                out.append((step, wall, float(v) if isinstance(v, (int, float)) else math.inf))
    return out


def load_result(run: Run, out_dir: str) -> Result:
    """The run's Result from what it wrote into out_dir."""
    from boost_jax.analysis.flops import flops_per_token
    from boost_jax.config import load_config

    cfg = load_config(os.path.join(out_dir, "config.yaml"))
    fpt = flops_per_token(cfg.model, cfg.data.seq_len)["train"]
    tps = cfg.train.global_batch * cfg.data.seq_len
    params = 0
    summary = os.path.join(out_dir, "summary.json")
    if os.path.exists(summary):
        with open(summary) as f:
            params = int(json.load(f).get("params", 0))
    curve = read_curve(os.path.join(out_dir, "metrics.jsonl"))
    res = Result(run, params, fpt, tps, [(s, s * tps * fpt, w, v) for s, w, v in curve])
    if curve and curve[-1][0] == run.steps:
        res.final = curve[-1][2]
    return res


def pick_lrs(sweep: list[Result]) -> dict[str, float]:
    """Per arch, the swept learning rate with the lowest final validation loss."""
    best: dict[str, Result] = {}
    for r in sweep:
        if r.run.arch not in best or r.final < best[r.run.arch].final:
            best[r.run.arch] = r
    return {a: r.run.lr for a, r in best.items()}


def runner_up_lr(sweep: list[Result], arch: str) -> Optional[float]:
    """The swept learning rate second best for `arch` (None if it has fewer than two)."""
    rs = sorted((r for r in sweep if r.run.arch == arch), key=lambda r: r.final)
    return rs[1].run.lr if len(rs) > 1 and math.isfinite(rs[1].final) else None


def seed_spread(results: list[Result], width: int) -> Optional[float]:
    """The largest |seed a - seed b| final-loss gap at `width` among the runs the verdicts
    compare (each arch at its best lr, as mean_final picks it); None with one seed."""
    gaps = []
    for arch in {r.run.arch for r in results if r.run.width == width}:
        lrs = {r.run.lr for r in results if (r.run.arch, r.run.width) == (arch, width)}
        lr = min(lrs, key=lambda x: mean_final(results, arch, width, x))
        finals = [r.final for r in results
                  if (r.run.arch, r.run.lr, r.run.width) == (arch, lr, width)]
        if len(finals) >= 2:
            gaps.append(max(finals) - min(finals))
    return max(gaps) if gaps else None


def mean_final(results: list[Result], arch: str, width: int,
               lr: Optional[float] = None) -> float:
    """Mean final loss over seeds; for an arch run at several lrs, that of the best lr."""
    lrs = {r.run.lr for r in results if r.run.arch == arch and r.run.width == width}
    means = []
    for x in lrs if lr is None else [lr]:
        finals = [r.final for r in results
                  if (r.run.arch, r.run.width, r.run.lr) == (arch, width, x)]
        means.append(sum(finals) / len(finals) if finals else math.nan)
    return min(means) if means else math.nan


def reference_lr(results: list[Result], width: int) -> float:
    """The lr of full rank's best run at `width` (the one low rank is compared with)."""
    lrs = {r.run.lr for r in results if r.run.arch == "full" and r.run.width == width}
    return min(lrs, key=lambda lr: mean_final(results, "full", width, lr))


def verdict(delta: float, noise: Optional[float]) -> str:
    """'match' when the gap to full rank is within the seed spread, else 'better' / 'worse'."""
    if noise is None or not math.isfinite(noise) or math.isnan(delta):
        return "unknown"
    if abs(delta) <= noise:
        return "match"
    return "better" if delta < 0 else "worse"


def verdicts(results: list[Result], noise: Optional[float]) -> list[tuple[int, str, float, str]]:
    """(width, arch, Δ mean final loss vs full at equal FLOPs, verdict) per low-rank run."""
    out = []
    for w in sorted({r.run.width for r in results}):
        base = mean_final(results, "full", w)
        for arch in [a for a in ARCHS if a != "full"]:
            if any(r.run.arch == arch and r.run.width == w for r in results):
                d = mean_final(results, arch, w) - base
                out.append((w, arch, d, verdict(d, noise)))
    return out


def sentences(vs: list, noise: Optional[float], seeds_width: int, n_seeds: int) -> list[str]:
    """The plain statement, one line per width, from the measured numbers."""
    if noise is None:
        crit = ("only one seed was run, so there is no measured spread and no verdict; "
                "the gaps are stated as measured")
    else:
        crit = (f"'matches' means the mean final validation loss is within {noise:.3f} nats of "
                f"full rank's, the largest gap between {n_seeds} seeds of any arch (at the lr "
                f"it is compared at) at d={seeds_width}, used for every width")
    lines = [f"Criterion: {crit}."]
    for w in sorted({v[0] for v in vs}):
        parts = [f"**{arch} {VERDICT_WORDS[v]}** ({d:+.3f} nats)" for ww, arch, d, v in vs
                 if ww == w]
        lines.append(f"At d={w}, with the same training FLOPs as full rank: " + "; ".join(parts)
                     + ".")
    return lines


def sweep_table(sweep: list[Result], chosen: dict[str, float]) -> str:
    lrs = sorted({r.run.lr for r in sweep})
    rows = []
    for arch in [a for a in ARCHS if any(r.run.arch == a for r in sweep)]:
        by_lr = {r.run.lr: r.final for r in sweep if r.run.arch == arch}
        cells = [("diverged" if math.isinf(by_lr[lr]) else f"{by_lr[lr]:.3f}") if lr in by_lr
                 else "-" for lr in lrs]
        tried = sorted(by_lr)
        edge = " (grid edge)" if len(tried) > 1 and chosen[arch] in (tried[0], tried[-1]) else ""
        rows.append([arch, *cells, f"{chosen[arch]:g}{edge}"])
    return markdown_table(["arch", *[f"lr {lr:g}" for lr in lrs], "chosen"], rows)


def main_table(results: list[Result], vs: list) -> str:
    vmap = {(w, a): (d, v) for w, a, d, v in vs}
    rows = []
    for w in sorted({r.run.width for r in results}):
        base = mean_final(results, "full", w)
        for arch, lr in sorted({(r.run.arch, r.run.lr) for r in results if r.run.width == w},
                               key=lambda k: (ARCHS.index(k[0]), k[1])):
            rs = sorted((r for r in results
                         if (r.run.arch, r.run.width, r.run.lr) == (arch, w, lr)),
                        key=lambda r: r.run.seed)
            r0 = rs[0]
            d, v = vmap.get((w, arch), (0.0, "reference"))
            if arch == "full" and mean_final(results, arch, w, lr) > base:
                v = "not the reference (higher loss)"
            rows.append([w, arch, f"{r0.run.lr:g}", r0.params / 1e6,
                         r0.train_flops_per_token / 1e6, r0.run.steps,
                         r0.run.steps * r0.tokens_per_step / 1e6, r0.total_flops / 1e12,
                         " / ".join(f"{r.final:.3f}" for r in rs),
                         "-" if arch == "full" else f"{d:+.3f}",
                         " / ".join(f"{r.train_s:.0f}" for r in rs),
                         VERDICT_WORDS.get(v, v)])
    return markdown_table(
        ["d", "arch", "lr", "params (M)", "train MFLOP/token", "steps", "tokens (M)",
         "training TFLOP", "final val loss (per seed)", "Δ vs full", "training s (per seed)",
         "at equal FLOPs"], rows)


COLORS = {"full": "black", "svd": "tab:orange", "cola": "tab:blue", "lax": "tab:green"}


def plot(results: list[Result], path: str) -> str:
    """Validation loss against training FLOPs (left) and training seconds (right), one row per
    width; seed 0 solid, further seeds dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    widths = sorted({r.run.width for r in results})
    fig, axes = plt.subplots(len(widths), 2, figsize=(11, 3.8 * len(widths)), squeeze=False)
    for row, w in zip(axes, widths):
        rs = [r for r in results if r.run.width == w and r.points]
        ref = reference_lr(results, w)
        for r in rs:
            other = r.run.arch == "full" and r.run.lr != ref  # full rank's runner-up lr
            style = dict(color="gray" if other else COLORS.get(r.run.arch), marker="o",
                         markersize=3, linestyle="-" if r.run.seed == 0 else "--",
                         label=f"{r.run.arch} lr {r.run.lr:g} seed {r.run.seed}")
            row[0].plot([p[1] / 1e12 for p in r.points], [p[3] for p in r.points], **style)
            row[1].plot([p[2] for p in r.points], [p[3] for p in r.points], **style)
        # the first evaluation is the untrained model: zoom on the learning after it
        tops = [r.points[1][3] for r in rs if len(r.points) > 2 and math.isfinite(r.points[1][3])]
        lows = [p[3] for r in rs for p in r.points if math.isfinite(p[3])]
        for ax, xlabel in zip(row, ("training TFLOPs", "training seconds (this machine)")):
            if tops and lows:
                ax.set_ylim(min(lows) - 0.05, max(tops) + 0.1)
            ax.set_xlabel(xlabel)
            ax.set_ylabel("validation loss (nats/token)")
            ax.set_title(f"d={w}")
            ax.grid(alpha=0.3)
        row[0].legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
