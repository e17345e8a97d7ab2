"""The secondary weight copy's dtype (parallel.secondary_dtype), decided per layout.

An int8 secondary moves q + scales where a bfloat16 one moves the working dtype over the
secondary's axes (the forward's gather and the backward's re-gather, every micro-batch), at
the price of its (de)quantization kernels and, where a bfloat16 copy would be the stored shard
itself (hierarchical: secondary over the params axes), of the memory of the copy. It saves
memory only where a bfloat16 copy would be kept too (a secondary over other axes, or kept
whole). The dequantized weight is needed at each use (forward and backward of every
micro-batch); holding it instead is holding the gathered weights the plan shards away.

One rule, used by `--search` for every layout that leaves the dtype unset, and printed beside
a single layout's report: the faster of the two that fit (bfloat16 on a tie), or the smaller
when neither fits. A dtype the config sets is kept.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

from boost_jax.plan.costmodel import predict
from boost_jax.sharding.placement import PRESETS, resolve_roles

DTYPES = ("bfloat16", "int8")
GiB = 2 ** 30


@dataclass(frozen=True)
class Choice:
    dtype: str
    source: str  # config (set there) | preset (the plan's default) | search (this rule)
    line: str  # which, and why, in one line

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def with_dtype(cfg, dtype: str):
    return dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel,
                                                                 secondary_dtype=dtype))


def matters(cfg) -> bool:
    """Whether the dtype changes what runs: a secondary is kept in one of them and qwZ does
    not make it int8 anyway."""
    roles = [resolve_roles(with_dtype(cfg, d)) for d in DTYPES]
    return len({(r["secondary"], r["sec_int8"]) for r in roles}) > 1


def pick(preds: dict) -> str:
    """The rule: the faster of those that fit (bfloat16 first on a tie), else the smaller."""
    fit = [d for d in DTYPES if preds[d].fits]
    if fit:
        return min(fit, key=lambda d: preds[d].step_time)
    return min(DTYPES, key=lambda d: preds[d].memory["total"])


def _level_text(ran, other) -> str:
    moved = [(lv, other.comm_bytes[lv] - ran.comm_bytes[lv]) for lv in ran.comm_bytes]
    moved = [(lv, d) for lv, d in moved if abs(d) >= 2 ** 20]
    if not moved:
        return "move the same bytes per step"
    return "move " + ", ".join(f"{abs(d) / GiB:.2f} GiB {'more' if d > 0 else 'less'} over {lv}"
                               for lv, d in moved) + " per step"


def compare(dtype: str, preds: dict) -> str:
    """What the other dtype would do beside `dtype`, per step and device."""
    other = next(d for d in DTYPES if d != dtype)
    ran, alt = preds[dtype], preds[other]
    dq = (alt.time["quant"] - ran.time["quant"]) * 1e3
    dm = (alt.memory["total"] - ran.memory["total"]) / GiB
    dt = (alt.step_time - ran.step_time) * 1e3
    fit = "" if alt.fits else (f", and not fit ({alt.memory['total'] / GiB:.1f} GiB > "
                               f"{alt.memory['limit'] / GiB:.1f} GiB)")
    return (f"{other} would {_level_text(ran, alt)}, {'cost' if dq >= 0 else 'save'} "
            f"{abs(dq):.1f} ms of (de)quantization and {'use' if dm >= 0 else 'free'} "
            f"{abs(dm):.2f} GiB: {abs(dt):.1f} ms {'slower' if dt >= 0 else 'faster'}{fit}")


def _why(dtype: str, source: str, plan: str, preds: dict) -> str:
    said = {"config": "set in the config", "search": "chosen by the planner",
            "preset": f"the {plan} preset's; --search weighs both"}[source]
    return f"secondary dtype {dtype} ({said}): {compare(dtype, preds)}"


def _both(cfg, topo, sizes, a) -> dict:
    return {d: predict(with_dtype(cfg, d), topo, sizes, a) for d in DTYPES}


def choose(cfg, topo, sizes, a):
    """(prediction, Choice or None) for a search candidate: an unset dtype that matters is
    costed both ways and the rule keeps one; otherwise the config as it is."""
    if cfg.parallel.secondary_dtype is not None or not matters(cfg):
        return predict(cfg, topo, sizes, a), None
    preds = _both(cfg, topo, sizes, a)
    d = pick(preds)
    return preds[d], Choice(d, "search", _why(d, "search", cfg.parallel.plan, preds))


def explain(cfg, topo, sizes, a) -> Optional[Choice]:
    """The dtype a single layout runs with, where it comes from, and the other beside it
    (analytic); None where the dtype changes nothing."""
    if not matters(cfg):
        return None
    par = cfg.parallel
    dtype = par.secondary_dtype or PRESETS[par.plan]["sec_dtype"]
    source = "preset" if par.secondary_dtype is None else "config"
    return Choice(dtype, source, _why(dtype, source, par.plan, _both(cfg, topo, sizes, a)))
