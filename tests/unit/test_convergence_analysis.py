"""benchmarks/convergence.py's analysis, in-process: the wall-clock reconstruction from
metrics.jsonl, the learning-rate grid's extension and the verdict against the seed spread
(tests/e2e/test_convergence.py: the script itself on synthetic runs)."""

import json
import sys

from train_proc import ROOT

sys.path.insert(0, ROOT)

from benchmarks import convergence as conv  # noqa: E402
from benchmarks import convergence_report as rep  # noqa: E402


def test_read_curve_adds_step_times_per_window(tmp_path):
    path = tmp_path / "metrics.jsonl"
    rows = [{"step": 0, "val_loss": 8.0},
            {"step": 3, "loss": 7.0},  # first logged step after compile: no timing yet
            {"step": 6, "loss": 6.5, "step_time_s": 0.5, "val_loss": 6.4},
            {"step": 8, "loss": 6.0, "step_time_s": 2.0, "val_loss": "nan"}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert rep.read_curve(str(path)) == [(0, 0.0, 8.0), (6, 3.0, 6.4), (8, 7.0, float("inf"))]


def test_lr_grid_extends_past_the_end_holding_the_best():
    assert conv.extend_lr([1e-3, 3e-3, 1e-2], 1e-2) == 0.0333
    assert conv.extend_lr([3e-3, 1e-3], 1e-3) == 0.000333
    assert conv.extend_lr([1e-3, 3e-3, 1e-2], 3e-3) is None


def test_verdict_against_the_seed_spread():
    assert [rep.verdict(d, 0.05) for d in (0.04, -0.05, -0.06, 0.07)] == [
        "match", "match", "better", "worse"]
    assert rep.verdict(0.3, None) == "unknown"
