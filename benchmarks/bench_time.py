"""The last step of `make bench`: how long regenerating every CPU figure took, into
benchmarks/results/bench.md (copied into benchmarks/README.md).

    python benchmarks/bench_time.py --since EPOCH_SECONDS
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import RESULTS, add_out, guard_out, load_note, write_result  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--since", type=float, required=True, help="when make bench started (epoch s)")
    add_out(p, os.path.join(RESULTS, "bench.md"))
    a = p.parse_args()
    guard_out(a.out, force=a.force)
    minutes = (time.time() - a.since) / 60
    start = datetime.datetime.fromtimestamp(a.since, datetime.timezone.utc)
    doc = f"""# `make bench`: every CPU figure, one command

`make bench` (the recipe in the Makefile; this file is written by `benchmarks/bench_time.py`,
its last step) re-ran every script below that writes a CPU figure — not the GPU check
(section 7) and not `make convergence` — in {minutes:.1f} minutes, started
{start:%Y-%m-%d %H:%M} UTC; {load_note()} at the end (the machine is shared: other processes
ran beside it, so the timing figures carry the load they were taken under).
"""
    write_result(a.out, doc)
    print(doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
