"""The first step of a generated batch job, one task per node: this Python imports JAX, starts
the backend the profile asks for and sees every device of the node, or the job stops here with
one line (not after a minute of start-up, and never training on the host CPUs instead).

    python node_check.py gpu 8      # exit 0, or 3 with the reason on stderr

Run by path (it imports only JAX), so it checks exactly the environment train.py will get.
"""

import socket
import sys


def check(want: str, n: int) -> str | None:
    """None when JAX sees n devices of kind `want` ("gpu" or "cpu"; cpu checks JAX only)."""
    host = socket.gethostname()
    try:
        import jax

        devs = jax.local_devices()
    except Exception as e:  # a missing plugin or driver surfaces as any of several types
        why = str(e).splitlines()[0] if str(e) else type(e).__name__
        return (f"node check failed on {host}: JAX cannot start ({why}); install the GPU plugin "
                f"into {sys.executable} (pip install -e '.[cuda]' or '.[rocm]')")
    kind = devs[0].platform
    if want == "gpu" and (kind == "cpu" or len(devs) != n):
        return (f"node check failed on {host}: JAX sees {len(devs)} {kind} "
                f"device{'' if len(devs) == 1 else 's'} but the job needs {n} "
                f"GPU{'' if n == 1 else 's'} per node; check the GPU plugin of "
                f"{sys.executable} and the job's --gpus-per-node")
    return None


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] not in ("gpu", "cpu") or not argv[1].isdigit():
        print("usage: python node_check.py gpu|cpu DEVICES_PER_NODE", file=sys.stderr)
        return 2
    why = check(argv[0], int(argv[1]))
    if why:
        print(f"boost_jax: {why}", file=sys.stderr)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
