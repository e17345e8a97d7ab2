"""Where a step's time goes, and what no overlap can take it below: the planner's explanation
of why a layout wins or loses (text report, `--search` table, `--json`)."""

from __future__ import annotations


def critical_path(p) -> dict:
    """Where a step's time goes, in the order it is spent (seconds; sums to the step)."""
    t = p.time
    once = t.get("dp_once_exposed", 0.0)  # a deferred leg's exposure in its one pass
    return {"compute": t["compute"] - t.get("bubble", 0.0) + t.get("quant", 0.0),
            "exposed TP": t["tp"], "exposed DP": t["dp_exposed"] - once,
            "bubble": t.get("bubble", 0.0),
            "once-per-step": t["step_comm"] + once + t["optimizer"]}


def floor(p) -> dict:
    """What no overlap of data-parallel traffic takes a step below (seconds): the critical
    path's compute ((de)quantization and bubble included) with its TP collectives and pipeline
    sends, and the time the node's NICs need for the bytes that leave it. `by` names the
    larger; `mfu_ceiling` is the MFU of a step that takes only that long."""
    compute = p.time["compute"] + p.time.get("quant", 0.0) + p.time["tp"]
    nic = p.time.get("nic", 0.0)
    low = max(compute, nic)
    return {"by": "node egress" if nic > compute else "compute + TP", "compute + TP": compute,
            "node egress": nic, "mfu_ceiling": p.mfu * p.step_time / low if low else 0.0}


def floor_text(p) -> str:
    """One line: the floor, the larger of the two first."""
    f = floor(p)
    other = "compute + TP" if f["by"] == "node egress" else "node egress"
    return (f"floor {f['by']} {f[f['by']] * 1e3:.1f} ms (> {other} {f[other] * 1e3:.1f} ms): "
            f"MFU <= {f['mfu_ceiling']:.1%} however much overlaps")


def dp_latency_text(p) -> str:
    """What the data-parallel collectives cost and how much of it is per-call latency (α for
    every call, the calls as the GPU program runs them: about one per layer and pass), the part
    that more bytes per call would not add to."""
    t = p.time
    return (f"data-parallel collectives {t['dp'] * 1e3:.1f} ms, {t['dp_latency'] * 1e3:.1f} ms "
            f"of it per-call latency, {t['dp_exposed'] * 1e3:.1f} ms exposed")


__all__ = ["critical_path", "floor", "floor_text", "dp_latency_text"]
