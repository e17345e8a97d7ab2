"""Learning per FLOP: does low rank learn as well as full rank for the same training compute?

    .venv/bin/python benchmarks/convergence.py      (make convergence; 28 train.py runs by default)

full, svd, cola and lax are trained on the default corpus (configs/demo.yaml: the Python
standard library's source) with a byte-level BPE, trained once on the training split and
shared by every run, at two widths. Every run is `train.py --config configs/demo.yaml` with
overrides, in its own process: the framework's training loop, data pipeline and optimizer.
Within a width every arch gets the same training FLOPs (full rank's steps x its FLOPs per
token; a low-rank arch, cheaper per token, takes proportionally more steps, each run with its
own full warmup + cosine schedule) and the same data order (one data.seed: a longer run sees
the same batches first, then continues along the same stream).

Each arch's learning rate is the best of a short sweep at the smaller width (a fraction of the
budget, seed 0), used at both widths. Seeds (train.seed, the initial weights) at the smaller
width measure the spread that decides "matches". The analysis is benchmarks/convergence_report.py.
Writes --out (Markdown) and the .png beside it; the default --out also updates its section of
benchmarks/README.md.
"""

from __future__ import annotations

import math
import os
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks import convergence_report as rep  # noqa: E402
from benchmarks.common import add_out, guard_out, sync_readme  # noqa: E402
from boost_jax.cli import Parser  # noqa: E402
from boost_jax.errors import UserError, cli_main  # noqa: E402

RESULTS = os.path.join(ROOT, "benchmarks", "results")
BASE_CONFIG = os.path.join(ROOT, "configs", "demo.yaml")
EVALS_PER_RUN = 8
MAX_EXTEND = 2  # extensions of the lr grid past its ends
PROCESS_S = "process_s.txt"  # the run's train.py process, start to exit, in seconds


def model_overrides(arch: str, width: int) -> list[str]:
    """The demo model at another width: head dim 32, SwiGLU d_ff = 8/3 d rounded up to 8
    (344 at d=128, as in the demo), rank d/4 (CoLA's default); vocabulary from the BPE."""
    d_ff = 8 * math.ceil(8 * width / 3 / 8)
    return [f"model.arch={arch}", f"model.d_model={width}", f"model.n_heads={max(1, width // 32)}",
            f"model.d_ff={d_ff}", f"model.rank={max(1, width // 4)}", "model.vocab_size=null",
            "data.tokenizer=bpe"]


def run_overrides(run: rep.Run, out_dir: str) -> list[str]:
    log_every = max(1, run.steps // (4 * EVALS_PER_RUN))
    return model_overrides(run.arch, run.width) + [
        f"optim.lr={run.lr:g}", f"train.seed={run.seed}", f"train.steps={run.steps}",
        f"train.log_every={log_every}", f"train.eval_every={4 * log_every}",
        f"checkpoint.every={run.steps}", "checkpoint.keep=1", "logging.tensorboard=false",
        "logging.plot=false", f"name={run.tag}", f"out_dir={out_dir}"]


def train_flops_per_token(arch: str, width: int) -> float:
    from boost_jax.analysis.flops import flops_per_token
    from boost_jax.config import load_config

    cfg = load_config(BASE_CONFIG, model_overrides(arch, width))  # bad widths fail here, exit 2
    return flops_per_token(cfg.model, cfg.data.seq_len)["train"]


def equal_flop_steps(archs, width: int, full_steps: int) -> dict[str, int]:
    """Steps per arch for full rank's training FLOPs at `width` (equal to within one step)."""
    base = train_flops_per_token("full", width) * full_steps
    return {a: max(1, round(base / train_flops_per_token(a, width))) for a in archs}


def finished(out_dir: str, steps: int) -> bool:
    metrics = os.path.join(out_dir, "metrics.jsonl")
    if not os.path.exists(metrics) or not os.path.exists(os.path.join(out_dir, "config.yaml")):
        return False
    curve = rep.read_curve(metrics)
    return bool(curve) and curve[-1][0] == steps


def prepare_tokenizer(work: str, reuse: bool) -> str:
    """Train the BPE once on the default corpus's training split; every run copies it."""
    path = os.path.join(work, "tokenizer", "tokenizer.json")
    if reuse and os.path.exists(path):
        return path
    if os.path.exists(path):
        os.remove(path)
    from boost_jax.config import load_config
    from boost_jax.data.sources import load_corpus

    cfg = load_config(BASE_CONFIG, ["data.tokenizer=bpe", "model.vocab_size=null"])
    load_corpus(cfg.data, os.path.dirname(path))
    return path


def train(run: rep.Run, work: str, tokenizer: str) -> None:
    """One `train.py` run into work/<tag>; a non-finite loss is a result (diverged), any other
    failure stops the benchmark."""
    out = os.path.join(work, run.tag)
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(os.path.join(out, "tokenizer"))
    shutil.copy(tokenizer, os.path.join(out, "tokenizer", "tokenizer.json"))
    log = os.path.join(work, "logs", run.tag + ".log")
    os.makedirs(os.path.dirname(log), exist_ok=True)
    # --force: out holds the shared tokenizer this script put there, and no run yet
    cmd = [sys.executable, os.path.join(ROOT, "train.py"), "--config", BASE_CONFIG, "--force",
           *run_overrides(run, out)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [ROOT] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    t0 = time.perf_counter()
    with open(log, "w") as f:
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=ROOT).returncode
    with open(os.path.join(out, PROCESS_S), "w") as f:
        f.write(f"{time.perf_counter() - t0:.1f}\n")
    shutil.rmtree(os.path.join(out, "checkpoints"), ignore_errors=True)  # not needed, MBs each
    with open(log) as f:
        diverged = "non-finite loss" in f.read()
    if rc != 0 and not diverged:
        raise UserError(f"run {run.tag} failed (exit {rc}); its output is in {log}")


LOAD_AT_END = "load_at_end.txt"  # in --work: the load average when a run last finished
WORK_MARK = ".convergence_work"  # in --work: the folder is this script's to delete in


def claim_work(work: str) -> None:
    """Make --work this script's (it deletes and rewrites runs and the tokenizer there): a
    missing or empty folder, or one an earlier invocation claimed; any other is refused, with
    or without --force (a run folder of the user's would lose its tokenizer)."""
    mark = os.path.join(work, WORK_MARK)
    if os.path.lexists(work) and not os.path.isdir(work):
        raise UserError(f"--work {work!r} is not a folder; choose a new or empty folder")
    if os.path.islink(mark) or (os.path.lexists(mark) and not os.path.isfile(mark)):
        raise UserError(f"--work {work!r} holds {WORK_MARK} that is no file this script "
                        "wrote; choose a new or empty folder")
    held = os.listdir(work) if os.path.isdir(work) else []
    if held and not (os.path.isfile(mark) or os.path.isfile(os.path.join(work, LOAD_AT_END))):
        raise UserError(f"--work {work!r} holds files this script did not write; it deletes and "
                        "rewrites runs there: choose a new or empty folder")
    os.makedirs(work, exist_ok=True)
    with open(mark, "w") as f:
        f.write("benchmarks/convergence.py's work folder: its runs are rewritten here\n")


def execute(runs: list, work: str, reuse: bool, tok: dict) -> list:
    """Train (or, with reuse, keep) each run; their Results."""
    results = []
    for i, run in enumerate(runs, 1):
        out = os.path.join(work, run.tag)
        t0 = time.perf_counter()
        if reuse and finished(out, run.steps):
            note = "kept from an earlier invocation"
        else:
            if "path" not in tok:
                tok["path"] = prepare_tokenizer(work, reuse)
            train(run, work, tok["path"])
            note = f"{time.perf_counter() - t0:.0f} s"
            with open(os.path.join(work, LOAD_AT_END), "w") as f:
                f.write(", ".join(f"{x:.1f}" for x in os.getloadavg()))
        res = rep.load_result(run, out)
        print(f"[{i}/{len(runs)}] {run.tag}: final val loss {res.final:.4f} ({note})",
              file=sys.stderr, flush=True)
        results.append(res)
    return results


def parse_args(argv=None):
    p = Parser(prog="benchmarks/convergence.py", description=__doc__)
    p.add_argument("--widths", default="128,256", help="model widths d, smallest first")
    p.add_argument("--steps", default="200,120",
                   help="full rank's steps at each width (sets the FLOP budget)")
    p.add_argument("--seeds", type=int, default=2, help="seeds at the smallest width (1 at others)")
    p.add_argument("--lrs", default="1e-3,3e-3,1e-2",
                   help="learning rates swept per arch; one value: no sweep, all use it")
    p.add_argument("--sweep-frac", type=float, default=0.25,
                   help="the sweep's budget as a fraction of the smallest width's")
    p.add_argument("--archs", default=",".join(rep.ARCHS))
    p.add_argument("--work", default=os.path.join(ROOT, "runs", "convergence"))
    add_out(p, os.path.join(RESULTS, "convergence.md"), "the report (and its .png beside it)")
    p.add_argument("--reuse", action="store_true",
                   help="keep runs finished in --work (same settings) instead of retraining")
    a = p.parse_args(argv)
    guard_out(a.out, os.path.splitext(a.out)[0] + ".png", force=a.force)
    try:
        a.widths = [int(x) for x in a.widths.split(",")]
        a.steps = [int(x) for x in a.steps.split(",")]
        a.lrs = [float(x) for x in a.lrs.split(",")]
    except ValueError as e:
        p.error(f"--widths/--steps take integers and --lrs numbers, comma-separated ({e})")
    a.archs = a.archs.split(",")
    if len(a.steps) != len(a.widths) or min(a.steps + a.widths) < 1:
        p.error("--steps needs one positive step count per width in --widths")
    if "full" not in a.archs or not set(a.archs) <= set(rep.ARCHS) or len(a.archs) < 2:
        p.error(f"--archs must name full rank and at least one of {list(rep.ARCHS[1:])}")
    if a.seeds < 1 or not 0 < a.sweep_frac <= 1 or min(a.lrs) <= 0:
        p.error("--seeds must be >= 1, --sweep-frac in (0, 1] and --lrs positive")
    return a


def plan(a, lr_of: dict, phase: str) -> list:
    runs = []
    for i, (w, n) in enumerate(zip(a.widths, a.steps)):
        if phase == "sweep" and i:
            break
        full = max(1, round(n * a.sweep_frac)) if phase == "sweep" else n
        steps = equal_flop_steps(a.archs, w, full)
        seeds = range(a.seeds if i == 0 and phase == "main" else 1)
        for arch in [x for x in a.archs if x in lr_of]:
            for lr in lr_of[arch]:
                runs += [rep.Run(arch, w, s, lr, steps[arch], phase) for s in seeds]
    return runs


def extend_lr(tried: list, best: float) -> float | None:
    """The next learning rate past an end of the grid when the best sits on that end (by the
    grid's ratio there), else None: a chosen lr should have a worse neighbour on each side."""
    tried = sorted(tried)
    if len(tried) < 2 or tried[0] < best < tried[-1]:
        return None
    lo, hi = (tried[0], tried[1]) if best == tried[0] else (tried[-2], tried[-1])
    return float(f"{best * (lo / hi if best == tried[0] else hi / lo):.3g}")


def sweep_lrs(a, tok: dict) -> tuple[list, dict]:
    """Sweep --lrs per arch at the smallest width; where an arch's best is at an end of the grid,
    extend the grid on that side (at most MAX_EXTEND times). Returns (results, chosen lr)."""
    results = execute(plan(a, {x: a.lrs for x in a.archs}, "sweep"), a.work, a.reuse, tok)
    for _ in range(MAX_EXTEND):
        more = {}
        for arch, best in rep.pick_lrs(results).items():
            nxt = extend_lr([r.run.lr for r in results if r.run.arch == arch], best)
            if nxt is not None:
                more[arch] = [nxt]
        if not more:
            break
        results += execute(plan(a, more, "sweep"), a.work, a.reuse, tok)
    return results, rep.pick_lrs(results)


def main_lrs(sweep: list, chosen: dict) -> dict:
    """Each arch at its chosen lr; full rank, the reference, also at its runner-up, and the
    better of the two is compared: an lr picked on a short budget must not handicap it."""
    lrs = {arch: [lr] for arch, lr in chosen.items()}
    second = rep.runner_up_lr(sweep, "full")
    if second is not None:
        lrs["full"].append(second)
    return lrs


def process_seconds(work: str, results: list) -> float:
    total = 0.0
    for r in results:
        path = os.path.join(work, r.run.tag, PROCESS_S)
        if os.path.exists(path):
            with open(path) as f:
                total += float(f.read())
    return total


def wall_sentence(results: list) -> str:
    """Training seconds and steps of each low-rank arch relative to full rank's reference run."""
    secs, steps = [], []
    for w in sorted({r.run.width for r in results}):
        ref_lr = rep.reference_lr(results, w)
        seed0 = {r.run.arch: r for r in results if r.run.width == w and r.run.seed == 0
                 and (r.run.arch != "full" or r.run.lr == ref_lr)}
        full = seed0.pop("full")
        secs.append(f"at d={w} " + ", ".join(
            f"{arch} {r.train_s / full.train_s:.2f}×" for arch, r in seed0.items()))
        steps.append(f"{max(r.run.steps for r in seed0.values()) / full.run.steps:.2f}× at d={w}")
    return (f"For the same FLOPs the low-rank archs take {' and '.join(steps)} full rank's "
            "optimizer steps; in runs this short the number of steps weighs heavily, so the "
            "verdict says which arch gets more out of this budget, not which is better per FLOP "
            "at scale. Training seconds for the same FLOPs, relative to full rank (seed 0): "
            + "; ".join(secs) + ".")


OPTIMIZER_NAMES = {"adamw": "AdamW", "adafactor": "Adafactor", "lion": "Lion",
                   "sgd-momentum": "SGD with momentum"}


def optimizer_text(o) -> str:
    """The optimizer and schedule every run of the study used (`optim.*` of BASE_CONFIG)."""
    after = {"cosine": f"cosine to {o.min_lr_ratio:g}× lr", "linear":
             f"linear to {o.min_lr_ratio:g}× lr", "constant": "constant", "wsd":
             f"constant, the last {o.decay_frac:g} linear to {o.min_lr_ratio:g}× lr"}
    return (f"{OPTIMIZER_NAMES[o.name]} (weight decay {o.weight_decay:g}, clip "
            f"{o.clip_norm:g}), warmup {o.warmup_frac:g} of the steps then {after[o.schedule]}")


def report(a, sweep: list, chosen: dict, results: list) -> str:
    from boost_jax.config import load_config

    cfg = load_config(BASE_CONFIG, ["data.tokenizer=bpe", "model.vocab_size=null"])
    d, t, o = cfg.data, cfg.train, cfg.optim
    default = ["--out", os.path.join(RESULTS, "convergence.md")]
    args = [x for x in sys.argv[1:] if x != "--reuse"]
    cmd = " ".join(["python benchmarks/convergence.py"] + ([] if args == default else args))
    noise = rep.seed_spread(results, a.widths[0])
    vs = rep.verdicts(results, noise)
    spent = process_seconds(a.work, sweep + results)
    # the load when the last run finished training (a --reuse report is written later)
    at_end = os.path.join(a.work, LOAD_AT_END)
    load = open(at_end).read().strip() if os.path.exists(at_end) else \
        ", ".join(f"{x:.1f}" for x in os.getloadavg())
    lr_text = (f"Each arch's learning rate is the one with the lowest final validation loss in a "
               f"sweep at d={a.widths[0]} (seed 0, {a.sweep_frac:g} of that width's FLOP budget, "
               f"each run with its own schedule; where the best was at an end of the grid, the "
               f"grid was extended on that side by the same factor, up to {MAX_EXTEND} times), "
               f"used at every width (\"-\": not tried). Full rank, the reference, is also run "
               f"at its runner-up and compared at the better of the two, so that an lr chosen "
               f"on a short budget does not handicap it:\n\n"
               f"{rep.sweep_table(sweep, chosen)}\n" if sweep else
               f"Every arch uses lr {a.lrs[0]:g} (a single value was given: no sweep).\n")
    return f"""# Learning per FLOP: low rank vs full rank at equal training FLOPs

Reproduce: `{cmd}` (`make convergence`; {len(sweep) + len(results)} `train.py` runs, \
{spent / 60:.0f} min of run time on this 2-core machine, load average at the end {load}).

Corpus: `data.source={d.source}` (configs/demo.yaml, the first {d.max_bytes / 1e6:g} MB), \
byte-level BPE of {d.bpe_vocab_size} tokens trained once on the training split and shared by \
every run. {cfg.model.n_layers} layers, head dim 32, SwiGLU d_ff = 8/3·d (rounded up to a \
multiple of 8), rank d/4 for the low-rank archs; {t.global_batch} × {d.seq_len} tokens per \
step, {optimizer_text(o)}, fp32, one CPU device. \
Within a width every arch gets full rank's training FLOPs (FLOPs per token from \
`boost_jax.analysis.flops`, the count train.py's MFU uses) and the same data order \
(`data.seed={d.seed}`); the low-rank archs take more steps for it. \
Seeds vary the initial weights (`train.seed`): {a.seeds} at d={a.widths[0]}, 1 at larger widths.

## Learning rate

{lr_text}
## Validation loss at equal training FLOPs

{rep.main_table(results, vs)}

{chr(10).join(rep.sentences(vs, noise, a.widths[0], a.seeds))}

{wall_sentence(results)} "Training s" adds up the step times train.py logs (no compilation, \
evaluation or checkpoints); the runs ran one after another on a shared machine, so it carries \
the load of the moment, and a FLOP is not a second on this CPU. Plot: `convergence.png` beside \
this file (validation loss against training FLOPs and against training seconds, one row per \
width; full rank black, at its other lr gray, svd orange, cola blue, lax green; seed 1 dashed).

What this does not show: these are short runs (the token counts above) of small models; the \
verdict is about this budget and this data, not about training to convergence at scale. The \
seed spread varies the initial weights only; the data order is the same in every run.
"""


@cli_main
def main(argv=None):
    a = parse_args(argv)
    claim_work(a.work)
    tok: dict = {}
    sweep = []
    if len(a.lrs) > 1:
        sweep, chosen = sweep_lrs(a, tok)
    else:
        chosen = {x: a.lrs[0] for x in a.archs}
    results = execute(plan(a, main_lrs(sweep, chosen), "main"), a.work, a.reuse, tok)
    png = os.path.splitext(a.out)[0] + ".png"
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    rep.plot(results, png)
    text = report(a, sweep, chosen, results)
    with open(a.out, "w") as f:
        f.write(text)
    print(text)
    sync_readme(a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
