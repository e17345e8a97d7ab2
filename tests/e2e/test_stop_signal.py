"""A signal while a command starts: it stops the command with 128 + the signal, even where
Python's own KeyboardInterrupt lands in a callback that swallows it (JAX's gc callback did, and
the run trained on), and the process exits without the teardown that could crash under XLA's
compile threads."""

import os
import subprocess
import sys

from train_proc import ROOT

SWALLOWED = """
import gc, os, signal
from boost_jax.errors import cli_main
from boost_jax.train.stop_signal import StopSignal, catch_early

@cli_main
def main():
    catch_early()
    def callback(phase, info):  # where JAX's gc callback took the KeyboardInterrupt
        if phase == "start" and not fired:
            fired.append(1)
            os.kill(os.getpid(), signal.SIGINT)
    fired = []
    gc.callbacks.append(callback)
    gc.collect()
    gc.callbacks.remove(callback)
    print("start-up went on", flush=True)
    with StopSignal():
        print("the loop ran", flush=True)
    return 0

main()
"""


def test_a_signal_swallowed_during_start_up_stops_the_run_before_its_loop():
    r = subprocess.run([sys.executable, "-c", SWALLOWED], cwd=ROOT, capture_output=True,
                       text=True, timeout=60, env=dict(os.environ, PYTHONPATH=ROOT))
    assert r.returncode == 130, (r.stdout, r.stderr)
    assert "start-up went on" in r.stdout and "the loop ran" not in r.stdout
    assert r.stderr.strip().splitlines()[-1] == "interrupted (signal 2)"


def test_a_signal_the_shell_ignores_stays_ignored():
    code = ("import signal; signal.signal(signal.SIGINT, signal.SIG_IGN)\n"
            "from boost_jax.train.stop_signal import catch_early; catch_early()\n"
            "assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN\n"
            "assert signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                       timeout=60, env=dict(os.environ, PYTHONPATH=ROOT))
    assert r.returncode == 0, r.stderr
