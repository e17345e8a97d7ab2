"""Shared benchmark helpers: device setup from argv, interleaved median timing, Markdown tables."""

from __future__ import annotations

import os
import statistics
import sys
import time
from typing import Callable, Sequence


def early_cpu_devices(default: int | None = None) -> None:
    """Honour `--cpu-devices N` before JAX starts (call at import time of the script)."""
    n = default
    if "--cpu-devices" in sys.argv:
        n = int(sys.argv[sys.argv.index("--cpu-devices") + 1])
    if n:
        from boost_jax.mesh import set_cpu_devices

        set_cpu_devices(n)


def interleaved_samples(fns: dict[str, Callable[[], object]], rounds: int = 5,
                        iters: int = 3, warmup: int = 2,
                        deadline: float | None = None) -> dict[str, list[float]]:
    """Seconds per call of each fn in each round, timed in alternating rounds so drift hits
    all alike. Each fn must block until its result is ready (e.g. end with
    jax.block_until_ready). Past `deadline` (a time.perf_counter() value) no new round starts
    after the first."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    samples: dict[str, list[float]] = {k: [] for k in fns}
    for i in range(rounds):
        if i and deadline is not None and time.perf_counter() > deadline:
            break
        for name, fn in fns.items():
            t0 = time.perf_counter()
            for _ in range(iters):
                fn()
            samples[name].append((time.perf_counter() - t0) / iters)
    return samples


def interleaved_median(fns: dict[str, Callable[[], object]], rounds: int = 5,
                       iters: int = 3, warmup: int = 2) -> dict[str, float]:
    """Median over rounds of interleaved_samples."""
    return {k: statistics.median(v)
            for k, v in interleaved_samples(fns, rounds, iters, warmup).items()}


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    def fmt(v):
        if isinstance(v, float):
            return f"{v:,.4g}" if abs(v) < 1e4 else f"{v:,.0f}"
        return str(v)

    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(fmt(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


README = os.path.join(os.path.dirname(os.path.abspath(__file__)), "README.md")
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def load_note() -> str:
    """The machine's load average, for timing figures taken on a shared machine."""
    one, five, fifteen = os.getloadavg()
    return f"load average {one:.1f}, {five:.1f}, {fifteen:.1f} on {os.cpu_count()} cores"


def spread_verdict(ratios: Sequence[float], subject: str, other: str) -> str:
    """`subject` time / `other` time per round → the sentence the figure allows: a range that
    holds 1 is no measurable difference, never a speed-up."""
    lo, hi = min(ratios), max(ratios)
    if lo <= 1.0 <= hi:
        return (f"the time ratio per round, {lo:.3f}–{hi:.3f}, holds 1: **no measurable "
                f"difference** between {subject} and {other}")
    word = "faster" if hi < 1.0 else "slower"
    return (f"{subject} is {word} than {other} in every round (time ratio per round "
            f"{lo:.3f}–{hi:.3f})")


def write_result(path: str, doc: str) -> None:
    """Write a results file and copy it into benchmarks/README.md (sync_readme)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        f.write(doc.rstrip() + "\n")
    sync_readme(path)


def readme_body(results_path: str) -> str:
    """A results file as the README embeds it: its Markdown headings one level down."""
    with open(results_path) as f:
        body = f.read().strip()
    out, fenced = [], False
    for line in body.splitlines():
        fenced ^= line.startswith("```")
        out.append("#" + line if line.startswith("#") and not fenced else line)
    return "\n".join(out)


def readme_blocks(text: str) -> dict[str, str]:
    """{"results/NAME.md": the README's copy} for every marked block of a README text."""
    import re

    pat = re.compile(r"<!-- (results/[\w.-]+\.md) -->\n(.*?)\n?<!-- end \1 -->", re.S)
    return {m.group(1): m.group(2) for m in pat.finditer(text)}


def sync_readme(results_path: str) -> None:
    """Copy a results file into benchmarks/README.md between its markers

        <!-- results/NAME.md -->  ...  <!-- end results/NAME.md -->

    so the README shows each figure exactly as the script that measured it wrote it (its
    headings one level down). A README without the markers is left alone."""
    name = "results/" + os.path.basename(results_path)
    begin, end = f"<!-- {name} -->", f"<!-- end {name} -->"
    with open(README) as f:
        text = f.read()
    if begin not in text or end not in text:
        return
    body = readme_body(results_path)
    head, rest = text.split(begin, 1)
    _, tail = rest.split(end, 1)
    with open(README, "w") as f:
        f.write(f"{head}{begin}\n{body}\n{end}{tail}")


def reproduce_command(script: str) -> str:
    """`python benchmarks/SCRIPT ARGS` as it was run, without --out and its value."""
    args, skip = [], False
    for x in sys.argv[1:]:
        if skip:
            skip = False
        elif x == "--out":
            skip = True
        elif not x.startswith("--out="):
            args.append(x)
    return " ".join([f"python benchmarks/{script}", *args])
