"""Write a ready batch script for a training run on a cluster.

    python -m boost_jax.launch slurm --config configs/cola-7b.yaml --topology frontier \\
        --nodes 48 --account abc123 --time 02:00:00 --out job.sbatch [key=value ...]
    sbatch job.sbatch

The topology profile (boost_jax/mesh.py) supplies the node layout, the environment and the
scratch file system; the config (with any overrides) is embedded in the script. A config written
by `python -m boost_jax.plan ... --emit-config FILE` needs no --topology or --nodes: its mesh
says both.
"""

from __future__ import annotations

import os
import shlex
import sys
from typing import Optional, Sequence

from boost_jax.cli import OverrideParser, shell_word
from boost_jax.errors import UserError, cli_main, counted


def build_parser() -> OverrideParser:
    p = OverrideParser(prog="python -m boost_jax.launch slurm",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("--topology", default=None,
                   help="topology profile (default: the config's mesh.topology)")
    p.add_argument("--nodes", type=int, default=None,
                   help="number of nodes (default: the config's mesh.shape / mesh.nodes)")
    p.add_argument("--account", default=None, help="project to charge (#SBATCH --account)")
    p.add_argument("--time", default="02:00:00", help="time limit per job (default 02:00:00); "
                   "the job requeues itself until training is done")
    p.add_argument("--partition", default=None, help="partition (default: the profile's)")
    p.add_argument("--qos", default=None, help="quality of service (default: the profile's)")
    p.add_argument("--module", action="append", default=None, metavar="NAME",
                   help="module to load instead of the profile's (repeat for several)")
    p.add_argument("--python", default=None,
                   help="Python of the environment on the compute nodes, with JAX's GPU plugin "
                   f"(default: this one, {sys.executable}); checked here and by the job's first "
                   "step on every node")
    p.add_argument("--out", default=None, help="write the script here (default: stdout)")
    p.add_argument("--force", action="store_true",
                   help="replace an existing --out file (never the --config itself)")
    p.add_argument("--allow-demo-data", action="store_true",
                   help="write a multi-node job on the demo corpus (data.source=stdlib) anyway")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: python -m boost_jax.launch slurm --config X.yaml [--topology T] "
              "[--nodes N] [--account A] [--time T] [--out FILE] [key=value ...]\n\n" + __doc__)
        return 0
    if argv[0] != "slurm":
        print(f"error: unknown launcher {argv[0]!r}; use: python -m boost_jax.launch slurm ...",
              file=sys.stderr)
        return 2
    args = build_parser().parse(argv[1:])
    return _slurm(args, "python -m boost_jax.launch " + shlex.join(argv))


@cli_main
def _slurm(args, command: str) -> int:
    from boost_jax.config import load_config
    from boost_jax.launch.slurm import (NODE_CHECK, TRAIN_PY, job_wrote, local_job_config,
                                        make_job, render)
    from boost_jax.mesh import get_topology
    from boost_jax.checkpoints.run_config import run_inputs
    from boost_jax.safe_write import check_target, refuse_inputs, write_text

    # safe_write's rule: never an input (the --config before it is read; then what the job
    # reads and the Python it runs), nothing else unforced
    if args.out is not None:
        check_target(args.out, {"--config": args.config}, args.force, f"--out {args.out!r}",
                     "choose another --out")
    cfg = load_config(args.config, args.overrides)
    topo = get_topology(cfg.mesh.topology if args.topology is None else args.topology)
    job = make_job(cfg, topo, args.nodes, account=args.account, time=args.time,
                   partition=args.partition, qos=args.qos, modules=args.module,
                   python=args.python, command=command)
    if args.out is not None:
        python = job.python if os.sep in job.python else None  # a path, not a name on PATH
        runs = {"the job's --python": python, "train.py": TRAIN_PY, "the node check": NODE_CHECK}
        refuse_inputs(args.out, {**run_inputs(cfg), **runs}, f"--out {args.out!r}",
                      "choose another --out")
    written = local_job_config(job)  # what the job writes at each start: never an input
    if written is not None:  # (a config an earlier job wrote there is the job's to rewrite)
        refuse_inputs(written, {"--config": None if job_wrote(args.config) else args.config,
                                "--out": args.out},
                      f"the job's {written!r} (out_dir/job_config.yaml)",
                      "choose another out_dir, or keep the config and the script elsewhere")
    from boost_jax.data.sources import refuse_demo_corpus

    refuse_demo_corpus(job.cfg, job.nodes, topo.name, args.allow_demo_data)
    text = render(job)
    p = job.predicted
    if not p["fits"]:
        print(f"warning: the planner estimates {p['memory'] / 2**30:.1f} GiB per device, more "
              f"than the {p['limit'] / 2**30:.1f} GiB that fit ({p['hbm_usable']:.0%} of "
              f"{topo.hbm_bytes / 2**30:.0f} GiB, less the model's safety margin); check with "
              "python -m boost_jax.plan before submitting", file=sys.stderr)
    if job.profile.platform != "cpu":
        _warn_cpu_only(job.python)
    if args.out is None:
        sys.stdout.write(text)
        return 0
    try:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        write_text(args.out, text, args.force, executable=True)
    except OSError as e:
        raise UserError(f"cannot write {args.out!r} ({e.strerror}); choose another --out") \
            from None
    print(f"wrote {shell_word(args.out)}: {counted(job.nodes, 'node')} x "
          f"{counted(job.profile.processes_per_node, 'process', 'processes')} x "
          f"{counted(job.devices_per_process, 'device')} on {topo.name}, out_dir "
          f"{job.out_dir}; submit with: sbatch {shell_word(args.out)}",  # already a shell word
          file=sys.stderr)
    return 0


# a GPU plugin of JAX, as pip names it (jax-cuda12-plugin, jax_rocm7_plugin, ...)
_PLUGIN = r"jax[-_](?:cuda|rocm)\d+[-_]plugin"
_HAS_PLUGIN = ("import importlib.metadata as m, re; print(any(re.fullmatch(%r, d.metadata['Name'] "
               "or '', re.I) for d in m.distributions()))" % _PLUGIN)


def _warn_cpu_only(python: str) -> None:
    """Say so now when the job's Python has no GPU plugin (the node check would stop the job,
    but only after its queue wait)."""
    import subprocess

    try:
        r = subprocess.run([python, "-c", _HAS_PLUGIN], capture_output=True, text=True,
                           timeout=60)
        has = r.stdout.strip() == "True" if r.returncode == 0 else None
    except (OSError, subprocess.TimeoutExpired):
        has = None
    if has is None:
        print(f"warning: cannot run --python {python} here to check its JAX GPU plugin; the "
              "job's node check tests it on the nodes before training", file=sys.stderr)
    elif not has:
        print(f"warning: --python {python} has no JAX GPU plugin (a CPU-only jaxlib); install "
              "it (pip install -e '.[cuda]' or '.[rocm]') or pass --python of an environment "
              "that has it: the job would stop at its node check", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
