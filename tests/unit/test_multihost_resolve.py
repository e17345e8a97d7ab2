"""Multi-process training: who starts JAX, from the config and the launcher's environment
(no JAX needed; tests/e2e/test_multihost.py: 2 processes x 4 CPU devices train like 1 x 8)."""

import pytest

from boost_jax.config import load_config
from boost_jax.errors import ConfigError, UserError
from boost_jax.train.distributed import Launch, resolve


# --------------------------------------------------------------------------- who starts JAX


def _cfg(*overrides):
    return load_config(None, list(overrides))


def test_resolve_single_process_by_default():
    assert resolve(_cfg(), {}) is None
    assert resolve(_cfg(), {"SLURM_NTASKS": "1", "OMPI_COMM_WORLD_SIZE": "1"}) is None
    assert resolve(_cfg("distributed.mode='off'"), {"SLURM_NTASKS": "8"}) is None


def test_resolve_launcher_environment():
    env = {"JAX_COORDINATOR_ADDRESS": "127.0.0.1:1234", "JAX_NUM_PROCESSES": "2",
           "JAX_PROCESS_ID": "1"}
    assert resolve(_cfg(), env) == Launch("127.0.0.1:1234", 2, 1, "env")
    with pytest.raises(UserError, match="not all of JAX_COORDINATOR_ADDRESS"):
        resolve(_cfg(), {"JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "0"})
    with pytest.raises(UserError, match=r"process_id=2 \(env\) must be in 0..1"):
        resolve(_cfg(), dict(env, JAX_PROCESS_ID="2"))
    # a coordinator alone: JAX's own cluster detection fills in the rest
    assert resolve(_cfg(), {"JAX_COORDINATOR_ADDRESS": "h:1"}) == Launch(None, None, None, "env")


def test_resolve_slurm_and_openmpi():
    assert resolve(_cfg(), {"SLURM_NTASKS": "4", "SLURM_PROCID": "2", "SLURM_JOB_ID": "7"}) == \
        Launch(None, None, None, "slurm")  # JAX's SLURM detection finds the coordinator
    assert resolve(_cfg("distributed.coordinator=node0:999"),
                   {"SLURM_NTASKS": "4", "SLURM_PROCID": "2"}) == Launch("node0:999", 4, 2, "slurm")
    assert resolve(_cfg(), {"OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "1",
                            "JAX_COORDINATOR_ADDRESS": "h:5"}) == Launch("h:5", 2, 1, "openmpi")
    assert resolve(_cfg(), {"OMPI_COMM_WORLD_SIZE": "2", "OMPI_MCA_orte_hnp_uri": "x"}) == \
        Launch(None, None, None, "openmpi")
    with pytest.raises(UserError, match="Open MPI started 2 processes but no coordinator"):
        resolve(_cfg(), {"OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "0"})
    # a task count without a job: JAX's detection would say only "coordinator_address should
    # be defined"
    with pytest.raises(UserError, match=r"^SLURM_NTASKS=2 is set but SLURM_JOB_ID is not, so "
                                        r"the coordinator cannot be found; start every process "
                                        r"with srun inside the job, or set distributed\.mode=off"):
        resolve(_cfg(), {"SLURM_NTASKS": "2", "SLURM_PROCID": "0"})


def test_resolve_explicit_config():
    cfg = _cfg("distributed.mode=explicit", "distributed.coordinator=10.0.0.1:1234",
               "distributed.num_processes=4", "distributed.process_id=3")
    assert resolve(cfg, {}) == Launch("10.0.0.1:1234", 4, 3, "config")
    with pytest.raises(UserError, match="needs distributed.coordinator, distributed.process_id"):
        resolve(_cfg("distributed.mode=explicit", "distributed.num_processes=2"), {})
    with pytest.raises(UserError, match="must look like HOST:PORT"):
        resolve(_cfg("distributed.mode=explicit", "distributed.coordinator=nohost",
                     "distributed.num_processes=2", "distributed.process_id=0"), {})
    # the rank may come from the launcher's environment
    cfg = _cfg("distributed.mode=explicit", "distributed.coordinator=h:1",
               "distributed.num_processes=2")
    assert resolve(cfg, {"JAX_PROCESS_ID": "1"}) == Launch("h:1", 2, 1, "config")
    # a count or rank outside mode=explicit would be ignored: refused instead
    for mode in ("auto", "off"):
        with pytest.raises(ConfigError, match=r"^distributed\.process_id is read only with "
                                              rf"distributed\.mode=explicit \(mode is {mode}\)"):
            _cfg(f"distributed.mode={mode}", "distributed.process_id=1")
    with pytest.raises(UserError, match="^JAX_PROCESS_ID=3 with JAX_NUM_PROCESSES=1; the only "):
        resolve(_cfg(), {"JAX_COORDINATOR_ADDRESS": "h:1", "JAX_NUM_PROCESSES": "1",
                         "JAX_PROCESS_ID": "3"})


def test_the_watchdog_ends_start_up_at_the_timeout_and_xla_waits_longer(monkeypatch):
    """A process that joins just inside distributed.init_timeout_s must not be refused: the
    one-line watchdog fires at that limit, and XLA, whose own timeout aborts the process with
    a C++ stack, is given a limit past it."""
    import socket
    import threading

    import jax

    from boost_jax.train import distributed as D

    with socket.socket() as s:  # a port free now: process 0's check binds it and lets go
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = _cfg("distributed.mode=explicit", f"distributed.coordinator=127.0.0.1:{port}",
               "distributed.num_processes=2", "distributed.process_id=0",
               "distributed.init_timeout_s=40")
    seen = {}

    class Timer:
        def __init__(self, interval, fn):
            seen["watchdog"] = interval

        def start(self):
            pass

        def cancel(self):
            seen["cancelled"] = True

    monkeypatch.setattr(threading, "Timer", Timer)
    monkeypatch.setattr(jax.distributed, "is_initialized", lambda: False)
    monkeypatch.setattr(jax.distributed, "initialize", lambda **kw: seen.update(kw))
    monkeypatch.setattr(jax.config, "update", lambda *a: None)
    assert D._start(cfg) == Launch(f"127.0.0.1:{port}", 2, 0, "config")
    assert seen["watchdog"] == 40 and seen["cancelled"]
    assert seen["initialization_timeout"] >= 40 + 10


@pytest.mark.parametrize("script", ["launch_local.py", "local_slurm.py"])
def test_the_local_launchers_drop_gloos_interleaved_pieces_and_keep_real_lines(script):
    """gloo's "[Gloo] Rank 1 is connected to 1 peer ranks. Expected number of connected peer
    ranks is : 1" arrives in pieces from several threads: every piece is dropped (a bare count
    or an empty line among them too); a process's own lines are kept, a bare number or an empty
    line included where no announcement is near."""
    import importlib.util
    import os

    path = os.path.join(os.path.dirname(__file__), "..", "..", "scripts", script)
    spec = importlib.util.spec_from_file_location(script[:-3], path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    noise = [b"[Gloo] Rank 1 is connected to 1 peer ranks. Expected number of connected peer "
             b"ranks is : 1\n", b"[Gloo] Rank 0 is connected to\n", b"7\n", b" : 1\n", b"\n",
             b"Expected number of connected peer ranks is : 3\n", b"1\n"]
    real = [b"step 10 | loss 2.4130 | 7,207 tok/s\n", b"done: step 300, val_loss 1.8509\n",
            b"error: data.seq_len=64 exceeds model.max_seq_len=32\n", b"x 1\n"]
    own = [b"result:\n", b"42\n", b"\n", b"end\n"]  # a script's own output, no gloo near

    def kept(lines):
        f = mod.GlooFilter()
        return [x for x in lines if not f.drop(x)]

    assert kept(noise + real) == real
    assert kept(own) == own
    window = mod.GlooFilter.drop.__globals__["GLOO_WINDOW"]  # where the filter is defined
    assert kept(noise + real + [b"x\n"] * window + own)[-len(own):] == own
