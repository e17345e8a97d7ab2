import json
import os

import jax
import numpy as np
import pytest

from boost_jax.errors import UserError
from boost_jax.mesh import AXES, TOPOLOGIES, get_topology, make_mesh, mesh_shape


def test_cpu_mesh_is_2x2x2_with_adjacent_pairs():
    mesh = make_mesh("cpu")
    assert mesh.axis_names == AXES
    assert dict(mesh.shape) == {"pair": 2, "node": 2, "global": 2}
    ids = np.vectorize(lambda d: d.id)(mesh.devices)
    # members of a pair are adjacent ids; a node is a contiguous run of 4 ids
    assert all(abs(ids[0, n, g] - ids[1, n, g]) == 1 for n in range(2) for g in range(2))
    for g in range(2):
        assert sorted(ids[:, :, g].ravel()) == list(range(4 * g, 4 * g + 4))
    assert all(t == jax.sharding.AxisType.Auto for t in mesh.axis_types)


def test_explicit_shape_and_too_large_mesh():
    assert dict(make_mesh("cpu", shape=[2, 1, 4]).shape) == {"pair": 2, "node": 1, "global": 4}
    with pytest.raises(UserError, match="needs 16 devices but only 8 are present; use --cpu-devices 16"):
        make_mesh("cpu", shape=[2, 2, 4])
    with pytest.raises(UserError, match="needs 2 devices but only 1 is present;"):
        mesh_shape(get_topology("cpu"), 1, shape=[2, 1, 1])


def test_topology_profiles():
    assert {"cpu", "frontier", "perlmutter", "dgx-h100"} <= set(TOPOLOGIES)
    fr = get_topology("frontier")
    assert fr.devices_per_node == 8 and fr.bw_pair > fr.bw_node > fr.bw_global
    assert mesh_shape(fr, 384) == (2, 4, 48)
    with pytest.raises(UserError):
        mesh_shape(fr, 8, nodes=48)
    with pytest.raises(Exception, match="unknown topology"):
        get_topology("summit")


def test_small_device_counts_degrade_gracefully():
    topo = get_topology("cpu")
    assert mesh_shape(topo, 1) == (1, 1, 1)
    assert mesh_shape(topo, 2) == (2, 1, 1)
    assert mesh_shape(topo, 6) == (2, 1, 3)


def test_cpu_peak_is_measured_lazily_and_cached_per_machine(monkeypatch, tmp_path):
    from boost_jax.backends import cpu_peak

    monkeypatch.delenv(cpu_peak.ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(cpu_peak, "_memo", {})
    monkeypatch.setattr(cpu_peak.os, "getloadavg", lambda: (0.0, 0.0, 0.0))  # a quiet machine
    calls = []
    monkeypatch.setattr(cpu_peak, "measure_gemm_flops", lambda: calls.append(1) or 8e11)
    topo = get_topology("cpu")
    make_mesh("cpu")
    assert calls == []  # looking the profile up does not probe
    assert topo.peak_flops == pytest.approx(8e11 / jax.local_device_count())
    assert calls == [1]
    saved = json.loads((tmp_path / "boost_jax" / "cpu_peak.json").read_text())
    assert saved == {cpu_peak.machine_key(): 8e11}
    monkeypatch.setattr(cpu_peak, "_memo", {})  # a new process: reads the cache, no probe
    assert topo.peak_flops == pytest.approx(8e11 / jax.local_device_count()) and calls == [1]
    monkeypatch.setenv(cpu_peak.ENV, "3e10")
    assert topo.peak_flops == 3e10
    # a probe taken beside other work is used, not kept: the next process measures again
    monkeypatch.delenv(cpu_peak.ENV)
    (tmp_path / "boost_jax" / "cpu_peak.json").unlink()
    monkeypatch.setattr(cpu_peak, "_memo", {})
    monkeypatch.setattr(cpu_peak.os, "getloadavg", lambda: (3.0 * os.cpu_count(), 0.0, 0.0))
    assert topo.peak_flops == pytest.approx(8e11 / jax.local_device_count()) and calls == [1, 1]
    assert not (tmp_path / "boost_jax" / "cpu_peak.json").exists()
    monkeypatch.delattr(cpu_peak.os, "getloadavg")  # no load average (Windows): kept
    monkeypatch.setattr(cpu_peak, "_memo", {})
    assert topo.peak_flops == pytest.approx(8e11 / jax.local_device_count())
    assert (tmp_path / "boost_jax" / "cpu_peak.json").exists()
    monkeypatch.setenv(cpu_peak.ENV, "3e10")
    for bad in ("fast", "inf", "nan", "0"):
        monkeypatch.setenv(cpu_peak.ENV, bad)
        with pytest.raises(UserError, match=f"BOOST_JAX_CPU_PEAK_FLOPS='{bad}' is not a "):
            topo.peak_flops
    assert get_topology("frontier").peak_flops == 191.5e12


def test_cpu_gemm_probe_measures_a_positive_rate():
    from boost_jax.backends import cpu_peak

    assert cpu_peak.measure_gemm_flops(n=64, rounds=2) > 0


def test_a_cpu_plan_shares_the_host_among_its_own_devices(monkeypatch):
    """The planner times a layout of N simulated devices as N sharing this host, however many
    devices the planning process itself holds (an analytic plan holds one; a compiled one N)."""
    from boost_jax.backends import cpu_peak
    from boost_jax.config import load_config
    from boost_jax.plan import costmodel as C

    monkeypatch.delenv(cpu_peak.ENV, raising=False)
    monkeypatch.setattr(cpu_peak, "host_gemm_flops", lambda: 8e11)
    cfg = load_config("configs/demo.yaml", ["parallel.plan=zero3"])
    topo, sizes = get_topology("cpu"), {"pair": 2, "node": 2, "global": 2}
    seen = []
    for local in (1, 8):
        monkeypatch.setattr(jax, "local_device_count", lambda n=local: n)
        p = C.predict(cfg, topo, sizes)
        seen.append((p.peak_flops, p.step_time))
    assert seen[0] == seen[1] and seen[0][0] == pytest.approx(8e11 / 8)
    from boost_jax.plan.__main__ import report_text

    assert "of 100.0 GFLOP/s\n" in report_text(p, cfg, topo, compiled=False)  # not "0.0 TFLOP/s"
    assert topo.peak_flops == pytest.approx(8e11 / 8)  # a run: this process's devices share it


def test_report_counts_one_node_in_the_singular():
    from boost_jax.errors import counted
    from boost_jax.config import load_config
    from boost_jax.plan import costmodel as C
    from boost_jax.plan.__main__ import report_text

    assert [counted(n, "process", "processes") for n in (1, 2)] == ["1 process", "2 processes"]
    cfg, topo = load_config("configs/demo.yaml"), get_topology("cpu")
    text = report_text(C.predict(cfg, topo, {"pair": 2, "node": 4, "global": 1}), cfg, topo,
                       compiled=False)
    assert "): 1 node, 8 devices = pair 2" in text and "1 nodes" not in text
    assert "; 1 micro-batch x 2 seq/device" in text
    from boost_jax.launch.slurm import layout_text

    assert "; 1 micro-batch, remat" in layout_text(cfg, None)


@pytest.mark.parametrize("needed,n,flags,compile_only,expect", [
    (True, 8, "", False, "false"), (True, 1, "", False, None), (True, 8, "", True, None),
    (False, 8, "", False, None), (True, 8, "=true", False, "true"),
    (True, 8, "=false", True, "false"), (True, 8, "ours", True, None)])
def test_simulated_devices_run_collectives_in_one_order(monkeypatch, needed, n, flags,
                                                        compile_only, expect):
    """Where the JAX release needs it (0.11 aborted test_pipeline_composes_with_plans_and_tp
    on a rendezvous timeout), several simulated devices that run collectives turn XLA:CPU's
    concurrency-optimized scheduler off; one device, compile-only devices and a release that
    does not need it keep XLA's default. A user's own setting wins; the flag an earlier call
    set ("ours", inherited by a child process) does not bind a compile-only one."""
    from boost_jax import compat
    from boost_jax.mesh import CPU_SCHEDULER_FLAG, CPU_SCHEDULER_OURS, set_cpu_devices

    monkeypatch.setattr(compat, "cpu_collectives_need_one_order", lambda: needed)
    monkeypatch.delenv(CPU_SCHEDULER_OURS, raising=False)
    if flags == "ours":
        monkeypatch.setenv(CPU_SCHEDULER_OURS, "1")
        flags = "=false"
    monkeypatch.setenv("XLA_FLAGS", f"--{CPU_SCHEDULER_FLAG}{flags}" if flags else "")
    set_cpu_devices(n, compile_only=compile_only)  # JAX runs 8 devices: only the env changes
    values = [f.split("=", 1)[1] for f in os.environ["XLA_FLAGS"].split()
              if f.startswith(f"--{CPU_SCHEDULER_FLAG}=")]
    assert values == ([expect] if expect else [])
    assert (os.environ.get(CPU_SCHEDULER_OURS) == "1") == (expect == "false" and flags == "")
