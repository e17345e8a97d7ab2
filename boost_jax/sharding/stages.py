"""The pipeline's shape (parallel.pp_stages = P): which layers and weights each stage holds,
and which micro-batch each stage runs at each tick (Schedule).

The mesh's hosts split into a `stage` axis and what stays of `global` (boost_jax/mesh.py), so
every plan and TP mode works inside a stage exactly as without stages. Layers split into P
contiguous runs of k = ceil(L/P): stage s holds layers [s·k, min((s+1)·k, L)); the stacked
block arrays are zero-padded to P·k layers (the padded layers are skipped: identity, zero
gradient) and their layer dim is sharded over `stage`. The embedding runs on the first stage,
the final norm, head and loss on the last; each of those weights is stored with a leading
stage dim of size P holding the real leaf at its owner's slot and zeros elsewhere, so no
collective outside the activation sends crosses stages. Checkpoints keep this stored form;
checkpoints/restage.py turns it into another (any P, or none).

m micro-batches run in lock-step ticks; at tick t stage s runs the forward (F) of micro-batch
f(t, s) and/or the backward (B) of micro-batch b(t, s):
    1f1b   warmup P−1 ticks F · steady m ticks F and B · cooldown P−1 ticks B
           f = t − s,  b = t − 2(P−1) + s;  stage s holds ≤ 2(P−1−s)+1 inputs, flat in m
    gpipe  m+P−1 ticks F, then m+P−1 ticks B
           f = t − s,  b = t − (m+P−1) − (P−1−s);  stage s holds all m inputs
Both idle (P−1)/(m+P−1) of a stage's tick-slots. Interleaved virtual stages (pp_virtual = V,
stage s holds chunks v·P + s): m → N = V·m (but 1f1b's b and depth), bubble (P−1)/(V·m+P−1).
step/pipeline.py runs it; the step's collective list (step_collectives.Passes) and the
planner (plan/costmodel.py) read its ticks, depth and sends. Derivation: benchmarks/README.md §9.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Optional

from boost_jax.errors import ConfigError, counted
from boost_jax.mesh import STAGE
from boost_jax.sharding.layout import LeafLayout

FIRST, LAST = "first", "last"
# the non-block weights and the stage that computes with them
ENDS = {"embed": FIRST, "final_norm": LAST, "lm_head": LAST}


def layers_per_stage(n_layers: int, stages: int, virtual: int = 1) -> int:
    """k: the layers of each of the stages·virtual chunks (the last may hold fewer); validated."""
    chunks = stages * virtual
    what = (f"parallel.pp_stages={stages}" if virtual == 1 else
            f"parallel.pp_stages={stages} x parallel.pp_virtual={virtual}")
    if chunks > n_layers:
        most = counted(n_layers, "stage") if virtual == 1 else \
            f"{n_layers} stages x virtual stages"
        raise ConfigError(f"{what} is more stages than the model's "
                          f"{counted(n_layers, 'layer')} (model.n_layers); use at most {most}")
    k = math.ceil(n_layers / chunks)
    if not _every_chunk_has_a_layer(n_layers, chunks):
        if virtual == 1:
            raise ConfigError(
                f"{what} splits {n_layers} layers into runs of {k}, which leaves stage "
                f"{chunks - 1} without a layer; choose stages so that "
                f"(stages-1)·ceil(layers/stages) < layers (e.g. a divisor of {n_layers})")
        fits = [v for v in range(virtual - 1, 0, -1)
                if _every_chunk_has_a_layer(n_layers, stages * v)]
        raise ConfigError(
            f"{what} splits {n_layers} layers into {chunks} chunks of {k}, which leaves chunk "
            f"{chunks - 1} without a layer; choose virtual stages so that "
            "(chunks-1)·ceil(layers/chunks) < layers, e.g. "
            + (f"parallel.pp_virtual={fits[0]}" if fits else
               f"parallel.pp_virtual=1 and stages that divide {n_layers}"))
    return k


def _every_chunk_has_a_layer(n_layers: int, chunks: int) -> bool:
    return (chunks - 1) * math.ceil(n_layers / chunks) < n_layers


def validate(cfg) -> None:
    """One-line ConfigErrors for a pipeline the model or the run cannot take."""
    par, P = cfg.parallel, cfg.parallel.pp_stages
    if P == 1:
        return
    V = par.pp_virtual
    layers_per_stage(cfg.model.n_layers, P, V)
    if V > 1 and cfg.train.micro_batches % P:
        raise ConfigError(
            f"parallel.pp_virtual={V} runs micro-batches in groups of the {P} stages: "
            f"train.micro_batches={cfg.train.micro_batches} is not a multiple of "
            f"parallel.pp_stages={P}; set train.micro_batches to a multiple of {P}")
    if cfg.model.tie_embeddings:
        raise ConfigError(
            "model.tie_embeddings=true with parallel.pp_stages>1: the table would live on the "
            "first and the last stage and its gradient cross stages every step; set "
            "model.tie_embeddings=false")
    if not cfg.train.scan_layers:
        raise ConfigError("parallel.pp_stages>1 needs train.scan_layers=true (stages split "
                          "the stacked layer arrays); drop train.scan_layers=false")
    if par.pp_schedule == "1f1b" and cfg.train.micro_batches < P:
        raise ConfigError(
            f"parallel.pp_schedule=1f1b needs at least as many micro-batches as stages: "
            f"train.micro_batches={cfg.train.micro_batches} < parallel.pp_stages={P}; set "
            f"train.micro_batches>={P} or parallel.pp_schedule=gpipe")


def owner(end: str, stages: int) -> int:
    return 0 if ENDS[end] == FIRST else stages - 1


def stage_layout(path: tuple, lay: LeafLayout, n_layers: int, stages: int,
                 virtual: int = 1) -> LeafLayout:
    """The stored layout of one weight under `stages` stages (see the module docstring)."""
    if path and path[0] == "blocks":
        k = layers_per_stage(n_layers, stages, virtual)
        return dataclasses.replace(lay, padded=(k * stages * virtual, *lay.padded[1:]),
                                   tp=((STAGE,), *lay.tp[1:]),
                                   interleave=(stages, virtual) if virtual > 1 else None)
    return LeafLayout((stages, *lay.shape), (stages, *lay.padded),
                      None if lay.dim is None else lay.dim + 1, ((STAGE,), *lay.tp),
                      layer_axis=True, owner=owner(path[0], stages))


# ---------------------------------------------------------------- the tick schedule
@dataclass(frozen=True)
class Schedule:
    kind: str  # 1f1b | gpipe
    stages: int
    micro: int
    virtual: int = 1

    @classmethod
    def of(cls, par, micro_batches: int, stages: Optional[int] = None) -> Optional[Schedule]:
        """The schedule of parallel section `par` over `micro_batches` and `stages` stages
        (default par.pp_stages; None for one stage): what the engine (sharding/parallel.py)
        and the planner (plan/costmodel.py) build."""
        P = par.pp_stages if stages is None else stages
        return None if P == 1 else cls(par.pp_schedule, P, micro_batches, par.pp_virtual)

    @property
    def units(self) -> int:
        """(micro-batch, chunk) slots each stage runs: N = V·m (with V > 1, m rounded up to
        whole groups of P: evaluation runs one micro-batch; the missing ones are masked)."""
        P, V = self.stages, self.virtual
        return self.micro if V == 1 else V * P * -(-self.micro // P)

    @property
    def phases(self) -> tuple[tuple[int, bool, bool, bool], ...]:
        """(ticks, forward?, backward?, send?) in order; the final tick sends nothing (its
        input gradient would go to no stage)."""
        P, N, VP = self.stages, self.units, self.virtual * self.stages
        if self.kind == "1f1b":
            ph = ((VP - 1, True, False, True), (N - VP + P, True, True, True),
                  (VP - 2, False, True, True))
        else:
            ph = ((N + P - 1, True, False, True), (N + P - 2, False, True, True))
        return tuple(p for p in ph + ((1, False, True, False),) if p[0] > 0)

    @property
    def ticks(self) -> int:
        """Ticks that run F (as many run B): N + P − 1 for both schedules."""
        return sum(n for n, f, _, _ in self.phases if f)

    def forward_index(self, t, s):
        return t - s

    def backward_index(self, t, s):
        P, VP = self.stages, self.virtual * self.stages
        if self.kind == "1f1b":
            return t - (VP - 1) - (P - 1 - s)
        return t - (self.units + P - 1) - (P - 1 - s)

    def unit(self, k, backward: bool = False):
        """Index k of a stage's forward (backward) order → (micro-batch, chunk): groups of P
        micro-batches through chunk 0, 1, …, V−1 (backward: V−1 … 0)."""
        P, V = self.stages, self.virtual
        if V == 1:
            return k, 0
        g, r = k // (P * V), k % (P * V)
        v = V - 1 - r // P if backward else r // P
        return g * P + r % P, v

    def forward_slot(self, i, v):
        """Forward index of (micro-batch i, chunk v): where its stage input is kept."""
        P, V = self.stages, self.virtual
        return i if V == 1 else (i // P) * P * V + v * P + i % P

    @property
    def depth(self) -> int:
        """Stage inputs a device keeps (its buffer holds one more slot for masked writes)."""
        N, VP = self.units, self.virtual * self.stages
        return min(N, 2 * VP - 1) if self.kind == "1f1b" else N

    @property
    def sends(self) -> int:
        """Collective-permutes per step: one per tick with F plus one per tick with B, but
        the final tick's: 2(V·m+P−1) − 1 for both schedules."""
        return sum(n * (int(f) + int(b)) for n, f, b, send in self.phases if send)

    @property
    def bubble(self) -> float:
        """The share of a stage's tick-slots that idle (masked)."""
        return (self.stages - 1) / self.ticks


__all__ = ["ENDS", "layers_per_stage", "validate", "owner", "stage_layout", "Schedule"]
