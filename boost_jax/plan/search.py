"""Layout search: plan × TP mode × TP axes × pipeline stages and virtual stages ×
micro-batch size × remat × working-weight/gradient dtype × keeping the forward's gathered
weights for the backward (`/keep`: parallel.secondary_axes=[], for zero3 and zeropp) ×
hierarchical's cross-node legs in int8 weights / int4 gradients (`/xq`: they change the loss,
within the qgZ study's tolerance on the demo, benchmarks/README.md §3), ranked by the cost
model. Where the config leaves parallel.secondary_dtype unset and a layout keeps a secondary,
both dtypes are costed and plan/secondary.py's rule keeps one (`/int8sec`, `/bf16sec`).

Every candidate is costed analytically (boost_jax.plan.costmodel: compiling hundreds of layouts
is too slow); those whose predicted memory fits are ranked by predicted step time (the global
batch is fixed, so this is also tokens/s). `compile_top=K` then compiles the best K with the
real step (boost_jax.plan.dryrun) and re-costs them from the measured collectives and memory;
the table says which rows were compiled.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass, field
from typing import Optional

from boost_jax import names
from boost_jax.errors import ConfigError, UserError, counted
from boost_jax.mesh import AXES, Topology, axis_size
from boost_jax.plan.critical_path import critical_path, dp_latency_text, floor, floor_text
from boost_jax.plan import memory
from boost_jax.plan.costmodel import REMAT_NONE_MARK, REMAT_NONE_NOTE, Assumptions, Prediction, SizesMesh
from boost_jax.plan.secondary import Choice, choose
from boost_jax.sharding import parallel
from boost_jax.sharding.placement import ALL, PRESETS

PLANS = names.PLANS
SHORT = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "int8": "int8"}
TP_AXES = ((), ("pair",), ("node",), ("pair", "node"))
MAX_MICRO = 32  # sequences per device per micro-batch: the largest tried
PP_STAGES = (1, 2, 4, 8)  # pipeline stages (1F1B) tried where they divide the hosts
PP_VIRTUAL = (1, 2)  # interleaved chunks per stage, where the micro-batches come in groups of P
# /keep where it saves the backward's re-gather over the params axes: zero3 keeps the forward's
# gather, zeropp an int8 copy of it (its hpZ re-gather inside the node is not free where TP
# took the pair); hierarchical already re-gathers from an int8 secondary over the pair
KEEP = {"zero3": (False, True), "zeropp": (False, True)}


@dataclass
class Candidate:
    plan: str
    tp_mode: str
    tp_axes: tuple
    micro_size: int  # sequences per device per micro-batch
    micro_batches: int
    remat: str
    pp_stages: int = 1
    pp_virtual: int = 1
    sizes: dict = field(default_factory=dict)  # the mesh: global = hosts / pp_stages
    low_precision: bool = False  # bf16 working weights and bf16 gradient reduction
    keep: bool = False  # the backward uses the forward's gathered weights (no re-gather)
    xq: bool = False  # hierarchical's cross-node legs quantized (int8 weights, int4 gradients)
    secondary: Optional[Choice] = None  # the secondary dtype the search chose, and why
    prediction: Optional[Prediction] = None
    error: Optional[str] = None
    compiled: bool = False
    compiled_fits: Optional[bool] = None
    gpu: Optional[str] = None  # the GPU the layout was compiled for (--gpu-compile)

    def key(self) -> str:
        tp = f"{self.tp_mode}x{'+'.join(self.tp_axes)}" if self.tp_axes else "none"
        pp = f"/pp{self.pp_stages}" if self.pp_stages > 1 else ""
        pp += f"v{self.pp_virtual}" if self.pp_virtual > 1 else ""
        bf = "/bf16" if self.low_precision else ""
        keep = "/keep" if self.keep else ""
        sec = f"/{SHORT[self.secondary.dtype]}sec" if self.secondary else ""
        xq = "/xq" if self.xq else ""
        return f"{self.plan}/{tp}{pp}/b{self.micro_size}/{self.remat}{bf}{keep}{sec}{xq}"

    def config(self, cfg):
        par = dataclasses.replace(cfg.parallel, plan=self.plan, tp_mode=self.tp_mode,
                                  tp_axes=list(self.tp_axes), pp_stages=self.pp_stages,
                                  pp_schedule="1f1b", pp_virtual=self.pp_virtual)
        tr = dataclasses.replace(cfg.train, micro_batches=self.micro_batches, remat=self.remat)
        model = cfg.model
        if self.keep:
            par = dataclasses.replace(par, secondary_axes=[])
        if self.xq:
            par = dataclasses.replace(par, quantize_cross_node_weights="int8",
                                      quantize_cross_node_grads="int4")
        if self.secondary:  # explicit, so the emitted config runs what was ranked
            par = dataclasses.replace(par, secondary_dtype=self.secondary.dtype)
        if self.low_precision:
            par = dataclasses.replace(par, grad_accum_dtype="bfloat16")
            model = dataclasses.replace(model, param_dtype="bfloat16")
        return dataclasses.replace(cfg, parallel=par, train=tr, model=model)


@dataclass
class SearchResult:
    candidates: list
    n_evaluated: int
    n_invalid: int
    notes: list = field(default_factory=list)
    n_unlisted: int = 0  # costed, valid, left out of the ranking (drop_staged_hierarchical)

    @property
    def fitting(self) -> list:
        ok = [c for c in self.candidates if c.prediction is not None and c.error is None and
              (c.compiled_fits if c.compiled else c.prediction.fits)]
        return sorted(ok, key=lambda c: c.prediction.step_time)

    @property
    def ceiling_layout(self):
        """The fitting candidate whose floor allows the highest MFU (every data-parallel
        collective hidden); None when nothing fits."""
        if not self.fitting:
            return None
        return max(self.fitting, key=lambda c: floor(c.prediction)["mfu_ceiling"])

    @property
    def ceiling(self) -> Optional[dict]:
        """ceiling_layout's key, MFU ceiling and what binds it, its predicted MFU and why."""
        best = self.ceiling_layout
        if best is None:
            return None
        f = floor(best.prediction)
        return dict(key=best.key(), mfu=f["mfu_ceiling"], by=f["by"], mfu_now=best.prediction.mfu,
                    why=dp_latency_text(best.prediction))

    @property
    def best_by_plan(self) -> list:
        """The best fitting layout of each plan, best first: (plan, rank among all fitting
        layouts, candidate); a plan none of whose layouts fits is left out."""
        out, seen = [], set()
        for i, c in enumerate(self.fitting, 1):
            if c.plan not in seen:
                seen.add(c.plan)
                out.append((c.plan, i, c))
        return out

    def to_dict(self) -> dict:
        rows = []
        for c in self.fitting:
            p = c.prediction
            rows.append(dict(key=c.key(), plan=c.plan, tp_mode=c.tp_mode, tp_axes=list(c.tp_axes),
                             micro_size=c.micro_size, micro_batches=c.micro_batches,
                             pp_stages=c.pp_stages, pp_virtual=c.pp_virtual,
                             remat=c.remat, low_precision=c.low_precision, keep=c.keep,
                             quantized_cross_node=c.xq,
                             secondary=c.secondary.to_dict() if c.secondary else None,
                             step_time=p.step_time, tokens_per_s=p.tokens_per_s,
                             tflops_per_device=p.tflops_per_device, mfu=p.mfu,
                             memory=p.memory["total"], comm_bytes=p.comm_bytes,
                             node_egress=sum(p.node_egress.values()),
                             critical_path=critical_path(p), floor=floor(p),
                             compiled=c.compiled, gpu=c.gpu))
        tight = [dict(key=c.key(), memory=c.prediction.memory["total"],
                      analytic_memory=c.prediction.memory["analytic_total"])
                 for c in self.candidates if c.compiled and c.compiled_fits is False]
        best = [dict(plan=plan, rank=i, key=c.key(), mfu=c.prediction.mfu,
                     step_time=c.prediction.step_time,
                     critical_path=critical_path(c.prediction))
                for plan, i, c in self.best_by_plan]
        return {"ranked": rows, "best_by_plan": best, "n_evaluated": self.n_evaluated,
                "n_invalid": self.n_invalid, "n_unlisted": self.n_unlisted,
                "n_fitting": len(rows), "compiled_not_fitting": tight,
                "mfu_ceiling": self.ceiling, "notes": self.notes}


def keeps(plan: str, tp_axes: tuple, sz: dict) -> tuple:
    """Whether to try /keep: where the plan's weights are gathered over some axis (with
    pipeline stages too: a backward tick's re-run forward keeps its gather for the backward)."""
    params = PRESETS[plan]["params"]
    params = AXES if params == ALL else params

    def spans(axes) -> bool:  # over an axis TP left to the plan
        return any(a not in tp_axes and sz[a] > 1 for a in axes)

    sec = PRESETS[plan]["secondary"]  # a secondary TP took whole is already /keep
    kept = sec is not None and not spans(sec)
    return KEEP.get(plan, (False,)) if spans(params) and not kept else (False,)


def quantized_legs(cfg, plan: str, sz: dict) -> tuple:
    """Whether to try /xq: hierarchical with one stage over several hosts (its cross-node legs
    run in the first forward and the last backward, layer by layer), its update deferred, where
    the config leaves both legs unquantized; a config that sets them is ranked as it is."""
    par = cfg.parallel
    unset = par.quantize_cross_node_weights == "none" and par.quantize_cross_node_grads == "none"
    legs = plan == "hierarchical" and "stage" not in sz and sz["global"] > 1 and \
        par.defer_update is not False  # int8 weights travel in the deferred update
    return (False, True) if legs and unset else (False,)


def collapses(plan: str, tp_axes: tuple, sizes: dict) -> bool:
    """hierarchical with TP over every axis inside the node keeps no role in the node: it runs
    as zero1 (Placement notes say so), already a candidate of its own."""
    inside = [a for a in ("pair", "node") if sizes[a] > 1]
    return plan == "hierarchical" and bool(inside) and set(inside) <= set(tp_axes)


def micro_sizes(global_batch: int, n_dp: int) -> list[int]:
    """Sequences per device per micro-batch to try: every divisor of a device's share of the
    batch up to MAX_MICRO (none if the batch does not divide over the n_dp devices); 5 of 5
    sequences too, not only powers of two."""
    share = global_batch // n_dp if global_batch % n_dp == 0 else 0
    return [b for b in range(1, min(share, MAX_MICRO) + 1) if share % b == 0]


def staged_mesh(sizes: dict, pp: int) -> dict:
    """The mesh of a layout with `pp` stages (which divide the hosts): `global` the host groups
    of one stage, `stage` the stages (absent for 1)."""
    sz = {"pair": sizes["pair"], "node": sizes["node"],
          "global": sizes["global"] * sizes.get("stage", 1) // pp}
    return dict(sz, stage=pp) if pp > 1 else sz


def dp_devices(sz: dict, tp_axes: tuple) -> int:
    """A layout's data-parallel device count: the mesh outside its TP axes and stages."""
    return axis_size(sz, [a for a in AXES if a not in tp_axes])


def dp_sizes(sizes: dict) -> list[int]:
    """The data-parallel device counts the search's layouts have on this mesh."""
    hosts = sizes["global"] * sizes.get("stage", 1)
    return sorted({dp_devices(staged_mesh(sizes, pp), axes)
                   for pp, axes in itertools.product(PP_STAGES, TP_AXES) if hosts % pp == 0})


def candidates(cfg, sizes: dict) -> list[Candidate]:
    lowrank = cfg.model.arch != "full"
    modes = ("vanilla", "btp") if lowrank else ("megatron",)
    remats = ("none", "full", "lowrank") if lowrank else ("none", "full")
    hosts = sizes["global"] * sizes.get("stage", 1)
    # the config's weight/gradient dtypes, and bf16 weights + bf16 gradient reduction (fp32
    # master and Adam stay) where the config has wider ones
    wide = cfg.model.param_dtype != "bfloat16" or cfg.parallel.grad_accum_dtype != "bfloat16"
    precisions = (False, True) if wide else (False,)
    out = []
    for pp, plan, axes in itertools.product(PP_STAGES, PLANS, TP_AXES):
        if (hosts % pp or pp > cfg.model.n_layers or any(sizes[a] <= 1 for a in axes)
                or collapses(plan, axes, sizes)):
            continue
        sz = staged_mesh(sizes, pp)
        for mode in (modes if axes else ("none",)):
            n_dp = dp_devices(sz, axes)
            for b, remat in itertools.product(micro_sizes(cfg.train.global_batch, n_dp),
                                              remats):
                m = cfg.train.global_batch // (b * n_dp)
                if m < pp:
                    continue  # 1F1B needs at least as many micro-batches as stages
                for v in PP_VIRTUAL if pp > 1 else (1,):
                    if v == 1 or (m % pp == 0 and pp * v <= cfg.model.n_layers):
                        for low, keep, xq in itertools.product(
                                precisions, keeps(plan, axes, sz), quantized_legs(cfg, plan, sz)):
                            out.append(Candidate(plan, mode, tuple(axes), b, m, remat, pp, v,
                                                 sz, low, keep=keep, xq=xq))
    return out


def search(cfg, topo: Topology, sizes: dict, a: Optional[Assumptions] = None,
           compile_top: int = 0, max_devices: int = 512, gpu: bool = False) -> SearchResult:
    """Every candidate costed analytically; with compile_top the best that fit are compiled,
    for simulated CPUs (the real step's collectives and memory) or, with `gpu`, for the
    topology's GPU (plan/gpu_compile.py: the schedule's exposed collectives and the GPU
    memory), and ranked by those figures."""
    a = a or Assumptions()
    cands = candidates(cfg, sizes)
    if not cands:
        dp = dp_sizes(sizes)
        raise UserError(f"train.global_batch={cfg.train.global_batch} divides over none of the "
                        f"data-parallel device counts a layout here has ({', '.join(map(str, dp))}"
                        f"); choose a multiple of one of them, e.g. {dp[0] * 8}")
    invalid = 0
    for c in cands:
        try:
            cc = c.config(cfg)
            parallel.check(cc, SizesMesh(c.sizes))  # pipeline split, TP cut
            c.prediction, c.secondary = choose(cc, topo, c.sizes, a)
        except (ConfigError, UserError, ValueError) as e:
            c.error = str(e).splitlines()[0]
            invalid += 1
    res = SearchResult(cands, len(cands), invalid)
    res.notes.append(f"{len(cands)} candidates costed analytically; {invalid} rejected by the "
                     "plan/TP validation (divisibility)")
    chose = [c.secondary.dtype for c in cands if c.secondary]
    if chose:
        res.notes.append(f"{len(chose)} keep a secondary with parallel.secondary_dtype unset: "
                         f"costed in bfloat16 and int8, the faster that fits kept (int8 in "
                         f"{chose.count('int8')})")
    xq = sum(c.xq for c in cands)
    if xq:
        res.notes.append(f"{xq} hierarchical layouts also costed with int8 weights and int4 "
                         "gradients across nodes (/xq, xq: parallel.quantize_cross_node_*; they "
                         "change the loss, within the qgZ study's tolerance on the demo)")
    if any(REMAT_NONE_NOTE in c.prediction.notes for c in cands if c.prediction is not None):
        res.notes.append(REMAT_NONE_NOTE)  # it names the layouts it is about
    if any(collapses("hierarchical", axes, sizes) for axes in TP_AXES):
        res.notes.append("hierarchical with TP over the whole node is not listed: no role is "
                         "left inside the node, so it runs as zero1 (listed as zero1)")
    staged = drop_staged_hierarchical(res)
    if staged:
        res.notes.append(staged)
    bound = once_per_step_bound(res, topo)
    if bound:
        res.notes.append(bound)
    if compile_top and gpu:
        compile_on_gpu(res, cfg, topo, compile_top, max_devices, a)
    elif compile_top:
        extra = compile_best(res, cfg, topo, compile_top, max_devices, a)
        res.notes.append(f"the best {compile_top} were compiled (real step, abstract shapes) "
                         "and re-costed from measured collectives and memory"
                         + (f", and {extra} more until the best that fits was one compiled"
                            if extra else ""))
    return res


def drop_staged_hierarchical(res: SearchResult) -> Optional[str]:
    """Take hierarchical with pipeline stages out of the ranking; the one-line reason, or None.
    Its promise is that only the optimizer runs once per step: the cross-node reduction moves
    into the last micro-batch's backward and the update gather into the next forward. Pipeline
    ticks do neither (placement: "pipeline stages fetch per tick"), so both stay exposed."""
    staged = [c for c in res.candidates if c.plan == "hierarchical" and c.pp_stages > 1]
    valid = [c for c in staged if c.error is None]  # the invalid are counted in n_invalid
    fitting = res.fitting
    gone, ok = {id(c) for c in staged}, {id(c) for c in valid}  # by identity: == compares deep
    shown = [c for c in fitting if id(c) in ok]
    res.candidates = [c for c in res.candidates if id(c) not in gone]
    res.n_unlisted += len(valid)
    head = f"hierarchical with pipeline stages is not listed ({len(valid)} valid layouts"
    why = "pipeline ticks keep its cross-node reduction and update once per step"
    if not valid:
        return None
    if not shown:
        return f"{head}, none fits): {why}"
    share = [critical_path(c.prediction)["once-per-step"] / c.prediction.step_time
             for c in shown]
    best = shown[0]
    return (f"{head}): {why} ({min(share):.0%}-{max(share):.0%} of the step here); the best, "
            f"{best.key()}, would rank {fitting.index(best) + 1} analytically at "
            f"{best.prediction.mfu:.1%} MFU")


ONCE_PER_STEP_GOAL = 0.05  # hierarchical's promise: only the optimizer runs once per step


def once_per_step_bound(res: SearchResult, topo: Topology) -> Optional[str]:
    """When every listed hierarchical layout spends over 5% of its step once per step, the one
    line that says what bounds the best one: the cross-node legs deferred into the first
    forward (and the last backward) can hide only behind that one pass's compute, beside the
    pass's own gathers (reduce-scatters); None when some layout is within 5% or none is
    costed analytically."""
    from boost_jax.plan.collectives import coll_time
    from boost_jax.sharding.step_collectives import (BACKWARD, FIRST_FORWARD, FORWARD,
                                                     LAST_BACKWARD)

    hier = [c for c in res.fitting if c.plan == "hierarchical"]
    shares = [critical_path(c.prediction)["once-per-step"] / c.prediction.step_time
              for c in hier]
    if not hier or min(shares) <= ONCE_PER_STEP_GOAL or not hier[0].prediction.collectives:
        return None
    c = hier[0]
    p, m = c.prediction, c.micro_batches
    ms = {r: 1e3 * sum(coll_time(x, topo, p.assumptions) for x in p.collectives if x.runs == r)
          for r in (FORWARD, BACKWARD, FIRST_FORWARD, LAST_BACKWARD)}
    fwd = 1e3 * p.time["forward"] / m
    bwd = 1e3 * (p.time["compute"] - p.time.get("bubble", 0.0)) / m - fwd
    return (f"hierarchical spends {min(shares):.0%}-{max(shares):.0%} of its step once per step "
            f"in the layouts listed (goal <= {ONCE_PER_STEP_GOAL:.0%}); what bounds the best, "
            f"{c.key()}: its cross-node update gather ({ms[FIRST_FORWARD]:.1f} ms) can hide "
            f"only behind the first forward ({fwd:.1f} ms of compute, {ms[FORWARD] / m:.1f} ms "
            f"of its own gathers), its cross-node reduction ({ms[LAST_BACKWARD]:.1f} ms) behind "
            f"the last backward ({bwd:.1f} ms, {ms[BACKWARD] / m:.1f} ms of its own); more "
            "micro-batches only shorten those passes, and the gather cannot start sooner: the "
            "update needs every layer's gradient (the clipping norm)")


def compile_best(res: SearchResult, cfg, topo: Topology, k: int, max_devices: int,
                 a: Assumptions) -> int:
    """Compile the best k that fit, then the best left while it is one not compiled: a layout
    the compile finds too large drops out, and the layout the search recommends is then always
    one compiled (unless none fits). Returns how many beyond k were compiled."""
    from boost_jax.plan.dryrun import StepCompileError, dry_run

    done = 0
    while True:
        todo = [c for c in res.fitting if not c.compiled]
        if not todo or (done >= k and res.fitting[0].compiled):
            return max(done - k, 0)
        c, done = todo[0], done + 1
        try:
            dr = dry_run(c.config(cfg), topo, c.sizes["global"] * c.pp_stages, max_devices, a)
        except StepCompileError as e:
            c.error = f"compile failed: {e}"
            continue
        c.prediction, c.compiled, c.compiled_fits = dr.prediction, True, dr.memory["fits"]


def compile_on_gpu(res: SearchResult, cfg, topo: Topology, k: int, max_devices: int,
                   a: Assumptions) -> None:
    """The best k that fit, and the k fitting ones closest to the memory limit, compiled for
    the GPU and re-costed from the GPU program (no layout near the limit fits on the analytic
    figure alone)."""
    from boost_jax.plan.dryrun import StepCompileError
    from boost_jax.plan.gpu_compile import gpu_compile, judged

    best = list(res.fitting[:k])
    for c in best + near_limit(res.fitting, k, best):
        try:
            g = gpu_compile(c.config(cfg), topo, c.sizes, a, max_devices)
        except StepCompileError as e:
            c.error = f"compile failed: {e}"
            continue
        c.prediction = judged(c.prediction, g, a, topo.hbm_bytes)
        c.compiled, c.compiled_fits, c.gpu = True, c.prediction.memory["fits"], g.device_kind
    res.notes.append(f"the best {k} and the {k} closest to the memory limit were compiled for "
                     f"the GPU ({topo.name}) and re-ranked by the GPU program's exposed "
                     "collectives and memory")


def near_limit(fitting: list, k: int, skip: list) -> list:
    """The k layouts of `fitting` (not in `skip`) whose analytic memory is nearest the limit."""
    rest = [c for c in fitting if all(c is not s for s in skip)]
    return sorted(rest, key=lambda c: c.prediction.memory["total"] / c.prediction.memory["limit"],
                  reverse=True)[:k]


def _precision(c: Candidate, cfg) -> str:
    """The dtypes of the working weights and of the gradient reduction, which tell apart
    rows that are otherwise the same layout."""
    if c.low_precision:
        return "bf16/bf16"
    return "/".join(SHORT.get(d, d) for d in (cfg.model.param_dtype,
                                              cfg.parallel.grad_accum_dtype))


def _fit_rule(res: SearchResult, topo: Topology) -> str:
    """What "fits" meant: the estimate plus the safety margin within the usable HBM; a
    compiled row's own program within the usable HBM."""
    a = next((c.prediction.assumptions for c in res.candidates if c.prediction is not None),
             Assumptions())
    rule = (f"estimate + {a.memory_margin:.0%} <= {a.hbm_usable:.0%} of "
            f"{topo.hbm_bytes / 2**30:.0f} GiB: at most "
            f"{memory.fit_limit(topo.hbm_bytes, a) / 2**30:.1f} GiB")
    if any(c.compiled for c in res.candidates):
        rule += f"; a compiled row: its program <= {a.hbm_usable:.0%}"
    return rule


def _table_row(i: int, c: Candidate, cfg, scale: float) -> str:
    p = c.prediction
    tp = f"{c.tp_mode} x{p.layout['tp']} [{','.join(c.tp_axes)}]" if c.tp_axes else "-"
    pp = f"{c.pp_stages}" + (f" x{c.pp_virtual}" if c.pp_virtual > 1 else "")
    plan = c.plan + (" keep" if c.keep else "") + (
        f" {SHORT[c.secondary.dtype]} sec" if c.secondary else "") + (" xq" if c.xq else "")
    remat = c.remat + ("*" if REMAT_NONE_NOTE in p.notes else "")
    return (f"| {i} | {plan} | {tp} | {pp} | {c.micro_size} | {c.micro_batches} | {remat} | "
            f"{_precision(c, cfg)} | {p.memory['total'] / 2**30:.1f} | {p.step_time:.3f} | "
            f"{p.tokens_per_s:,.0f} | {p.tflops_per_device * scale:.1f} | {p.mfu:.1%} | "
            f"{p.comm_bytes['global'] / 1e9:.2f} | {sum(p.node_egress.values()) / 1e9:.2f} | "
            f"{('GPU' if c.gpu else 'yes') if c.compiled else 'no'} |")


def print_search(res: SearchResult, cfg, topo: Topology, sizes: dict, top: int = 15) -> str:
    hosts = sizes["global"] * sizes.get("stage", 1)
    n = sizes["pair"] * sizes["node"] * hosts
    lines = [f"layout search for {cfg.name} on {topo.name}: {counted(hosts, 'node')}, "
             f"{counted(n, 'device')}, "
             f"global batch {cfg.train.global_batch} x {cfg.data.seq_len} tokens",
             *[f"  {x}" for x in res.notes],
             f"  {len(res.fitting)} of {res.n_evaluated - res.n_invalid - res.n_unlisted} valid "
             f"layouts listed fit ({_fit_rule(res, topo)}); best first:", ""]
    unit, scale = ("TFLOP/s", 1) if topo.nominal_peak_flops else ("GFLOP/s", 1e3)  # a CPU
    hdr = ("| # | plan | TP | PP | seq/dev/micro | micro-batches | remat | weights/grad sums | "
           f"GiB/dev | step s | tokens/s | {unit}/dev | MFU | global GB/dev/step | "
           "node egress GB/step | compiled |")
    lines += [hdr, "|" + "---|" * 16]
    shown = res.fitting[:top]
    lines += [_table_row(i, c, cfg, scale) for i, c in enumerate(shown, 1)]
    if any(REMAT_NONE_NOTE in c.prediction.notes for c in shown):
        lines += ["", REMAT_NONE_MARK]
    ceil = res.ceiling
    if ceil:
        lines += ["", f"highest MFU any fitting layout allows with its data-parallel traffic "
                  f"hidden: "
                  f"{ceil['mfu']:.1%} ({ceil['key']}, floor: {ceil['by']}; predicted "
                  f"{ceil['mfu_now']:.1%}: {ceil['why']})"]
    if res.fitting and res.fitting[0].secondary:
        lines += ["", f"best layout's {res.fitting[0].secondary.line}"]
    if res.fitting:
        lines += ["", "critical path of the top layouts (ms per step: compute, exposed TP, "
                  "exposed DP, pipeline bubble, once-per-step comm + optimizer):"]
        for i, c in enumerate(res.fitting[:min(top, 5)], 1):
            cp = critical_path(c.prediction)
            lines.append(f"  {i}. {c.key()}: " + ", ".join(
                f"{k} {v * 1e3:.1f}" for k, v in cp.items()) + f"; {floor_text(c.prediction)}")
    lines += best_by_plan_lines(res)
    tight = [c for c in res.candidates if c.compiled and c.compiled_fits is False]
    if tight:
        lines.append("")
        lines.append("compiled and found not to fit (ranked analytically above the rows shown):")
        lines += [f"  {c.key()}: {c.prediction.memory['total'] / 2**30:.1f} GiB per device as "
                  f"compiled (analytic {c.prediction.memory['analytic_total'] / 2**30:.1f} GiB)"
                  for c in tight]
    failed = [c for c in res.candidates if c.error and c.error.startswith("compile failed")]
    if failed:
        lines.append("")
        lines.append("dropped because the training step does not compile them (ranked analytically "
                     "above the rows shown):")
        lines += [f"  {c.key()}: {c.error}" for c in failed]
    if not res.fitting:
        lines.append("| - | nothing fits |" + " |" * 14)
    return "\n".join(lines)


def best_by_plan_lines(res: SearchResult) -> list[str]:
    """The best layout of each plan side by side with its critical path (ms per step)."""
    if not res.fitting:
        return []
    names = list(critical_path(res.fitting[0].prediction))
    lines = ["", "best layout of each plan (critical path in ms per step):", "",
             "| plan | rank | layout | MFU | step s | " + " | ".join(names) + " |",
             "|" + "---|" * (5 + len(names))]
    for plan, i, c in res.best_by_plan:
        cp = critical_path(c.prediction)
        lines.append(f"| {plan} | {i} | {c.key()} | {c.prediction.mfu:.1%} | "
                     f"{c.prediction.step_time:.3f} | "
                     + " | ".join(f"{cp[k] * 1e3:.1f}" for k in names) + " |")
    return lines
