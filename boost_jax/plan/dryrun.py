"""AOT dry-run: compile the real training step on simulated CPU devices, nothing allocated.

`build_step_for_analysis(cfg, mesh)` gives the jitted step and ShapeDtypeStruct arguments;
lowering + compiling them yields the per-device program, whose HLO (collectives), memory
analysis and cost analysis are read by boost_jax.analysis.comm.

Two reductions keep this fast, both extrapolated analytically and reported as such:

layers   a scanned stack makes every per-layer quantity additive, so a model with more than
         `full_layers_max` layers is compiled with 2 and with 3 layers and each figure X is
         extrapolated linearly: X(L) = X(2) + (L−2)·(X(3) − X(2)). (Not 1 and 2: with one
         layer XLA removes the scan loop and the temporaries are laid out differently.)
global   if the topology's device count exceeds the simulated devices, the mesh keeps its
         `pair` and `node` sizes and shrinks `global` (≥ 2, so cross-node collectives exist in
         the program); the global batch shrinks with it so each device's micro-batch is the
         same. Every collective whose group spans `global` is re-costed with its group size
         scaled back up (payloads — the un-sharded buffer — do not depend on the global size
         for a fixed per-device batch); persistent state (arguments) is taken from the
         placement formula at the full size; temporaries are the compiled ones.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass, field
from typing import Optional

from boost_jax.backends.cpu import dev_compile_options
from boost_jax.errors import UserError, counted
from boost_jax.mesh import STAGE, Topology, axis_size, check_node_shape
from boost_jax.plan.collectives import CommSummary, colls_from_report, gpu_combined
from boost_jax.plan.costmodel import Assumptions, Prediction, predict, state_sizes
from boost_jax.plan.roofline import DTYPE_BYTES
from boost_jax.step.optim import STATE_PER_PARAM


class StepCompileError(RuntimeError):
    """boost_jax.step.build failed to build, lower or compile for the layout."""


def full_sizes(cfg, topo: Topology, nodes: Optional[int]) -> dict[str, int]:
    """Mesh sizes of the whole run: topology pair/node (or mesh.shape), `nodes` hosts."""
    if nodes is None or nodes == cfg.mesh.nodes:  # the config's own: the two must agree
        cfg.mesh.check_nodes_agree()
    if cfg.mesh.shape is not None:
        p, n, g = cfg.mesh.shape
        if nodes is not None:
            g = nodes
        check_node_shape(cfg.mesh.shape, topo, g)
    else:
        p, n = topo.pair, topo.node
        g = nodes if nodes is not None else (cfg.mesh.nodes or 1)
    pp = cfg.parallel.pp_stages
    if pp == 1:
        return {"pair": int(p), "node": int(n), "global": int(g)}
    if g % pp:
        raise UserError(f"parallel.pp_stages={pp} does not divide the {counted(g, 'node')}; "
                        "choose a node count that is a multiple of the stages")
    return {"pair": int(p), "node": int(n), "global": int(g) // pp, STAGE: pp}


def compile_sizes(sizes: dict, max_devices: int) -> dict:
    """The mesh compiled on: fewer data-parallel hosts (`global` ≥ 2 where the run has 2) when
    the run has more devices than are simulated; pair, node and stages stay."""
    total = math.prod(sizes.values())
    if total <= max_devices:
        return dict(sizes)
    per_node = sizes["pair"] * sizes["node"] * sizes.get(STAGE, 1)
    g = max_devices // per_node
    if g < min(2, sizes["global"]):
        need = per_node * min(2, sizes["global"])
        raise UserError(
            f"cannot keep pair={sizes['pair']} x node={sizes['node']} (x {sizes.get(STAGE, 1)} "
            f"stages) with global>=2 on {max_devices} simulated devices; pass --cpu-devices "
            f"{need} or more")
    return {**sizes, "global": min(g, sizes["global"])}


def mesh_hosts(sizes: dict) -> list[int]:
    """mesh.shape of `sizes`: [pair, node, hosts], the hosts holding the stages too."""
    return [sizes["pair"], sizes["node"], sizes["global"] * sizes.get(STAGE, 1)]


def scaled_config(cfg, sizes: dict, full: dict, n_layers: Optional[int] = None):
    """cfg on the (possibly reduced) mesh `sizes` with the per-device batch of `full`."""
    g_full, g = full["global"], sizes["global"]
    gb = cfg.train.global_batch
    if g != g_full:
        if (gb * g) % g_full:
            raise UserError(f"train.global_batch={gb} does not scale down to global={g} hosts "
                            f"for compiling; use --cpu-devices {math.prod(full.values())} or a "
                            "global batch divisible by the host count")
        gb = gb * g // g_full
    model = cfg.model if n_layers is None else dataclasses.replace(cfg.model, n_layers=n_layers)
    return dataclasses.replace(
        cfg, model=model,
        mesh=dataclasses.replace(cfg.mesh, shape=mesh_hosts(sizes), nodes=None),
        train=dataclasses.replace(cfg.train, global_batch=gb))


@dataclass
class Compiled:
    n_layers: int
    sizes: dict
    memory: dict
    xla_flops: float  # cost_analysis(): a loop body counted once
    comm: CommSummary
    raw_level_bytes: dict  # as compiled (before re-costing the global group sizes)
    compile_s: float
    n_collectives: int
    flops: float = 0.0  # dots × loop trip counts (CommReport.flops)
    report: object = field(default=None, repr=False)


def compile_once(cfg, full: dict, sizes: dict, topo: Topology, a: Assumptions,
                 n_layers: Optional[int] = None, keep_report: bool = False,
                 devices=None, compiler_options: Optional[dict] = None) -> Compiled:
    """Compile the step on `sizes`; `devices` (default: jax.devices(), the simulated CPUs) may
    be compile-only GPU devices (boost_jax.plan.gpu_target), read without the CPU fixes."""
    import jax

    from boost_jax.analysis.comm import analyze_compiled, compile_fn
    from boost_jax.mesh import make_mesh
    from boost_jax.step.build import build_step_for_analysis

    c = scaled_config(cfg, sizes, full, n_layers)
    cpu = devices is None
    if cpu and compiler_options is None:  # tests: LLVM -O0, as train.py's loop compiles
        compiler_options = dev_compile_options()
    mesh = make_mesh(topo, mesh_hosts(sizes), devices=jax.devices() if cpu else devices,
                     stages=sizes.get(STAGE, 1))
    t0 = time.perf_counter()
    try:
        fn, args = build_step_for_analysis(c, mesh, compiler_options)
        compiled = compile_fn(fn, args, mesh)
    except UserError:
        raise
    except Exception as e:  # the step itself does not lower/compile for this layout
        raise StepCompileError(f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                               ) from e
    dt = time.perf_counter() - t0
    report = analyze_compiled(compiled, mesh, cpu)
    colls = colls_from_report(report, c.parallel.tp_axes, c.train.micro_batches)
    raw = CommSummary.of(colls, topo, a).level_bytes
    colls = full_size_colls(colls, sizes, full)
    if cpu:  # merged at the run's group sizes: a reduce-scatter's result shrinks with n
        colls = gpu_combined(colls, a.combine_bytes)
    return Compiled(c.model.n_layers, dict(sizes), dict(report.memory or {}),
                    float(report.xla_flops or 0.0), CommSummary.of(colls, topo, a), raw, dt,
                    len(report.collectives), flops=report.flops or 0.0,
                    report=report if keep_report else None)


def full_size_colls(colls: list, sizes: dict, full: dict) -> list:
    """Collectives compiled on fewer hosts, with every group spanning `global` scaled back up."""
    if sizes["global"] == full["global"]:
        return colls
    up = full["global"] / sizes["global"]
    return [dataclasses.replace(x, n=int(round(x.n * up))) if "global" in x.axes else x
            for x in colls]


LAYER_POINTS = (2, 3)  # compile these layer counts (1 layer lets XLA drop the scan loop)


def _lin(x1: float, x2: float, L: int) -> float:
    a, b = LAYER_POINTS
    return x1 + (L - a) * (x2 - x1) / (b - a)


@dataclass
class DryRun:
    prediction: Prediction
    compiled: list  # Compiled programs (1 or 2)
    full_sizes: dict
    compile_sizes: dict
    layers_extrapolated: bool
    global_extrapolated: bool
    memory: dict  # per-device bytes at the full size: arguments, temp, total, formula parts
    flops_compiled: float  # per device per step: compiled dots × loop trips (extrapolated)
    formula: dict  # placement formula at the compile size: weights/master/adam/batch/arguments
    notes: list
    xla_flops: float = 0.0  # cost_analysis() (loop bodies counted once), same extrapolation

    def to_dict(self) -> dict:
        return {"prediction": self.prediction.to_dict(),
                "compiled": [{k: v for k, v in dataclasses.asdict(c).items() if k != "report"}
                             for c in self.compiled],
                "full_sizes": self.full_sizes, "compile_sizes": self.compile_sizes,
                "layers_extrapolated": self.layers_extrapolated,
                "global_extrapolated": self.global_extrapolated, "memory": self.memory,
                "flops_compiled": self.flops_compiled, "xla_cost_analysis_flops": self.xla_flops,
                "formula_at_compile_size": self.formula,
                "notes": self.notes}


def argument_formula(cfg, sizes: dict) -> dict:
    """Persistent per-device bytes the step takes as arguments, from the placement layouts."""
    st, _ = state_sizes(cfg, sizes)
    pb = DTYPE_BYTES[cfg.model.param_dtype]
    mixed = cfg.model.param_dtype != "float32"
    from boost_jax.sharding.placement import resolve_roles

    n_batch = axis_size(sizes, resolve_roles(cfg)["batch"])
    d = {"weights": st.params * pb, "master": st.opt * 4 if mixed else 0.0,
         "adam": st.opt * 4 * STATE_PER_PARAM[cfg.optim.name], "batch": 2 * 4 * cfg.train.global_batch * cfg.data.seq_len / n_batch}
    d["arguments"] = sum(d.values())
    d["grads"] = st.grads * DTYPE_BYTES[cfg.parallel.grad_accum_dtype]
    return d


@dataclass
class _LayerFit:
    """The compiled programs' figures at the run's layer count (extrapolated when two)."""

    progs: list  # Compiled programs (1 or 2)
    two_point: bool
    comm: CommSummary
    temp: float
    flops: float
    xla_flops: float
    args: float  # compiled argument bytes
    notes: list


def _compile_layers(cfg, full: dict, small: dict, topo: Topology, a: Assumptions,
                    full_layers_max: int, keep_report: bool) -> _LayerFit:
    """Compile every layer, or LAYER_POINTS layers and extrapolate linearly to the rest."""
    # per-chunk layers: what the compiled program's scan runs (all layers without stages;
    # a stage's, or with virtual stages one chunk's)
    chunks = cfg.parallel.pp_stages * cfg.parallel.pp_virtual
    L = -(-cfg.model.n_layers // chunks)
    if L <= full_layers_max:
        c = compile_once(cfg, full, small, topo, a, None, keep_report)
        return _LayerFit([c], False, c.comm, c.memory.get("temp", 0), c.flops, c.xla_flops,
                         c.memory.get("argument", 0), [])
    p1, p2 = LAYER_POINTS
    c1 = compile_once(cfg, full, small, topo, a, p1 * chunks, keep_report)
    c2 = compile_once(cfg, full, small, topo, a, p2 * chunks, keep_report)
    w = (L - p1) / (p2 - p1)
    comm = c1.comm.combine(c2.comm, 1 - w, w)  # X(p1) + (L−p1)·(X(p2) − X(p1))/(p2−p1)
    per = ("" if chunks == 1 else
           " per stage" if cfg.parallel.pp_virtual == 1 else " per chunk")
    note = (f"layers: compiled with {p1} and {p2} of {L} layers{per}; per-layer "
            "figures extrapolated linearly (scan over layers: cost is additive)")
    return _LayerFit([c1, c2], True, comm,
                     _lin(c1.memory.get("temp", 0), c2.memory.get("temp", 0), L),
                     _lin(c1.flops, c2.flops, L), _lin(c1.xla_flops, c2.xla_flops, L),
                     _lin(c1.memory.get("argument", 0), c2.memory.get("argument", 0), L),
                     [note])


def _mesh_note(small: dict, full: dict) -> str:
    return (f"mesh: compiled on pair={small['pair']} x node={small['node']} x "
            f"global={small['global']}"
            + (f" x stage={small[STAGE]}" if STAGE in small else "")
            + f" ({math.prod(small.values())} devices) instead "
            f"of global={full['global']}; collectives spanning `global` re-costed at "
            "the full group size, persistent state from the placement formula at the "
            "full size")


def _dry_run_memory(fit: _LayerFit, form_full: dict, topo: Topology, a: Assumptions,
                    keep_report: bool) -> dict:
    """Per-device bytes at the full size: formula arguments plus compiled temporaries."""
    temp_b = float(fit.temp)
    mem = {"arguments_formula": form_full["arguments"], "arguments_compiled": float(fit.args),
           "temp_compiled": temp_b, "weights": form_full["weights"],
           "master": form_full["master"], "adam": form_full["adam"],
           "grads_accumulator": form_full["grads"]}
    mem["total"] = form_full["arguments"] + temp_b
    mem["hbm"] = topo.hbm_bytes
    # compiled temporaries: the heap as packed, so no margin for it (plan/memory.py)
    mem["limit"] = a.hbm_usable * topo.hbm_bytes
    mem["fits"] = mem["total"] <= mem["limit"]
    mem["largest_temporaries"] = largest_buffers(fit.progs[-1].report) if keep_report else []
    return mem


def dry_run(cfg, topo: Topology, nodes: Optional[int], max_devices: int,
            a: Optional[Assumptions] = None, full_layers_max: int = 4,
            keep_report: bool = False) -> DryRun:
    a = a or Assumptions()
    full = full_sizes(cfg, topo, nodes)
    small = compile_sizes(full, max_devices)
    fit = _compile_layers(cfg, full, small, topo, a, full_layers_max, keep_report)
    notes = list(fit.notes)
    glob = small["global"] != full["global"]
    if glob:
        notes.append(_mesh_note(small, full))
    form_small = argument_formula(scaled_config(cfg, small, full), small)
    form_full = argument_formula(cfg, full)
    pred = predict(cfg, topo, full, a, measured=fit.comm)
    analytic = predict(cfg, topo, full, a)
    pred.memory["analytic_comm_bytes"] = analytic.comm_bytes
    pred.memory["analytic_step_time"] = analytic.step_time
    pred.memory["analytic_node_egress"] = sum(analytic.node_egress.values())
    mem = _dry_run_memory(fit, form_full, topo, a, keep_report)
    pred.memory = {**pred.memory, "analytic_total": pred.memory["total"], **mem}
    pred.notes = notes + pred.notes
    return DryRun(pred, fit.progs, full, small, fit.two_point, glob, mem, fit.flops, form_small,
                  notes, fit.xla_flops)


def largest_buffers(report, k: int = 6) -> list:
    """The largest array shapes in the compiled program (a hint at what dominates temp)."""
    if report is None or not report.hlo_text:
        return []
    from boost_jax.analysis import hlo as H

    seen = {}
    for line in report.hlo_text.splitlines():
        if "=" not in line or line.lstrip().startswith("//"):
            continue
        lhs, rhs = line.split("=", 1)
        shape_txt = rhs.strip().split(" ", 1)[0]
        for arr in H.parse_shape(shape_txt):
            if arr.dims:
                seen[str(arr)] = max(seen.get(str(arr), 0), arr.nbytes)
    return sorted(seen.items(), key=lambda kv: -kv[1])[:k]

