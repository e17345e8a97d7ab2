"""Plan a run at cluster scale before paying for it.

    python -m boost_jax.plan --config configs/cola-7b.yaml --topology frontier --nodes 48 \\
        parallel.plan=hierarchical parallel.tp_mode=btp parallel.tp_axes=[node] \\
        train.global_batch=768
    python -m boost_jax.plan ... --json             # machine-readable
    python -m boost_jax.plan ... --search           # rank candidate layouts that fit
    python -m boost_jax.plan ... --no-compile       # analytic only (no XLA compile)
    python -m boost_jax.plan ... --gpu-compile      # compile for the topology's GPU (no GPU needed)
    python -m boost_jax.plan ... --search --gpu-compile --compile-top 3   # rank the best by it

Compiles the real training step (boost_jax.step.build) for the topology's device count on
simulated CPU devices with abstract shapes — nothing is allocated — or, beyond --cpu-devices, on
a mesh with the same pair/node sizes and fewer hosts, extrapolating cross-node terms (said in
the output). Reports per-device memory against the device's HBM, FLOPs, collective bytes per
topology level, and a predicted step time / tokens/s / TFLOP/s / MFU from the α–β cost model
(boost_jax.plan.costmodel; its assumptions are printed with every report).
"""

from __future__ import annotations

import math
import sys
from typing import Optional, Sequence

from boost_jax.cli import OverrideParser, flop_rate, json_dumps, shell_word
from boost_jax.errors import counted
from boost_jax.names import KEPT_SECONDARY, MESH_AXES
from boost_jax.plan.critical_path import critical_path, dp_latency_text, floor_text


def _gb(x: float) -> str:
    return f"{x / 2**30:.2f} GiB"


def _bytes(x: float) -> str:
    for unit, f in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(x) >= f:
            return f"{x / f:.2f} {unit}"
    return f"{x:.0f} B"


def _ms(x: float) -> str:
    return f"{x * 1e3:.1f} ms" if x < 10 else f"{x:.2f} s"


def _count(n: float) -> str:
    for unit, f in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= f:
            return f"{n / f:.2f}{unit}"
    return f"{n:.0f}"


def _hosts(sizes: dict) -> int:
    return sizes["global"] * sizes.get("stage", 1)


def _mesh_text(sizes: dict) -> str:
    text = f"pair {sizes['pair']} x node {sizes['node']} x global {sizes['global']}"
    return text + (f" x stage {sizes['stage']}" if sizes.get("stage", 1) > 1 else "")


def build_parser() -> OverrideParser:
    p = OverrideParser(prog="python -m boost_jax.plan", description=__doc__.split("\n\n")[0])
    p.add_argument("--topology", default=None,
                   help="topology profile (default: the config's mesh.topology)")
    p.add_argument("--nodes", type=int, default=None,
                   help="number of hosts (the global axis; with pipeline stages, stages x the "
                        "data-parallel host groups)")
    p.add_argument("--cpu-devices", type=int, default=None,
                   help="simulated CPU devices to compile on (default: the run's device count, "
                        "capped at 512); a bigger run is compiled on fewer hosts")
    p.add_argument("--layers", default="auto",
                   help="auto: compile every layer if n_layers <= 4, else 1 and 2 layers and "
                        "extrapolate linearly; full: always every layer; N: every layer if "
                        "n_layers <= N")
    p.add_argument("--no-compile", action="store_true", help="analytic model only")
    p.add_argument("--search", action="store_true", help="rank candidate layouts that fit")
    p.add_argument("--compile-top", type=int, default=0,
                   help="with --search: also compile the best K candidates")
    p.add_argument("--top", type=int, default=None, help="with --search: rows to print (15)")
    p.add_argument("--attention", choices=("auto", "dense", "flash"), default="auto",
                   help="attention kernel the cost model assumes (auto: the config's "
                        "model.attention, else flash on GPU topologies)")
    p.add_argument("--overlap", choices=("xla", "gpu", "none"), default="xla",
                   help="xla: collectives overlap as the step compiled with the launcher's XLA "
                        "flags does; gpu: each phase hides the share the GPU schedule showed "
                        "(benchmarks/gpu_overlap.py); none: every collective on the critical "
                        "path")
    p.add_argument("--gpu-compile", action="store_true",
                   help="compile the step for the topology's GPU (compile-only devices, the "
                        "gpu-compile extra) instead of simulated CPUs; report its memory, "
                        "kernels and collective overlap next to the analytic model; with "
                        "--search --compile-top K the best K are compiled for the GPU and "
                        "ranked by the GPU program's exposed collectives and memory")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument("--emit-config", default=None, metavar="FILE",
                   help="write the layout (with --search: the best that fits) as a config that "
                        "train.py and python -m boost_jax.launch slurm take unchanged")
    p.add_argument("--force", action="store_true",
                   help="replace an existing --emit-config FILE (never the --config itself)")
    p.add_argument("--allow-demo-data", action="store_true",
                   help="let --emit-config write a multi-node run on the demo corpus "
                        "(data.source=stdlib), e.g. to smoke-test a cluster")
    return p


def check_emit_target(path: str, config: str, force: bool) -> None:
    """safe_write's rule for --emit-config FILE: never the --config; an existing FILE only with
    --force."""
    from boost_jax.safe_write import check_target

    check_target(path, {"--config": config}, force, f"--emit-config {path!r}",
                 "choose another FILE")


def emit_config(path: str, cfg, pred, topo, command: str, force: bool = False,
                secondary=None) -> None:
    """The planned run as a YAML config: mesh.topology and mesh.shape carry the cluster layout,
    so `python -m boost_jax.launch slurm --config FILE` needs no --topology or --nodes."""
    from boost_jax.config import config_to_yaml
    from boost_jax.data.sources import ALLOW_DEMO, on_demo_corpus
    from boost_jax.errors import UserError
    from boost_jax.launch.script_values import comment
    from boost_jax.launch.slurm import ACCOUNT, cross_node_text, dtypes_text
    from boost_jax.plan.costmodel import REMAT_NONE_NOTE

    lay, s = pred.layout, pred.sizes
    how = "analytic"
    if "compiled_for" in pred.memory:  # gpu_compile.judged
        how = (f"memory and exposed collectives of the step compiled for "
               f"{pred.memory['compiled_for']}")
    elif "temp_compiled" in pred.memory:
        how = "memory with the temporaries of the step compiled for CPU"
    notes = [f"{cfg.name} on {topo.name}: {counted(_hosts(s), 'node')}, {_mesh_text(s)} = "
             f"{counted(pred.devices, 'device')}",
             f"layout: plan {lay['plan']}, TP {lay['tp_mode']} x{lay['tp']} over "
             f"{lay['tp_axes'] or '-'}, "
             f"{counted(lay.get('pipeline_stages', 1), 'pipeline stage')}, "
             f"{counted(pred.micro_batches, 'micro-batch', 'micro-batches')}, "
             f"remat {lay['remat']}; {dtypes_text(cfg)}"
             f"{cross_node_text(cfg.parallel)}",
             f"predicted ({how}): {pred.memory['total'] / 2**30:.1f} GiB per device of "
             f"{topo.hbm_bytes / 2**30:.0f} GiB, {pred.step_time:.3f} s per step, "
             f"{pred.tokens_per_s:,.0f} tokens/s, MFU {pred.mfu:.1%} (collectives overlapped "
             f"as --overlap {pred.assumptions.overlap} assumes)",
             *([secondary.line] if secondary else []),
             *[note for note in pred.notes if note == REMAT_NONE_NOTE],
             f"written by: {command}"]
    head = [*map(comment, notes), ""]  # one line each, whatever a path in them holds
    from boost_jax.safe_write import write_text

    try:
        write_text(path, "\n".join(head) + config_to_yaml(cfg), force)
    except OSError as e:
        raise UserError(f"cannot write --emit-config {path!r} ({e.strerror}); choose another "
                        "path") from None
    word = shell_word(path)
    refused = _launch_refusal(cfg, topo)
    if refused:
        print(f"wrote {word}: train with python train.py --config {word}; launch slurm refuses "
              f"it as it is: {refused}", file=sys.stderr)
        return
    # what launch slurm will ask of this config, so the command printed runs as shown
    extra = (f" --account {ACCOUNT}" if topo.job is not None and topo.job.needs_account else "") \
        + (f" {ALLOW_DEMO}" if on_demo_corpus(cfg, _hosts(s), topo.name) else "")
    print(f"wrote {word}: train with python train.py --config {word}, or write a batch job with "
          f"python -m boost_jax.launch slurm --config {word}{extra}", file=sys.stderr)


def _launch_refusal(cfg, topo) -> Optional[str]:
    """What `launch slurm --config` would refuse in the emitted config (its name, distributed
    settings, out_dir), with any project id; None when the suggested command runs."""
    from boost_jax.errors import UserError
    from boost_jax.launch.slurm import make_job

    if topo.job is None:
        return "the topology has no job settings"
    try:
        make_job(cfg, topo, None, account="abc123" if topo.job.needs_account else None)
    except UserError as e:
        return str(e)
    return None


def _layout_line(p, cfg) -> str:
    from boost_jax.launch.slurm import cross_node_text

    lay = p.layout
    pl = lay["placement"]
    late = (f", the layers' reduced over {pl['deferred_grad_axes']} in the backward"
            if pl.get("reduce_in_backward") else "")
    sec = KEPT_SECONDARY if pl["secondary"] == [] else pl["secondary"] or "-"
    return (f"layout: plan {lay['plan']} (params {pl['params'] or '-'}, grads {pl['grads'] or '-'}"
            f"{late}, opt_state {pl['opt_state'] or '-'}, secondary {sec}"
            f"{' int8' if pl['int8_secondary'] else ''}{', qwZ int8 gathers' if pl['quantize_gather'] else ''}"
            f"{', qgZ int4 gradient reduce-scatter' if pl.get('quantize_grads') else ''})"
            f"{cross_node_text(cfg.parallel)}; TP {lay['tp_mode']} x{lay['tp']} over {lay['tp_axes'] or '-'}; "
            + (f"{lay['pipeline_stages']} pipeline stages ({lay['pp_schedule']}"
               + (f", {lay['pp_virtual']} virtual" if (lay.get("pp_virtual") or 1) > 1 else "")
               + "); "
               if lay.get("pipeline_stages", 1) > 1 else "")
            + f"remat {lay['remat']}; "
            f"{counted(p.micro_batches, 'micro-batch', 'micro-batches')} x "
            f"{p.micro_batch_per_device} seq/device of "
            f"{cfg.data.seq_len} tokens ({p.tokens_per_step} tokens/step)")


def _header_lines(p, cfg, topo) -> list:
    """What runs where: model, cluster, layout, the plan TP settled on."""
    sizes = p.sizes
    L = [f"plan for {cfg.name}: {cfg.model.arch} d={cfg.model.d_model} L={cfg.model.n_layers} "
         f"({_count(p.memory.get('params_total', 0))} params) on {topo.name} "
         f"({topo.device}): {counted(_hosts(sizes), 'node')}, {counted(p.devices, 'device')} = "
         f"{_mesh_text(sizes)}",
         _layout_line(p, cfg)]
    for note in p.notes:
        if note.startswith(("parallel.plan=", "secondary dtype")):  # roles TP took; the copy
            L.append(f"  {note}")
    return L


def _compile_lines(dr, compiled: bool) -> list:
    if not compiled:
        return ["not compiled: analytic model only (--no-compile)"]
    progs, cs = dr.compiled, dr.compile_sizes
    L = [f"compiled: {counted(len(progs), 'program')} on "
         f"{counted(math.prod(cs.values()), 'simulated CPU device')} ({_mesh_text(cs)}), "
         f"layers {[c.n_layers for c in progs]}, "
         f"{sum(c.compile_s for c in progs):.0f} s, abstract shapes (nothing allocated)"]
    return L + [f"  extrapolated: {note}" for note in dr.notes]


def _compiled_memory_lines(m: dict, dr) -> list:
    L = [f"  arguments: formula {_bytes(m['arguments_formula'])}"
         + (f" (compiled {_bytes(m['arguments_compiled'])})" if not dr.global_extrapolated
            else f" (compile-size check: formula {_bytes(dr.formula['arguments'])} vs "
                 f"compiled {_bytes(dr.compiled[-1].memory.get('argument', 0))} at "
                 f"{counted(dr.compiled[-1].n_layers, 'layer')})")
         + f"; temporaries (compiled) {_bytes(m['temp_compiled'])}",
         f"  analytic cross-check: activations {_bytes(m['activations'])}, gathered "
         f"weights {_bytes(m['gathered_weights'])}, analytic total "
         f"{_bytes(m['analytic_total'])}"]
    if m.get("largest_temporaries"):
        L.append("  largest buffers: " + ", ".join(f"{s} {_bytes(b)}" for s, b in
                                                   m["largest_temporaries"]))
    return L


def _memory_lines(p, dr, topo, compiled: bool) -> list:
    from boost_jax.plan.costmodel import REMAT_NONE_NOTE

    m = p.memory
    kind = "per simulated device, a fixed budget" if topo.name == "cpu" else "HBM"
    L = [f"memory per device ({topo.device}, {_gb(topo.hbm_bytes)} {kind}, usable "
         f"{p.assumptions.hbm_usable:.0%}):",
         f"  weights {_bytes(m['weights'])}, fp32 master {_bytes(m['master'])}, Adam m+v "
         f"{_bytes(m['adam'])}, grad accumulator {_bytes(m.get('grads_accumulator', m.get('grads', 0)))}"
         + (f", secondary {_bytes(m['secondary'])}" if m.get("secondary") else "")]
    if compiled:
        L += _compiled_memory_lines(m, dr)
    else:
        from boost_jax.plan.memory import report_lines

        L += report_lines(m, p.assumptions, topo.hbm_bytes)
    verdict = "FITS" if m["fits"] else "DOES NOT FIT (add --search for the layouts that do)"
    L.append(f"  total {_bytes(m['total'])} of {_bytes(topo.hbm_bytes)} -> {verdict}")
    if "compiled_for" in m:  # judged by the GPU program already (gpu_compile.judged)
        return L
    return L + [f"  {note}" for note in p.notes if note == REMAT_NONE_NOTE]


def _flops_line(p, dr, compiled: bool) -> str:
    fl = (f"flops per device per step: model {p.flops_per_device:.3e} (3x forward; "
          f"{p.executed_flops_per_device:.3e} with remat={p.layout['remat']} recompute)")
    if compiled:
        fl += (f", compiled {dr.flops_compiled:.3e} (dots x loop trip counts; XLA "
               f"cost_analysis, which counts a loop body once: {dr.xla_flops:.3e})")
    return fl


def _comm_lines(p, topo, compiled: bool) -> list:
    L = ["collective bytes per device per step (ring bytes sent) and time at "
         f"{p.assumptions.eta_net:.0%} of link bandwidth:"]
    for lv in MESH_AXES:
        L.append(f"  {lv:<7}{_bytes(p.comm_bytes[lv]):>12}  {_ms(p.comm_time[lv]):>10}  "
                 f"({topo.bandwidth(lv) / 1e9:.1f} GB/s, {topo.latency(lv) * 1e6:.0f} us)")
    eg = p.node_egress
    if sum(eg.values()):
        L.append(f"  leaving each node through its NICs ({topo.nic_node / 1e9:.0f} GB/s per node):"
                 f" {_bytes(sum(eg.values()))} per step (tensor-parallel and pipeline "
                 f"{_bytes(eg.get('tp', 0))}, per micro-batch {_bytes(eg.get('dp', 0))}, once "
                 f"per step {_bytes(eg.get('step', 0))})")
    m = p.memory
    if compiled and m.get("analytic_comm_bytes"):
        ab = m["analytic_comm_bytes"]
        L.append("  (analytic model of the same layout: " + ", ".join(
            f"{lv} {_bytes(ab[lv])}" for lv in MESH_AXES)
            + f"; step {_ms(m['analytic_step_time'])})")
    return L


def _time_lines(p, topo) -> list:
    t = p.time
    L = ["predicted step time:",
         f"  compute {_ms(t['compute'])} (of which pipeline bubble {_ms(t['bubble'])}) + "
         f"(de)quantization {_ms(t['quant'])} + TP collectives {_ms(t['tp'])} + DP "
         f"collectives exposed {_ms(t['dp_exposed'])} (of {_ms(t['dp'])}) + once-per-step "
         f"collectives {_ms(t['step_comm'])} + optimizer {_ms(t['optimizer'])}"
         + (f" (pipeline p2p {_ms(t['p2p'])} within TP)" if t.get("p2p") else ""),
         "  critical path: " + critical_path_line(p),
         "  " + floor_text(p) + "\n  " + dp_latency_text(p),
         f"  = {_ms(t['total'])} per step  (DP collectives fully overlapped: "
         f"{_ms(t['total_overlapped'])})",
         f"  {p.tokens_per_s:,.0f} tokens/s, {flop_rate(p.tflops_per_device * 1e12)} per "
         f"device, MFU {p.mfu:.1%} of {flop_rate(p.peak_flops)}",
         "assumptions:"]
    return L + [f"  - {line}" for line in p.assumptions.describe()]


def report_text(dr, cfg, topo, compiled: bool) -> str:
    """The human report: `dr` is a dry run when `compiled`, else an analytic prediction."""
    p = dr.prediction if compiled else dr
    L = _header_lines(p, cfg, topo) + _compile_lines(dr, compiled)
    L += [""] + _memory_lines(p, dr, topo, compiled)
    L += ["", _flops_line(p, dr, compiled)] + _comm_lines(p, topo, compiled)
    L += [""] + _time_lines(p, topo)
    return "\n".join(L)


def critical_path_line(p) -> str:
    """The critical path; its once-per-step part split into what it holds, since the DP
    collectives exposed in the first forward and the last backward (all of them with one
    micro-batch) count there, not as exposed DP."""
    cp, t = critical_path(p), p.time
    once = t.get("dp_once_exposed", 0.0)
    return ", ".join(f"{k} {_ms(v)} ({v / p.step_time:.0%})" for k, v in cp.items()) + (
        f" = DP exposed in the first forward and last backward {_ms(once)} + step-end "
        f"collectives {_ms(t['step_comm'])} + optimizer {_ms(t['optimizer'])}")


def check_args(args) -> None:
    """Numbers the planner would otherwise divide by or extrapolate from (a negative node
    count gives a negative step time): one line naming the flag."""
    from boost_jax.errors import UserError

    for flag, value, least in (("--nodes", args.nodes, 1), ("--cpu-devices", args.cpu_devices, 1),
                               ("--top", args.top, 1), ("--compile-top", args.compile_top, 0)):
        if value is not None and value < least:
            raise UserError(f"{flag} {value} must be >= {least}")
    if args.gpu_compile and args.no_compile:
        raise UserError("--gpu-compile compiles for the GPU: drop --no-compile")
    if args.gpu_compile and args.search and not args.compile_top:
        raise UserError("--search --gpu-compile compiles the best layouts for the GPU: add "
                        "--compile-top K (e.g. 3)")
    if args.layers not in ("auto", "full") and not (args.layers.isascii() and
                                                    args.layers.isdigit() and
                                                    int(args.layers) >= 1):
        raise UserError(f"--layers {args.layers!r} must be auto, full or a number >= 1")
    _check_flag_needs(args)


def _check_flag_needs(args) -> None:
    """A flag that would do nothing in this command is refused, not silently dropped."""
    from boost_jax.errors import UserError

    compiles = not args.no_compile and (not args.search or args.compile_top > 0)
    one_layout = not (args.no_compile or args.search or args.gpu_compile)
    needs = (("--compile-top", args.compile_top > 0, args.search and not args.no_compile,
              "--search without --no-compile"),
             ("--top", args.top is not None, args.search and not args.json,
              "--search without --json"),
             ("--cpu-devices", args.cpu_devices is not None, compiles,
              "a compile (drop --no-compile; with --search, --compile-top K)"),
             ("--layers", args.layers != "auto", one_layout,
              "one layout compiled on CPUs (no --no-compile, --search or --gpu-compile)"),
             ("--force", args.force, args.emit_config is not None, "--emit-config FILE"),
             ("--allow-demo-data", args.allow_demo_data, args.emit_config is not None,
              "--emit-config FILE"))
    for flag, given, ok, what in needs:
        if given and not ok:
            raise UserError(f"{flag} does nothing here: it needs {what}; drop it or add that")


def run_gpu_compile(args, cfg, topo, full: dict, a, command: str) -> int:
    """--gpu-compile: the analytic prediction, then the GPU program next to it; --emit-config
    writes the layout when the GPU program compiles and its memory fits."""
    from boost_jax.analysis.flops import param_count
    from boost_jax.errors import UserError
    from boost_jax.plan import dryrun, gpu_compile
    from boost_jax.plan.costmodel import predict

    gpu_compile.gpu_target.target_name(topo)  # a profile without a GPU target fails first
    _check_layout(cfg, full)
    try:
        pred = predict(cfg, topo, full, a)
    except ValueError as e:
        raise UserError(str(e)) from None
    pred.memory["params_total"] = param_count(cfg.model)
    failure = None
    try:
        g = gpu_compile.gpu_compile(cfg, topo, full, a, args.cpu_devices or 512)
    except dryrun.StepCompileError as e:
        failure, g = str(e), None
        print(f"error: the training step does not compile for the GPU ({failure})",
              file=sys.stderr)
    judged = gpu_compile.judged(pred, g, a, topo.hbm_bytes) if g else pred
    if args.json:
        d = pred.to_dict()
        d["gpu_compile"] = g.to_dict() if g else {"error": failure}
        if g:  # the verdict that --emit-config acts on
            d["gpu_compile"].update(fits=judged.memory["fits"], limit=judged.memory["limit"])
        print(json_dumps(d, indent=1, default=str))
    else:
        text = report_text(pred, cfg, topo, compiled=False).replace(
            "not compiled: analytic model only (--no-compile)",
            "analytic model (the CPU dry run is skipped with --gpu-compile); the GPU program "
            "follows")
        print(text + "\n\n" + (gpu_compile.report_text(g) + "\n" + _gpu_verdict(judged)
                                 if g else f"GPU program: NOT COMPILED ({failure})"))
    if args.emit_config:
        _emit_layout(args, judged, cfg, topo, failure, command)
    return 1 if failure else 0


def _gpu_verdict(judged) -> str:
    """The fit by the GPU program's own buffers, which decides over the analytic one above."""
    m = judged.memory
    verdict = "FITS" if m["fits"] else "DOES NOT FIT"
    return (f"  fit by the GPU program: {m['total'] / 2**30:.2f} GiB of {m['limit'] / 2**30:.2f} "
            f"GiB usable (hbm_usable; its buffers as allocated: no margin) -> {verdict}; this, "
            "not the analytic total, decides --emit-config")


def _set_compile_devices(args, full: dict) -> None:
    """The simulated CPU device count, before JAX starts: only when the step is compiled."""
    total = math.prod(full.values())
    compile_needed = not args.no_compile and not (args.search and not args.compile_top) \
        and not args.gpu_compile
    if compile_needed:
        n = args.cpu_devices or min(total, 512)
        from boost_jax.mesh import set_cpu_devices

        set_cpu_devices(min(n, max(total, 1)) if args.cpu_devices is None else n,
                        compile_only=True)


def _load_plan_inputs(args):
    """Checks, then (cfg with the planned mesh, topology, full mesh sizes, assumptions).
    The import order matters: the GPU env and the CPU device count are set before JAX starts."""
    from boost_jax.config import load_config
    from boost_jax.mesh import get_topology

    check_args(args)
    if args.emit_config is not None:  # before any work: the file may not be written at all
        check_emit_target(args.emit_config, args.config, args.force)
    overrides = args.overrides
    if args.search:  # the search sets the micro-batches and stages: the config's may not divide
        overrides = [*overrides, "train.micro_batches=1", "parallel.pp_stages=1",
                     "parallel.pp_virtual=1"]
    cfg = load_config(args.config, overrides)  # neither imports JAX
    if args.emit_config is not None:  # nor what the planned run will read
        from boost_jax.checkpoints.run_config import run_inputs
        from boost_jax.safe_write import refuse_inputs

        refuse_inputs(args.emit_config, run_inputs(cfg), f"--emit-config {args.emit_config!r}",
                      "choose another FILE")
    topo = get_topology(cfg.mesh.topology if args.topology is None else args.topology)
    if args.gpu_compile:  # before JAX starts; a profile without a GPU target says so first
        from boost_jax.plan.gpu_target import prepare_env, target_name

        target_name(topo)
        prepare_env()
    from boost_jax.plan import dryrun

    full = dryrun.full_sizes(cfg, topo, args.nodes if args.nodes is not None else cfg.mesh.nodes)
    if args.emit_config:  # before any work: a cluster job on the demo corpus is a mistake
        from boost_jax.data.sources import refuse_demo_corpus

        refuse_demo_corpus(cfg, _hosts(full), topo.name, args.allow_demo_data)
    _set_compile_devices(args, full)
    import dataclasses

    from boost_jax.plan.costmodel import Assumptions

    a = Assumptions(attention=args.attention, overlap=args.overlap)
    # the kernel planned is the kernel trained: an --emit-config carries it
    model = cfg.model if args.attention == "auto" else dataclasses.replace(
        cfg.model, attention=args.attention)
    cfg = dataclasses.replace(cfg, model=model, mesh=dataclasses.replace(
        cfg.mesh, topology=topo.name, shape=dryrun.mesh_hosts(full), nodes=None))
    return cfg, topo, full, a


def run_search(args, cfg, topo, full: dict, a, command: str) -> int:
    """--search: rank the layouts; --emit-config writes the best that fits."""
    from boost_jax.errors import UserError
    from boost_jax.plan.search import print_search, search

    if args.gpu_compile:
        from boost_jax.plan.gpu_target import target_name

        target_name(topo)  # a profile without a GPU target fails before the search
    res = search(cfg, topo, full, a, compile_top=args.compile_top,
                 max_devices=args.cpu_devices or 512, gpu=args.gpu_compile)
    if args.json:
        print(json_dumps(res.to_dict(), indent=1, default=str))
    else:
        print(print_search(res, cfg, topo, full, top=15 if args.top is None else args.top))
    if args.emit_config:
        if not res.fitting:
            raise UserError(f"no layout fits, so --emit-config {args.emit_config!r} was "
                            "not written; try more nodes or a smaller global batch")
        best = res.fitting[0]
        emit_config(args.emit_config, best.config(cfg), best.prediction, topo, command,
                    args.force, best.secondary)
    return 0


def _check_layout(cfg, full: dict) -> None:
    """What train.py checks of the layout (parallel.check: pipeline split, TP cut), also for
    the analytic model alone: --no-compile must not pass, or emit, a layout training refuses."""
    from boost_jax.plan.costmodel import SizesMesh
    from boost_jax.sharding import parallel

    parallel.check(cfg, SizesMesh(full))


def _dry_run_or_predict(args, cfg, topo, full: dict, a):
    """(out, compiled, failure): the dry run when compiling, else (or when the step fails
    to compile) the analytic prediction."""
    from boost_jax.analysis.flops import param_count
    from boost_jax.errors import UserError
    from boost_jax.plan import dryrun
    from boost_jax.plan.costmodel import predict

    compiled, failure = not args.no_compile, None
    _check_layout(cfg, full)
    try:
        if compiled:
            import jax

            try:
                out = dryrun.dry_run(cfg, topo, None, jax.device_count(), a,
                                     full_layers_max=10**9 if args.layers == "full" else
                                     (4 if args.layers == "auto" else int(args.layers)),
                                     keep_report=True)
                out.prediction.memory["params_total"] = param_count(cfg.model)
            except dryrun.StepCompileError as e:
                failure = str(e)
                compiled = False
        if not compiled:
            out = predict(cfg, topo, full, a)
            out.memory["params_total"] = param_count(cfg.model)
    except ValueError as e:
        raise UserError(str(e)) from None
    return out, compiled, failure


def _print_layout(args, out, cfg, topo, compiled: bool, failure: Optional[str],
                  secondary=None) -> None:
    if failure:
        print(f"error: the training step does not compile for this layout ({failure}); "
              "the analytic prediction follows, but train.py would fail the same way",
              file=sys.stderr)
        out.notes.insert(0, f"compile failed: {failure}")
    if args.json:
        d = out.to_dict()
        if failure:
            d["compile_error"] = failure
        d["secondary"] = secondary.to_dict() if secondary else None
        print(json_dumps(d, indent=1, default=str))
    else:
        text = report_text(out, cfg, topo, compiled=compiled)
        if failure:
            text = text.replace("not compiled: analytic model only (--no-compile)",
                                f"NOT COMPILED: the step failed to compile ({failure}); "
                                "analytic model only")
        print(text)


def _emit_layout(args, pred, cfg, topo, failure: Optional[str], command: str,
                 secondary=None) -> None:
    """--emit-config for one layout: written only when it compiles and fits."""
    from boost_jax.errors import UserError

    if failure or not pred.memory["fits"]:
        why = "the step does not compile" if failure else (
            f"it needs {pred.memory['total'] / 2**30:.1f} GiB per device, more than "
            f"{pred.memory.get('limit', pred.assumptions.hbm_usable * topo.hbm_bytes) / 2**30:.1f}"
            f" GiB that fit ({pred.assumptions.hbm_usable:.0%} of {topo.hbm_bytes / 2**30:.0f} "
            "GiB, less the model's safety margin)")
        raise UserError(f"this layout does not fit ({why}), so --emit-config "
                        f"{args.emit_config!r} was not written; --search lists layouts "
                        "that fit")
    emit_config(args.emit_config, cfg, pred, topo, command, args.force, secondary)


def _secondary(cfg, topo, full: dict, out, compiled: bool, a):
    """The secondary dtype's line (plan/secondary.py), also among the prediction's notes."""
    from boost_jax.errors import UserError
    from boost_jax.plan.secondary import explain

    try:
        choice = explain(cfg, topo, full, a)
    except ValueError as e:
        raise UserError(str(e)) from None
    if choice:
        (out.prediction if compiled else out).notes.append(choice.line)
    return choice


def run_layout(args, cfg, topo, full: dict, a, command: str) -> int:
    """One layout: dry run (or analytic model), report, maybe --emit-config."""
    out, compiled, failure = _dry_run_or_predict(args, cfg, topo, full, a)
    sec = _secondary(cfg, topo, full, out, compiled, a)
    _print_layout(args, out, cfg, topo, compiled, failure, sec)
    if args.emit_config:
        _emit_layout(args, out.prediction if compiled else out, cfg, topo, failure, command,
                     sec)
    return 1 if failure else 0


def run_plan(args, command: str) -> int:
    """The planner for parsed `args`; `command` is the command line --emit-config records."""
    cfg, topo, full, a = _load_plan_inputs(args)
    if args.gpu_compile and not args.search:
        return run_gpu_compile(args, cfg, topo, full, a, command)
    if args.search:
        return run_search(args, cfg, topo, full, a, command)
    return run_layout(args, cfg, topo, full, a, command)


def main(argv: Optional[Sequence[str]] = None) -> int:
    from boost_jax.errors import cli_main

    argv = list(sys.argv[1:] if argv is None else argv)
    command = "python -m boost_jax.plan " + " ".join(map(shell_word, argv))
    args = build_parser().parse(argv)
    return cli_main(run_plan)(args, command)


if __name__ == "__main__":
    sys.exit(main())
