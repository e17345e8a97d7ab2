"""The planner's `--search` against an earlier commit's, timed side by side, outputs compared.

    python benchmarks/search_speed.py [--base b6b3777] [--rounds 3]
                                      [--out benchmarks/results/search_speed.md]

Checks `--base` out into a temporary git worktree and runs each search below there and in this
checkout in alternating rounds (same Python, same machine), as separate processes timed from
start to exit. The two outputs must be identical, byte for byte: a speed-up that changed a
ranking would be a different planner. The default base is the last commit before the search
cached its per-pass collective lists and state counts (boost_jax/plan/costmodel.py).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from benchmarks.common import (RESULTS, add_out, refuse, positive_int, guard_out, load_note, markdown_table,  # noqa: E402
                               reproduce_command, spread_verdict, write_result)

SEARCHES = {
    "CoLA-7B, Frontier 48 nodes, 768 sequences":
        ["--config", "configs/cola-7b.yaml", "--topology", "frontier", "--nodes", "48",
         "train.global_batch=768"],
    "CoLA-1B, Frontier 8 nodes": ["--config", "configs/cola-1b.yaml", "--topology", "frontier",
                                  "--nodes", "8"],
}


def run(root: str, args: list) -> tuple[float, bytes]:
    """(wall seconds, stdout) of one search run from the checkout at `root`."""
    cmd = [sys.executable, "-m", "boost_jax.plan", *args, "--search", "--no-compile"]
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=root)
    t0 = time.perf_counter()
    p = subprocess.run(cmd, cwd=root, env=env, capture_output=True, timeout=900)
    took = time.perf_counter() - t0
    if p.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} in {root} exited {p.returncode}:\n"
                         f"{p.stderr.decode()[-2000:]}")
    return took, p.stdout


def measure(base: str, rounds: int) -> dict:
    """{search: (base seconds per round, ours per round)}, outputs checked equal."""
    with tempfile.TemporaryDirectory() as tmp:
        tree = os.path.join(tmp, "base")
        made = subprocess.run(["git", "-C", ROOT, "worktree", "add", "--detach", "-q", tree,
                               base], capture_output=True, text=True)
        if made.returncode != 0:
            refuse(f"--base {base!r} is not a revision git can check out; give a commit of this "
                   "repository, e.g. --base HEAD~1")
        try:
            out = {}
            for name, args in SEARCHES.items():
                old, new = [], []
                for _ in range(rounds):
                    (t_old, o_old), (t_new, o_new) = run(tree, args), run(ROOT, args)
                    if o_old != o_new:
                        raise SystemExit(f"{name}: the search output differs from {base}'s")
                    old.append(t_old)
                    new.append(t_new)
                out[name] = (old, new)
        finally:
            subprocess.run(["git", "-C", ROOT, "worktree", "remove", "--force", tree],
                           check=False)
    return out


def report(r: dict, base: str) -> str:
    rows, verdicts = [], []
    for name, (old, new) in r.items():
        ratios = [n / o for o, n in zip(old, new)]
        rows.append((name, " / ".join(f"{t:.1f}" for t in old),
                     " / ".join(f"{t:.1f}" for t in new),
                     f"{min(ratios):.2f}–{max(ratios):.2f}"))
        verdicts.append(f"{name}: " + spread_verdict(ratios, "this checkout", base))
    table = markdown_table(["search (`--search --no-compile`)", f"{base} s per round",
                            "this checkout s per round", "time ratio per round"], rows)
    return f"""# Planner search time against {base}

Reproduce: `{reproduce_command("search_speed.py")}` (writes `results/search_speed.md`, copied
here). Each search ran as its own process from `{base}` (a git worktree) and from this
checkout, alternating, {len(next(iter(r.values()))[0])} rounds; both printed the same output,
byte for byte. Wall seconds from start to exit, Python start-up and imports included;
{load_note()}.

{table}

{"; ".join(verdicts)}.
"""


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", default="b6b3777", help="the git revision to time against")
    p.add_argument("--rounds", type=positive_int, default=3)
    add_out(p, os.path.join(RESULTS, "search_speed.md"))
    args = p.parse_args()
    guard_out(args.out, force=args.force)
    doc = report(measure(args.base, args.rounds), args.base)
    write_result(args.out, doc)
    print(doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
