"""A signal while a command starts stops it, even where Python's own KeyboardInterrupt lands in
a callback that swallows it (JAX's gc callback did, and the run trained on): the loop then stops
at its first step as for a signal during the loop, on every process."""

import os
import subprocess
import sys

from train_proc import ROOT

SWALLOWED = """
import gc, os, signal
from boost_jax.errors import cli_main
from boost_jax.train.stop_signal import StopSignal, catch_early

# as a shell starts a foreground command: SIGINT not ignored (an ignored one is inherited, and
# catch_early rightly keeps it so; a test process that ignored it failed this test once)
signal.signal(signal.SIGINT, signal.default_int_handler)


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
    with StopSignal() as stop:
        print("the loop sees signal", stop.received, flush=True)
    return 0

main()
"""


def test_a_signal_swallowed_during_start_up_stops_the_loop_at_its_first_step():
    r = subprocess.run([sys.executable, "-c", SWALLOWED], cwd=ROOT, capture_output=True,
                       text=True, timeout=60, env=dict(os.environ, PYTHONPATH=ROOT))
    assert r.returncode == 0, (r.stdout, r.stderr)
    assert r.stdout.splitlines() == ["start-up went on", "the loop sees signal 2"], r.stderr

