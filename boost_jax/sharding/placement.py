"""Placement plans: which mesh axes hold the batch, weights, gradients and optimizer state.

A plan maps roles to axes of the ("pair", "node", "global") mesh, innermost first by link speed
(the README's "Parallelism" section). Axes used by tensor parallelism never take a data-parallel
role; every role below is taken from the remaining (data-parallel) axes, `all` = all of them:

    plan          params      grads        opt_state  secondary (backward)   weight gathers
    ddp           -           -            -          -                      none
    zero1         -           -            all        -                      none
    zero3         all         all          all        - (re-gather over all) working dtype
    zeropp        all         all          all        pair+node (hpZ)        int8 (qwZ)
    hierarchical  pair        pair+node    all        pair, int8             int8 (secondary)

Every role is overridable (`parallel.params_axes=[pair,node]`, `parallel.secondary_axes=[]`,
...). The gradient is accumulated over the grads axes and left unreduced over the deferred
axes R = batch − grads, which are reduced once per optimizer step (or per layer in the last
micro-batch's backward, `reduce_in_backward`) straight into the opt_state sharding.

Layout of one array (`LeafLayout`): all roles shard the *same* dimension (the largest that
divides by the product of all role axes; if none does, the largest, zero-padded at its end and
kept zero through training), with the axes in one canonical order, so a finer role's shard is a
sub-block of a coarser role's: a pure slice one way, a gather over the extra axes the other.
Derivation (qwZ and the secondary, the state arrays, which dim, padding and its restore):
benchmarks/README.md §3, "Derivations moved from the code".
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field, replace
from typing import Any, Optional, Sequence

import jax
from jax.sharding import NamedSharding, PartitionSpec as P

from boost_jax.errors import ConfigError
from boost_jax.layers.forward import path_keys
from boost_jax.mesh import AXES, axis_size, get_topology
from boost_jax.sharding import stages
from boost_jax.sharding.gather import Int8Copies
from boost_jax.sharding.layout import LeafLayout, choose_layout, spec_entry
from boost_jax.sharding.bucket import FLAT, Policy
from boost_jax.sharding.tp.specs import tp_param_specs

ALL = "all"
# plan: params, grads, opt_state, secondary, quantize_gather (qwZ), quantize_grads (qgZ),
# secondary_dtype
PRESETS: dict[str, dict[str, Any]] = {
    "ddp": dict(params=(), grads=(), opt_state=(), secondary=None, qwz=False, qgz=False,
                sec_dtype="bfloat16"),
    "zero1": dict(params=(), grads=(), opt_state=ALL, secondary=None, qwz=False, qgz=False,
                  sec_dtype="bfloat16"),
    "zero3": dict(params=ALL, grads=ALL, opt_state=ALL, secondary=None, qwz=False, qgz=False,
                  sec_dtype="bfloat16"),
    # ZeRO++ complete: qwZ int8 gathers, hpZ node secondary, qgZ int4 gradients
    # (parallel.quantize_grads=false turns qgZ off)
    "zeropp": dict(params=ALL, grads=ALL, opt_state=ALL, secondary=("pair", "node"), qwz=True,
                   qgz=True, sec_dtype="bfloat16"),
    "hierarchical": dict(params=("pair",), grads=("pair", "node"), opt_state=ALL,
                         secondary=("pair",), qwz=False, qgz=False, sec_dtype="int8"),
}



def order_axes(roles: Sequence[Sequence[str]], dp_axes: Sequence[str]) -> tuple[str, ...]:
    """Canonical order: axes held by more roles first (ties: innermost first).

    For nested roles (params ⊆ secondary ⊆ grads ⊆ opt_state, or secondary ⊆ params) every
    role is then a prefix of the order, so its shards nest inside the coarser roles' shards.
    """
    count = {a: sum(a in r for r in roles) for a in dp_axes}
    return tuple(sorted(dp_axes, key=lambda a: (-count[a], AXES.index(a))))


def process_rows(sharding: NamedSharding, shape: tuple) -> tuple[int, int]:
    """(index, count): which of the batch's row groups this process feeds. Processes whose
    devices hold the same rows (tensor parallelism or pipeline stages across processes) feed
    the same rows, so they read the same windows; the others read disjoint ones."""
    by_process: dict = {}
    for dev, idx in sharding.devices_indices_map(tuple(shape)).items():
        by_process.setdefault(dev.process_index, set()).update(
            range(*idx[0].indices(shape[0])))
    return row_group({p: frozenset(r) for p, r in by_process.items()}, jax.process_index())


def row_group(rows_by_process: dict, me: int) -> tuple[int, int]:
    """(index, count) of process `me`'s rows among the distinct row sets, ordered by first
    row; the sets must split the rows evenly (a batch sharding's contiguous blocks do)."""
    groups = sorted(set(rows_by_process.values()), key=min)
    if sum(map(len, groups)) != len(set().union(*groups)) or len(set(map(len, groups))) > 1:
        raise ConfigError("the batch sharding gives processes overlapping or unequal rows; "
                          "use a mesh whose batch axes split evenly over the processes")
    return groups.index(rows_by_process[me]), len(groups)


@dataclass
class Placement(Int8Copies):
    mesh: Any
    preset: str  # parallel.plan: the preset the roles start from
    batch_axes: tuple[str, ...]
    params_axes: tuple[str, ...]
    grads_axes: tuple[str, ...]
    opt_state_axes: tuple[str, ...]
    tp_axes: tuple[str, ...] = ()
    secondary_axes: Optional[tuple[str, ...]] = None  # None: no secondary partition
    int8_secondary: bool = False  # the secondary copy is int8 (secondary_dtype=int8, or qwZ)
    quantize_gather: bool = False
    quant_block: int = 256
    deferred_axes: tuple[str, ...] = ()  # R: batch axes the per-micro-batch grads stay unreduced on
    layouts: Any = None  # pytree of LeafLayout, same structure as the params
    param_dtype: str = "float32"
    grad_accum_dtype: str = "float32"
    notes: list[str] = field(default_factory=list)
    quantize_grads: bool = False  # qgZ: int4 all-to-all gradient reduce-scatter
    reduce_in_backward: bool = False  # R reduced per layer in the (last micro-batch's) backward
    collectives: Policy = FLAT  # parallel.collectives (sharding/bucket.py)
    micro_batches: int = 1
    opt_state_per_param: int = 2  # fp32 optimizer-state elements per weight (optim.name)
    defer_update: bool = False  # weights stored over opt_state axes, gathered in the forward
    replay: bool = False  # train.remat=full: each layer's backward replays its forward
    xq_weights: bool = False  # the deferred update's cross-node gather in int8
    xq_grads: str = "none"  # the gradient's cross-node reduce-scatter: none | int8 | int4

    @property
    def step_policy(self) -> Policy:
        """How the once-per-step calls (the deferred reduction, the optimizer's norm and
        update gathers) run: the run's policy with log_step's exchanges as rings (Policy.rings:
        they run beside the layer loop's chains)."""
        return self.collectives.rings()

    @property
    def stored_axes(self) -> tuple[str, ...]:
        """What the step's `params` are stored over: the params axes, or with `defer_update`
        the opt_state axes (the optimizer's output, cast; the next step's first forward
        gathers each layer to the params sharding, `update_stages`)."""
        return self.opt_state_axes if self.defer_update else self.params_axes

    def stored_shardings(self):
        return self._tree(self.stored_axes)

    @property
    def update_via_grads(self) -> bool:
        """The new weights go opt_state → grads → params sharding (A ⊆ G ⊆ O), so the cross-node
        part moves only the node's shard; else opt_state → params directly."""
        return set(self.params_axes) <= set(self.grads_axes) <= set(self.opt_state_axes)

    def update_stages(self) -> tuple[tuple[str, ...], ...]:
        """The gathers that take new weights from the opt_state to the params sharding, cross-
        node part first: O → G → A (`update_via_grads`), else O → A."""
        A, G, O = self.params_axes, self.grads_axes, self.opt_state_axes
        path = (O, G, A) if self.update_via_grads else (O, A)
        return tuple(tuple(a for a in hi if a not in lo) for hi, lo in zip(path, path[1:])
                     if set(hi) != set(lo))

    def update_steps(self) -> tuple[tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]], ...]:
        """(axes, source sharding, result sharding) of each update_stages gather, from the
        opt_state sharding down to the params sharding."""
        out, left = [], tuple(self.opt_state_axes)
        for axes in self.update_stages():
            src, left = left, tuple(x for x in left if x not in axes)
            out.append((axes, src, left))
        return tuple(out)

    @property
    def reduce_scatter_axes(self) -> tuple[str, ...]:
        """R ∩ opt_state axes: the part of the reduction over R that scatters into the
        opt_state shard (for the leaves that reduce into it)."""
        return tuple(a for a in self.deferred_axes if a in self.opt_state_axes)

    # ------------------------------------------------------------------ shardings by role
    def named(self, spec: P) -> NamedSharding:
        return NamedSharding(self.mesh, spec)

    def batch_sharding(self) -> NamedSharding:
        return self.named(P(spec_entry(self.batch_axes)))

    def replicated(self) -> NamedSharding:
        return self.named(P())

    def _tree(self, axes, layouts=None):
        return jax.tree.map(lambda lay: self.named(lay.spec(axes)),
                            layouts if layouts is not None else self.layouts,
                            is_leaf=lambda x: isinstance(x, LeafLayout))

    def params_shardings(self):
        return self._tree(self.params_axes)

    def grads_shardings(self):
        return self._tree(self.grads_axes)

    def master_shardings(self):
        return self._tree(self.opt_state_axes)

    def opt_state_shardings(self, opt_state, tx=None):
        """Param-shaped leaves of an optax state over opt_state axes; the rest replicated."""
        by_path = {path_keys(p): lay for p, lay in jax.tree_util.tree_flatten_with_path(
            self.layouts, is_leaf=lambda x: isinstance(x, LeafLayout))[0]}

        def one(path, x):
            key = path_keys(path)
            # optax nests param trees inside its states: match the longest param path suffix
            for start in range(len(key)):
                lay = by_path.get(key[start:])
                if lay is not None and tuple(x.shape) == lay.padded:
                    return self.named(lay.spec(self.opt_state_axes))
            return self.replicated()

        return jax.tree_util.tree_map_with_path(one, opt_state)

    # ------------------------------------------------------------------ the gradient's path
    def reduces_into_opt_state(self, lay: LeafLayout) -> bool:
        """Whether the opt_state shard of `lay` is a reduce-scatter over R ∩ O of its grads
        shard (true for every preset: the canonical axis order nests the roles)."""
        if lay.dim is None:
            return True
        return _nested(lay, tuple(self.opt_state_axes), tuple(self.grads_axes),
                       tuple(self.deferred_axes))

    def deferred_reduction(self, lay: LeafLayout) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """(all-reduce axes, reduce-scatter axes) of the reduction of one leaf's gradient over
        the deferred axes R: once per step, or per layer with `reduce_in_backward`."""
        R = self.deferred_axes
        if lay.dim is None or not self.reduces_into_opt_state(lay):
            return R, ()
        rs = self.reduce_scatter_axes
        return tuple(a for a in R if a not in rs), rs

    def in_backward(self, lay: LeafLayout) -> bool:
        """Whether the reduction over R of `lay` runs per layer in the backward: with
        `reduce_in_backward`, for the scanned layer stack (used once per pass, inside the
        layer loop) and the weights used once after it (their gradient is whole first in the
        backward: its reduction hides behind the layers')."""
        return self.reduce_in_backward and (lay.layer_axis or lay.after_stack)

    def accum_axes(self, lay: LeafLayout) -> tuple[str, ...]:
        """Axes the gradient accumulator of `lay` is sharded over: the grads axes, and when
        reduced in the backward of the only micro-batch also the reduce-scatter part of R
        (the opt_state shard; with more, the last one's backward adds the accumulator)."""
        if not self.in_backward(lay) or self.micro_batches > 1:
            return tuple(self.grads_axes)
        return tuple(self.grads_axes) + self.deferred_reduction(lay)[1]

    # ------------------------------------------------------------------ reporting
    def describe(self) -> dict:
        return {"plan": self.preset, "batch": list(self.batch_axes),
                "params": list(self.params_axes), "grads": list(self.grads_axes),
                "opt_state": list(self.opt_state_axes), "tp": list(self.tp_axes),
                "secondary": None if self.secondary_axes is None else list(self.secondary_axes),
                "int8_secondary": self.int8_secondary, "quantize_gather": self.quantize_gather,
                "quantize_grads": self.quantize_grads,
                "deferred_grad_axes": list(self.deferred_axes),
                "reduce_in_backward": self.reduce_in_backward,
                "collectives": self.collectives.mode,
                "defer_update": self.defer_update,
                "quantize_cross_node": {"weights": "int8" if self.xq_weights else "none",
                                        "grads": self.xq_grads}}

    def memory(self) -> dict:
        """Predicted persistent bytes per device by role, with the padding overhead.

        weights  Σ padded/|params|·bytes(param_dtype)
        master   Σ padded/|opt|·4            (only with bf16 params)
        adam     Σ padded/|opt|·8            (m and v, fp32)
        grads    Σ padded/|accum_axes|·bytes(grad_accum_dtype)   (accumulator, one per device)
        secondary Σ padded/|secondary|·(1 + 4/block) int8, or param bytes, when kept
        padding  the part of all the above that is zero padding
        replicated_overhead  bytes a leaf that could not be sharded costs above its share
        """
        from boost_jax.sharding.formulas import memory_per_device  # noqa: PLC0415

        return memory_per_device(self)


@functools.lru_cache(maxsize=1 << 16)
def _nested(lay: LeafLayout, O: tuple, G: tuple, R: tuple) -> bool:
    return lay.spec(O) == lay.spec(G + tuple(a for a in R if a in O))


def dp_axes_of(tp_axes: Sequence[str]) -> tuple[str, ...]:
    return tuple(a for a in AXES if a not in tp_axes)


def _pick_axes(name: str, override, default, tp: tuple, dp: tuple) -> tuple:
    """One role's axes: the parallel.<name> override (checked against TP), else the preset's."""
    if override is not None:
        axes = tuple(override)
        clash = [a for a in axes if a in tp]
        if clash:
            raise ConfigError(
                f"parallel.{name}={list(axes)} uses {clash}, which tensor parallelism "
                f"(parallel.tp_axes={list(tp)}) already holds; data-parallel roles may use "
                f"only {list(dp)}")
        if len(set(axes)) != len(axes):
            raise ConfigError(f"parallel.{name}={list(axes)} repeats an axis")
        return axes
    axes = dp if default == ALL else tuple(default)
    return tuple(a for a in axes if a not in tp)  # presets silently drop TP axes


def _secondary_roles(par, preset: dict, params: tuple, tp: tuple, dp: tuple):
    """(secondary axes or None, qwZ, secondary dtype): dropped where they would change nothing."""
    if par.secondary_axes is not None:
        sec = _pick_axes("secondary_axes", par.secondary_axes, (), tp, dp)
    else:
        sec = preset["secondary"]
        sec = None if sec is None else tuple(a for a in sec if a not in tp)
    qwz = par.quantize_gather if par.quantize_gather is not None else preset["qwz"]
    sec_dtype = par.secondary_dtype or preset["sec_dtype"]
    if not params:
        if par.secondary_axes is not None and par.secondary_axes:
            raise ConfigError(
                f"parallel.secondary_axes={par.secondary_axes} needs sharded weights, but plan "
                f"{par.plan!r} keeps them replicated; set parallel.params_axes or drop it")
        if par.quantize_gather:
            raise ConfigError(f"parallel.quantize_gather=true needs sharded weights, but plan "
                              f"{par.plan!r} keeps them replicated (nothing is gathered)")
        sec, qwz = None, False
    if sec is not None and tuple(sorted(sec)) == tuple(sorted(params)) \
            and sec_dtype != "int8" and not qwz:
        sec = None  # identical to the primary partition: re-gather from it
    return sec, qwz, sec_dtype


def _rehome_params(par, preset: dict, params: tuple, tp: tuple, dp: tuple) -> tuple:
    """A preset's weights inside the node that tensor parallelism left with no axis (the
    hierarchical plan with TP over `pair`) move to the innermost intra-node axis left, so
    they are still gathered inside the node and updated from the optimizer's shards; none
    left (TP over the whole node): they stay replicated (collapsed_roles says so)."""
    wanted = preset["params"]
    if par.params_axes is not None or wanted in (None, ALL) or params or not wanted:
        return params
    inner = [a for a in dp if a != "global"]
    return (inner[0],) if inner else params


def _check_sharded_over_batch(roles: dict) -> None:
    for name in ("params", "grads"):
        extra = [a for a in roles[name] if a not in roles["batch"]]
        if extra:
            raise ConfigError(f"parallel.{name}_axes {extra} are not batch axes "
                              f"({list(roles['batch'])}); shard {name} only over batch axes")


def _quantize_grads_role(par, preset: dict, grads: tuple) -> bool:
    """qgZ: only with sharded gradients (an explicit request without them is an error)."""
    qgz = par.quantize_grads if par.quantize_grads is not None else preset["qgz"]
    if qgz and not grads:
        if par.quantize_grads:
            raise ConfigError(f"parallel.quantize_grads=true needs sharded gradients, but plan "
                              f"{par.plan!r} keeps them replicated; set parallel.grads_axes or "
                              "drop it")
        qgz = False
    return qgz


def resolve_roles(cfg) -> dict:
    """Role → axes (unordered) after presets, overrides and TP exclusion; validated."""
    par = cfg.parallel
    tp = tuple(par.tp_axes)
    dp = dp_axes_of(tp)
    preset = PRESETS[par.plan]
    roles = {
        "batch": _pick_axes("batch_axes", par.batch_axes, ALL, tp, dp),
        "params": _pick_axes("params_axes", par.params_axes, preset["params"], tp, dp),
        "grads": _pick_axes("grads_axes", par.grads_axes, preset["grads"], tp, dp),
        "opt_state": _pick_axes("opt_state_axes", par.opt_state_axes, preset["opt_state"],
                                tp, dp),
    }
    rehomed = _rehome_params(par, preset, roles["params"], tp, dp)
    if rehomed != roles["params"]:  # the preset's secondary follows the weights
        roles["params"], preset = rehomed, dict(preset, secondary=rehomed)
    sec, qwz, sec_dtype = _secondary_roles(par, preset, roles["params"], tp, dp)
    _check_sharded_over_batch(roles)
    qgz = _quantize_grads_role(par, preset, roles["grads"])
    roles.update(secondary=sec, qwz=bool(qwz), qgz=bool(qgz),
                 sec_int8=(sec is not None and (sec_dtype == "int8" or bool(qwz))),
                 tp=tp, dp=dp)
    roles["collapsed"] = collapsed_roles(cfg, roles)
    return roles


def _axes_text(axes) -> str:
    return "+".join(axes) if axes else "-"


def effective_plan(roles: dict) -> str:
    """The preset whose roles the resolved ones are (over the data-parallel axes left)."""
    dp = set(roles["dp"])
    p, g, o = set(roles["params"]), set(roles["grads"]), set(roles["opt_state"])
    if not p and not g:
        return "zero1" if o else "ddp"
    if p == g == o == dp:
        return "zeropp" if roles["secondary"] is not None else "zero3"
    return "hierarchical-like (custom roles)"


def collapsed_roles(cfg, roles: dict) -> Optional[str]:
    """One line when tensor parallelism took axes a preset's roles name (None otherwise)."""
    par = cfg.parallel
    preset, tp = PRESETS[par.plan], set(roles["tp"])
    lost = []
    for name in ("params", "grads", "secondary"):
        if getattr(par, f"{name}_axes", None) is not None or preset[name] in (None, ALL):
            continue
        taken = [a for a in preset[name] if a in tp]
        if taken:
            lost.append(f"{name} {_axes_text(preset[name])} -> {_axes_text(roles[name] or ())}")
    if not lost:
        return None
    inside = roles["grads"] and "global" not in roles["grads"]
    return (f"parallel.plan={par.plan} with parallel.tp_axes={list(par.tp_axes)}: tensor "
            f"parallelism took the axes of {', '.join(lost)}"
            f"{' (re-homed: gradients stay inside the node)' if inside else ''}; this runs as "
            f"{effective_plan(roles)} over {_axes_text(roles['dp'])}")


def make_placement(cfg, mesh, abstract_params=None) -> Placement:
    """The plan's Placement; with `abstract_params` (pure dict of shapes) it carries layouts."""
    par = cfg.parallel
    r = resolve_roles(cfg)
    tp, dp = r["tp"], r["dp"]
    deferred = tuple(a for a in r["batch"] if a not in r["grads"])
    notes = [r["collapsed"]] if r["collapsed"] else []
    if tp and axis_size(mesh, tp) == 1:  # e.g. stages took all of `global`
        shape = " x ".join(f"{a} {n}" for a, n in mesh.shape.items())
        notes.append(f"parallel.tp_axes={list(par.tp_axes)} spans 1 device of this mesh "
                     f"({shape}): parallel.tp_mode={par.tp_mode} runs at degree 1")
    roles = [r["params"], r["grads"], r["opt_state"]] + ([r["secondary"]] if r["secondary"] else [])
    order = order_axes(roles, dp)
    ordered = lambda axes: tuple(a for a in order if a in axes)  # noqa: E731
    # batch: deferred (R) axes major so a [|R|, b/|R|] reshape of the batch is local
    batch = tuple(a for a in order if a in deferred) + tuple(
        a for a in order if a in r["batch"] and a not in deferred)
    pl = Placement(
        mesh, par.plan, batch, ordered(r["params"]), ordered(r["grads"]), ordered(r["opt_state"]),
        tp, None if r["secondary"] is None else ordered(r["secondary"]), r["sec_int8"], r["qwz"],
        par.quant_block, tuple(a for a in order if a in deferred),
        quantize_grads=r["qgz"], param_dtype=cfg.model.param_dtype,
        grad_accum_dtype=par.grad_accum_dtype, notes=notes,
        reduce_in_backward=bool(deferred) and par.pp_stages == 1,
        micro_batches=cfg.train.micro_batches, collectives=collectives_policy(cfg, mesh),
        opt_state_per_param=cfg.optim.state_per_param)
    pl.replay = cfg.train.remat == "full"
    pl.defer_update = _defer_update(par, pl)
    pl.xq_weights, pl.xq_grads = _cross_node_quantization(par, pl)
    n_batch = axis_size(mesh, batch)
    micro = cfg.train.global_batch // cfg.train.micro_batches
    if micro % n_batch:
        raise ConfigError(
            f"micro-batch of {micro} sequences (train.global_batch/train.micro_batches) does not "
            f"divide over {n_batch} data-parallel devices; make it a multiple of {n_batch}")
    if abstract_params is not None:
        pl.layouts = make_layouts(cfg, mesh, abstract_params, pl)
    return pl


def collectives_policy(cfg, mesh) -> Policy:
    """parallel.collectives over this mesh, with the topology's links for `auto`."""
    mode = cfg.parallel.collectives
    topo = get_topology(cfg.mesh.topology) if mode == "auto" else None
    return Policy.of(mode, dict(mesh.shape), topo)


def _defer_update(par, pl: Placement) -> bool:
    """parallel.defer_update resolved: where the weights are sharded over fewer axes than the
    optimizer state, each role's axes a prefix of the next (the gathers then tile), no
    pipeline; an explicit true where it cannot apply is an error."""
    A, G, O = pl.params_axes, pl.grads_axes, pl.opt_state_axes
    # the gather's transpose reduce-scatters the gradient over O - A: it must vary there
    unbatched = [a for a in O if a not in A and a not in pl.batch_axes]
    nested = O[:len(A)] == A and (not pl.update_via_grads
                                  or (O[:len(G)] == G and G[:len(A)] == A))
    why = ("the weights are not sharded (nothing to gather)" if not A else
           "the weights are sharded like the optimizer state (nothing to gather)"
           if set(A) == set(O) else "pipeline stages fetch per tick" if par.pp_stages > 1
           else "hpZ cuts its secondary from the forward's gather" if pl.hpz
           else f"the optimizer state is sharded over {unbatched}, not batch axes" if unbatched
           else None if nested and set(A) < set(O) else "its roles do not nest")
    if par.defer_update and why:
        raise ConfigError(f"parallel.defer_update=true does not apply to parallel.plan="
                          f"{par.plan} here: {why}; drop it")
    return why is None and par.defer_update is not False


def _cross_node_quantization(par, pl: Placement) -> tuple[bool, str]:
    """parallel.quantize_cross_node_{weights,grads}, checked against the legs that exist: the
    deferred update's gather across nodes, the reduce-scatter over R ∩ opt_state axes across
    nodes (a one-line error where the plan has none)."""
    w, g = par.quantize_cross_node_weights, par.quantize_cross_node_grads
    if w != "none" and not (pl.defer_update and any("global" in st for st in pl.update_stages())):
        raise ConfigError(f"parallel.quantize_cross_node_weights={w} needs a deferred update "
                          "that gathers across nodes (parallel.plan=hierarchical with "
                          "parallel.defer_update); drop it")
    if g != "none" and "global" not in pl.reduce_scatter_axes:
        raise ConfigError(f"parallel.quantize_cross_node_grads={g} needs a gradient reduce-"
                          "scatter across nodes outside the micro-batch loop (parallel.plan="
                          "hierarchical, `global` not a grads axis); drop it")
    return w == "int8", g


_LAYOUTS: dict = {}


def make_layouts(cfg, mesh, abstract_params, pl: Placement):
    """LeafLayout per param: one dim for every role, padded when nothing divides. Cached on
    what the layouts read (the planner's search asks for the same ones under every remat mode
    and micro-batch count); layouts are frozen and nothing writes into the tree."""
    roles = [pl.params_axes, pl.grads_axes, pl.opt_state_axes, pl.secondary_axes or ()]
    union = tuple(a for a in AXES if any(a in r for r in roles))
    leaves, tree = jax.tree_util.tree_flatten(abstract_params)
    par = cfg.parallel
    key = (repr(cfg.model), par.tp_mode, tuple(par.tp_axes), cfg.train.scan_layers,
           par.pp_stages, par.pp_virtual, union, tuple(dict(mesh.shape).items()), tree,
           tuple((tuple(x.shape), str(x.dtype)) for x in leaves))
    if key not in _LAYOUTS:
        _LAYOUTS[key] = _layouts(cfg, mesh, abstract_params, axis_size(mesh, union))
    return _LAYOUTS[key]


def _layouts(cfg, mesh, abstract_params, n: int):
    tp_specs = None
    if cfg.parallel.tp_mode != "none":
        tp_specs = tp_param_specs(cfg, abstract_params)
    scan, n_stages = cfg.train.scan_layers, cfg.parallel.pp_stages

    def one(path, x, spec=None):
        key = path_keys(path)
        layer = scan and bool(key) and key[0] == "blocks" and len(x.shape) >= 1
        tp = [()] * len(x.shape)
        if spec is not None:
            for i, e in enumerate(tuple(spec) + (None,) * (len(x.shape) - len(tuple(spec)))):
                tp[i] = () if e is None else ((e,) if isinstance(e, str) else tuple(e))
        lay = choose_layout(x.shape, n, tp, layer, mesh)
        after = key[:1] in (("final_norm",), ("lm_head",))
        return replace(lay, after_stack=True) if after and n_stages == 1 else lay

    if tp_specs is None:
        layouts = jax.tree_util.tree_map_with_path(one, abstract_params)
    else:
        layouts = jax.tree_util.tree_map_with_path(one, abstract_params, tp_specs,
                                                   is_leaf=lambda s: isinstance(s, P))
    if n_stages == 1:
        return layouts
    return jax.tree_util.tree_map_with_path(
        lambda path, lay: stages.stage_layout(path_keys(path), lay, cfg.model.n_layers, n_stages,
                                              cfg.parallel.pp_virtual),
        layouts, is_leaf=lambda x: isinstance(x, LeafLayout))


__all__ = ["Placement", "LeafLayout", "PRESETS", "make_placement", "make_layouts",
           "choose_layout", "order_axes", "resolve_roles", "replace"]

