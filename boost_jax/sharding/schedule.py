"""The pipeline's tick schedule: which micro-batch each stage runs at each tick.

P stages (the mesh's `stage` axis, sharding/stages.py), m micro-batches, lock-step ticks; at
tick t stage s runs the forward (F) of micro-batch f(t, s) and/or the backward (B) of
micro-batch b(t, s):

    1f1b   warmup P−1 ticks F · steady m ticks F and B · cooldown P−1 ticks B
           f = t − s,  b = t − 2(P−1) + s
           stage s holds the inputs of micro-batches b..f: at most 2(P−1−s)+1 ≤ 2P−1, flat in m
    gpipe  m+P−1 ticks F, then m+P−1 ticks B
           f = t − s,  b = t − (m+P−1) − (P−1−s)
           stage s holds the inputs of all m micro-batches

Both keep every stage busy m of m+P−1 tick-slots: bubble (P−1)/(m+P−1). Interleaved virtual
stages (parallel.pp_virtual = V): stage s holds the chunks v·P + s (v < V) of P·V, the formulas
hold with m → N = V·m (except 1f1b's b and depth), and the bubble is (P−1)/(V·m+P−1).

step/pipeline.py runs it; the step's collective list (sharding/step_collectives.Passes) and the
planner (plan/costmodel.py) read its tick count, depth and sends from here.
Derivation (the virtual-stage order, its 1f1b formulas): benchmarks/README.md §9.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Schedule:
    kind: str  # 1f1b | gpipe
    stages: int
    micro: int
    virtual: int = 1

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


__all__ = ["Schedule"]
