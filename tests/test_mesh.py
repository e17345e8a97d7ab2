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
