"""benchmarks/convergence.py's analysis, in-process: the wall-clock reconstruction from
metrics.jsonl, the learning-rate grid's extension and the verdict against the seed spread
(tests/e2e/test_convergence.py: the script itself on synthetic runs)."""

import json
import sys

import pytest

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


def test_seed_spread_counts_only_the_runs_the_verdicts_compare():
    """Full rank's rejected lr (a wide seed gap) does not widen the 'matches' criterion."""
    def res(arch, lr, seed, final):
        return rep.Result(rep.Run(arch, 128, seed, lr, 200, "main"), 1, 1.0, 1, final=final)
    results = [res("full", 0.003, 0, 4.90), res("full", 0.003, 1, 5.00),
               res("full", 0.01, 0, 4.96), res("full", 0.01, 1, 5.22),
               res("cola", 0.003, 0, 4.60), res("cola", 0.003, 1, 4.65)]
    assert rep.seed_spread(results, 128) == pytest.approx(0.10)
    assert rep.seed_spread(results[:1] + results[4:5], 128) is None
