"""python -m boost_jax.data.prepare's memory, which must not grow with the corpus."""

import os
import subprocess
import sys

from train_proc import ROOT

PEAK = """
import resource, sys
from boost_jax.data.prepare import main
try:
    main(sys.argv[1:])
except SystemExit as e:
    assert not e.code, e.code
# VmHWM: this process's own peak (ru_maxrss would include the pytest process it was forked from)
me = next(int(ln.split()[1]) for ln in open("/proc/self/status") if ln.startswith("VmHWM"))
print("PEAK_KB", me, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)
"""


def _peak_kb(src, out, workers=2):
    env = dict(os.environ, PYTHONPATH=ROOT)
    p = subprocess.run([sys.executable, "-c", PEAK, str(src), str(out), "--tokenizer", "byte",
                        "--workers", str(workers), "--no-progress"], env=env, cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    me, kids = (int(x) for x in p.stdout.split("PEAK_KB")[1].split())
    return me, kids


def test_memory_does_not_grow_with_the_corpus(tmp_path):
    """Preparing a 64 MiB text file (128 MiB of uint16 ids) takes no more memory than a 16 MiB
    one (each process's peak RSS within 32 MiB, while the extra 48 MiB of text alone would
    add 96 MiB of ids if they were held), and every process stays far below the size
    of the corpus: memory depends on the task size and worker count, not on the corpus."""
    line = ("def f(x):\n    return x * 2  # " + "é" * 20 + "\n").encode()
    block = line * ((1 << 20) // len(line))
    small, big = tmp_path / "small.txt", tmp_path / "big.txt"
    for path, mib in ((small, 16), (big, 64)):
        with open(path, "wb") as f:
            for _ in range(mib):
                f.write(block)
    base = _peak_kb(small, tmp_path / "small.bin")
    peak = _peak_kb(big, tmp_path / "big.bin")
    assert os.path.getsize(tmp_path / "big.bin") > 120 << 20
    assert peak[0] - base[0] < 32 << 10 and peak[1] - base[1] < 32 << 10, (base, peak)
    assert max(peak) < 128 << 10, peak  # KiB: under 128 MiB each, the ids alone are 128 MiB
