"""The cpu topology's peak FLOP/s setting, as the planner's command line reports a bad one."""


def test_bad_cpu_peak_setting_is_a_one_line_error():
    import os
    import subprocess
    import sys

    env = dict(os.environ, BOOST_JAX_CPU_PEAK_FLOPS="fast")
    p = subprocess.run([sys.executable, "-m", "boost_jax.plan", "--config", "configs/demo.yaml",
                        "--topology", "cpu", "--no-compile"], env=env, capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 2, p.stderr
    assert p.stderr.strip() == ("error: BOOST_JAX_CPU_PEAK_FLOPS='fast' is not a positive number "
                                "of FLOP/s per device; set it to e.g. 5e10 or unset it to "
                                "measure this machine")
