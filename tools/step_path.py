#!/usr/bin/env python
"""The boost_jax modules one training step runs code from: python tools/step_path.py [--readme]

The step is the README's BOOST layout (configs/demo.yaml with BTP over `pair`, the hierarchical
plan, 4 micro-batches, low-rank remat) on a tiny model and 8 simulated CPU devices. While
build_step resolves the plan and builds the step, and while its first call traces, compiles and
runs it, a trace hook notes every function that starts in a file under boost_jax/ (module and
class bodies, which run on import, do not count). Loading the config, the mesh and the initial
state happen outside that window. Prints the modules, one a line, then their count; --readme
also writes them into README.md's "Where each idea lives" (tests/e2e/test_step_path.py checks
that copy against this output)."""

import argparse
import contextlib
import inspect
import os
import re
import sys
import textwrap
import threading

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")
BEGIN, END = "<!-- step_path -->", "<!-- end step_path -->"
# the README's BTP command on a tiny model (its sizes divide over the TP pair)
OVERRIDES = ["parallel.tp_mode=btp", "parallel.tp_axes=[pair]", "parallel.plan=hierarchical",
             "train.micro_batches=4", "train.remat=lowrank", "model.d_model=32",
             "model.n_layers=2", "model.n_heads=2", "model.d_ff=64", "model.rank=8",
             "model.max_seq_len=32", "data.seq_len=32", "train.global_batch=16"]


class Recorder:
    """The files of package `root` (a folder) whose functions start while `on()` is active."""

    def __init__(self, root: str):
        self.root = os.path.join(root, "")
        self.files: set[str] = set()

    def _call(self, frame, event, arg):
        code = frame.f_code
        # CO_OPTIMIZED marks a function's code: module and class bodies lack it
        if code.co_flags & inspect.CO_OPTIMIZED and code.co_filename.startswith(self.root):
            self.files.add(code.co_filename)
        return None  # no line events: only calls are wanted

    @contextlib.contextmanager
    def on(self):
        sys.settrace(self._call)
        threading.settrace(self._call)
        try:
            yield self
        finally:
            sys.settrace(None)
            threading.settrace(None)

    def modules(self) -> list[str]:
        """Dotted module names of the files seen, sorted."""
        out = set()
        for path in self.files:
            rel = os.path.relpath(path, os.path.dirname(self.root[:-1]))
            rel = rel[:-len(".py")].split(os.sep)
            out.add(".".join(rel[:-1] if rel[-1] == "__init__" else rel))
        return sorted(out)


def trace_step(recorder: Recorder) -> None:
    """Build the step and run its first call, with `recorder` on for both."""
    from boost_jax.mesh import set_cpu_devices

    set_cpu_devices(8)
    import jax
    import numpy as np

    from boost_jax.backends.cpu import fast_compile_options
    from boost_jax.config import load_config
    from boost_jax.mesh import mesh_from_config
    from boost_jax.step.build import build_step

    cfg = load_config(os.path.join(ROOT, "configs", "demo.yaml"), OVERRIDES)
    mesh, options = mesh_from_config(cfg), fast_compile_options()
    with recorder.on():
        bundle = build_step(cfg, mesh, options)
    state = bundle.init_state()
    x = np.random.default_rng(0).integers(0, cfg.model.vocab_size,
                                          (cfg.train.global_batch, cfg.data.seq_len))
    batch = {k: jax.device_put(v.astype(np.int32), bundle.batch_sharding)
             for k, v in (("inputs", x), ("targets", (x + 1) % cfg.model.vocab_size))}
    with recorder.on():
        jax.block_until_ready(bundle.train_step(state, batch))


def readme_block(modules: list[str]) -> str:
    """What --readme writes between the README's markers."""
    names = ", ".join(f"`{m}`" for m in modules) + f" ({len(modules)} modules)"
    return textwrap.fill(names, 100, break_long_words=False, break_on_hyphens=False)


def readme_modules(text: str) -> list[str]:
    """The module names the README's copy lists, in its order."""
    block = text.split(BEGIN, 1)[1].split(END, 1)[0]
    return re.findall(r"`([\w.]+)`", block)


def write_readme(modules: list[str]) -> None:
    with open(README, encoding="utf-8") as f:
        text = f.read()
    if BEGIN not in text or END not in text:
        raise SystemExit(f"README.md has no {BEGIN} ... {END} block")
    head, rest = text.split(BEGIN, 1)
    tail = rest.split(END, 1)[1]
    with open(README, "w", encoding="utf-8") as f:
        f.write(f"{head}{BEGIN}\n{readme_block(modules)}\n{END}{tail}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--readme", action="store_true",
                   help="also write the list into README.md's \"Where each idea lives\"")
    args = p.parse_args(argv)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    sys.path.insert(0, ROOT)
    import boost_jax

    recorder = Recorder(os.path.dirname(os.path.abspath(boost_jax.__file__)))
    trace_step(recorder)
    modules = recorder.modules()
    print("\n".join(modules))
    print(f"{len(modules)} modules")
    if args.readme:
        write_readme(modules)
    return 0


if __name__ == "__main__":
    sys.exit(main())
