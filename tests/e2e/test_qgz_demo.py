"""ZeRO++'s int4 gradients (qgZ, on by default in zeropp) train the demo as well as unquantized
gradients: the real train.py, twice (benchmarks/qgz_demo.py holds the command and tolerances)."""

from benchmarks.qgz_demo import STEP_TOL, STEPS, VAL_TOL, run_pair


def test_qgz_demo_stays_within_tolerance_of_unquantized(tmp_path):
    r = run_pair(str(tmp_path))
    assert sorted(r["bf16"]["loss"]) == list(range(1, STEPS + 1))
    assert r["max_step_diff"] <= STEP_TOL, r["step_diff"]
    assert abs(r["val_diff"]) <= VAL_TOL, (r["int4"]["val_loss"], r["bf16"]["val_loss"])
    assert r["max_step_diff"] > 1e-5  # the int4 run did quantize
    q = r["int4"]["loss"]
    assert q[STEPS] < q[1] - 1.0  # and learned
