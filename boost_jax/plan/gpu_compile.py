"""--gpu-compile: the planned layout's training step compiled for the topology's GPU, no GPU needed.

The step (boost_jax.step.build, the launcher's GPU_XLA_FLAGS as compile options, Pallas kernels
picked as on a GPU) is compiled for compile-only devices (boost_jax.plan.gpu_target) with the
model's L layers and with L − 1: memory, collectives and their overlap are the L-layer
program's as compiled (a GPU program's peak memory is not additive in layers: the scheduler's
double buffering lays 2 and 3 layers out differently), kernels per layer the difference of the
two. A mesh bigger than --cpu-devices is compiled with fewer hosts, as the CPU dry run does
(groups spanning `global` re-costed at the full size, arguments from the placement formula).
Read off the scheduled GPU program: memory_analysis(), kernels per layer, every collective with
its group, bytes and the kernels scheduled between its start and done, and the collectives left
exposed. Each figure stands next to the analytic model's; a difference over 25% is flagged.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from boost_jax.analysis import hlo as H
from boost_jax.analysis import schedule as S
from boost_jax.mesh import Topology, axis_size
from boost_jax.plan import dryrun, gpu_target, overlap
from boost_jax.plan.collectives import CommSummary, Coll, coll_time, colls_from_report
from boost_jax.plan.costmodel import Assumptions, predict, state_sizes, tp_info
from boost_jax.plan.roofline import block_kernels, block_model

RTOL = 0.25


@dataclass
class Program:
    """One compiled GPU program (n_layers layers per chunk) as read off its schedule."""

    n_layers: int
    memory: dict
    kernels: float  # kernel launches per step
    mix: dict
    collectives: list  # dicts, one per collective of the HLO
    comm: CommSummary
    exposed_s: float  # collective time not hidden behind scheduled compute, per step
    compile_s: float
    in_flight: int  # the most collectives in flight at once (schedule.max_in_flight)


@dataclass
class GpuCompile:
    target: str
    device_kind: str
    sizes: dict  # the mesh compiled
    programs: list
    memory: dict  # per device at the model's layer count
    kernels_per_layer: float
    kernels_per_step: float
    exposed: dict
    comm_bytes: dict
    comparison: list
    notes: list = field(default_factory=list)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _per_call(c: Coll) -> Coll:
    return dataclasses.replace(c, calls=1.0)


def read_program(comp: dryrun.Compiled, cfg, sizes, full, topo, a: Assumptions) -> Program:
    """Kernels, collectives with their overlap, and exposed time of one compiled program."""
    mod = H.parse_module(comp.report.hlo_text)
    sched = {x.name: x for x in S.async_collectives(mod)}
    colls = {c.name: c for c in dryrun.full_size_colls(
        colls_from_report(comp.report, cfg.parallel.tp_axes, cfg.train.micro_batches),
        sizes, full)}
    peak = topo.device_peak(math.prod(full.values())) * a.eta_flops
    rows, exposed = [], 0.0
    for c in comp.report.collectives:
        s, cc = sched.get(c.name), colls[c.name]
        t = coll_time(_per_call(cc), topo, a)
        hidden = 0.0 if s is None or s.sync else min(
            t, s.overlap_flops / peak + len(s.overlapped) * a.launch_s)
        trips = c.trip_count or 1
        exposed += (t - hidden) * trips
        rows.append({"name": c.name, "kind": c.kind, "level": c.level, "axes": list(c.axes),
                     "group_size": cc.n, "groups": c.groups[:4], "shapes": c.shapes,
                     "trips": trips, "bytes_per_call": c.bytes_per_call,
                     "bytes_per_step": c.bytes_per_step, "phase": cc.phase,
                     "sync": bool(s is None or s.sync),
                     "overlapped_kernels": len(s.overlapped) if s else 0,
                     "overlapped_gemms": s.gemms if s else 0,
                     "overlapped": s.overlapped[:6] if s else [],
                     "overlap_flops": s.overlap_flops if s else 0.0,
                     "comm_s_per_call": t, "exposed_s_per_call": t - hidden,
                     "exposed": bool(s is None or s.exposed)})
    kernels, _ = S.kernel_launches(mod)
    return Program(comp.n_layers, comp.memory, kernels, S.kernel_mix(mod), rows, comp.comm,
                   exposed, comp.compile_s, S.max_in_flight(mod))


def roofline_kernels_per_layer(cfg, sizes, a: Assumptions) -> float:
    """Launches of one block per micro-batch in the roofline's list (roofline.block_kernels)."""
    mode, t = tp_info(cfg, sizes)
    _, pl = state_sizes(cfg, sizes)
    b = cfg.train.global_batch // cfg.train.micro_batches // axis_size(sizes, pl.batch_axes)
    return block_kernels(cfg, block_model(cfg.model, b, cfg.data.seq_len, mode, t, a.attention))


def analytic_kernels_per_layer(cfg, sizes, a: Assumptions) -> float:
    """Launches of one block per micro-batch the cost model charges: the roofline's list plus
    what the measured tables add for the block and the plan (overlap.extra_kernels)."""
    return roofline_kernels_per_layer(cfg, sizes, a) + overlap.extra_kernels(cfg)


def layer_points(L: int) -> tuple[int, int]:
    """The layer counts compiled: L − 1 and L (1 and 2 for a one-layer model)."""
    return (L - 1, L) if L >= 2 else (1, 2)


def compile_programs(cfg, topo: Topology, full: dict, small: dict, a: Assumptions,
                     target: str | None = None):
    """(programs at the two layer points, layers per pipeline chunk, the GPU's name)."""
    from boost_jax.pallas import dispatch

    devices = gpu_target.compile_devices(topo, small, target)
    chunks = cfg.parallel.pp_stages * cfg.parallel.pp_virtual
    L = -(-cfg.model.n_layers // chunks)
    progs = []
    with dispatch.compile_target("cuda"):
        for n in layer_points(L):
            comp = dryrun.compile_once(cfg, full, small, topo, a, n * chunks, keep_report=True,
                                       devices=devices,
                                       compiler_options=gpu_target.compiler_options())
            progs.append(read_program(comp, cfg, small, full, topo, a))
    return progs, L, devices[0].device_kind


def memory_of(prog: Program, cfg, full: dict, small: dict) -> dict:
    """Per-device bytes of the L-layer program; arguments from the placement formula when
    compiled on fewer hosts (as the dry run)."""
    mem = {k: float(prog.memory.get(k, 0)) for k in ("argument", "output", "alias", "temp")}
    if small["global"] != full["global"]:
        mem["argument"] = dryrun.argument_formula(cfg, full)["arguments"]
    mem["total"] = mem["argument"] + mem["temp"] + max(0.0, mem["output"] - mem["alias"])
    return mem


def _row(what: str, gpu: float, analytic: float, unit: str) -> dict:
    ratio = gpu / analytic if analytic else None
    return {"what": what, "gpu": gpu, "analytic": analytic, "unit": unit, "ratio": ratio,
            "differs": ratio is None and gpu > 0 or ratio is not None and abs(ratio - 1) > RTOL}


def compare(g: GpuCompile, pred, cfg, full, a: Assumptions) -> list:
    """The GPU program's figures next to the analytic model's, each flagged past 25%."""
    m, t = pred.memory, pred.time
    form = dryrun.argument_formula(cfg, full)
    rows = [_row("memory total", g.memory["total"], m["total"], "bytes"),
            _row("memory arguments", g.memory["argument"], form["arguments"], "bytes"),
            _row("memory temporaries", g.memory["temp"], m["total"] - form["arguments"],
                 "bytes")]
    for lv in ("pair", "node", "global"):
        if g.comm_bytes.get(lv, 0) or pred.comm_bytes.get(lv, 0):
            rows.append(_row(f"collective bytes {lv}", g.comm_bytes.get(lv, 0.0),
                             pred.comm_bytes.get(lv, 0.0), "bytes"))
    rows.append(_row("exposed collective time", g.exposed["time_s"],
                     t["tp"] + t["dp_exposed"] + t["step_comm"], "s"))
    rows.append(_row("kernels per layer", g.kernels_per_layer,
                     analytic_kernels_per_layer(cfg, full, a), "kernels"))
    return rows


def exposed_summary(p: Program) -> dict:
    exp = [c for c in p.collectives if c["exposed"]]
    by_phase = {"tp": 0.0, "dp": 0.0, "step": 0.0}
    for c in p.collectives:
        by_phase[c["phase"]] = by_phase.get(c["phase"], 0.0) + c["exposed_s_per_call"] * c["trips"]
    return {"count": len(exp), "of": len(p.collectives), "time_s_by_phase": by_phase,
            "overlap_gemm": sum(c["overlapped_gemms"] > 0 and not c["exposed"]
                                for c in p.collectives),
            "bytes_per_step": sum(c["bytes_per_step"] for c in exp), "time_s": p.exposed_s,
            "by_kind": {k: [sum(c["exposed"] for c in p.collectives if c["kind"] == k),
                            sum(c["kind"] == k for c in p.collectives)]
                        for k in sorted({c["kind"] for c in p.collectives})}}


def gpu_compile(cfg, topo: Topology, full: dict, a: Assumptions, max_devices: int,
                target: str | None = None) -> GpuCompile:
    """The layout compiled for the profile's GPU, or for `target` (a gpu_targets/ name: e.g.
    an A100 standing in for a GPU no plugin compiles for without one)."""
    name = target or gpu_target.target_name(topo)
    small = dryrun.compile_sizes(full, max_devices)
    progs, L, kind = compile_programs(cfg, topo, full, small, a, target)
    p1, p2 = progs
    prog = p2 if L >= 2 else p1
    # one layer fewer per chunk: a device runs V chunks of its stage per micro-batch
    v = cfg.parallel.pp_virtual if cfg.parallel.pp_stages > 1 else 1
    per_layer = (p2.kernels - p1.kernels) / (cfg.train.micro_batches * v)
    g = GpuCompile(name, kind, dict(small), progs, memory_of(prog, cfg, full, small),
                   per_layer, prog.kernels, exposed_summary(prog), dict(prog.comm.level_bytes),
                   [])
    g.notes.append(f"layers: compiled with {p1.n_layers} and {p2.n_layers} layers; figures are "
                   f"the {L}-layer program's, kernels per layer the difference of the two")
    if small != full:
        g.notes.append(f"mesh: compiled on {math.prod(small.values())} devices "
                       f"({small}) instead of {math.prod(full.values())}; groups spanning "
                       "`global` re-costed at the full size, arguments from the placement "
                       "formula")
    if cfg.parallel.pp_stages > 1:
        g.notes.append("pipeline: kernels per layer count every tick's passes per micro-batch")
    g.comparison = compare(g, predict(cfg, topo, full, a), cfg, full, a)
    return g


def judged(pred, g: GpuCompile, a: Assumptions, hbm_bytes: float):
    """The analytic prediction with what the GPU program shows in place of the model's
    assumptions: its exposed collective time per phase (TP, per-micro-batch data-parallel,
    once per step: read off the schedule) and its memory. Compute, (de)quantization and the
    optimizer stay the model's (a compile-only device runs nothing). However much the schedule
    hides, the step is no shorter than the node's NICs need for the bytes that leave it: what
    falls short of that floor is exposed data-parallel time."""
    t, ph = dict(pred.time), g.exposed["time_s_by_phase"]
    t.update(tp=ph.get("tp", 0.0), dp_exposed=ph.get("dp", 0.0), step_comm=ph.get("step", 0.0),
             dp_once_exposed=0.0)  # the schedule's phases do not split a pass by leg
    rest = t["compute"] + t["quant"] + t["tp"] + t["step_comm"] + t["optimizer"]
    t["dp_exposed"] = max(t["dp_exposed"], t.get("nic", 0.0) - rest)
    total = rest + t["dp_exposed"]
    t["total"] = total
    mem = dict(pred.memory, analytic_total=pred.memory["total"], total=g.memory["total"])
    mem["limit"] = a.hbm_usable * hbm_bytes  # the program's heap as packed: no margin
    mem["fits"] = mem["total"] <= mem["limit"]
    mem["compiled_for"] = g.device_kind
    tflops = pred.flops_per_device / total / 1e12
    return dataclasses.replace(
        pred, time=t, memory=mem, step_time=total, tokens_per_s=pred.tokens_per_step / total,
        tflops_per_device=tflops, mfu=pred.mfu * pred.step_time / total,
        notes=pred.notes + [f"GPU-compiled for {g.device_kind}: exposed collectives and memory "
                            "read off the scheduled program"])


def _fmt(x: float, unit: str) -> str:
    if unit == "bytes":
        for u, f in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
            if abs(x) >= f:
                return f"{x / f:.2f} {u}"
        return f"{x:.0f} B"
    if unit == "s":
        return f"{x * 1e3:.2f} ms"
    return f"{x:.1f}"


def report_text(g: GpuCompile, top: int = 12) -> str:
    m = g.memory
    p = next(q for q in g.programs if q.kernels == g.kernels_per_step)
    n_dev = math.prod(g.sizes.values())
    L = [f"GPU program: compiled for {n_dev} x {g.device_kind} (target {g.target}, the "
         f"launcher's GPU_XLA_FLAGS), {sum(q.compile_s for q in g.programs):.0f} s, no GPU used",
         f"  memory per device: arguments {_fmt(m['argument'], 'bytes')}, temporaries "
         f"{_fmt(m['temp'], 'bytes')}, total {_fmt(m['total'], 'bytes')}",
         f"  kernels: {g.kernels_per_layer:.0f} per layer per micro-batch, "
         f"{g.kernels_per_step:.0f} per step ("
         + ", ".join(f"{k} {v:.0f}" for k, v in sorted(p.mix.items(), key=lambda kv: -kv[1]))
         + ")"]
    e = g.exposed
    L.append(f"  collectives: {e['of']}, {e['of'] - e['count']} overlap compute "
             f"({e['overlap_gemm']} a GEMM), {e['count']} exposed ("
             + ", ".join(f"{k} {x}/{n}" for k, (x, n) in e["by_kind"].items())
             + f"); exposed collective time {_fmt(e['time_s'], 's')} per step; at most "
             f"{max(q.in_flight for q in g.programs)} in flight at once")
    hdr = f"    {'kind':<15}{'level':<7}{'n':>3}{'trips':>6}{'bytes/step':>12}  overlaps"
    L.append(hdr)
    rows = sorted(p.collectives, key=lambda c: -c["bytes_per_step"])
    for c in rows[:top]:
        ov = ("EXPOSED (sync)" if c["sync"] else "EXPOSED (nothing between start and done)"
              if c["exposed"] else f"{c['overlapped_kernels']} kernels, {c['overlapped_gemms']} "
              f"GEMMs ({', '.join(c['overlapped'][:3])}{', ...' if c['overlapped_kernels'] > 3 else ''})")
        L.append(f"    {c['kind']:<15}{c['level']:<7}{c['group_size']:>3}{c['trips']:>6}"
                 f"{_fmt(c['bytes_per_step'], 'bytes'):>12}  {ov}")
    if len(rows) > top:
        L.append(f"    ... {len(rows) - top} more (--json lists every one)")
    L.append("  GPU program vs analytic model:")
    for r in g.comparison:
        ratio = f"x{r['ratio']:.2f}" if r["ratio"] is not None else "-"
        L.append(f"    {r['what']:<26}{_fmt(r['gpu'], r['unit']):>12} vs "
                 f"{_fmt(r['analytic'], r['unit']):>12}  {ratio:>6}"
                 + ("  DIFFERS by more than 25%" if r["differs"] else ""))
    L += [f"  note: {n}" for n in g.notes]
    return "\n".join(L)
