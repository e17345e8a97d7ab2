"""Multi-process training through jax.distributed: 2 local processes x 4 CPU devices must train
exactly like 1 process x 8 devices, across a collective save and restore; the launcher is
checked on its own (tests/unit/test_multihost_resolve.py: the environment detection)."""

import json
import os
import re
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from boost_jax.config import load_config
from train_proc import ROOT, TINY, assert_same_metrics

LAUNCH = os.path.join(ROOT, "scripts", "launch_local.py")
RUN = TINY + ["train.steps=10", "train.eval_every=5", "checkpoint.every=5"]

pytestmark = pytest.mark.usefixtures("jax_cache")  # conftest: shared compile cache


def _rows(out_dir):
    return [json.loads(line) for line in open(os.path.join(out_dir, "metrics.jsonl"))]


def _launch(jax_cache, *args, timeout=400):
    env = dict(os.environ, JAX_COMPILATION_CACHE_DIR=jax_cache,
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
               JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="-1")
    env.pop("XLA_FLAGS", None)
    return subprocess.run([sys.executable, LAUNCH, *args], cwd=ROOT, env=env, timeout=timeout,
                          capture_output=True, text=True)


def test_two_processes_train_like_one_including_save_and_restore(jax_cache, tmp_path):
    from boost_jax.mesh import mesh_from_config
    from boost_jax.checkpoints.store import Checkpointer
    from boost_jax.train.loop import run
    from boost_jax.step.build import build_step

    one = str(tmp_path / "one")
    cfg_one = load_config(None, RUN + ["logging.progress=false", f"out_dir={one}"])
    run(cfg_one)  # 1 process x 8 devices (this test process)

    two = str(tmp_path / "two")
    args = ["-n", "2", "--cpu-devices-per-process", "4", "--", *RUN, f"out_dir={two}"]
    first = _launch(jax_cache, *args, "train.stop_after=5")  # steps 1-5, collective save of 5
    assert first.returncode == 0, first.stdout + first.stderr
    state_dir = os.path.join(two, "checkpoints", "5", "state")
    assert {"ocdbt.process_0", "ocdbt.process_1"} <= set(os.listdir(state_dir))
    second = _launch(jax_cache, *args)  # collective restore of 5, steps 6-10, save of 10
    assert second.returncode == 0, second.stdout + second.stderr
    out = second.stdout
    assert "[rank 0] resumed from step 5" in out and "[rank 0] 2 processes x 4 devices" in out
    assert "[rank 0] step 10/10 | loss" in out
    assert "[rank 1] step" not in out and "[rank 1] resumed" not in out  # logs: process 0 only
    assert "[Gloo]" not in out + second.stderr
    assert "unusable" not in out + second.stderr  # both processes' shares matched the seal
    from boost_jax.checkpoints.seal import SEAL_FILE, check_seal

    for step in (5, 10):  # sealed after both processes wrote, every file of both covered
        step_dir = os.path.join(two, "checkpoints", str(step))
        assert check_seal(step_dir) is None
        sealed = json.load(open(os.path.join(step_dir, SEAL_FILE)))["crc32"]
        assert any(n.startswith("state/ocdbt.process_1/") for n in sealed), sorted(sealed)

    a, b = _rows(one), _rows(two)
    assert [r["step"] for r in b if "loss" in r] == list(range(1, 11))  # one writer, no repeats
    assert_same_metrics(a, b)

    # the 2-process checkpoint holds the same weights, restorable on the 1-process mesh
    bundle = build_step(cfg_one, mesh_from_config(cfg_one))
    got = Checkpointer(os.path.join(two, "checkpoints"), cfg_one.checkpoint).restore(
        10, bundle.abstract_state)[0]
    want = Checkpointer(os.path.join(one, "checkpoints"), cfg_one.checkpoint).restore(
        10, bundle.abstract_state)[0]
    import jax

    for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-4, atol=1e-5)


def test_launcher_kills_the_others_when_one_process_dies(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(textwrap.dedent(f"""
        import os, sys, time
        rank = int(os.environ["JAX_PROCESS_ID"])
        print(f"hello from {{rank}} of {{os.environ['JAX_NUM_PROCESSES']}} "
              f"via {{os.environ['JAX_COORDINATOR_ADDRESS']}} {{sys.argv[1:]}}", flush=True)
        open(os.path.join({str(tmp_path)!r}, f"started.{{rank}}"), "w").close()
        if rank == 1:  # fail once everyone is up
            while len([f for f in os.listdir({str(tmp_path)!r}) if f.startswith("started.")]) < 3:
                time.sleep(0.05)
            sys.exit(3)
        time.sleep(120)
    """))
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, LAUNCH, "-n", "3", "--script", str(script), "--", "a=1"],
                       capture_output=True, text=True, timeout=60)
    assert time.monotonic() - t0 < 30  # did not wait for the sleepers
    assert r.returncode == 3, r.stdout + r.stderr
    for rank in range(3):
        assert f"[rank {rank}] hello from {rank} of 3 via 127.0.0.1:" in r.stdout
    assert "['a=1']" in r.stdout
    assert "rank 1 exited with code 3; killing ranks [0, 2]" in r.stdout


def test_launcher_succeeds_when_all_succeed(tmp_path):
    script = tmp_path / "ok.py"
    script.write_text("import os; print('rank', os.environ['JAX_PROCESS_ID'])\n")
    r = subprocess.run([sys.executable, LAUNCH, "-n", "2", "--script", str(script), "--", "x=1"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "[rank 0] rank 0" in r.stdout and "[rank 1] rank 1" in r.stdout


def test_launcher_bad_counts_are_one_line_and_start_nothing(tmp_path):
    """-n 0, -n 99999 (a fork storm), 0 or x devices per process, train.py's options before
    the --, a port out of range, a NaN grace, a variable without a value, a missing
    interpreter: one line, exit 2."""
    script = tmp_path / "touch.py"
    script.write_text(f"open({str(tmp_path / 'ran')!r}, 'w')\n")
    for args, msg in ((["-n", "0"], "-n 0 must be between 1 and 64"),
                      (["-n", "99999"], "-n 99999 must be between 1 and 64"),
                      (["-n", "2", "--cpu-devices-per-process", "0"],
                       "--cpu-devices-per-process 0 must be between 1 and 4096"),
                      (["-n", "2", "--cpu-devices-per-process", "x"],
                       "argument --cpu-devices-per-process: invalid int value: 'x'; see "),
                      (["-n", "2", "--config", "c.yaml"],  # train.py's, before the --
                       "unrecognized arguments: --config; put train.py's arguments after --"),
                      (["-n", "1", "--port", "99999"], "--port 99999 must be between 1 and 65535"),
                      (["-n", "1", "--grace", "nan"], "--grace nan must be a number of seconds"),
                      (["-n", "1", "--env-rank", "X"], "--env-rank 'X' is not NAME=VALUE"),
                      (["-n", "1", "--python", str(tmp_path / "none")],
                       f"--python {str(tmp_path / 'none')!r} is not an executable program")):
        r = subprocess.run([sys.executable, LAUNCH, *args, "--script", str(script), "--", "x=1"],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 2 and r.stderr.startswith(f"error: {msg}"), r.stderr
        assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert not (tmp_path / "ran").exists()
    r = subprocess.run([sys.executable, LAUNCH, "-n", "1", "--script", str(tmp_path / "none.py"),
                        "--", "x=1"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and r.stderr.startswith(
        f"error: --script {str(tmp_path / 'none.py')!r} is not a file"), r.stderr
    from boost_jax.errors import UserError
    from boost_jax.mesh import set_cpu_devices

    with pytest.raises(UserError, match="--cpu-devices 100000 must be between 1 and 4096"):
        set_cpu_devices(100_000)
    from boost_jax.config import load_config
    from boost_jax.train.distributed import setup

    with pytest.raises(UserError, match="^distributed.local_cpu_devices=5000 must be between"):
        setup(load_config(None, ["distributed.local_cpu_devices=5000"]))


# --------------------------------------------------------------------------- who starts JAX


def _free_port():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(jax_cache, rank, port, log, *args):
    env = dict(os.environ, JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", JAX_NUM_PROCESSES="2",
               JAX_PROCESS_ID=str(rank), JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1",
               JAX_COMPILATION_CACHE_DIR=jax_cache,
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
               JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="-1")
    env.pop("XLA_FLAGS", None)
    return subprocess.Popen([sys.executable, os.path.join(ROOT, "train.py"), "--cpu-devices",
                             "4", *args], cwd=ROOT, env=env, stdout=log,
                            stderr=subprocess.STDOUT)


def test_sigterm_to_one_of_two_processes_stops_both_at_the_same_saved_step(jax_cache, tmp_path):
    import signal

    out = str(tmp_path / "run")
    args = [*TINY, "train.steps=500", "checkpoint.every=1000", "logging.progress=false",
            f"out_dir={out}"]  # only the signal makes a checkpoint
    port, logs = _free_port(), [open(tmp_path / f"rank{r}.log", "w") for r in range(2)]
    procs = [_rank(jax_cache, r, port, logs[r], *args) for r in range(2)]
    try:
        metrics, deadline = os.path.join(out, "metrics.jsonl"), time.time() + 300
        while not (os.path.exists(metrics) and any("loss" in r for r in _rows(out))):
            assert time.time() < deadline and all(p.poll() is None for p in procs), \
                open(tmp_path / "rank0.log").read()
            time.sleep(0.05)
        procs[1].send_signal(signal.SIGTERM)  # rank 1 only: rank 0 learns it from rank 1
        codes = [p.wait(240) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    text = open(tmp_path / "rank0.log").read() + open(tmp_path / "rank1.log").read()
    assert codes == [128 + signal.SIGTERM] * 2, text
    saved = sorted(os.listdir(os.path.join(out, "checkpoints")))
    assert len(saved) == 1 and saved[0].isdigit() and 1 <= int(saved[0]) < 500, saved
    step = int(saved[0])
    state = os.listdir(os.path.join(out, "checkpoints", saved[0], "state"))
    assert {"ocdbt.process_0", "ocdbt.process_1"} <= set(state)  # both wrote the same step
    assert f"signal {int(signal.SIGTERM)}: saved step {step}, exiting" in text
    assert max(r["step"] for r in _rows(out) if "loss" in r) == step


def _start_alone(tmp_path, args, env_extra=()):
    env = dict(os.environ, JAX_PLATFORMS="cpu", **dict(env_extra))
    env.pop("XLA_FLAGS", None)
    return subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), "--cpu-devices", "4",
                           "distributed.init_timeout_s=2", f"out_dir={tmp_path / 'run'}", *args],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)


EXPLICIT = ["distributed.mode=explicit", "distributed.coordinator=127.0.0.1:{port}",
            "distributed.num_processes=2"]
HOW = "(coordinator 127.0.0.1:{port}, 2 processes, this is process {rank})"
FIX = "check that every process was started and can reach the coordinator"


@pytest.mark.parametrize("case", ["rank1_unreachable", "rank0_alone", "rank0_port_taken",
                                  "slurm_rank1_unreachable", "coordinator_alone"])
def test_a_start_up_that_cannot_meet_is_one_line(tmp_path, case):
    """Every way a process cannot join is one line and exit 2, nothing written; XLA itself
    would abort (a C++ stack, SIGABRT) on a timeout, or crash on a taken port."""
    import socket

    port = _free_port()  # nobody listens there: rank 1 waits for rank 0's coordinator in vain
    how = HOW.format(port=port, rank=0 if case.startswith("rank0") else 1)
    args, env, sock = [x.format(port=port) for x in EXPLICIT], {}, None
    if case == "rank1_unreachable":
        want = (f"jax.distributed.initialize failed {how}: nothing answers at 127.0.0.1:{port} "
                f"after 2 s (Connection refused); {FIX}")
    elif case.startswith("rank0"):
        want = (f"jax.distributed.initialize did not finish within 2 s {how}: a process is "
                f"missing or cannot reach the coordinator; {FIX}, or raise "
                "distributed.init_timeout_s")
        if case == "rank0_port_taken":
            sock = socket.socket()
            sock.bind(("127.0.0.1", port))
            sock.listen()
            want = (f"jax.distributed cannot start {how}: port {port} is taken on this host, "
                    "where process 0 serves the coordinator (another run's?); choose another "
                    "port for every process")
    elif case == "coordinator_alone":  # no launcher JAX's detection knows: no count, no rank
        args, env = [], {"JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}"}
        want = ("jax.distributed.initialize failed (env auto-detection): <JAX's words>; set "
                "JAX_NUM_PROCESSES and JAX_PROCESS_ID beside "
                "JAX_COORDINATOR_ADDRESS (or start the processes with srun / mpirun), or "
                "distributed.mode=off for one process")
    else:  # srun's environment, the coordinator found by JAX's own SLURM detection
        args, how = [], "(slurm auto-detection)"
        env = {"SLURM_JOB_ID": "1", "SLURM_NTASKS": "2", "SLURM_PROCID": "1",
               "SLURM_LOCALID": "0", "SLURM_NODEID": "0", "SLURM_STEP_NODELIST": "localhost"}
        want = (f"jax.distributed.initialize did not finish within 2 s {how}: a process is "
                f"missing or cannot reach the coordinator; {FIX}, or raise "
                "distributed.init_timeout_s")
    if case == "rank1_unreachable" or case.startswith("rank0"):
        args.append(f"distributed.process_id={0 if case.startswith('rank0') else 1}")
    try:
        p = _start_alone(tmp_path, args, env)
    finally:
        if sock is not None:
            sock.close()
    pattern = re.escape(f"error: {want}").replace(re.escape("<JAX's words>"), "[^;\\n]+")
    assert p.returncode == 2 and re.fullmatch(pattern, p.stderr.strip()), (p.returncode,
                                                                           p.stderr)
    assert not os.path.exists(tmp_path / "run")


def test_tensor_parallelism_across_processes_feeds_each_group_the_same_rows(jax_cache, tmp_path):
    """BTP over `node`, which here is the process boundary (2 processes x 2 devices, mesh
    2x2x1): both processes hold the same batch rows, so both must read the same windows
    (sharding/placement.process_rows); training equals one process with the same mesh. Before,
    each read half the rows: a halved batch and TP partners computing on different inputs."""
    tp = TINY + ["train.steps=4", "train.eval_every=4", "checkpoint.every=100",
                 "parallel.tp_mode=btp", "parallel.tp_axes=[node]", "mesh.shape=[2,2,1]"]
    one = str(tmp_path / "one")
    from boost_jax.train.loop import run

    run(load_config(None, tp + ["logging.progress=false", f"out_dir={one}"]))
    two = str(tmp_path / "two")
    r = _launch(jax_cache, "-n", "2", "--cpu-devices-per-process", "2", "--", *tp,
                f"out_dir={two}")
    assert r.returncode == 0, r.stdout + r.stderr
    a, b = _rows(one), _rows(two)
    assert [x["step"] for x in b if "loss" in x] == [1, 2, 3, 4]
    assert_same_metrics(a, b)
