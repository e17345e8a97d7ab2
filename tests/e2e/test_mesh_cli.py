"""The cpu topology's peak FLOP/s setting, as the planner and train.py report a bad one."""


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


def test_train_refuses_a_bad_cpu_peak_setting_before_it_writes(tmp_path):
    import os
    import subprocess
    import sys

    out = tmp_path / "run"
    env = dict(os.environ, BOOST_JAX_CPU_PEAK_FLOPS="fast")
    p = subprocess.run([sys.executable, "train.py", "--config", "configs/demo.yaml",
                        "model.n_layers=1", "model.d_model=32", "model.n_heads=2",
                        "model.d_ff=64", "model.rank=8", f"out_dir={out}"], env=env,
                       capture_output=True, text=True, timeout=240)
    assert p.returncode == 2, p.stderr
    assert p.stderr.strip().startswith("error: BOOST_JAX_CPU_PEAK_FLOPS='fast'"), p.stderr
    assert not out.exists()  # no config.yaml, metrics.jsonl, tb/ or checkpoints/
