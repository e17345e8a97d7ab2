"""Where a training step's device time goes, per variant: a profiler trace of a few steps,
summed by kernel name (device streams only) -> a table per variant, and the traces.

    python benchmarks/gpu_profile.py --config configs/cola-1b.yaml --set model.n_layers=4 \
        --variant cola model.arch=cola --variant btp parallel.tp_mode=btp parallel.tp_axes=[pair] \
        --out DIR

Used on the lent GPU to find why one variant is slower than another (benchmarks/README.md §7);
each variant is built as benchmarks/train_speed.py builds it.
"""
from __future__ import annotations

import argparse
import collections
import gzip
import json
import re
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import jax  # noqa: E402

from benchmarks.common import add_out, guard_out  # noqa: E402
from benchmarks.train_speed import prepare  # noqa: E402
from boost_jax.config import load_config  # noqa: E402


def device_kernels(trace: dict) -> dict:
    """{thread name: Counter(event name -> summed µs)} for the device's processes of a
    perfetto trace (on a GPU: its streams and the XLA ops / modules lines)."""
    events = trace.get("traceEvents", [])
    procs = {e["pid"]: e.get("args", {}).get("name", "") for e in events
             if e.get("ph") == "M" and e.get("name") == "process_name"}
    threads = {(e["pid"], e.get("tid")): e.get("args", {}).get("name", "") for e in events
               if e.get("ph") == "M" and e.get("name") == "thread_name"}
    device = {pid for pid, n in procs.items() if "/device:" in n and "CPU" not in n}
    if not device:  # a CPU run: the host's lines stand in
        device = set(procs)
    out: dict = collections.defaultdict(collections.Counter)
    for e in events:
        if e.get("ph") == "X" and e.get("pid") in device:
            line = f"{procs[e['pid']][:40]} | {threads.get((e['pid'], e.get('tid')), '?')}"
            out[line][e.get("name", "?")] += float(e.get("dur", 0))
    return out


def profile(name, cfg, out: Path, steps: int, top: int) -> dict:
    step, _, info = prepare(name, cfg)
    for _ in range(2):
        step().block_until_ready()
    tmp = Path(tempfile.mkdtemp())
    with jax.profiler.trace(str(tmp), create_perfetto_trace=True):
        for _ in range(steps):
            step().block_until_ready()
    found = sorted(tmp.rglob("*.trace.json.gz"))
    if not found:
        raise SystemExit(f"error: no perfetto trace under {tmp}")
    shutil.copy(found[-1], out / f"{name}.trace.json.gz")
    with gzip.open(found[-1], "rt") as f:
        lines = device_kernels(json.load(f))
    ranked = sorted(lines.items(), key=lambda kv: -sum(kv[1].values()))
    print(f"\n## {name}: temp {info['temp_gib']:.2f} GiB; device lines, ms per step:")
    for line, sums in ranked:
        print(f"  {sum(sums.values()) / steps / 1e3:9.3f} ms  {len(sums):5d} names  {line}")
    for line, sums in ranked[:2]:
        total = sum(sums.values()) / steps
        print(f"# {name} | {line}: top {top}")
        for k, v in sums.most_common(top):
            print(f"{v / steps / 1e3:9.3f} ms {100 * v / steps / total:5.1f}%  {k[:100]}")
    return dict(variant=name, lines={line: dict(sums.most_common(80))
                                     for line, sums in ranked[:4]}, steps=steps)


CLASSES = (  # first match wins; names as the H200's CUDA 13 libraries and XLA print them
    ("fp32 GEMM", re.compile(r"f32f32|sgemm|_ffma_")),
    ("Pallas kernel", re.compile(r"^(norm_matmul|grouped_gemm|concat_down|online_rmsnorm)")),
    ("bf16 GEMM", re.compile(r"gemm|nvjet|cutlass|xmma|dot")),
    ("attention (cuDNN)", re.compile(r"sdpa|cudnn")),
    ("other (fusions, copies)", re.compile(r"")),
)


def report(rows: list) -> str:
    """Markdown: each variant's device time per step by kernel class (top-80 kernels)."""
    head = ["variant", "device ms/step"] + [c for c, _ in CLASSES]
    body = []
    for r in rows:
        sums = collections.Counter()
        line = max(r["lines"].values(), key=lambda d: sum(d.values()))
        for name, us in line.items():
            sums[next(c for c, rx in CLASSES if rx.search(name))] += us / r["steps"] / 1e3
        body.append([r["variant"], f"{sum(sums.values()):.1f}"]
                    + [f"{sums[c]:.1f}" for c, _ in CLASSES])
    return "\n".join(["| " + " | ".join(x) + " |" for x in
                      [head, ["---"] * len(head), *body]]) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config")
    p.add_argument("--set", nargs="*", default=[])
    p.add_argument("--variant", nargs="+", action="append",
                   metavar="NAME OVERRIDE")
    add_out(p, None, "profile.json, profile.md and the traces (a folder)")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--report", metavar="PROFILE_JSON",
                   help="only print the class table of an earlier run's profile.json")
    a = p.parse_args(argv)
    if a.report:
        print(report(json.loads(Path(a.report).read_text())), end="")
        return 0
    if not (a.config and a.variant and a.out):
        p.error("--config, --variant and --out are needed (or --report FILE)")
    out = Path(a.out)
    guard_out(str(out / "profile.json"), str(out / "profile.md"), force=a.force,
              inputs={"--config": a.config})
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for name, *overrides in a.variant:
        cfg = load_config(a.config, [*a.set, "train.steps=1000000", *overrides])
        rows.append(profile(name, cfg, out, a.steps, a.top))
    (out / "profile.json").write_text(json.dumps(rows, indent=1))
    (out / "profile.md").write_text(report(rows))
    print(report(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
