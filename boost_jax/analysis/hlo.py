"""A small parser for compiled HLO text: computations, instructions, shapes, replica groups.

It reads what `jax.jit(f).lower(...).compile().as_text()` prints. Only what the communication
analyzer needs is parsed (names, shapes, opcodes, operands, a few attributes); the rest of each
line is kept raw in `Instr.attrs`.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

DTYPE_BYTES = {
    "pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4,
    "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16, "s4": 0.5, "u4": 0.5,
    "s2": 0.25, "u2": 0.25, "token": 0,
}

_ARRAY_RE = re.compile(r"([a-z][a-z0-9]*)\[([0-9,<=]*)\]")
_INSTR_RE = re.compile(r"^\s*(ROOT\s+)?%?([^\s=]+)\s*=\s*(.*)$")
_NAME_RE = re.compile(r"%([\w.\-]+)")


def dtype_bytes(dtype: str) -> float:
    if dtype in DTYPE_BYTES:
        return DTYPE_BYTES[dtype]
    if dtype.startswith("f8") or dtype.startswith("f4") or dtype.startswith("f6"):
        return 1  # fp8 variants (f8e4m3fn, ...) and sub-byte floats stored padded to a byte
    raise ValueError(f"unknown HLO dtype {dtype!r}")


@dataclass(frozen=True)
class Array:
    dtype: str
    dims: tuple[int, ...]

    @property
    def elements(self) -> int:
        return int(np.prod(self.dims, dtype=np.int64)) if self.dims else 1

    @property
    def nbytes(self) -> float:
        return self.elements * dtype_bytes(self.dtype)

    def __str__(self) -> str:
        return f"{self.dtype}[{','.join(map(str, self.dims))}]"


def parse_shape(text: str) -> list[Array]:
    """All array leaves of an HLO shape (a tuple gives several); layouts are ignored."""
    out = []
    for dt, dims in _ARRAY_RE.findall(text):
        ds = tuple(int(d.replace("<=", "")) for d in dims.split(",") if d)
        out.append(Array(dt, ds))
    return out


def _match_close(s: str, start: int, open_ch: str, close_ch: str) -> int:
    """Index just past the bracket that closes s[start] (which must be open_ch)."""
    depth = 0
    for i in range(start, len(s)):
        c = s[i]
        if c == open_ch:
            depth += 1
        elif c == close_ch:
            depth -= 1
            if depth == 0:
                return i + 1
    raise ValueError(f"unbalanced {open_ch}{close_ch} in {s[:200]!r}")


@dataclass
class Instr:
    name: str
    opcode: str
    shape: list[Array]
    operands: list[str]
    attrs: str
    computation: str
    is_root: bool = False
    raw_args: str = ""  # text inside the parentheses (a constant's literal lives here)

    def attr(self, key: str) -> Optional[str]:
        """Raw value of `key=...` up to the next top-level comma (braces/brackets balanced)."""
        m = re.search(r"(?:^|[,\s])" + re.escape(key) + r"=", self.attrs)
        if not m:
            return None
        i, depth, s = m.end(), 0, self.attrs
        j = i
        while j < len(s):
            c = s[j]
            if c in "{[(":
                depth += 1
            elif c in "}])":
                depth -= 1
            elif c == "," and depth == 0:
                break
            j += 1
        return s[i:j].strip()

    def called(self) -> list[str]:
        """Computations this instruction calls (bodies, branches, fusions, async wrappers)."""
        out = []
        for key in ("body", "condition", "calls", "to_apply", "true_computation",
                    "false_computation", "branch_computations", "async_execution_thread"):
            v = self.attr(key)
            if v and key != "async_execution_thread":
                out += _NAME_RE.findall(v) or [v.strip("{}")]
        return out

    @property
    def nbytes(self) -> float:
        return sum(a.nbytes for a in self.shape)


@dataclass
class Computation:
    name: str
    is_entry: bool
    instrs: dict[str, Instr] = field(default_factory=dict)

    def users(self) -> dict[str, list[Instr]]:
        if getattr(self, "_users", None) is None:  # built once, after parsing
            u: dict[str, list[Instr]] = {}
            for ins in self.instrs.values():
                for op in ins.operands:
                    u.setdefault(op, []).append(ins)
            self._users = u
        return self._users


@dataclass
class Module:
    name: str
    computations: dict[str, Computation]
    entry: str
    num_partitions: int = 1
    num_replicas: int = 1

    def instr(self, name: str) -> Optional[Instr]:
        for c in self.computations.values():
            if name in c.instrs:
                return c.instrs[name]
        return None


def _parse_instr(line: str, comp: str) -> Optional[Instr]:
    m = _INSTR_RE.match(line)
    if not m:
        return None
    root, name, rest = bool(m.group(1)), m.group(2).lstrip("%"), m.group(3)
    if rest.startswith("("):
        end = _match_close(rest, 0, "(", ")")
    else:
        end = rest.find(" ")
        if end < 0:
            return None
    shape_txt, rest = rest[:end], rest[end:].lstrip()
    om = re.match(r"([\w\-]+)\(", rest)
    if not om:
        return None
    opcode = om.group(1)
    close = _match_close(rest, om.end() - 1, "(", ")")
    operands = _NAME_RE.findall(rest[om.end():close - 1])
    attrs = rest[close:].lstrip(", ")
    return Instr(name, opcode, parse_shape(shape_txt), operands, attrs, comp, root,
                 rest[om.end():close - 1].strip())


def parse_module(text: str) -> Module:
    comps: dict[str, Computation] = {}
    entry, cur, mod_name, nparts, nreps = None, None, "", 1, 1
    for line in text.splitlines():
        if line.startswith("HloModule"):
            mod_name = line.split()[1].rstrip(",")
            m = re.search(r"num_partitions=(\d+)", line)
            nparts = int(m.group(1)) if m else 1
            m = re.search(r"replica_count=(\d+)", line)
            nreps = int(m.group(1)) if m else 1
            continue
        if not line.strip() or line.strip().startswith("//"):
            continue
        if not line[0].isspace() and line.rstrip().endswith("{"):
            is_entry = line.startswith("ENTRY")
            head = line[len("ENTRY"):].strip() if is_entry else line.strip()
            name = head.split()[0].split("(")[0].lstrip("%")
            cur = Computation(name, is_entry)
            comps[name] = cur
            if is_entry:
                entry = name
            continue
        if line.strip() == "}":
            cur = None
            continue
        if cur is not None:
            ins = _parse_instr(line, cur.name)
            if ins is not None:
                cur.instrs[ins.name] = ins
    if entry is None:
        raise ValueError("no ENTRY computation in HLO text")
    return Module(mod_name, comps, entry, nparts, nreps)


# --------------------------------------------------------------------------- replica groups


def iota_groups(group_shape, reshape_dims, perm=None) -> list[list[int]]:
    """XLA iota replica groups `[G,S]<=[dims]T(perm)`: iota over dims, transpose, reshape."""
    dims = [int(d) for d in reshape_dims]
    arr = np.arange(int(np.prod(dims))).reshape(dims)
    if perm is not None:
        arr = arr.transpose([int(p) for p in perm])
    return arr.reshape([int(g) for g in group_shape]).tolist()


def _parse_device_ids(text: str, n: int) -> np.ndarray:
    text = text.strip()
    m = re.fullmatch(r"\[([\d,]+)\](?:T\(([\d,]+)\))?", text)
    if m:  # iota form: [reshape dims] with optional transpose
        dims = [int(d) for d in m.group(1).split(",")]
        arr = np.arange(int(np.prod(dims))).reshape(dims)
        if m.group(2):
            arr = arr.transpose([int(p) for p in m.group(2).split(",")])
        return arr.reshape(-1)
    m = re.fullmatch(r"(?:devices=)?(?:\[[\d,]+\])?([\d,\s]+)", text)
    if m:  # explicit list, possibly prefixed by its dimensions
        return np.array([int(v) for v in m.group(1).replace(" ", "").split(",") if v])
    raise ValueError(f"cannot parse mesh device_ids {text!r}")


def mesh_axes_groups(text: str) -> list[list[int]]:
    """XLA mesh-axes groups `mesh['a'=4,'b'=2], device_ids=(...) {'a', 'b':(1)2}`.

    Mirrors MeshAxesReplicaGroupList::flattened_replica_groups: reshape the mesh's device
    array, split sub-axes, move the grouped axes to the end (in listed order), chunk."""
    text = text.strip()
    if not text.startswith("mesh["):
        raise ValueError(f"cannot parse mesh replica groups {text!r}")
    j = _match_close(text, 4, "[", "]")
    axes_txt, ids_txt = text[5:j - 1], None
    m = re.match(r",\s*device_ids=", text[j:])
    if m:
        k = _match_close(text, j + m.end(), "(", ")")
        ids_txt, j = text[j + m.end() + 1:k - 1], k
    g = re.match(r"\s*\{([^}]*)\}", text[j:])
    if not g:
        raise ValueError(f"cannot parse mesh replica groups {text!r}")
    names, sizes = [], []
    for item in axes_txt.split(","):
        k, v = item.split("=")
        names.append(k.strip().strip("'\""))
        sizes.append(int(v))
    n = int(np.prod(sizes))
    ids = _parse_device_ids(ids_txt, n) if ids_txt else np.arange(n)
    refs = []  # (axis index, pre_size or None, size or None)
    for tok in re.findall(r"'?([\w.\-]+)'?(?::\((\d+)\)(\d+))?", g.group(1)):
        refs.append((names.index(tok[0]), int(tok[1]) if tok[1] else None,
                     int(tok[2]) if tok[2] else None))
    per_dim: dict[int, list[int]] = {}
    for i, r in enumerate(refs):
        per_dim.setdefault(r[0], []).append(i)
    new_sizes, grouped = [], [0] * len(refs)
    for d, full in enumerate(sizes):
        base = len(new_sizes)
        if d not in per_dim:
            new_sizes.append(full)
            continue
        idx = per_dim[d]
        if len(idx) == 1 and refs[idx[0]][1] is None:
            new_sizes.append(full)
            grouped[idx[0]] = base
            continue
        prod = 1
        for i in sorted(idx, key=lambda i: refs[i][1]):  # sub-axes by pre_size
            pre, sz = refs[i][1], refs[i][2]
            if pre != prod:
                new_sizes.append(pre // prod)
                prod = pre
            grouped[i] = len(new_sizes)
            new_sizes.append(sz)
            prod *= sz
        if prod != full:
            new_sizes.append(full // prod)
    arr = ids.reshape(new_sizes)
    order = [a for a in range(len(new_sizes)) if a not in grouped] + grouped
    gsize = int(np.prod([new_sizes[a] for a in grouped])) if grouped else 1
    return arr.transpose(order).reshape(-1, gsize).tolist()


def parse_replica_groups(value: Optional[str], num_devices: int) -> list[list[int]]:
    """Groups from any of the three syntaxes; `{}` or absent means one group of everyone."""
    if value is None:
        return [list(range(num_devices))]
    v = value.strip()
    if v.startswith("mesh["):
        return mesh_axes_groups(v)
    if v.startswith("["):
        m = re.match(r"\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", v)
        if not m:
            raise ValueError(f"cannot parse iota replica groups {v!r}")
        perm = m.group(3).split(",") if m.group(3) else None
        return iota_groups(m.group(1).split(","), m.group(2).split(","), perm)
    if v.startswith("{"):
        inner = v[1:_match_close(v, 0, "{", "}") - 1].strip()
        if not inner:
            return [list(range(num_devices))]
        return [[int(x) for x in g.split(",") if x.strip()]
                for g in re.findall(r"\{([\d,\s]*)\}", inner)]
    raise ValueError(f"unknown replica group syntax {v!r}")


def replica_groups_text(ins: Instr) -> Optional[str]:
    """The replica-group text of a collective; the mesh form runs on past commas."""
    a = ins.attrs
    i = a.find("replica_groups=mesh[")
    if i < 0:
        return ins.attr("replica_groups")
    i += len("replica_groups=")
    j = _match_close(a, i + 4, "[", "]")
    m = re.match(r",\s*device_ids=", a[j:])
    if m:
        j = _match_close(a, j + m.end(), "(", ")")
    k = a.index("{", j)
    return a[i:_match_close(a, k, "{", "}")]


def source_target_pairs(ins: Instr) -> list[tuple[int, int]]:
    v = ins.attr("source_target_pairs") or "{}"
    return [(int(a), int(b)) for a, b in re.findall(r"\{(\d+),(\d+)\}", v)]


def known_trip_count(ins: Instr) -> Optional[int]:
    """`known_trip_count` from a while's backend_config, if XLA proved one."""
    m = re.search(r"backend_config=(\{.*\})", ins.attrs)
    if m:
        try:
            n = json.loads(m.group(1)).get("known_trip_count", {}).get("n")
            if n is not None:
                return int(n)
        except json.JSONDecodeError:
            pass
    m = re.search(r'"known_trip_count":\{"n":"(\d+)"\}', ins.attrs)
    return int(m.group(1)) if m else None


def guess_trip_count(module: Module, cond_name: str) -> Optional[int]:
    """Fallback: a condition `i < N` holding exactly one integer scalar constant N.

    Assumes the induction variable starts at 0 and steps by 1 (what scan/fori_loop emit)."""
    consts: set[int] = set()
    has_lt = False
    seen, todo = set(), [cond_name]
    while todo:
        c = module.computations.get(todo.pop())
        if c is None or c.name in seen:
            continue
        seen.add(c.name)
        for ins in c.instrs.values():
            if ins.opcode == "constant" and len(ins.shape) == 1 and not ins.shape[0].dims \
                    and ins.shape[0].dtype[0] in "su" and re.fullmatch(r"-?\d+", ins.raw_args):
                consts.add(int(ins.raw_args))
            if ins.opcode == "compare" and "direction=LT" in ins.attrs:
                has_lt = True
            todo += ins.called()
    return consts.pop() if has_lt and len(consts) == 1 else None


# --------------------------------------------------------------------------- call graph


def walk(module: Module):
    """Yield (computation, trip multiplier or None, enclosing while names) from ENTRY down."""
    stack = [(module.entry, 1, [])]
    while stack:
        cname, mult, loops = stack.pop()
        comp = module.computations[cname]
        yield comp, mult, loops
        for ins in comp.instrs.values():
            if ins.opcode == "while":
                body, cond = ins.attr("body"), ins.attr("condition")
                tc = known_trip_count(ins)
                if tc is None and cond:
                    tc = guess_trip_count(module, cond.lstrip("%"))
                m = mult * tc if (mult is not None and tc is not None) else None
                for c in (body, cond):
                    if c and c.lstrip("%") in module.computations:
                        stack.append((c.lstrip("%"), m, loops + [ins.name]))
            elif ins.opcode in ("call", "conditional", "async-start"):
                for c in ins.called():
                    if c in module.computations:
                        stack.append((c, mult, loops))


def matmul_flops(module: Module) -> tuple[float, bool]:
    """(FLOPs of every dot in the compiled program × its loop trip counts, all trips known).

    XLA's cost_analysis() counts a while body once, so with scanned layers and micro-batches
    it undercounts by the trip counts; this walks the loops (`walk`) and the fusions they call
    and counts each dot as 2·|result|·|contracted dims|, the convention of
    boost_jax.analysis.flops."""

    def dims_of(comp, name):
        ins = comp.instrs.get(name)
        return ins.shape[0].dims if ins is not None and ins.shape else None

    def comp_flops(cname: str, depth: int = 0) -> float:
        comp = module.computations[cname]
        f = 0.0
        for ins in comp.instrs.values():
            if ins.opcode == "dot" and ins.shape:
                lhs = dims_of(comp, ins.operands[0]) if ins.operands else None
                cd = ins.attr("lhs_contracting_dims") or "{}"
                idx = [int(x) for x in cd.strip("{}").split(",") if x.strip()]
                k = math.prod(lhs[i] for i in idx) if lhs is not None else 1
                f += 2.0 * ins.shape[0].elements * k
            elif ins.opcode == "fusion" and depth < 8:
                f += sum(comp_flops(c, depth + 1) for c in ins.called()
                         if c in module.computations)
        return f

    total, known = 0.0, True
    for comp, mult, _ in walk(module):
        if mult is None:
            known, mult = False, 1
        total += mult * comp_flops(comp.name)
    return total, known


def result_shape(comp: Computation, ins: Instr, kind: str) -> list[Array]:
    if not ins.opcode.endswith("-start"):
        return ins.shape
    for u in comp.users().get(ins.name, []):  # the -done carries the real result
        if u.opcode == kind + "-done":
            return u.shape
    return ins.shape[-1:]
