"""Checkpoint integrity's checksums: exact sums of the state, whatever its sharding or padding,
that any one flipped bit changes (tests/e2e/test_ckpt_integrity.py: every read path, failed
saves and SIGKILL)."""

import numpy as np
import pytest

pytestmark = pytest.mark.usefixtures("jax_cache")  # conftest: shared compile cache


# --------------------------------------------------------------------------- checksums


def _numpy_checksum(x):
    """The same sums in numpy, straight from the definition."""
    x = np.asarray(x)
    b = x.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[x.dtype.itemsize]).astype(np.uint32)
    m = b.ravel() * np.uint32(0x9E3779B1)
    m ^= m >> 15
    return [int(b.sum(dtype=np.uint32)), int((m * np.uint32(0x85EBCA77)).sum(dtype=np.uint32))]


def test_state_checksums_are_exact_and_ignore_sharding_and_padding():
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P

    from boost_jax.checkpoints.store import state_checksums

    rng = np.random.default_rng(0)
    xs = {"f": rng.standard_normal((14, 22)).astype(np.float32),  # 7 x 11 per device
          "h": rng.standard_normal((6, 5)).astype(jnp.bfloat16),
          "i": np.arange(7, dtype=np.int32), "s": np.float32(3.5)}
    sums, finite = state_checksums(jax.tree.map(jnp.asarray, xs))
    assert finite and sums == {f"['{k}']": _numpy_checksum(v) for k, v in xs.items()}
    mesh = jax.make_mesh((2, 4), ("a", "b"))
    f = jax.device_put(xs["f"], NamedSharding(mesh, P("a", None)))
    padded = jnp.pad(xs["f"], ((0, 2), (0, 3)))  # what another plan's layout stores
    assert state_checksums([f])[0] == state_checksums([padded])[0] == state_checksums(
        [xs["f"]])[0]
    for k, v in xs.items():  # any one flipped bit of any element changes both sums
        flat = np.array(v).reshape(-1)
        words = flat.view({2: np.uint16, 4: np.uint32}[flat.dtype.itemsize])
        i, bit = rng.integers(flat.size), rng.integers(8 * flat.dtype.itemsize)
        words[i] ^= words.dtype.type(1 << int(bit))
        got = state_checksums([flat.reshape(np.shape(v))])[0]["[0]"]
        assert all(g != w for g, w in zip(got, _numpy_checksum(v))), k
    assert state_checksums([jnp.asarray(xs["f"]).at[3, 4].set(jnp.nan)])[1] is False


def test_a_seal_of_the_wrong_shape_is_a_reason_not_a_crash(tmp_path):
    """Valid JSON that is no seal makes the step unusable (one clause), like a damaged one."""
    import json

    from boost_jax.checkpoints import seal

    step = tmp_path / "3"
    (step / "state").mkdir(parents=True)
    (step / "state" / "a").write_bytes(b"abc")
    seal.write_seal(str(step))
    assert seal.check_seal(str(step)) is None
    for bad in ({"crc32": 5}, {"crc32": {"state/a": 1}}, {"crc32": {"state/a": [3]}},
                {"crc32": {"state/a": ["3", 1]}}, {"crc32": [1, 2]}, [], 7):
        (step / seal.SEAL_FILE).write_text(json.dumps(bad))
        why = seal.check_seal(str(step))
        assert why is not None and seal.SEAL_FILE in why, (bad, why)


def test_orbax_step_record_is_under_the_seal(tmp_path):
    """_CHECKPOINT_METADATA, which orbax rewrites after the seal (its commit time), is sealed by
    content: a changed digit, another handler or garbage makes the step unusable, as does its
    removal; the commit time orbax set afterwards is not a change."""
    import json

    import jax.numpy as jnp

    from boost_jax.checkpoints import seal
    from boost_jax.checkpoints.store import Checkpointer
    from boost_jax.config import CheckpointConfig

    ck = Checkpointer(str(tmp_path), CheckpointConfig(async_save=False))
    ck.save(1, {"w": jnp.ones(4)}, {"pos": 1}, {"x": 1})
    ck.wait()
    ck.close()
    step = str(tmp_path / "1")
    path = tmp_path / "1" / seal.ORBAX_META
    text = path.read_text()
    tree = json.loads(text)
    assert isinstance(tree.get("commit_timestamp_nsecs"), int)  # set after the seal
    assert seal.check_seal(step) is None
    digit = dict(tree, init_timestamp_nsecs=tree["init_timestamp_nsecs"] + 1)
    handler = json.loads(text)
    handler["item_handlers"]["state"] = "x.Y"
    for bad in (json.dumps(digit), json.dumps(handler), "garbage{", "[]", "[" * 100000):
        path.write_text(bad)
        assert seal.check_seal(step) == f"file {seal.ORBAX_META} is not what was written", bad
    path.unlink()
    assert seal.check_seal(step) == f"file {seal.ORBAX_META} is missing"
    path.write_text(text)
    assert seal.check_seal(step) is None


def test_one_process_saves_each_replicated_shard_from_one_replica(tmp_path, monkeypatch):
    """In one process a replicated array is written whole from one replica: no slice per
    replica (orbax's replica-parallel split, a kernel and a compile each), and it reads back."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P

    from boost_jax.checkpoints.store import Checkpointer
    from boost_jax.config import CheckpointConfig

    sliced = []
    real = jax.lax.slice_in_dim
    monkeypatch.setattr(jax.lax, "slice_in_dim", lambda *a, **k: sliced.append(1) or real(*a, **k))
    mesh = jax.make_mesh((8,), ("d",))
    w = jax.device_put(jnp.arange(64.0).reshape(16, 4), NamedSharding(mesh, P()))  # 8 replicas
    ck = Checkpointer(str(tmp_path), CheckpointConfig(async_save=False))
    ck.save(1, {"w": w}, {"pos": 1}, {"x": 1})
    ck.wait()
    ck.close()
    assert not sliced
    assert list(tmp_path.glob("1/state/array_metadatas/*"))  # orbax's own metadata still written
    ck = Checkpointer(str(tmp_path), CheckpointConfig(async_save=False))
    state, _, _ = ck.restore(1, {"w": w})
    ck.close()
    assert (np.asarray(state["w"]) == np.asarray(w)).all()
