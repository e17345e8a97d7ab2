"""A ready SLURM batch script for one training run on a topology profile's cluster.

The script holds everything the job needs, so a requeued job (or a copy run a year later) runs
the same thing:

- `#SBATCH` resources: nodes, one task per process (``JobProfile.processes_per_node``), GPUs
  and CPUs per task, account / time / partition / QOS / constraint, ``--requeue``,
  ``--signal=TERM@<save margin>`` and append-mode output ``%x-%j.out``;
- the environment of the profile: collective library and network variables, site modules,
  ``JAX_PLATFORMS`` (a missing GPU backend fails at start instead of training on the CPUs),
  XLA flags, and ``XLA_PYTHON_CLIENT_MEM_FRACTION`` = the planner's usable HBM fraction, so a
  layout the planner says fits is allowed that memory;
- the resolved config as a heredoc, written next to the run's checkpoints on the scratch file
  system (``JobProfile.scratch``) and passed to train.py with ``--config``;
- ``srun --kill-on-bad-exit=1`` (a dead process would leave the others waiting in a collective);
- resume on requeue: SLURM sends SIGTERM ``save_margin_s`` before the time limit, train.py
  saves and exits 143, the script then runs ``scontrol requeue`` and the requeued job resumes
  from that checkpoint (the same script, the same out_dir); a SIGTERM before a new step was
  saved (too short a limit) ends the job instead. A node failure requeues the job too
  (``--requeue``); it resumes from the last checkpoint.

Arguments given to ``sbatch job.sbatch ...`` after the script are passed on to train.py as
extra overrides (e.g. ``train.stop_after=100``); ``out_dir`` is refused there, as the script
watches its own for checkpoints.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import shlex
import sys
from dataclasses import dataclass
from typing import Optional

from boost_jax.config import Config, config_to_yaml
from boost_jax.errors import ConfigError, UserError, counted
from boost_jax.launch import script_values as sv
from boost_jax.mesh import AXES, JobProfile, Topology, check_node_shape
from boost_jax.names import CHECKPOINTS_DIR, KEPT_SECONDARY

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TRAIN_PY = os.path.join(ROOT, "train.py")
NODE_CHECK = os.path.join(ROOT, "boost_jax", "launch", "node_check.py")  # run by path
EXIT_SIGTERM = 143  # train.py after saving on SIGTERM: 128 + 15
_TIME = re.compile(r"(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?", re.ASCII)  # 0-9 only


@dataclass
class Job:
    cfg: Config  # mesh.topology / mesh.shape set to the job's
    topo: Topology
    profile: JobProfile
    sizes: dict
    account: Optional[str]
    time: str
    partition: Optional[str]
    qos: Optional[str]
    modules: tuple
    out_dir: str  # shell expression
    python: str
    command: str  # the command line that wrote the script
    predicted: Optional[dict] = None  # planner's memory and step time, for the header

    @property
    def nodes(self) -> int:
        return self.sizes["global"]

    @property
    def processes(self) -> int:
        return self.nodes * self.profile.processes_per_node

    @property
    def devices_per_process(self) -> int:
        return self.topo.devices_per_node // self.profile.processes_per_node


def time_seconds(text: str) -> int:
    """SLURM's time formats: M, M:S, H:M:S, D-H, D-H:M, D-H:M:S."""
    m = _TIME.fullmatch(text) if isinstance(text, str) else None
    if not m:
        raise UserError(f"--time {text!r} is not a SLURM time limit; use HH:MM:SS (e.g. "
                        "02:00:00) or D-HH:MM:SS")
    d, a, b, c = m.groups()
    # minutes and seconds after a colon run 0-59 (SLURM would carry them over silently)
    if any(int(x) > 59 for x in (b, c) if x is not None):
        raise UserError(f"--time {text!r} has minutes or seconds above 59; use HH:MM:SS (e.g. "
                        "02:00:00) or D-HH:MM:SS")
    if d is not None:  # D-H[:M[:S]]
        h, mi, s = int(a), int(b or 0), int(c or 0)
        return ((int(d) * 24 + h) * 60 + mi) * 60 + s
    if b is None:  # M
        return int(a) * 60
    if c is None:  # M:S
        return int(a) * 60 + int(b)
    return (int(a) * 60 + int(b)) * 60 + int(c)


def job_sizes(cfg: Config, topo: Topology, nodes: Optional[int]) -> dict:
    """(pair, node, global) of the job; the config's mesh.shape must match the node."""
    per_node = topo.devices_per_node
    if nodes is None:
        cfg.mesh.check_nodes_agree()
        nodes = cfg.mesh.shape[2] if cfg.mesh.shape is not None else cfg.mesh.nodes
    if nodes is None:
        raise UserError(f"how many nodes? pass --nodes N (a {topo.name} node has {per_node} "
                        "devices), or set mesh.nodes / mesh.shape in the config")
    if nodes < 1:
        raise UserError(f"--nodes {nodes} must be >= 1")
    check_node_shape(cfg.mesh.shape, topo, nodes)
    p, n = cfg.mesh.shape[:2] if cfg.mesh.shape is not None else (topo.pair, topo.node)
    return {"pair": int(p), "node": int(n), "global": int(nodes)}


def check_layout(cfg: Config, topo: Topology, sizes: dict) -> dict:
    """The checks train.py would make on the cluster, made now: the parallel layout's (TP cut,
    pipeline split), the batch over the data-parallel devices; returns the planner's analytic
    memory and step time."""
    from boost_jax.plan.costmodel import SizesMesh, predict
    from boost_jax.sharding import parallel

    try:
        parallel.check(cfg, SizesMesh(sizes))  # pipeline split, TP cut
        p = predict(cfg, topo, sizes)
    except (ConfigError, ValueError) as e:
        raise UserError(str(e).splitlines()[0]) from None
    return {"memory": p.memory["total"], "fits": p.memory["fits"], "step_time": p.step_time,
            "hbm_usable": p.assumptions.hbm_usable, "limit": p.memory["limit"],
            "layout": p.layout,
            "notes": list(p.notes)}


def out_dir_expr(cfg: Config, profile: JobProfile, account: Optional[str]) -> str:
    """out_dir on the scratch file system as a shell word (absolute out_dirs are kept): the
    profile's root is expanded by the job's shell, the config's path never is."""
    from boost_jax.checkpoints.run_config import refuse_pattern

    refuse_pattern(cfg.out_dir)  # train.py would refuse it when the job starts
    if os.path.isabs(cfg.out_dir) or not profile.scratch:
        # ./-v, not -v: a word starting with "-" would be read as an option by mkdir and argparse
        return shlex.quote(cfg.out_dir if not cfg.out_dir.startswith("-") else
                           os.path.join(".", cfg.out_dir))
    rel = os.path.normpath(cfg.out_dir)
    if rel == os.pardir or rel.startswith(os.pardir + os.sep):
        raise UserError(f"out_dir={cfg.out_dir!r} climbs out of the scratch directory "
                        f"({profile.scratch}); give a path inside it or an absolute one")
    root = profile.scratch.replace("{account}", (account or "").lower())
    return f'"{root}"/{shlex.quote(rel)}'


ACCOUNT = "ACCOUNT"  # the planner's hint stands it for the project id; refused as a value


JOB_CONFIG = "job_config.yaml"  # in OUT_DIR: the resolved config the job writes at each start
JOB_CONFIG_MARK = "# boost_jax launch slurm: the job rewrites this file at each start"


def job_wrote(path: Optional[str]) -> bool:
    """Is `path` a job_config.yaml a job wrote (its first line the mark)?"""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.readline().rstrip("\n") == JOB_CONFIG_MARK
    except (OSError, TypeError):
        return False


def local_job_config(job: Job) -> Optional[str]:
    """Where the job will write OUT_DIR/job_config.yaml, as a path on this machine: the
    config's out_dir when absolute (or with no scratch root), else under the scratch root with
    its variables as this shell has them; None where one is not set here."""
    out = job.cfg.out_dir
    if not (os.path.isabs(out) or not job.profile.scratch):
        root = os.path.expandvars(job.profile.scratch.replace("{account}",
                                                              (job.account or "").lower()))
        if "$" in root:
            return None
        out = os.path.join(root, out)
    return os.path.join(out, JOB_CONFIG)


def make_job(cfg: Config, topo: Topology, nodes: Optional[int], account: Optional[str] = None,
             time: str = "02:00:00", partition: Optional[str] = None, qos: Optional[str] = None,
             modules: Optional[list] = None, python: Optional[str] = None,
             command: str = "") -> Job:
    profile = topo.job
    if profile is None:
        raise UserError(f"topology {topo.name!r} has no job settings; give it a JobProfile in "
                        "boost_jax/mesh.py (processes per node, GPUs, environment, scratch)")
    if profile.needs_account and not account:
        raise UserError(f"--account is needed on {topo.name}: the project id that is charged "
                        f"and names the scratch directory ({profile.scratch}); e.g. "
                        "--account abc123")
    if account == ACCOUNT:
        raise UserError(f"--account {ACCOUNT} is the placeholder the planner prints; give the "
                        "project id that is charged, e.g. --account abc123")
    if account is not None and not re.fullmatch(r"[A-Za-z0-9_.-]+", account):
        raise UserError(f"--account {account!r} is not a project id (letters, digits, _ . -)")
    _check_distributed(cfg)
    secs = time_seconds(time)
    if secs <= profile.save_margin_s:
        raise UserError(f"--time {time} leaves no time to train: SLURM asks the job to save "
                        f"{profile.save_margin_s} s before the limit; ask for more time")
    sizes = job_sizes(cfg, topo, nodes)
    cfg = dataclasses.replace(cfg, mesh=dataclasses.replace(
        cfg.mesh, topology=topo.name, shape=[sizes[a] for a in AXES], nodes=None))
    predicted = check_layout(cfg, topo, sizes)
    python = python or os.path.abspath(sys.executable)
    if not os.path.isfile(TRAIN_PY):
        raise UserError(f"train.py is not at {TRAIN_PY}; run the launcher from a checkout of "
                        "boost_jax (pip install -e .)")
    job = Job(cfg, topo, profile, sizes, account, time,  # "": the flag given empty, refused
              profile.partition if partition is None else partition,
              profile.qos if qos is None else qos,
              tuple(profile.modules if modules is None else modules),
              out_dir_expr(cfg, profile, account), python, command, predicted)
    check_values(job)
    return job


def _check_distributed(cfg: Config) -> None:
    """The job's processes join through SLURM's variables (distributed.mode=auto); a config
    that turns that off or names one process's place would start them apart or all as one."""
    d = cfg.distributed
    given = [f"distributed.{k}={getattr(d, k)}" for k in
             ("coordinator", "num_processes", "process_id", "local_cpu_devices")
             if getattr(d, k) is not None]
    if d.mode != "auto" or given:
        what = ", ".join(([f"distributed.mode={d.mode}"] if d.mode != "auto" else []) + given)
        raise UserError(f"{what}: the job's srun starts every process, which join through "
                        "SLURM's variables (distributed.mode=auto); drop these settings")


def check_values(job: Job) -> None:
    """Every value the script holds is data: a word of a fixed alphabet where SLURM or the shell
    reads it bare, otherwise free of control characters and quoted where it is written."""
    pr, word = job.profile, sv.check_word
    word("name", job.cfg.name, sv.SLURM_NAME,
         "letters, digits and _ . + - (e.g. name=cola-7b)")
    if job.account is not None:
        word("--account", job.account, r"[A-Za-z0-9_.-]+", "a project id (letters, digits, _ . -)")
    for flag, v in (("--partition", job.partition), ("--qos", job.qos)):
        if v is not None:
            word(flag, v, sv.SLURM_NAMES, "letters, digits and _ . + - (commas between several)")
    if pr.constraint is not None:
        word("the profile's constraint", pr.constraint, sv.SLURM_CONSTRAINT, "a SLURM constraint")
    time_seconds(job.time)
    for m in job.modules:
        word("--module", m, sv.MODULE, "a module name such as rocm/7.0.2")
    sv.check_text("--python", job.python, "give the path of the Python on the compute nodes")
    sv.check_text("train.py's path", TRAIN_PY, "run from a checkout in a plain directory")
    sv.check_text("out_dir", job.cfg.out_dir, "choose a plain path")
    if pr.scratch:
        word("the profile's scratch", pr.scratch, sv.SCRATCH, "a path with $VARIABLES only")
    for k, v in list(pr.env) + [("XLA_FLAGS", " ".join(pr.xla_flags))]:
        word("the profile's environment variable", k, sv.ENV_NAME, "a shell variable name")
        sv.check_text(f"the profile's {k}", v, "fix the profile in boost_jax/mesh.py")


def _sbatch_lines(job: Job) -> list[str]:
    pr = job.profile
    opts = [("job-name", job.cfg.name), ("account", job.account), ("nodes", job.nodes),
            ("ntasks-per-node", pr.processes_per_node),
            ("gpus-per-node", pr.gpus_per_node or None),
            ("cpus-per-task", pr.cpus_per_task or None), ("time", job.time),
            ("partition", job.partition), ("qos", job.qos), ("constraint", pr.constraint),
            ("output", "%x-%j.out"), ("open-mode", "append"), ("requeue", ""),
            ("signal", f"TERM@{pr.save_margin_s}")]
    return [f"#SBATCH --{k}={v}" if v != "" else f"#SBATCH --{k}" for k, v in opts
            if v is not None]


def srun_command(job: Job) -> str:
    """The job step: one task per process; the options one per line, then train.py."""
    pr = job.profile
    opts = [f"--nodes={job.nodes}", f"--ntasks={job.processes}",
            f"--ntasks-per-node={pr.processes_per_node}"]
    if pr.cpus_per_task:
        opts.append(f"--cpus-per-task={pr.cpus_per_task}")
    if pr.gpus_per_node:
        opts.append("--gpu-bind=none")  # every process sees its node's GPUs; JAX picks by rank
    opts.append("--kill-on-bad-exit=1")
    train = [sv.quote(job.python), "-u", sv.quote(TRAIN_PY), "--config", '"$CONFIG"',
             'out_dir="$OUT_DIR"']
    if pr.platform == "cpu":
        train += ["--cpu-devices", str(job.devices_per_process)]
    return " \\\n    ".join(["srun", *opts, " ".join(train + ['"$@"'])])


def layout_text(cfg: Config, layout: Optional[dict]) -> str:
    """The layout the job runs, as the planner resolved it: the plan's roles after tensor
    parallelism took its axes, TP, pipeline stages, micro-batches and dtypes."""
    par, tr = cfg.parallel, cfg.train
    text = f"plan {par.plan}"
    pl = (layout or {}).get("placement")
    if pl:
        roles = ", ".join(f"{k} {pl.get(k) or '-'}" for k in ("params", "grads", "opt_state"))
        sec = pl.get("secondary")
        roles += ", secondary " + (KEPT_SECONDARY if sec == [] else str(sec or "-"))
        roles += (" int8" if pl.get("int8_secondary") else "") + (
            ", qwZ int8 gathers" if pl.get("quantize_gather") else "") + (
            ", qgZ int4 gradient reduce-scatter" if pl.get("quantize_grads") else "")
        text += f" ({roles})"
    text += cross_node_text(par) + f"; TP {par.tp_mode} over {par.tp_axes or '-'}"
    if par.pp_stages > 1:
        text += (f"; {par.pp_stages} pipeline stages ({par.pp_schedule}"
                 + (f", {par.pp_virtual} virtual" if par.pp_virtual > 1 else "") + ")")
    return (text + f"; {counted(tr.micro_batches, 'micro-batch', 'micro-batches')}, "
            f"remat {tr.remat}; global batch "
            f"{tr.global_batch} x {cfg.data.seq_len} tokens; " + dtypes_text(cfg))


def cross_node_text(par) -> str:
    """'; cross-node weights int8, gradients int4' for quantized cross-node legs, else '':
    they change the loss, so every header that describes the layout says so."""
    xq = [f"{k} {v}" for k, v in (("weights", par.quantize_cross_node_weights),
                                  ("gradients", par.quantize_cross_node_grads)) if v != "none"]
    return f"; cross-node {', '.join(xq)}" if xq else ""


def dtypes_text(cfg: Config) -> str:
    """The weights' and the gradient sum's dtypes (the planner's search may lower both)."""
    master = ", an fp32 master copy" if cfg.model.param_dtype != "float32" else ""
    return (f"weights {cfg.model.param_dtype}{master}, gradients summed in "
            f"{cfg.parallel.grad_accum_dtype}")


def _header(job: Job) -> list[str]:
    c, s, pr = job.cfg, job.sizes, job.profile
    lines = [f"boost_jax: {c.name} on {job.topo.name} ({job.topo.device}): "
             f"{counted(job.nodes, 'node')} x "
             f"{counted(pr.processes_per_node, 'process', 'processes')} x "
             f"{counted(job.devices_per_process, 'device')} = "
             f"{counted(math.prod(s.values()), 'device')} = pair {s['pair']} x node {s['node']} x "
             + (f"global {s['global'] // c.parallel.pp_stages} x stage {c.parallel.pp_stages}"
                if c.parallel.pp_stages > 1 else f"global {s['global']}"),
             "layout: " + layout_text(c, (job.predicted or {}).get("layout"))]
    if job.predicted:
        p = job.predicted
        lines += [f"note: {n}" for n in p.get("notes", [])]
        lines.append(f"planner (analytic): {p['memory'] / 2**30:.1f} GiB per device of "
                     f"{job.topo.hbm_bytes / 2**30:.0f} GiB, {p['step_time']:.3f} s per step")
    lines.append(f"python on the compute nodes: {job.python}")
    if job.command:
        lines.append(f"written by: {job.command}")
    lines += ["submit: sbatch THIS_FILE [key=value ...]  (extra overrides go to train.py)",
              "resumes by itself: SIGTERM before the time limit -> checkpoint -> requeue"]
    return [sv.comment(x) for x in lines]


def node_check_command(job: Job) -> str:
    """One task per node runs node_check.py with the job's Python before training."""
    pr = job.profile
    opts = [f"--nodes={job.nodes}", f"--ntasks={job.nodes}", "--ntasks-per-node=1"]
    if pr.gpus_per_node:
        opts.append("--gpu-bind=none")
    want = "cpu" if pr.platform == "cpu" else "gpu"
    return " ".join(["srun", *opts, sv.quote(job.python), sv.quote(NODE_CHECK), want,
                     str(job.topo.devices_per_node)])


def _heredoc_or_exit(target: str, text: str, tag: str) -> list[str]:
    """The lines that write `text` to `target` (quoted) and stop the script when writing fails
    (a full disk): a file cut short is removed, never renamed into place."""
    lines = sv.heredoc(target, text, tag)
    return [lines[0] + f" || {{ rm -f -- {target}; exit 1; }}", *lines[1:]]


def render(job: Job) -> str:
    check_values(job)
    pr = job.profile
    env = list(pr.env) + [("JAX_PLATFORMS", pr.platform)]
    if pr.xla_flags:
        env.append(("XLA_FLAGS", " ".join(pr.xla_flags)))
    if pr.gpus_per_node:
        env.append(("XLA_PYTHON_CLIENT_MEM_FRACTION", f"{job.predicted['hbm_usable']:.2f}"))
    L = ["#!/bin/bash", *_sbatch_lines(job), *_header(job), ""]
    L.append('echo "boost_jax: job ${SLURM_JOB_ID}, nodes: ${SLURM_JOB_NUM_NODES} '
             '(${SLURM_JOB_NODELIST}), restart ${SLURM_RESTART_COUNT:-0}"')
    if env:
        L.append("# collective library, network and JAX settings of the profile "
                 "(boost_jax/mesh.py)")
        L += [f"export {k}={sv.quote(v)}" for k, v in env]
    if job.modules:
        L.append("# site modules last: their settings win over the defaults above")
        L += [f"module load {sv.quote(m)} || exit 1" for m in job.modules]
    L += _config_lines(job) + _train_lines(job)
    return "\n".join(L)

def _config_lines(job: Job) -> list[str]:
    """OUT_DIR (never an override of the job's), and the resolved config written into it."""
    text = config_to_yaml(job.cfg)
    # a job of an earlier version wrote no mark: its config names this out_dir (a resolved
    # config ends with out_dir and name; a user's notes do not)
    out_line = next(x for x in text.splitlines() if x.startswith("out_dir:"))
    return ["", f"OUT_DIR={job.out_dir}", f'CONFIG="$OUT_DIR/{JOB_CONFIG}"',
            "# the job's out_dir is OUT_DIR (its checkpoints, its requeue): not an override",
            'for arg in "$@"; do',
            '    case "$arg" in out_dir=*)',
            '        echo "boost_jax: this job trains in $OUT_DIR; drop $arg, or write a job for '
            'that out_dir with python -m boost_jax.launch slurm" >&2',
            "        exit 2;;",
            "    esac",
            "done",
            'mkdir -p -- "$OUT_DIR" || exit 1',
            "# the resolved config (train.py --config takes it unchanged), published whole: "
            "never",
            "# written through a link, into a special file of that name, or over a file a job "
            "did not write",
            'if [ -L "$CONFIG" ] || { [ -e "$CONFIG" ] && [ ! -f "$CONFIG" ]; }; then',
            '    echo "boost_jax: $CONFIG is a link or not a regular file; move it away" >&2',
            "    exit 1",
            "fi",
            'if [ -e "$CONFIG" ] && [ "$(head -n 1 -- "$CONFIG")" != '
            f'{shlex.quote(JOB_CONFIG_MARK)} ] && ! {{ grep -qxF -- {shlex.quote(out_line)} '
            '"$CONFIG" && grep -qx "distributed:" "$CONFIG"; }; then',
            '    echo "boost_jax: $CONFIG is not a file this job wrote; move it away" >&2',
            "    exit 1",
            "fi",
            f'NEW_CONFIG=$(mktemp "$OUT_DIR/.{JOB_CONFIG}.XXXXXX") || exit 1',
            *_heredoc_or_exit('"$NEW_CONFIG"', JOB_CONFIG_MARK + "\n" + text,
                              "BOOST_JAX_CONFIG"),
            "# mktemp made it 0600: the mode a new file gets under the umask",
            'chmod "$(printf %o $((0666 & ~0$(umask))))" "$NEW_CONFIG" || exit 1',
            'mv -f -- "$NEW_CONFIG" "$CONFIG" || exit 1']


def _train_lines(job: Job) -> list[str]:
    """The node check, training, and the requeue of a job that saved a step past its start."""
    return ["", "# one task per node: JAX, its backend and every device, or stop here",
            node_check_command(job) + ' || { echo "boost_jax: node check failed; not '
            'training"; exit 1; }',
            "", "# the newest saved step: a job requeues only when it got past it",
            "newest_step() { ls -- \"$OUT_DIR/%s\" 2>/dev/null | grep -E '^[0-9]+$' | "
            "sort -n | tail -n 1; }" % CHECKPOINTS_DIR,
            'BEFORE=$(newest_step)',
            srun_command(job), "status=$?",
            f"if [ \"$status\" -eq {EXIT_SIGTERM} ]; then",
            '    if [ "$(newest_step)" = "$BEFORE" ]; then',
            '        echo "boost_jax: SIGTERM came before a step past ${BEFORE:-the start} was '
            'saved: the time limit leaves too little to start and train; not requeueing (ask '
            'for more --time)" >&2',
            "        exit 1",
            "    fi",
            '    echo "boost_jax: saved a checkpoint on SIGTERM (time limit near); requeueing '
            'job ${SLURM_JOB_ID} to resume it"',
            '    scontrol requeue "$SLURM_JOB_ID" && exit 0',
            "fi",
            'exit "$status"', ""]

