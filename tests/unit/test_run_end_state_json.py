"""A run's JSON outputs hold a non-finite number as JSON null plus a `*_nonfinite` flag, never a
bare NaN (tests/e2e/test_run_end_state.py: the same through a real train.py run)."""

import json

from strict_json import _no_constant


def test_json_dumps_writes_null_and_a_flag_for_every_nonfinite_number():
    from boost_jax.cli import json_dumps

    text = json_dumps({"loss": float("nan"), "perf": {"mfu": float("inf"), "ok": 1.5},
                       "curve": [1.0, -float("inf")], "steps": 3})
    assert json.loads(text, parse_constant=_no_constant) == {
        "loss": None, "loss_nonfinite": True, "perf": {"mfu": None, "mfu_nonfinite": True,
                                                       "ok": 1.5},
        "curve": [1.0, None], "steps": 3}
