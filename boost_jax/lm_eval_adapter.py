"""lm-evaluation-harness on a trained run (the lm_eval extra: pip install -e '.[lm_eval]'):

    python -m boost_jax.lm_eval_adapter --model boost_jax --model_args run=runs/demo \\
        --tasks TASK --batch_size 8 [any other lm_eval option]

lm_eval's own `lm_eval` command knows only its built-in models, so this module registers the
model `boost_jax` and then runs lm_eval's command line with the same arguments. model_args:
run (the out_dir, required), step (default: the latest checkpoint), max_length (tokens the
model reads, default model.max_seq_len); lm_eval's --batch_size is the sequences per forward
pass ("auto": 8).
From Python, import this module and call lm_eval.simple_evaluate(model="boost_jax",
model_args={"run": ...}, tasks=[...]), or pass model=BoostJaxLM(run=...).

The scoring is boost_jax.infer.score; generation is greedy (sampling settings in a task's
generation_kwargs are not applied; a warning says so).
"""

from __future__ import annotations

import re
import sys

from boost_jax.errors import UserError, cli_main

try:
    from lm_eval.api.model import LM
    from lm_eval.api.registry import register_model
except ImportError:  # the lm_eval extra is not installed: main() says so
    LM, register_model = object, None


LM_EVAL_PASSES = {"device", "max_batch_size"}  # to every model; JAX uses its default device


def _whole(name: str, value, low: int):
    """A whole-number argument (None when not given), or a one-line error naming it."""
    if value in (None, ""):
        return None
    try:
        n = int(str(value))
    except ValueError:
        n = None
    if n is None or n < low:
        raise UserError(f"{name}={value} is not a whole number >= {low}; e.g. "
                        f"{name}={low or 100}")
    return n


def _require_lm_eval() -> None:
    if register_model is None:
        raise UserError("the lm-evaluation-harness is not installed; install the extra "
                        "(pip install -e '.[lm_eval]')")


class BoostJaxLM(LM):
    """lm_eval's model interface over a trained run (boost_jax.infer.score.Scorer)."""

    def __init__(self, run=None, step=None, batch_size=8, max_length=None, **extra):
        super().__init__()
        from boost_jax.infer.load import open_run, quiet_libraries
        from boost_jax.infer.score import Scorer

        unknown = sorted(set(extra) - LM_EVAL_PASSES)
        if unknown:  # a typo such as stpe=100 would otherwise score another step
            raise UserError(f"model_args {unknown[0]}= is not one of boost_jax's; use "
                            "run=OUT_DIR, step=N, max_length=N")
        if not run:
            raise UserError("model_args needs run=OUT_DIR, the training run's out_dir (e.g. "
                            "--model_args run=runs/demo)")
        quiet_libraries()
        auto = batch_size in (None, "auto") or str(batch_size).startswith("auto")
        size = 8 if auto else _whole("--batch_size", batch_size, 1)
        step, max_length = (_whole("model_args step", step, 0),
                            _whole("model_args max_length", max_length, 2))
        try:
            self.run = open_run(run, step)
        except UserError as e:  # open_run's advice names the flags of evaluate / generate
            msg = str(e).replace("--run runs/demo", "run=runs/demo")
            raise UserError(re.sub(r"(?<=\s)--(run|step)(?=\s|$)", r"model_args \1=", msg)) \
                from None
        self.scorer = Scorer(self.run, size, max_length)
        self._warned = False

    def loglikelihood(self, requests) -> list:
        out = self.scorer.loglikelihood([req.args for req in requests])
        for req, res in zip(requests, out):
            self.cache_hook.add_partial("loglikelihood", req.args, res)
        return out

    def loglikelihood_rolling(self, requests) -> list:
        out = self.scorer.loglikelihood_rolling([req.args[0] for req in requests])
        for req, res in zip(requests, out):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, res)
        return out

    def generate_until(self, requests) -> list:
        out = []
        for req in requests:
            context, kwargs = req.args
            kwargs = dict(kwargs or {})
            until = kwargs.pop("until", None) or []
            until = [until] if isinstance(until, str) else list(until)
            max_gen = int(kwargs.pop("max_gen_toks", 256))
            if (kwargs.get("do_sample") or float(kwargs.get("temperature") or 0) > 0) \
                    and not self._warned:
                print("warning: boost_jax decodes greedily; the task's sampling settings are "
                      "not applied", file=sys.stderr)
                self._warned = True
            text = self.scorer.generate_until(context, until, max_gen)
            self.cache_hook.add_partial("generate_until", req.args, text)
            out.append(text)
        return out


if register_model is not None and __name__ != "__main__":  # once, under the module's name
    register_model("boost_jax")(BoostJaxLM)


@cli_main
def main(argv=None):
    """lm_eval's command line, with the model `boost_jax` registered."""
    _require_lm_eval()
    import lm_eval.models  # noqa: F401 - registers lm_eval's own models next to ours
    from lm_eval.__main__ import cli_evaluate

    sys.argv = [sys.argv[0], *(sys.argv[1:] if argv is None else argv)]
    cli_evaluate()
    return 0


if __name__ == "__main__":
    from boost_jax.lm_eval_adapter import main as _main  # the copy that registered the model

    sys.exit(_main())
