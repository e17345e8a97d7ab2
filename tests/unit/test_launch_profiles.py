"""Cluster jobs: every topology profile's job runs whole nodes (tests/e2e/test_launch.py: the
batch scripts, read back and run through the local SLURM stand-in)."""

from boost_jax.mesh import TOPOLOGIES


def test_every_profile_runs_whole_nodes():
    for name, t in TOPOLOGIES.items():
        assert t.job is not None, name
        assert t.devices_per_node % t.job.processes_per_node == 0, name
        assert t.job.gpus_per_node in (0, t.devices_per_node), name
