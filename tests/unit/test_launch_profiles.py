"""Cluster jobs: every topology profile's job runs whole nodes (tests/e2e/test_launch.py: the
batch scripts, read back and run through the local SLURM stand-in)."""

import pytest

from boost_jax.mesh import TOPOLOGIES


def test_every_profile_runs_whole_nodes():
    for name, t in TOPOLOGIES.items():
        assert t.job is not None, name
        assert t.devices_per_node % t.job.processes_per_node == 0, name
        assert t.job.gpus_per_node in (0, t.devices_per_node), name


def test_job_header_says_when_the_forward_gather_is_kept():
    """A layout with parallel.secondary_axes=[] keeps the forward's gathered weights: the job's
    header says so instead of "secondary -" (no secondary, which re-gathers)."""
    from boost_jax.config import load_config
    from boost_jax.launch.slurm import layout_text

    cfg = load_config(None, ["parallel.plan=zero3", "parallel.secondary_axes=[]"])
    roles = {"params": ["global"], "grads": ["global"], "opt_state": ["global"]}
    kept = layout_text(cfg, {"placement": dict(roles, secondary=[])})
    none = layout_text(cfg, {"placement": dict(roles, secondary=None)})
    assert "secondary the forward's gather kept" in kept and "secondary -" in none
    # what changes the loss is said: int8 copies, quantized gathers and reductions, cross-node
    zpp = layout_text(load_config(None, ["parallel.plan=zeropp"]), {"placement": dict(
        roles, secondary=["pair"], int8_secondary=True, quantize_gather=True,
        quantize_grads=True)})
    assert "secondary ['pair'] int8, qwZ int8 gathers, qgZ int4 gradient reduce-scatter)" in zpp
    xq = layout_text(load_config(None, ["parallel.plan=hierarchical",
                                        "parallel.quantize_cross_node_weights=int8",
                                        "parallel.quantize_cross_node_grads=int4"]), None)
    assert "; cross-node weights int8, gradients int4;" in xq


def test_time_limits_are_slurm_formats_in_ascii_digits():
    """SLURM's formats are read; Unicode digits (which `\\d` would take) and minutes or seconds
    above 59 are refused with one line."""
    from boost_jax.errors import UserError
    from boost_jax.launch.slurm import time_seconds

    assert [time_seconds(t) for t in ("90", "5:30", "02:00:00", "1-00", "1-2:30", "1-0:0:59")] \
        == [5400, 330, 7200, 86400, 95400, 86459]
    for bad, match in (("٠٢:٠٠:٠٠", "is not a SLURM time limit"), ("2h", "is not a SLURM"),
                       ("1:99:99", "above 59"), ("5:60", "above 59"), ("1-2:60", "above 59")):
        with pytest.raises(UserError, match=match):
            time_seconds(bad)


@pytest.mark.parametrize("overrides, said", [
    (["distributed.mode=off"], "distributed.mode=off: "),
    (["distributed.mode=explicit", "distributed.coordinator=h:1", "distributed.num_processes=2",
      "distributed.process_id=0"], "distributed.mode=explicit, distributed.coordinator=h:1, "
                                   "distributed.num_processes=2, distributed.process_id=0: "),
    (["distributed.local_cpu_devices=2"], "distributed.local_cpu_devices=2: ")])
def test_a_job_refuses_distributed_settings_that_would_start_its_processes_apart(overrides,
                                                                                 said):
    from boost_jax.config import load_config
    from boost_jax.errors import UserError
    from boost_jax.launch.slurm import make_job
    from boost_jax.mesh import get_topology

    cfg = load_config(None, overrides)
    with pytest.raises(UserError) as e:
        make_job(cfg, get_topology("frontier"), 2, account="abc")
    assert str(e.value) == said + ("the job's srun starts every process, which join through "
                                   "SLURM's variables (distributed.mode=auto); drop these "
                                   "settings")


def test_a_relative_out_dir_stays_inside_the_scratch_directory():
    """A relative out_dir lands under the profile's scratch root; one that climbs out of it is
    refused in one line (an absolute out_dir is the way to leave scratch)."""
    from boost_jax.config import load_config
    from boost_jax.errors import UserError
    from boost_jax.launch.slurm import out_dir_expr
    from boost_jax.mesh import get_topology

    prof = get_topology("frontier").job

    def expr(out_dir):
        return out_dir_expr(load_config(None, [f"out_dir={out_dir}"]), prof, "ABC1")

    root = prof.scratch.replace("{account}", "abc1")
    assert expr("runs/a/../b") == f'"{root}"/runs/b'
    assert expr("/abs/../x") == "/abs/../x"
    for bad in ("..", "../x", "runs/../../x"):
        with pytest.raises(UserError, match=r"climbs out of the scratch directory .*; give a "
                                            r"path inside it or an absolute one"):
            expr(bad)


def test_job_header_names_the_dtypes_the_search_may_have_lowered():
    from boost_jax.config import load_config
    from boost_jax.launch.slurm import layout_text

    low = load_config(None, ["model.param_dtype=bfloat16", "parallel.grad_accum_dtype=bfloat16"])
    assert layout_text(low, None).endswith(
        " tokens; weights bfloat16, an fp32 master copy, gradients summed in bfloat16")
    assert layout_text(load_config(None, []), None).endswith(
        " tokens; weights float32, gradients summed in float32")
