#!/usr/bin/env python3
"""A local stand-in for SLURM's sbatch, srun, scontrol and scancel: runs a batch script written
by ``python -m boost_jax.launch slurm`` on this machine, every "node" a group of processes here.

    PATH=$PWD/scripts/local_slurm:$PATH sbatch job.sbatch [train.py overrides ...]
    PATH=$PWD/scripts/local_slurm:$PATH scancel --signal=TERM JOBID   # what --signal=TERM@S does

``scripts/local_slurm/{sbatch,srun,scontrol,scancel}`` link here; the name called picks the tool.

sbatch   reads ``#SBATCH`` options (those on its command line win), prints ``Submitted batch job
         N``, runs the script in the foreground (output on stdout, not ``%x-%j.out``) with what
         SLURM sets for a batch script: SLURM_JOB_ID, SLURM_JOB_NAME, SLURM_JOB_NUM_NODES /
         SLURM_NNODES, SLURM_JOB_NODELIST / SLURM_NODELIST, SLURM_SUBMIT_DIR,
         SLURM_NTASKS_PER_NODE, and SLURM_RESTART_COUNT after a requeue. Nodes are 127.0.0.1 ...
         127.0.0.N, listed the way SLURM compresses host lists (127.0.0.[1-2]); the job id is
         chosen so that the port JAX derives from it (id % 4096 + 61440) is free. When the
         script asked for ``scontrol requeue``, the script runs again, as a requeued job does.
srun     starts the step's tasks (block distribution over the nodes) with SLURM_PROCID,
         SLURM_LOCALID, SLURM_NODEID, SLURM_NTASKS / SLURM_NPROCS, SLURM_STEP_ID,
         SLURM_STEP_NUM_TASKS, SLURM_STEP_NUM_NODES, SLURM_STEP_NODELIST, SLURM_TASKS_PER_NODE,
         SLURMD_NODENAME; forwards the tasks' output line by line (``--label``: with the task
         number); ``--kill-on-bad-exit=1`` ends the step when a task fails (SIGTERM, then
         SIGKILL after 10 s); a signal to srun goes to every task. Binding options
         (--cpus-per-task, --gpu-bind) are accepted and have no effect here.
scontrol ``requeue JOBID``: the job's script runs again once it has exited.
scancel  ``--signal=SIG JOBID`` (or ``-s SIG``): the signal goes to the tasks of the running
         step, not to the batch script (SLURM's default), like ``--signal=TERM@S`` near the time
         limit; plain ``scancel JOBID`` ends the job.

An option these tools do not know is refused (exit 2): the stand-in runs what it understands.
"""

from __future__ import annotations

import os
import random
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import NoReturn

STATE = os.environ.get("LOCAL_SLURM_STATE") or os.path.join(
    os.environ.get("TMPDIR", "/tmp"), f"boost_jax_local_slurm-{os.getuid()}")
HERE = os.path.join(os.path.dirname(os.path.realpath(__file__)), "local_slurm")
IGNORED = {"account", "time", "partition", "qos", "constraint", "output", "error", "open-mode",
           "requeue", "signal", "gpus-per-node", "cpus-per-task", "gpu-bind", "exclusive",
           "mail-type", "mail-user", "unbuffered"}
SHORT = {"-N": "nodes", "-n": "ntasks", "-J": "job-name", "-A": "account", "-t": "time",
         "-p": "partition", "-q": "qos", "-C": "constraint", "-o": "output", "-e": "error",
         "-c": "cpus-per-task", "-K": "kill-on-bad-exit", "-l": "label", "-u": "unbuffered",
         "-s": "signal"}
FLAGS = {"requeue", "exclusive", "kill-on-bad-exit", "label", "unbuffered", "full", "batch"}


def fail(tool: str, msg: str) -> NoReturn:
    print(f"{tool}: error: {msg}", file=sys.stderr)
    sys.exit(2)


def parse_opts(tool: str, argv: list, known: set) -> tuple[dict, list]:
    """`--key=value`, `--key value`, `-k value`, flags; stops at the first non-option."""
    opts, i = {}, 0
    while i < len(argv) and argv[i].startswith("-") and argv[i] != "-":
        a = argv[i]
        if a.startswith("--"):
            key, eq, val = a[2:].partition("=")
        else:
            key, eq, val = SHORT.get(a[:2], a), "", a[2:]
            eq = "=" if val else ""
        if key not in known and key not in IGNORED:
            fail(tool, f"unknown option {a!r} (this local stand-in knows "
                       f"{', '.join(sorted(known | IGNORED))})")
        if not eq and key not in FLAGS:
            i += 1
            if i >= len(argv):
                fail(tool, f"option {a!r} needs a value")
            val = argv[i]
        opts[key] = val if eq or key not in FLAGS else "1"
        i += 1
    return opts, argv[i:]


def hostlist(n: int) -> tuple[list, str]:
    hosts = [f"127.0.0.{i}" for i in range(1, n + 1)]
    return hosts, (hosts[0] if n == 1 else f"127.0.0.[1-{n}]")


def job_dir(job_id) -> str:
    return os.path.join(STATE, str(job_id))


def free_job_id() -> int:
    for _ in range(200):
        job_id = random.randrange(10_000, 10_000_000)
        port = job_id % 2**12 + (65535 - 2**12 + 1)  # JAX's SLURM coordinator port
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        if not os.path.exists(job_dir(job_id)):
            return job_id
    fail("sbatch", "no free coordinator port found")


# --------------------------------------------------------------------------- sbatch


def sbatch(argv: list) -> int:
    known = {"nodes", "ntasks-per-node", "job-name"}
    cli, rest = parse_opts("sbatch", argv, known)
    if not rest:
        fail("sbatch", "give the batch script")
    script, args = rest[0], rest[1:]
    directives = []
    with open(script) as f:
        for line in f.read().splitlines()[1:]:
            if line.startswith("#SBATCH"):
                directives += shlex.split(line[len("#SBATCH"):])
            elif line.strip() and not line.startswith("#"):
                break  # SLURM reads directives up to the first command
    opts, extra = parse_opts("sbatch", directives, known)
    if extra:
        fail("sbatch", f"cannot read #SBATCH {' '.join(extra)!r}")
    opts.update(cli)
    nodes = int(opts.get("nodes", 1))
    hosts, nodelist = hostlist(nodes)
    job_id = free_job_id()
    os.makedirs(job_dir(job_id))
    env = dict(os.environ, SLURM_JOB_ID=str(job_id), SLURM_JOBID=str(job_id),
               SLURM_JOB_NAME=opts.get("job-name", os.path.basename(script)),
               SLURM_JOB_NUM_NODES=str(nodes), SLURM_NNODES=str(nodes),
               SLURM_JOB_NODELIST=nodelist, SLURM_NODELIST=nodelist,
               SLURM_SUBMIT_DIR=os.getcwd(), SLURM_CLUSTER_NAME="local",
               LOCAL_SLURM_STATE=STATE, PATH=HERE + os.pathsep + os.environ.get("PATH", ""))
    if "ntasks-per-node" in opts:
        env["SLURM_NTASKS_PER_NODE"] = opts["ntasks-per-node"]
    print(f"Submitted batch job {job_id}", flush=True)
    restarts = 0
    try:
        while True:
            proc = subprocess.Popen(["bash", script, *args], env=env, start_new_session=True)
            with open(os.path.join(job_dir(job_id), "batch.pid"), "w") as f:
                f.write(str(proc.pid))
            _on_signals(lambda s, f: _end(proc.pid))
            code = proc.wait()
            flag = os.path.join(job_dir(job_id), "requeue")
            if not os.path.exists(flag) or restarts >= 20:
                break
            os.remove(flag)
            restarts += 1
            env["SLURM_RESTART_COUNT"] = str(restarts)
            print(f"sbatch (local): job {job_id} requeued, restart {restarts}", flush=True)
    finally:
        shutil.rmtree(job_dir(job_id), ignore_errors=True)
    return code if code >= 0 else 128 - code


def _end(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGTERM)
    except ProcessLookupError:
        pass


def _on_signals(handler) -> None:
    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, handler)


# --------------------------------------------------------------------------- srun


def srun(argv: list) -> int:
    known = {"nodes", "ntasks", "ntasks-per-node", "kill-on-bad-exit", "label"}
    opts, cmd = parse_opts("srun", argv, known)
    label = "label" in opts
    job_id = os.environ.get("SLURM_JOB_ID")
    if not job_id or not os.path.isdir(job_dir(job_id)):
        fail("srun", "run it inside a job of the local sbatch stand-in")
    job_nodes = int(os.environ["SLURM_JOB_NUM_NODES"])
    nodes = int(opts.get("nodes", job_nodes))
    if not 1 <= nodes <= job_nodes:
        fail("srun", f"--nodes={nodes}: the job has {job_nodes} node{'' if job_nodes == 1 else 's'}")
    per_node = int(opts.get("ntasks-per-node", 0))
    ntasks = int(opts.get("ntasks", per_node * nodes or nodes))
    per_node = per_node or -(-ntasks // nodes)
    if ntasks > per_node * nodes or not cmd:
        fail("srun", f"{ntasks} tasks do not fit {nodes} node{'' if nodes == 1 else 's'} x {per_node}" if cmd
             else "give the command to run")
    hosts, nodelist = hostlist(nodes)
    step = len([f for f in os.listdir(job_dir(job_id)) if f.startswith("step-")])
    pidfile = os.path.join(job_dir(job_id), f"step-{step}.pid")
    with open(pidfile, "w") as f:
        f.write(str(os.getpid()))
    counts = [min(per_node, ntasks - i * per_node) for i in range(nodes)]
    tasks_per_node = ",".join(str(c) for c in counts)
    procs = []
    for rank in range(ntasks):
        node = rank // per_node
        env = dict(os.environ, SLURM_PROCID=str(rank), SLURM_LOCALID=str(rank % per_node),
                   SLURM_NODEID=str(node), SLURM_NTASKS=str(ntasks), SLURM_NPROCS=str(ntasks),
                   SLURM_STEP_ID=str(step), SLURM_STEPID=str(step),
                   SLURM_STEP_NUM_TASKS=str(ntasks), SLURM_STEP_NUM_NODES=str(nodes),
                   SLURM_STEP_NODELIST=nodelist, SLURM_NODELIST=nodelist,
                   SLURM_NNODES=str(nodes), SLURM_TASKS_PER_NODE=tasks_per_node,
                   SLURM_STEP_TASKS_PER_NODE=tasks_per_node, SLURMD_NODENAME=hosts[node],
                   SLURM_TOPOLOGY_ADDR=hosts[node])
        procs.append(subprocess.Popen(cmd, env=env, start_new_session=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    lock = threading.Lock()
    pumps = [threading.Thread(target=_pump, args=(stream, out, lock, f"{rank}: " if label
                                                  else ""), daemon=True)
             for rank, p in enumerate(procs) for stream, out in
             ((p.stdout, sys.stdout.buffer), (p.stderr, sys.stderr.buffer))]
    for t in pumps:
        t.start()
    try:
        code = _supervise(procs, opts.get("kill-on-bad-exit", "0") not in ("0", ""))
    finally:
        os.remove(pidfile)
    for t in pumps:
        t.join(timeout=5)
    return code


# gloo (CPU collectives) announces each rank's connections, from several threads at once: the
# pieces interleave, so a line can hold a piece of it ("[Gloo] Rank 1 is connected to", "...
# connected peer ranks is : 1") or nothing but the count. Noise for every local run. A bare
# count or an empty line is a piece only in the few lines after a piece: elsewhere it is the
# process's own output, passed on.
GLOO_CONNECTED = re.compile(rb"\[Gloo\]|connected to \d+ peer ranks|connected peer ranks")
GLOO_PIECE = re.compile(rb"^\s*:?\s*\d*\s*$")
GLOO_WINDOW = 8  # lines after a piece that may hold its stray counts


class GlooFilter:
    """One stream's gloo noise: `drop(line)` is True for a piece of a connection announcement."""

    def __init__(self):
        self.left = 0

    def drop(self, line: bytes) -> bool:
        if GLOO_CONNECTED.search(line):
            self.left = GLOO_WINDOW
            return True
        if self.left:
            self.left -= 1
            return bool(GLOO_PIECE.match(line))
        return False


def _pump(stream, out, lock: threading.Lock, prefix: str) -> None:
    """Whole lines, as srun forwards its tasks' output (lines of tasks never interleave)."""
    gloo = GlooFilter()
    for line in iter(stream.readline, b""):
        if gloo.drop(line):
            continue
        with lock:
            out.write(prefix.encode() + line + (b"" if line.endswith(b"\n") else b"\n"))
            out.flush()
    stream.close()


def _supervise(procs: list, kill_on_bad_exit: bool) -> int:
    state = {"signalled": None}

    def forward(signum, frame):
        if state["signalled"] is None:
            state["signalled"] = time.monotonic()
            for p in procs:
                if p.poll() is None:
                    p.send_signal(signum)
        else:  # a second signal: end the step now
            for p in procs:
                if p.poll() is None:
                    p.kill()

    _on_signals(forward)
    ending = None  # when the step was told to end (a task failed under --kill-on-bad-exit)
    while any(p.poll() is None for p in procs):
        failed = [p for p in procs if p.poll() not in (None, 0)]
        if failed and kill_on_bad_exit and ending is None:
            ending = time.monotonic()
            for p in procs:
                if p.poll() is None:
                    p.terminate()
        if ending is not None and time.monotonic() - ending > 10:
            for p in procs:
                if p.poll() is None:
                    p.kill()
        time.sleep(0.05)
    codes = [p.returncode for p in procs]
    code = max((c if c >= 0 else 128 - c for c in codes), default=0)
    return code


# --------------------------------------------------------------------------- scontrol / scancel


def scontrol(argv: list) -> int:
    if len(argv) != 2 or argv[0] != "requeue":
        fail("scontrol", "this local stand-in knows only: scontrol requeue JOBID")
    if not os.path.isdir(job_dir(argv[1])):
        fail("scontrol", f"no running job {argv[1]}")
    open(os.path.join(job_dir(argv[1]), "requeue"), "w").close()
    return 0


def scancel(argv: list) -> int:
    opts, rest = parse_opts("scancel", argv, {"signal", "full", "batch"})
    if len(rest) != 1 or not os.path.isdir(job_dir(rest[0])):
        fail("scancel", f"give one running job id (got {rest})")
    d = job_dir(rest[0])
    if "signal" not in opts:  # the whole job: batch script, steps and their tasks
        with open(os.path.join(d, "batch.pid")) as fh:
            _end(int(fh.read()))
    name = opts.get("signal", "TERM").upper()
    try:
        sig = int(name) if name.isdigit() else getattr(signal, "SIG" + re.sub("^SIG", "", name))
    except AttributeError:
        fail("scancel", f"unknown signal {name!r}")
    pids = []
    for f in os.listdir(job_dir(rest[0])):
        if f.startswith("step-"):
            with open(os.path.join(job_dir(rest[0]), f)) as fh:
                pids.append(int(fh.read()))
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass
    return 0 if pids else 1


def main() -> int:
    tool = os.path.basename(sys.argv[0])
    tools = {"sbatch": sbatch, "srun": srun, "scontrol": scontrol, "scancel": scancel}
    if tool not in tools:
        print(__doc__)
        return 2
    return tools[tool](sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
