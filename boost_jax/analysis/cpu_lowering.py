"""How XLA:CPU lowers collectives, and what a GPU would move instead.

The communication analyzer (boost_jax.analysis.comm) reads collectives off compiled CPU
programs. Two XLA:CPU artifacts would misstate the traffic of the same program on a GPU:

* XLA:CPU runs bf16 reductions in fp32: an all-reduce / reduce-scatter fed by a convert from
  bf16, its reducer a `*_promoted` computation. The payload counts at the original 16 bits.
  It moves a bf16 collective-permute (pipeline stage sends) in fp32 too: converted from 16
  bits before and straight back after; it counts at 16 bits.
  After XLA's combiner merges it with an fp32 reduction the reducer is the fp32 one: then each
  operand that is a convert (or a fusion ending in one) from a 16-bit value counts at 16 bits.
* GSPMD lowers a reduce-scatter as all-reduce + dynamic-slice of 1/n. It counts as one only if
  each slice reads the all-reduce's own result (inside a fusion: the parameter it feeds) and the
  full result has no other user. `lowered_reduce_scatter`
  recognises a slice reached through bitcasts, copies and reshapes (the analyzer's raw reading);
  `undo_cpu_artifacts` also sees one behind a convert (or bitcast-convert, get-tuple-element, a
  fusion of those): the all-reduce is a reduce-scatter, half the ring bytes. A variadic
  all-reduce with only some elements sliced keeps its kind and has those elements' share halved.
"""

from __future__ import annotations

from typing import Optional

from boost_jax.analysis import hlo as H

_PASS_THROUGH = ("bitcast", "copy", "reshape")


def _slices_to(module: H.Module, users: dict, name: str, elems: int, n: int):
    """The slice shape if every use of `name` is a dynamic-slice keeping elems/n, else None."""
    us, found = users.get(name, []), None
    if not us:
        return None
    for u in us:
        if u.opcode in _PASS_THROUGH:
            found = _slices_to(module, users, u.name, elems, n)
        elif u.opcode == "dynamic-slice":
            found = u.shape[0] if _slices(u, name, elems, n) else None
        elif u.opcode == "fusion":  # CPU fuses the slice (often with a bitcast)
            found = _fused_slice(module, u, name, elems, n)
        else:
            found = None
        if found is None:
            return None
    return found


def lowered_reduce_scatter(module, comp, ins, n) -> Optional[list[H.Array]]:
    """Sliced result shapes if `ins` is an all-reduce used only through 1/n dynamic-slices."""
    if n <= 1:
        return None
    users = comp.users()
    if len(ins.shape) == 1:
        s = _slices_to(module, users, ins.name, ins.shape[0].elements, n)
        return [s] if s is not None else None
    gtes = users.get(ins.name, [])  # variadic all-reduce: every element must be sliced
    if not gtes or any(g.opcode != "get-tuple-element" for g in gtes):
        return None
    out = [_slices_to(module, users, g.name, g.shape[0].elements, n) for g in gtes]
    return None if any(s is None for s in out) else out


def undo_cpu_artifacts(module, comp, ins, kind, lowered, payload, n):
    """(kind, lowered_as, payload, bytes factor, fixes) with the XLA:CPU artifacts undone.

    The factor multiplies the ring bytes read off the program: 0.5 for a bf16 reduction run in
    fp32, and (1 − 0.5·f) for an all-reduce of which a fraction f is only used sliced 1/n. The
    returned payload keeps ring_bytes(kind, n, payload) equal to the corrected bytes."""
    factor, fixes = 1.0, []
    if kind == "collective-permute" and _permute_promoted(module, comp, ins):
        return kind, lowered, payload * 0.5, 0.5, ("fp32-promoted",)
    if n <= 1 or kind not in ("all-reduce", "reduce-scatter"):
        return kind, lowered, payload, factor, ()
    if (ins.attr("to_apply") or "").endswith("_promoted"):
        factor, payload = 0.5, payload * 0.5
        fixes.append("fp32-promoted")
    else:  # a combined (variadic) reduction keeps the plain reducer: promoted per operand
        pf = _promoted_fraction(module, comp, ins)
        if pf:
            factor, payload = 1.0 - 0.5 * pf, payload * (1.0 - 0.5 * pf)
            fixes.append("fp32-promoted operands")
    if kind == "all-reduce":
        rs = _sliced_fraction(module, comp, ins, n)
        if rs:
            factor *= 1.0 - 0.5 * rs
            fixes.append("sliced")
        if rs == 1.0:
            kind, lowered = "reduce-scatter", "all-reduce+convert+dynamic-slice"
        elif rs:  # partly sliced: the payload whose all-reduce ring bytes equal the mix
            payload *= 1.0 - 0.5 * rs
    return kind, lowered, payload, factor, tuple(fixes)


_PASS = ("bitcast", "copy", "reshape", "convert", "get-tuple-element", "bitcast-convert")
_16 = ("bf16", "f16")


def _from_16bit(module, comp, name: str) -> bool:
    """`name` is an fp32 value converted from a 16-bit one (a convert, or a fusion whose root
    is such a convert): XLA:CPU's promotion of a 16-bit reduction operand."""
    ins = comp.instrs.get(name)
    if ins is None or [a.dtype for a in ins.shape] != ["f32"]:
        return False
    if ins.opcode == "convert":
        src = comp.instrs.get(ins.operands[0]) if ins.operands else None
        return src is not None and src.shape[0].dtype in _16
    if ins.opcode == "fusion":
        for cn in ins.called():
            fc = module.computations.get(cn)
            root = next((i for i in fc.instrs.values() if i.is_root), None) if fc else None
            if root is not None and root.opcode == "convert":
                src = fc.instrs.get(root.operands[0]) if root.operands else None
                if src is not None and src.shape[0].dtype in _16:
                    return True
    return False


def _back_to_16bit(module, comp, name: str) -> bool:
    """Every use of `name` converts it back to 16 bits (a convert, or a fusion of only that):
    the other half of XLA:CPU's promotion. Our own fp32 reductions (e.g. gradients reduced in
    grad_accum_dtype) keep their fp32 result."""
    users = comp.users().get(name, [])
    for u in users:
        if [a.dtype for a in u.shape] != [u.shape[0].dtype] or u.shape[0].dtype not in _16:
            return False
        if u.opcode == "fusion":
            ops = {i.opcode for cn in u.called() if module.computations.get(cn)
                   for i in module.computations[cn].instrs.values()}
            if not ops <= {"parameter", "convert", "bitcast", "copy", "reshape"}:
                return False
        elif u.opcode != "convert":
            return False
    return bool(users)


def _permute_promoted(module, comp, ins) -> bool:
    """A collective-permute XLA:CPU moves in fp32 for a 16-bit value: its operand converts
    from 16 bits (a convert, or a fusion holding one) and every use converts straight back."""
    if [a.dtype for a in ins.shape] != ["f32"] or not ins.operands:
        return False
    src = comp.instrs.get(ins.operands[0])
    if src is None or not _back_to_16bit(module, comp, ins.name):
        return False
    if src.opcode == "convert":
        return _from_16bit(module, comp, src.name)
    for cn in src.called() if src.opcode == "fusion" else ():
        fc = module.computations.get(cn)
        for i in (fc.instrs.values() if fc else ()):
            arg = fc.instrs.get(i.operands[0]) if i.opcode == "convert" and i.operands else None
            if arg is not None and arg.shape and arg.shape[0].dtype in _16:
                return True
    return False


def _promoted_fraction(module, comp, ins) -> float:
    """Fraction of a reduction's bytes whose operands are 16-bit values promoted to fp32 and
    whose results go straight back to 16 bits."""
    total = sum(a.nbytes for a in ins.shape) or 1.0
    if len(ins.shape) == 1:
        results = [ins.name]
    else:
        by_index = {g.attr("index"): g.name for g in comp.users().get(ins.name, [])
                    if g.opcode == "get-tuple-element"}
        results = [by_index.get(str(i)) for i in range(len(ins.shape))]
    done = sum(a.nbytes for a, op, res in zip(ins.shape, ins.operands, results)
               if res is not None and _from_16bit(module, comp, op)
               and _back_to_16bit(module, comp, res))
    return done / total


def _fusion_is_pass(module, ins) -> bool:
    comps = [module.computations.get(cn) for cn in ins.called()]
    ops = {i.opcode for cc in comps if cc for i in cc.instrs.values()} - {"parameter"}
    return bool(ops) and ops <= set(_PASS)


def _sliced_fraction(module, comp, ins, n) -> float:
    """Fraction of an all-reduce's bytes (per tuple element) that is only used sliced 1/n."""
    if len(ins.shape) == 1:
        return 1.0 if _only_sliced(module, comp, ins, n) else 0.0
    total = sum(a.nbytes for a in ins.shape) or 1.0
    done = 0.0
    for g in comp.users().get(ins.name, []):
        if g.opcode != "get-tuple-element":
            return 0.0
        if _only_sliced(module, comp, g, n):
            done += g.shape[0].nbytes
    return done / total


def _only_sliced(module, comp, ins, n, depth=0) -> bool:
    """Every use of `ins` ends in a 1/n dynamic-slice (possibly inside a fusion)."""
    if depth > 8:
        return False
    users = comp.users().get(ins.name, [])
    if not users:
        return False
    elems = sum(a.elements for a in ins.shape)
    for u in users:
        if u.opcode in _PASS or (u.opcode == "fusion" and _fusion_is_pass(module, u)):
            if not _only_sliced(module, comp, u, n, depth + 1):
                return False
        elif u.opcode == "dynamic-slice":
            if not _slices(u, ins.name, elems, n):
                return False
        elif u.opcode == "fusion":
            if _fused_slice(module, u, ins.name, elems, n) is None:
                return False
        else:
            return False
    return True


def _slices(ds, name: str, elems: int, n: int) -> bool:
    """`ds` is a dynamic-slice of `name` itself (not of another value) keeping elems/n."""
    return ds.operands[:1] == [name] and ds.shape[0].elements * n == elems


def _fused_slice(module, fusion, name: str, elems: int, n: int) -> Optional[H.Array]:
    """The slice shape if, inside `fusion`, every use of the parameter(s) fed by `name` ends
    (through pass-through ops) in a 1/n dynamic-slice of it; else None. A slice of another
    value in the same fusion, or any other use of the full value, does not count."""
    positions = {str(k) for k, op in enumerate(fusion.operands) if op == name}
    found = None
    for cn in fusion.called():
        fc = module.computations.get(cn)
        for p in (fc.instrs.values() if fc and positions else ()):
            if p.opcode == "parameter" and p.raw_args in positions:
                s = _fused_uses_sliced(fc, p.name, elems, n)
                if s is None:
                    return None
                found = s
    return found


def _fused_uses_sliced(fc, name: str, elems: int, n: int, depth=0) -> Optional[H.Array]:
    uses, found = fc.users().get(name, []), None
    if not uses or depth > 8:
        return None
    for u in uses:
        if u.opcode in _PASS and not u.is_root:
            found = _fused_uses_sliced(fc, u.name, elems, n, depth + 1)
        else:
            found = u.shape[0] if u.opcode == "dynamic-slice" and _slices(u, name, elems, n) \
                else None
        if found is None:
            return None
    return found
