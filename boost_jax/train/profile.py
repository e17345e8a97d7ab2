"""A jax.profiler trace of chosen steps: `train.profile_steps=[first, last]` writes one trace of
steps first..last (inclusive, counted as the run counts them) under out_dir/profile/.

The trace starts before `first` is dispatched and stops once `last` has finished on the device,
so the window holds exactly those steps' kernels and collectives. Open it with TensorBoard's
profile plugin (`tensorboard --logdir out_dir/profile`, tab "Profile") or drop the
`*.trace.json.gz` file on https://ui.perfetto.dev.
"""

import os
import time
from typing import Optional

import jax


class StepProfiler:
    def __init__(self, out_dir: str, steps: Optional[list[int]], enabled: bool = True):
        self.first, self.last = (steps or (None, None))
        self.dir = os.path.join(out_dir, "profile")
        if jax.process_count() > 1:  # every process traces: each into its own folder
            self.dir = os.path.join(self.dir, f"process_{jax.process_index()}")
        self.enabled = enabled and steps is not None
        self.active = False
        self.write_s = 0.0  # how long writing the trace took (not training: the meter skips it)

    def before(self, step: int) -> None:
        """Call with the step about to run (1-based)."""
        if self.enabled and step == self.first and not self.active:
            jax.profiler.start_trace(self.dir)
            self.active = True

    def after(self, step: int, outputs) -> Optional[str]:
        """Call with the step just dispatched; returns the trace folder once written."""
        if not (self.active and step >= self.last):
            return None
        jax.block_until_ready(outputs)
        return self.stop()

    def stop(self) -> Optional[str]:
        if not self.active:
            return None
        t = time.perf_counter()
        jax.profiler.stop_trace()
        self.write_s = time.perf_counter() - t
        self.active = False
        return self.dir
