"""What a scheduled GPU program does: its kernels, and the compute each async collective overlaps.

In a scheduled module (`is_scheduled=true`, what compiled.as_text() prints for a GPU) the
instructions of each computation are listed in execution order. An async collective is a
start/done pair (all-gather-start … all-gather-done; reduce-scatter and all-to-all as
async-start … async-done around a wrapped computation); the kernels listed between the two run
while the collective is in flight. A collective with no kernel between them, or one XLA marked
synchronous (`"is_sync":true`: nothing to overlap it with), sits on the critical path.

Kernels are the instructions a GPU launches: fusions, custom calls (cuBLAS, cuDNN, Triton)
and the unfused ops, not the bookkeeping (parameters, tuples, bitcasts, control flow).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

from boost_jax.analysis import hlo as H

NOT_KERNELS = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "while", "call",
               "conditional", "partition-id", "replica-id", "after-all", "opt-barrier",
               "add-dependency", "async-done", "copy-done", "send-done", "recv-done"}
COLLECTIVE_KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all",
                    "collective-permute", "collective-broadcast", "ragged-all-to-all")


def collective_kind(comp: H.Computation, ins: H.Instr, module: H.Module) -> Optional[str]:
    """The collective an instruction starts (or is), else None."""
    op = ins.opcode
    if op.endswith("-done"):
        return None
    base = op[: -len("-start")] if op.endswith("-start") else op
    if base in COLLECTIVE_KINDS:
        return base
    if op == "async-start":
        for c in ins.called():
            inner = module.computations.get(c)
            for i in (inner.instrs.values() if inner else ()):
                if i.opcode in COLLECTIVE_KINDS:
                    return i.opcode
    return None


def is_kernel(comp, ins: H.Instr, module: H.Module) -> bool:
    """A compute kernel: launched on the GPU and not a collective."""
    return (ins.opcode not in NOT_KERNELS and not ins.opcode.endswith("-done")
            and collective_kind(comp, ins, module) is None)


@dataclass
class AsyncCollective:
    name: str  # the start instruction (for async-start: the wrapped collective's name)
    kind: str
    computation: str
    sync: bool  # XLA runs it on the compute stream (is_sync) or it is not async at all
    overlapped: list = field(default_factory=list)  # kernels scheduled between start and done
    gemms: int = 0  # of those, matrix multiplications
    overlap_flops: float = 0.0  # dot FLOPs of the overlapped kernels (one execution)

    @property
    def exposed(self) -> bool:
        return self.sync or not self.overlapped


def _sync(ins: H.Instr) -> bool:
    return '"is_sync":true' in ins.attrs


def _done_index(order: list, i: int) -> Optional[int]:
    name = order[i].name
    for j in range(i + 1, len(order)):
        if order[j].opcode.endswith("-done") and name in order[j].operands:
            return j
    return None


def dot_flops(module: H.Module, comp: H.Computation, ins: H.Instr, depth: int = 0) -> float:
    """FLOPs of the dots in one kernel (2·|result|·|contracted|), fusions followed down."""
    if ins.opcode == "dot" and ins.shape and ins.operands:
        lhs = comp.instrs.get(ins.operands[0])
        idx = [int(x) for x in (ins.attr("lhs_contracting_dims") or "{}").strip("{}").split(",")
               if x.strip()]
        k = math.prod(lhs.shape[0].dims[i] for i in idx) if lhs is not None and lhs.shape else 1
        return 2.0 * ins.shape[0].elements * k
    if ins.opcode != "fusion" or depth > 8:
        return 0.0
    total = 0.0
    for c in ins.called():
        inner = module.computations.get(c)
        for i in (inner.instrs.values() if inner else ()):
            total += dot_flops(module, inner, i, depth + 1)
    return total


def async_collectives(module: H.Module) -> list[AsyncCollective]:
    """Every collective of every computation, with the kernels between its start and done."""
    out = []
    for comp in module.computations.values():
        order = list(comp.instrs.values())
        for i, ins in enumerate(order):
            kind = collective_kind(comp, ins, module)
            if kind is None:
                continue
            name = ins.name
            if ins.opcode == "async-start":  # named like the wrapped collective (comm.py does)
                inner = module.computations.get(ins.called()[0]) if ins.called() else None
                name = next((x.name for x in (inner.instrs.values() if inner else ())
                             if x.opcode == kind), name)
            j = _done_index(order, i) if ins.opcode.endswith("start") else None
            ac = AsyncCollective(name, kind, comp.name, j is None or _sync(ins))
            for k in order[i + 1: j] if j is not None else ():
                if is_kernel(comp, k, module):
                    ac.overlapped.append(k.name)
                    f = dot_flops(module, comp, k)
                    ac.gemms += f > 0
                    ac.overlap_flops += f
            out.append(ac)
    return out


def max_in_flight(module: H.Module) -> int:
    """The most collectives started and not yet done at one point of any computation's order.
    XLA's latency-hiding scheduler keeps one in flight unless
    xla_gpu_experimental_parallel_collective_overlap_limit is raised (default 1, which the
    launcher keeps): the cost model's overlap runs the collectives one after another."""
    most = 0
    for comp in module.computations.values():
        live = set()
        for ins in comp.instrs.values():
            if ins.opcode.endswith("-start") and collective_kind(comp, ins, module):
                live.add(ins.name)
            elif ins.opcode.endswith("-done"):
                live.difference_update(ins.operands)
            most = max(most, len(live))
    return most


def kernel_launches(module: H.Module) -> tuple[float, bool]:
    """(kernels launched per execution of the program, every loop trip count known)."""
    total, known = 0.0, True
    for comp, mult, _ in H.walk(module):
        if mult is None:
            known, mult = False, 1
        total += mult * sum(is_kernel(comp, i, module) for i in comp.instrs.values())
    return total, known


def kernel_mix(module: H.Module) -> dict:
    """Kernels per step by sort: gemm (dots), custom-call target, fusion, other opcodes."""
    mix: dict[str, float] = {}
    for comp, mult, _ in H.walk(module):
        for ins in comp.instrs.values():
            if not is_kernel(comp, ins, module):
                continue
            if ins.opcode == "custom-call":
                key = (ins.attr("custom_call_target") or "custom-call").strip('"')
            elif dot_flops(module, comp, ins) > 0:
                key = "gemm"
            else:
                key = ins.opcode
            mix[key] = mix.get(key, 0.0) + (mult or 1)
    return mix
