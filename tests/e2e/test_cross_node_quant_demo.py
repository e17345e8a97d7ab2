"""hierarchical's quantized cross-node legs (int8 weights, int8 or int4 gradients across nodes)
train the demo as well as unquantized ones: the real train.py, three times
(benchmarks/cross_node_quant_demo.py holds the commands; the tolerances are the qgZ study's)."""

from benchmarks.cross_node_quant_demo import RUNS, STEP_TOL, STEPS, VAL_TOL, run_all


def test_quantized_cross_node_legs_stay_within_tolerance_of_unquantized(tmp_path):
    r = run_all(str(tmp_path))
    base = r["runs"]["unquantized"]["loss"]
    assert sorted(base) == list(range(1, STEPS + 1))
    for name in list(RUNS)[1:]:
        assert r["max_step_diff"][name] <= STEP_TOL, (name, r["step_diff"][name])
        assert abs(r["val_diff"][name]) <= VAL_TOL, (name, r["val_diff"][name])
        assert r["max_step_diff"][name] > 1e-5  # it did quantize
        q = r["runs"][name]["loss"]
        assert q[STEPS] < q[1] - 1.0  # and learned
