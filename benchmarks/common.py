"""Shared benchmark helpers: device setup from argv, interleaved median timing, Markdown tables."""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Callable, Sequence


def early_cpu_devices(default: int | None = None) -> None:
    """Honour `--cpu-devices N` before JAX starts (call at import time of the script)."""
    n = default
    for i, arg in enumerate(sys.argv):
        value = (sys.argv[i + 1] if i + 1 < len(sys.argv) else "") if arg == "--cpu-devices" \
            else arg.split("=", 1)[1] if arg.startswith("--cpu-devices=") else None
        if value is None:
            continue
        if not value.isdigit() or int(value) < 1:
            refuse(f"--cpu-devices {value!r} is not a device count; give a whole number ≥ 1, "
                   "e.g. --cpu-devices 8")
        n = int(value)
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


def refuse(message: str) -> None:
    """Bad input: one line on stderr, exit 2 (the project's rule for every command)."""
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def positive_int(text: str) -> int:
    """argparse type: a whole number ≥ 1 (a count of rounds, devices, ...)."""
    if not text.strip().isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number ≥ 1")
    return int(text)


def add_out(p, default: str | None, what: str = "the Markdown report") -> None:
    """`--out` and `--force` for a script that writes: its own files are those under
    benchmarks/results/ (and the defaults it names to guard_out); anything else that exists
    is the user's, replaced only with --force (guard_out)."""
    p.add_argument("--out", default=default, help=f"where to write {what}")
    p.add_argument("--force", action="store_true",
                   help="replace existing output files outside benchmarks/results/")


def add_json(p, force: bool = True) -> None:
    """`--json FILE` (and `--force`, unless the script's add_out gave it): the rows as JSON; an
    existing file is replaced only with --force (guard_out), as gpu.sh passes in its own run
    folder."""
    p.add_argument("--json", default=None, metavar="FILE",
                   help="also write the rows to this JSON file")
    if force:
        p.add_argument("--force", action="store_true", help="replace an existing --json file")


def ours(path: str, own: Sequence[str] = ()) -> bool:
    """Is `path` one of the files the benchmark scripts own: under benchmarks/results/, or one
    of `own` (a script's default outputs elsewhere)?"""
    real = os.path.realpath(path)
    return (real.startswith(os.path.realpath(RESULTS) + os.sep)
            or real in {os.path.realpath(o) for o in own})


def guard_out(*paths: str | None, force: bool, own: Sequence[str] = (),
              inputs: dict | None = None) -> None:
    """Before any work: exit 2 with one line if a file this run would write is no file it could
    replace (an empty path or a folder's name; a link, FIFO, device, socket or folder), is or
    holds one of the run's `inputs` ({label: path}) (--force lifts neither), or exists and is
    not ours (a user's file) without --force. Nothing is written on refusal."""
    from boost_jax.safe_write import Refused, check_target

    for path in paths:
        if path is None:
            continue
        try:  # existence is judged below: ours is replaced without --force
            check_target(path, inputs or {}, True, f"the output {path!r}", "choose another file")
        except Refused as e:
            refuse(str(e))
        if os.path.lexists(path) and not force and not ours(path, own):
            refuse(f"{path} exists and is not a benchmarks/results/ file; choose another file "
                   "or pass --force to replace it")


def write_result(path: str, doc: str) -> None:
    """Write a results file whole (a temp file renamed over it: an interrupted run leaves the
    old one) and, when it is one of benchmarks/results/, copy it into benchmarks/README.md
    (sync_readme). guard_out has checked `path` before the run."""
    from boost_jax.errors import UserError
    from boost_jax.safe_write import write_text

    try:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        write_text(path, doc.rstrip() + "\n", force=True)
    except OSError as e:
        refuse(f"cannot write {path!r} ({e.strerror or e}); choose another file")
    except UserError as e:  # it became a link or a FIFO since guard_out looked
        refuse(str(e))
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
    headings one level down). A README without the markers is left alone, and so is the README
    when the file is not one of benchmarks/results/ (a scratch --out)."""
    real = os.path.realpath(results_path)
    if os.path.dirname(real) != os.path.realpath(RESULTS):  # not a sub-folder's file either
        return
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
