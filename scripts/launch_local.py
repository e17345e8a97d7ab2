#!/usr/bin/env python
"""Run N training processes on this machine, joined by jax.distributed (development / testing).

    python scripts/launch_local.py -n 2 --cpu-devices-per-process 4 -- \\
        --config configs/demo.yaml train.steps=50 out_dir=runs/mh

Everything after ``--`` goes to train.py (or ``--script``). Each process gets
``JAX_COORDINATOR_ADDRESS`` (127.0.0.1 and a free port), ``JAX_NUM_PROCESSES`` and
``JAX_PROCESS_ID`` in its environment (what ``distributed.mode=auto`` reads), plus
``--cpu-devices K`` when ``--cpu-devices-per-process K`` is given (and JAX_PLATFORMS=cpu).
``--env-rank NAME=VALUE`` adds per-rank variables (``{rank}`` is replaced by the rank).

Output lines are prefixed with ``[rank i]``. If a process fails, the others are killed (they
would only wait in a collective for it) and the launcher exits with the failing process's code.
Ctrl-C / SIGTERM are forwarded to every process once (they save a checkpoint and exit); a second
one kills them.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from boost_jax.cli import Parser, shell_word  # noqa: E402
from boost_jax.errors import counted  # noqa: E402
from boost_jax.mesh import MAX_CPU_DEVICES  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
# the SLURM stand-in's gloo filter (it runs the same processes; stdlib only, so it is there)
from local_slurm import GlooFilter  # noqa: E402


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


MAX_PROCESSES = 64


def _fail(message: str) -> None:
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


class _Parser(Parser):
    """One-line errors; an option of train.py given before `--` says where it goes."""

    def error(self, message: str):
        if message.startswith("unrecognized arguments"):
            message += ("; put train.py's arguments after --, e.g. python scripts/launch_local.py"
                        " -n 2 -- --config configs/demo.yaml")
        super().error(message)


def parse_args(argv=None):
    p = _Parser(prog="python scripts/launch_local.py", description=__doc__)
    p.add_argument("-n", "--num-processes", type=int, required=True)
    p.add_argument("--cpu-devices-per-process", type=int, default=None,
                   help="simulate K CPU devices in each process (sets JAX_PLATFORMS=cpu)")
    p.add_argument("--port", type=int, default=None, help="coordinator port (default: a free one)")
    p.add_argument("--script", default=os.path.join(ROOT, "train.py"))
    p.add_argument("--python", default=sys.executable)
    p.add_argument("--env-rank", action="append", default=[], metavar="NAME=VALUE",
                   help="extra per-process environment variable; {rank} expands to the rank")
    p.add_argument("--grace", type=float, default=60.0,
                   help="seconds to wait after forwarding a signal before killing")
    p.add_argument("args", nargs=argparse.REMAINDER, help="-- then the script's arguments")
    a = p.parse_args(argv)
    # one line, exit 2, no usage block: the rule for bad input
    if not 1 <= a.num_processes <= MAX_PROCESSES:
        _fail(f"-n {a.num_processes} must be between 1 and {MAX_PROCESSES} (local processes on "
              "this machine; a cluster runs through SLURM)")
    k = a.cpu_devices_per_process
    if k is not None and not 1 <= k <= MAX_CPU_DEVICES:
        _fail(f"--cpu-devices-per-process {k} must be between 1 and {MAX_CPU_DEVICES}")
    _check_launch(a)
    if a.args and a.args[0] == "--":
        a.args = a.args[1:]
    return a


ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def _check_launch(a) -> None:
    """What the processes are started with: a port, a grace period, variables, the programs."""
    if a.port is not None and not 1 <= a.port <= 65535:
        _fail(f"--port {a.port} must be between 1 and 65535 (or leave it out for a free one)")
    if not math.isfinite(a.grace) or a.grace < 0:
        _fail(f"--grace {a.grace} must be a number of seconds >= 0")
    for item in a.env_rank:
        name, eq, _ = item.partition("=")
        if not eq or not ENV_NAME.fullmatch(name):
            _fail(f"--env-rank {item!r} is not NAME=VALUE with NAME a variable name (letters, "
                  "digits, _; not starting with a digit)")
    if not os.path.isfile(a.script):
        _fail(f"--script {a.script!r} is not a file; pass the Python script to run (default "
              "train.py)")
    if shutil.which(a.python) is None:
        _fail(f"--python {a.python!r} is not an executable program; pass the Python "
              "interpreter to run the script with (default: this one)")


def _pump(rank: int, stream, out, lock: threading.Lock) -> None:
    prefix = f"[rank {rank}] ".encode()
    gloo = GlooFilter()
    for line in iter(stream.readline, b""):
        if gloo.drop(line):
            continue
        with lock:
            out.write(prefix + line if line.endswith(b"\n") else prefix + line + b"\n")
            out.flush()
    stream.close()


def _start(args, cmd: list, port: int, out, lock) -> tuple[list, list]:
    """One process per rank with JAX's coordinator variables, and a thread pumping its output."""
    n = args.num_processes
    procs, pumps = [], []
    for rank in range(n):
        env = dict(os.environ, JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
                   JAX_NUM_PROCESSES=str(n), JAX_PROCESS_ID=str(rank), PYTHONUNBUFFERED="1")
        if args.cpu_devices_per_process:
            env["JAX_PLATFORMS"] = "cpu"
        for item in args.env_rank:
            k, _, v = item.partition("=")
            env[k] = v.replace("{rank}", str(rank))
        # own session: a terminal's Ctrl-C reaches the launcher only, which forwards it once
        p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             start_new_session=True, cwd=os.getcwd())
        procs.append(p)
        t = threading.Thread(target=_pump, args=(rank, p.stdout, out, lock), daemon=True)
        t.start()
        pumps.append(t)
    return procs, pumps


def _kill_alive(procs: list) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()


def _watch(procs: list, forwarded: dict, grace: float, say):
    """Wait for every rank; the first that fails takes the others down. (rank, code) of it."""
    failed = None
    while any(p.poll() is None for p in procs):
        for rank, p in enumerate(procs):
            code = p.poll()
            if code not in (None, 0) and failed is None:
                failed = (rank, code)
                alive = [r for r, q in enumerate(procs) if q.poll() is None]
                if alive and forwarded["at"] is None:
                    say(f"rank {rank} exited with code {code}; killing ranks {alive}")
                    _kill_alive([procs[r] for r in alive])
        if forwarded["at"] is not None and time.monotonic() - forwarded["at"] > grace:
            _kill_alive(procs)
        time.sleep(0.05)
    return failed


def launch(args) -> int:
    port = args.port or free_port()
    cmd = [args.python, "-u", args.script]
    if args.cpu_devices_per_process:
        cmd += ["--cpu-devices", str(args.cpu_devices_per_process)]
    cmd += args.args
    out, lock = sys.stdout.buffer, threading.Lock()
    procs, pumps = _start(args, cmd, port, out, lock)

    def say(msg: str) -> None:
        with lock:
            out.write(f"[launch_local] {msg}\n".encode())
            out.flush()

    say(f"{counted(args.num_processes, 'process', 'processes')}, coordinator 127.0.0.1:{port}: "
        f"{' '.join(shell_word(x) for x in cmd)}")
    forwarded = {"at": None}

    def on_signal(signum, frame):
        if forwarded["at"] is None:
            forwarded["at"] = time.monotonic()
            say(f"signal {signum}: forwarding to all processes (again to kill them)")
            for p in procs:
                if p.poll() is None:
                    p.send_signal(signum)
        else:
            _kill_alive(procs)

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        failed = _watch(procs, forwarded, args.grace, say)
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    for t in pumps:
        t.join(timeout=5)
    codes = [p.returncode for p in procs]
    if failed is None:
        failed = next(((r, c) for r, c in enumerate(codes) if c != 0), None)
    if failed is None:
        return 0
    say(f"exit codes by rank: {codes}")
    code = failed[1]
    return code if code > 0 else 128 - code  # killed by signal s: 128 + s


def main(argv=None) -> int:
    args = parse_args(argv)
    if not args.args:
        print("launch_local: give the script's arguments after --", file=sys.stderr)
        return 2
    return launch(args)


if __name__ == "__main__":
    sys.exit(main())
