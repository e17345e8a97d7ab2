"""Communication analyzer: collectives, topology levels and ring-cost bytes from compiled HLO.

Wall-clock on simulated CPU devices says nothing about a cluster, so claims about traffic are
checked on the compiled program. Each collective's replica groups (partition ids = index into
`mesh.devices.flat`) are mapped to mesh coordinates and classified as `pair`, `node` or
`global`; bytes are ring-algorithm bytes sent per device, multiplied by enclosing loop trip
counts so totals are per optimizer step.

Bytes are what a GPU would move: boost_jax.analysis.cpu_lowering undoes two XLA:CPU artifacts
(bf16 reductions run in fp32; reduce-scatter lowered as all-reduce + dynamic-slice), and
`raw_bytes_per_step` / `per_level(raw=True)` keep the bytes read off the CPU program.

    python -m boost_jax.analysis.comm --config configs/demo.yaml parallel.plan=zero3 --cpu-devices 8
"""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import numpy as np

from boost_jax.analysis import hlo as H
from boost_jax.analysis.cpu_lowering import lowered_reduce_scatter, undo_cpu_artifacts
from boost_jax.cli import json_dumps
from boost_jax.mesh import level_of
from boost_jax.names import MESH_AXES
from boost_jax.sharding.step_collectives import ring_bytes

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute",
         "collective-broadcast")


@dataclass
class Collective:
    name: str
    kind: str  # what it does; a CPU all-reduce+dynamic-slice is a "reduce-scatter"
    opcode: str  # as printed in the HLO (e.g. "all-reduce", "all-gather-start")
    shapes: list[str]  # result leaves, e.g. ["f32[4,16]"] (tuple collectives list several)
    dtypes: list[str]
    result_bytes: float  # bytes of the result on one device (all tuple operands)
    payload_bytes: float  # P of the ring formula (full result; input for reduce-scatter), as a
    # GPU would move it (a bf16 reduction XLA:CPU ran in fp32 counts at 16 bits); shapes, dtypes
    # and result_bytes are as compiled
    groups: list[list[int]]  # partition ids; collective-permute: its (source, target) pairs
    group_size: int
    level: str  # pair | node | global | none (groups of one) | '+'-joined axes on other meshes
    axes: tuple[str, ...]  # mesh axes the group members differ in
    computation: str
    in_loop: bool
    loops: list[str] = field(default_factory=list)  # enclosing while ops, outermost first
    trip_count: Optional[int] = 1  # times executed per call of the program; None: unknown
    bytes_per_call: float = 0.0  # ring bytes sent per device by one execution
    bytes_per_step: float = 0.0  # × trip_count (× 1 when unknown)
    lowered_as: Optional[str] = None
    reduction: Optional[str] = None  # all-reduce/reduce-scatter combiner root (add, maximum…)
    raw_bytes_per_step: float = 0.0  # as read off the CPU program, before the CPU corrections
    cpu_fixes: tuple[str, ...] = ()  # XLA:CPU artifacts undone: "fp32-promoted", "sliced"

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["axes"] = list(self.axes)
        if len(self.groups) > 64:  # keep JSON readable for 384-device plans
            d["groups"] = self.groups[:4] + [["..."]]
        return d


def egress_bytes(kind: str, n: int, payload: float, k: int, groups: int) -> float:
    """Bytes leaving one host per call of a collective whose groups span hosts: k members of a
    group on the host, `groups` groups sharing it. A ring with contiguous members leaves the
    host once (one device's ring bytes per group); an all-to-all sends k·(n−k)/n·P of a group
    off the host; a point-to-point send moves every member's buffer."""
    if n <= 1:
        return 0.0
    if kind == "all-to-all":
        per_group = k * (n - k) / n * payload
    elif kind in ("collective-permute", "collective-broadcast"):
        per_group = k * payload
    else:
        per_group = ring_bytes(kind, n, payload)
    return groups * per_group


def host_egress(c: "Collective", mesh_shape: dict) -> float:
    """Bytes per step that `c` sends out of one host (0 for groups inside a host)."""
    if c.level != "global" or c.group_size <= 1:
        return 0.0
    k = 1
    for a in c.axes:
        if a in ("pair", "node"):
            k *= int(mesh_shape.get(a, 1))
    on_host = int(mesh_shape.get("pair", 1)) * int(mesh_shape.get("node", 1))
    return egress_bytes(c.kind, c.group_size, c.payload_bytes, k, max(on_host // k, 1)) * (
        c.trip_count or 1)


def classify_group(members: Sequence[int], mesh) -> tuple[str, tuple[str, ...]]:
    """Topology level of one group of partition ids (row-major index into mesh.devices)."""
    shape = mesh.devices.shape
    coords = np.array(np.unravel_index(np.asarray(members, dtype=np.int64), shape)).T
    varying = tuple(a for i, a in enumerate(mesh.axis_names)
                    if len(set(coords[:, i].tolist())) > 1)
    if not varying:
        return "none", ()
    names = set(mesh.axis_names)
    if not set(MESH_AXES) <= names:
        return "+".join(varying), varying
    return level_of(varying), varying


def _worst(levels: list[str]) -> str:
    order = {"none": 0, "pair": 1, "node": 2, "global": 3}
    return max(levels, key=lambda lv: order.get(lv, 4)) if levels else "none"


def extract_collectives(module: H.Module, mesh, cpu: bool = True) -> list[Collective]:
    """Every collective of `module` with its groups, level and bytes per step. cpu=False reads a
    GPU program as compiled (no XLA:CPU artifacts to undo)."""
    n_dev = int(np.prod(mesh.devices.shape))
    if module.num_partitions * module.num_replicas != n_dev:
        raise ValueError(f"program has {module.num_partitions} partitions x "
                         f"{module.num_replicas} replicas but the mesh has {n_dev} devices")
    out = []
    for comp, mult, loops in H.walk(module):
        for ins in comp.instrs.values():
            op = ins.opcode
            kind = op[: -len("-start")] if op.endswith("-start") else op
            if kind not in KINDS:
                continue
            shape = H.result_shape(comp, ins, kind)
            res_bytes = float(sum(a.nbytes for a in shape))
            if kind == "collective-permute":
                groups = [list(p) for p in H.source_target_pairs(ins)]
                real = [g for g in groups if g[0] != g[1]]
                lv = [classify_group(g, mesh) for g in real]
                n = 2 if real else 1
            else:
                groups = H.parse_replica_groups(H.replica_groups_text(ins), n_dev)
                lv = [classify_group(g, mesh) for g in groups]
                n = max(len(g) for g in groups)
            level = _worst([lvl for lvl, _ in lv])
            axes = tuple(a for a in mesh.axis_names if any(a in ax for _, ax in lv))
            lowered = None
            payload = res_bytes
            sliced = lowered_reduce_scatter(module, comp, ins, n) if kind == "all-reduce" \
                and cpu else None
            if sliced is not None:  # payload stays the all-reduce result (= the RS input)
                kind, lowered, shape = "reduce-scatter", "all-reduce+dynamic-slice", sliced
                res_bytes = float(sum(a.nbytes for a in shape))
            elif kind == "reduce-scatter":
                payload = res_bytes * n  # formula uses the un-scattered input
            red = None
            if ins.attr("to_apply"):
                rc = module.computations.get(ins.attr("to_apply").lstrip("%"))
                roots = [i.opcode for i in rc.instrs.values() if i.is_root] if rc else []
                red = roots[0] if roots else None
            per_call = ring_bytes(kind, n, payload)
            # raw: what the CPU program moves, the all-reduce it lowered a reduce-scatter to
            raw_per_call = ring_bytes("all-reduce", n, payload) if lowered else per_call
            kind, lowered, payload, factor, fixes = undo_cpu_artifacts(
                module, comp, ins, kind, lowered, payload, n) if cpu else \
                (kind, lowered, payload, 1.0, ())
            per_call *= factor
            out.append(Collective(
                name=ins.name, kind=kind, opcode=op, shapes=[str(a) for a in shape],
                dtypes=[a.dtype for a in shape], result_bytes=res_bytes, payload_bytes=payload,
                groups=groups, group_size=n, level=level, axes=axes, computation=comp.name,
                in_loop=bool(loops), loops=list(loops), trip_count=mult,
                bytes_per_call=per_call, bytes_per_step=per_call * (mult or 1),
                lowered_as=lowered, reduction=red,
                raw_bytes_per_step=raw_per_call * (mult or 1), cpu_fixes=fixes))
    return out


# --------------------------------------------------------------------------- memory


MEMORY_KEYS = ("argument", "output", "alias", "temp", "generated_code", "total", "peak")


def memory_report(compiled) -> Optional[dict]:
    """Per-device bytes from compiled.memory_analysis(); total = argument + output + temp − alias."""
    try:
        m = compiled.memory_analysis()
    except Exception:  # some backends don't implement it
        return None
    if m is None:
        return None
    d = {k: int(getattr(m, f"{k}_size_in_bytes", 0) or 0)
         for k in ("argument", "output", "alias", "temp", "generated_code")}
    d["total"] = d["argument"] + d["output"] + d["temp"] - d["alias"]
    d["peak"] = int(getattr(m, "peak_memory_in_bytes", 0) or 0) or d["total"]
    return d


def compare_memory(measured: dict, predicted: dict, rtol: float = 0.25,
                   combine: Optional[dict] = None) -> dict:
    """Compare a formula's predicted bytes with memory_report(), per key.

    `predicted` keys are MEMORY_KEYS; role keys from a placement plan (weights, adam, ...)
    are summed into a measured key with `combine={"argument": ["weights", "master", "adam"]}`.
    Any other key is an error, so a typo cannot silently skip a check."""
    pred = {k: v for k, v in predicted.items() if k in MEMORY_KEYS}
    used = set(pred)
    for key, roles in (combine or {}).items():
        if key not in MEMORY_KEYS:
            raise ValueError(f"combine target {key!r} is not one of {list(MEMORY_KEYS)}")
        missing = [r for r in roles if r not in predicted]
        if missing:
            raise ValueError(f"combine roles {missing} are not in the prediction")
        pred[key] = sum(float(predicted[r]) for r in roles)
        used |= set(roles)
    bad = sorted(set(predicted) - used)
    if bad:
        raise ValueError(f"unknown memory keys {bad}; use {list(MEMORY_KEYS)} or combine=")
    rows = {}
    for k, p in pred.items():
        m = measured.get(k)
        ratio = (m / p) if (m is not None and p) else None
        rows[k] = {"measured": m, "predicted": p, "ratio": ratio,
                   "ok": ratio is not None and abs(ratio - 1.0) <= rtol}
    return rows


# --------------------------------------------------------------------------- report


def _fmt_bytes(b: float) -> str:
    for unit, f in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(b) >= f:
            return f"{b / f:.2f} {unit}"
    return f"{b:.0f} B"


def _match(value, want) -> bool:
    if want is None:
        return True
    return value in want if isinstance(want, (tuple, list, set, frozenset)) else value == want


@dataclass
class CommReport:
    collectives: list[Collective]
    mesh_shape: dict[str, int]
    memory: Optional[dict] = None
    flops: Optional[float] = None  # dots × loop trip counts (hlo.matmul_flops)
    flops_trips_known: bool = True  # False: some loop's trip count unknown, counted once
    xla_flops: Optional[float] = None  # cost_analysis(): a loop body counted once
    hlo_text: str = field(default="", repr=False)

    def filter(self, kind=None, level=None, in_loop=None, computation=None) -> list[Collective]:
        return [c for c in self.collectives if _match(c.kind, kind) and _match(c.level, level)
                and _match(c.in_loop, in_loop) and _match(c.computation, computation)]

    def per_level(self, raw: bool = False) -> dict[str, dict]:
        """level → {bytes (per device per step), count (ops in the HLO), calls (per step)}.

        raw: bytes as read off the CPU program, without undoing the XLA:CPU artifacts."""
        out = {lv: {"bytes": 0.0, "count": 0, "calls": 0} for lv in MESH_AXES}
        for c in self.collectives:
            row = out.setdefault(c.level, {"bytes": 0.0, "count": 0, "calls": 0})
            row["bytes"] += c.raw_bytes_per_step if raw else c.bytes_per_step
            row["count"] += 1
            row["calls"] += c.trip_count or 1
        return out

    @property
    def total_bytes(self) -> float:
        return sum(c.bytes_per_step for c in self.collectives)

    @property
    def node_egress(self) -> float:
        """Bytes leaving one host per step (rings leave a host once per group)."""
        return sum(host_egress(c, self.mesh_shape) for c in self.collectives)

    def to_dict(self) -> dict:
        return {"mesh": dict(self.mesh_shape), "per_level": self.per_level(),
                "total_bytes": self.total_bytes, "node_egress_bytes": self.node_egress,
                "memory": self.memory, "flops": self.flops,
                "flops_trips_known": self.flops_trips_known,
                "xla_cost_analysis_flops": self.xla_flops,
                "collectives": [c.to_dict() for c in self.collectives]}

    def table(self) -> str:
        hdr = f"{'kind':<19}{'level':<7}{'n':>3}  {'loop':<9}{'shape':<28}{'payload':>11}" \
              f"{'bytes/step':>12}  computation"
        lines = [hdr, "-" * len(hdr)]
        for c in sorted(self.collectives, key=lambda c: (-c.bytes_per_step, c.name)):
            loop = f"x{c.trip_count if c.trip_count is not None else '?'}" if c.in_loop else "-"
            shape = ",".join(c.shapes)
            shape = shape if len(shape) <= 27 else shape[:24] + "..."
            kind = c.kind + ("*" if c.lowered_as else "") + ("†" if c.cpu_fixes else "")
            lines.append(f"{kind:<19}{c.level:<7}{c.group_size:>3}  {loop:<9}{shape:<28}"
                         f"{_fmt_bytes(c.payload_bytes):>11}{_fmt_bytes(c.bytes_per_step):>12}"
                         f"  {c.computation}")
        if any(c.lowered_as for c in self.collectives):
            lines.append("* lowered by XLA as all-reduce + dynamic-slice")
        if any(c.cpu_fixes for c in self.collectives):
            lines.append("† XLA:CPU artifact undone (bf16 reduction run in fp32; reduce-scatter "
                         "behind a convert): bytes as a GPU would move")
        lines.append("")
        mesh = " x ".join(f"{k}={v}" for k, v in self.mesh_shape.items())
        lines.append(f"per level (bytes sent per device per step, mesh {mesh}):")
        for lv, row in self.per_level().items():
            lines.append(f"  {lv:<7}{_fmt_bytes(row['bytes']):>12}  {row['count']} ops, "
                         f"{row['calls']} calls/step")
        lines.append(f"  leaving each node: {_fmt_bytes(self.node_egress)} per step (a ring "
                     "leaves a node once per group)")
        if self.memory:
            m = self.memory
            # total, not XLA's peak: on CPU its peak leaves the temporaries out
            lines.append("memory per device: " + ", ".join(
                f"{k} {_fmt_bytes(m[k])}" for k in ("argument", "output", "temp", "alias",
                                                   "generated_code", "total")))
        if self.flops:
            how = ("dots x loop trip counts" if self.flops_trips_known else
                   "dots x loop trip counts, a loop of unknown count taken once")
            xla = f"; XLA's cost_analysis, a loop body once: {self.xla_flops:.3e}" \
                if self.xla_flops else ""
            lines.append(f"matmul flops per device per step: {self.flops:.3e} ({how}{xla})")
        return "\n".join(lines)


def analyze_hlo_text(text: str, mesh, cpu: bool = True) -> CommReport:
    module = H.parse_module(text)
    flops, known = H.matmul_flops(module)
    return CommReport(extract_collectives(module, mesh, cpu), dict(mesh.shape), flops=flops,
                      flops_trips_known=known, hlo_text=text)


def analyze_compiled(compiled, mesh, cpu: bool = True) -> CommReport:
    report = analyze_hlo_text(compiled.as_text(), mesh, cpu)
    report.memory = memory_report(compiled)
    try:
        ca = compiled.cost_analysis()
        ca = ca[0] if isinstance(ca, (list, tuple)) else ca
        report.xla_flops = float(ca["flops"]) if ca and ca.get("flops") is not None else None
    except Exception:
        pass
    return report


def compile_fn(fn, args: Sequence[Any], mesh, **jit_kwargs):
    """Lower and compile `fn` (plain or already jitted) on abstract or real args."""
    import jax

    with jax.set_mesh(mesh):
        if hasattr(fn, "lower") and not jit_kwargs:
            lowered = fn.lower(*args)
        else:
            lowered = jax.jit(fn, **jit_kwargs).lower(*args)
        return lowered.compile()


def analyze(fn, args: Sequence[Any], mesh, **jit_kwargs) -> CommReport:
    """Lower + compile `fn(*args)` (jax.ShapeDtypeStruct with sharding is fine) and analyze."""
    return analyze_compiled(compile_fn(fn, args, mesh, **jit_kwargs), mesh)


# --------------------------------------------------------------------------- CLI


def _compile_step(built, mesh):
    """Accept what build_step_for_analysis returns: Compiled, Lowered or (fn, args[, kw])."""
    if hasattr(built, "as_text") and hasattr(built, "memory_analysis"):
        return built
    if hasattr(built, "compile"):
        return built.compile()
    fn, args, *rest = built
    return compile_fn(fn, args, mesh, **(rest[0] if rest else {}))


def _dump(path: str, text: str, force: bool) -> None:
    from boost_jax.errors import UserError
    from boost_jax.safe_write import write_text

    try:
        write_text(path, text, force)
    except OSError as e:
        raise UserError(f"cannot write --dump-hlo {path!r} ({e.strerror}); choose another "
                        "FILE") from None


def main(argv: Optional[Sequence[str]] = None) -> int:
    from boost_jax.errors import UserError, cli_main

    from boost_jax.cli import OverrideParser

    p = OverrideParser(prog="python -m boost_jax.analysis.comm",
                       description="Collectives, topology levels and bytes of a training step, "
                                   "from its compiled HLO.")
    p.add_argument("--cpu-devices", type=int, default=None, help="simulate N CPU devices")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--dump-hlo", default=None, metavar="FILE", help="write compiled HLO text")
    p.add_argument("--force", action="store_true",
                   help="replace an existing --dump-hlo FILE (never the --config itself)")
    args = p.parse(argv)

    @cli_main
    def run() -> int:
        if args.dump_hlo is not None:  # before the compile: the file may not be written at all
            from boost_jax.safe_write import check_target

            check_target(args.dump_hlo, {"--config": args.config}, args.force,
                         f"--dump-hlo {args.dump_hlo!r}", "choose another FILE")
        if args.cpu_devices is not None:  # must precede anything that touches jax devices
            from boost_jax.mesh import set_cpu_devices

            if args.cpu_devices <= 0:
                raise UserError(f"--cpu-devices {args.cpu_devices} must be > 0")
            set_cpu_devices(args.cpu_devices, compile_only=True)
        from boost_jax.config import load_config
        from boost_jax.mesh import mesh_from_config
        from boost_jax.step.build import build_step_for_analysis

        cfg = load_config(args.config, args.overrides)
        mesh = mesh_from_config(cfg)
        compiled = _compile_step(build_step_for_analysis(cfg, mesh), mesh)
        report = analyze_compiled(compiled, mesh)
        if args.dump_hlo is not None:
            _dump(args.dump_hlo, report.hlo_text, args.force)
        if args.json:
            print(json_dumps(report.to_dict(), indent=1))
        else:
            print(report.table())
            # one network model: the planner's, which times these collectives as NCCL/RCCL
            print(f"their time on {cfg.mesh.topology}: python -m boost_jax.plan with the same "
                  "--config and overrides")
        return 0

    return run()


if __name__ == "__main__":
    sys.exit(main())
