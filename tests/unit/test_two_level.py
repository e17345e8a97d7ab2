"""parallel.collectives=two_level: collectives spanning hosts and a node run as rank-aligned
sub-collectives (sharding/two_level.py). 8 simulated devices as (pair, node, global) =
(2, 2, 2). Each two-level op gives exactly the flat collective's result (awkward shapes, every
axis order); the compiled step's groups never mix `global` with a node axis; losses equal the
flat step's; the step's list (step_collectives.py) is what is compiled."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from boost_jax.mesh import make_mesh
from boost_jax.sharding import two_level
from boost_jax.sharding.two_level import Policy


@pytest.fixture(scope="module")
def mesh():
    return make_mesh("cpu", (2, 2, 2))


AXES_ORDERS = [("pair", "node", "global"), ("global", "pair"), ("node", "global", "pair"),
               ("global", "node")]


def _run(mesh, body, x):
    spec = P(("pair", "node", "global"))
    f = jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec, check_vma=True)
    return np.asarray(jax.jit(f)(x))


@pytest.mark.parametrize("axes", AXES_ORDERS)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_each_op_equals_the_flat_collective(mesh, axes, dtype):
    pol = Policy.of("two_level", mesh.shape)
    assert pol.split("all-gather", axes) is not None
    n = pol.n(axes)
    x = (jnp.arange(8 * 3 * n * 5, dtype=jnp.float32) % 13 - 6).astype(dtype)
    x = x.reshape(8 * 3, n * 5)  # each device: [3, n·5]

    def gathers(v):
        flat = jax.lax.all_gather(v, axes, axis=1, tiled=True)
        two = two_level.tiled_all_gather(v, axes, 1, pol)
        return (flat - two)[:, :v.shape[1]]

    def scatters(v):
        flat = jax.lax.psum_scatter(v, axes, scatter_dimension=1, tiled=True)
        two = two_level.psum_scatter(v, axes, 1, pol)
        return jnp.tile(flat - two, (1, n))

    def reduces(v):  # a padded length: 3·n·5 is not a multiple of the node's members
        d = jax.lax.psum(v[:, :7], axes) - two_level.all_reduce(v[:, :7], axes, pol)
        return jnp.zeros_like(v).at[:, :7].set(d)

    for body in (gathers, scatters, reduces):
        assert not np.any(_run(mesh, body, x)), (body.__name__, axes)


def test_an_op_issues_no_group_that_mixes_global_with_a_node_axis(mesh):
    from boost_jax.analysis.comm import analyze

    pol = Policy.of("two_level", mesh.shape)
    axes = ("pair", "node", "global")

    def body(v):
        g = two_level.tiled_all_gather(v, axes, 0, pol)
        return two_level.psum_scatter(g, axes, 0, pol) + two_level.all_reduce(v, axes, pol)

    spec = P(axes)
    f = jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec)
    r = analyze(f, [jax.ShapeDtypeStruct((24, 5), jnp.float32)], mesh)
    assert r.collectives
    assert all(c.axes == ("global",) or "global" not in c.axes for c in r.collectives), \
        r.table()
