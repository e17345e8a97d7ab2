#!/usr/bin/env python
"""Train a model: python train.py --config configs/demo.yaml [key=value ...] [--cpu-devices N]"""

import sys

from boost_jax.cli import OverrideParser
from boost_jax.errors import cli_main


def parse_args(argv=None):
    p = OverrideParser(prog="train.py", description=__doc__)
    p.add_argument("--cpu-devices", type=int, default=None,
                   help="simulate N CPU devices per process (testing a mesh on one machine)")
    p.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    p.add_argument("--force", action="store_true",
                   help="train into an out_dir that holds files but no run, replacing them")
    return p.parse(argv)


@cli_main
def main(argv=None):
    from boost_jax.train.stop_signal import catch_early

    catch_early()  # before JAX starts: Ctrl-C while it compiles stops the run at once
    args = parse_args(argv)
    from boost_jax.config import config_to_yaml, load_config

    cfg = load_config(args.config, args.overrides)
    if args.print_config:
        print(config_to_yaml(cfg))
        return 0
    # jax.distributed first, then the per-process CPU device count: both before JAX's backends
    from boost_jax.train.distributed import setup

    setup(cfg, args.cpu_devices)
    from boost_jax.train.loop import run

    summary = run(cfg, cli=True, force=args.force, config_path=args.config)
    # stopped by SIGTERM/SIGINT after saving: 128 + signal, so schedulers see an unfinished run
    return 128 + summary["stopped_by_signal"] if summary.get("stopped_by_signal") else 0


if __name__ == "__main__":
    sys.exit(main())
