"""summary.md of a benchmarks/gpu.sh run: the kernel, training-speed and end-to-end tables.

    python benchmarks/gpu_summary.py OUT_DIR [TRAIN_METRICS_JSONL]

Reads OUT_DIR/env.txt, kernels.json (benchmarks/kernels.py), train_speed.json
(benchmarks/train_speed.py) and attention.json (benchmarks/attention.py); a missing one is
named in the summary, not an error.
"""

from __future__ import annotations

import datetime
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import markdown_table  # noqa: E402


def kernels_section(path: Path) -> list[str]:
    if not path.exists():
        return [f"no {path.name} (kernels.py failed or did not run)"]
    data = json.loads(path.read_text())
    by = {(r["kernel"], r["pass_"], r["impl"]): r for r in data["rows"]}
    rows = []
    for (kernel, pas, impl), p in by.items():
        x = by.get((kernel, pas, "xla"))
        if impl != "pallas" or x is None:
            continue
        rows.append([kernel, pas, f"{x['time_us']:.1f}", f"{p['time_us']:.1f}",
                     f"{p['speedup_vs_xla']:.2f}", f"{x['pct_copy_bw']:.0f}%",
                     f"{p['pct_copy_bw']:.0f}%", f"{x['pct_peak']:.1f}%", f"{p['pct_peak']:.1f}%",
                     f"{p['rel_err_vs_xla']:.1e}"])
    return [f"`{data['header']}`", "",
            markdown_table(["kernel", "pass", "xla µs", "pallas µs", "xla/pallas time",
                            "xla % copy BW", "pallas % copy BW", "xla % peak", "pallas % peak",
                            "pallas rel. error vs xla"], rows)]


def attention_section(path: Path) -> list[str]:
    if not path.exists():
        return [f"no {path.name} (attention.py failed or did not run)"]
    rows = [[r["platform"], r["seq"], r["impl"] + (" (auto)" if r["auto"] else ""),
             r["error"] if r.get("error") else f"{r['ms']:.2f}",
             "-" if r["temp_bytes"] is None else f"{r['temp_bytes'] / 2**20:.1f}"]
            for r in json.loads(path.read_text())]
    return [markdown_table(["platform", "tokens", "attention", "fwd+bwd ms",
                            "temporaries MiB"], rows)]


def _ratio(rows: dict, a: str, b: str, what: str) -> str:
    if "tokens_per_s" not in rows.get(a, {}) or "tokens_per_s" not in rows.get(b, {}):
        return f"- {a} vs {b}: not measured"
    r = rows[a]["tokens_per_s"] / rows[b]["tokens_per_s"]
    dl = rows[a]["final_loss"] - rows[b]["final_loss"]
    return (f"- {what}: {a} / {b} tokens/s = **{r:.3f}x** (loss after the same steps "
            f"{rows[a]['final_loss']:.4f} vs {rows[b]['final_loss']:.4f}, difference {dl:+.2e})")


def speed_section(path: Path) -> list[str]:
    if not path.exists():
        return [f"no {path.name} (train_speed.py failed or did not run)"]
    data = json.loads(path.read_text())
    rows = {r["variant"]: r for r in data["rows"]}
    # only BTP calls the fused kernels
    table = [[r["variant"], r["arch"], r["tp_mode"],
              r["kernels"] if r["tp_mode"] == "btp" else "-",
              f"{r['n_params'] / 1e6:.1f}", f"{r['ms_per_step']:.1f}",
              f"{r['tokens_per_s']:,.0f}",
              f"{r['tokens_per_s_min']:,.0f} - {r['tokens_per_s_max']:,.0f}",
              f"{100 * r['mfu']:.1f}%", f"{r['compile_s']:.0f}"]
             for r in rows.values() if "tokens_per_s" in r]
    out = [f"`{data['header']}`", "",
           markdown_table(["variant", "arch", "TP", "kernels", "params (M)", "ms/step",
                           "tokens/s median", "tokens/s min - max over rounds", "MFU",
                           "compile s"], table), "",
           _ratio(rows, "cola-btp-pallas", "cola-btp-xla", "Pallas kernels in training"),
           _ratio(rows, "cola", "full", "CoLA vs full rank at the same width")]
    out += [f"- {r['variant']}: FAILED: {r['error']}" for r in rows.values() if "error" in r]
    return out


def e2e_section(path: Path | None) -> list[str]:
    if path is None or not path.exists():
        return ["no metrics (train.py failed or did not run)"]
    rows = [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()]
    last = [r for r in rows if "tokens_per_s" in r][-1:] or rows[-1:]
    return [f"last metrics row of {len(rows)}: `{json.dumps(last[0]) if last else '-'}`"]


def main(argv: list[str]) -> int:
    import argparse

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out_dir", help="the gpu.sh run folder: reads its files, writes summary.md")
    p.add_argument("train_metrics", nargs="?", help="train.py's metrics.jsonl of the e2e step")
    a = p.parse_args(argv)
    out = Path(a.out_dir)
    if not out.is_dir():
        print(f"error: {out} is not a folder; give the folder benchmarks/gpu.sh wrote",
              file=sys.stderr)
        return 2
    env = (out / "env.txt").read_text().strip() if (out / "env.txt").exists() else "no env.txt"
    lines = [f"# GPU check, {datetime.datetime.now().astimezone():%Y-%m-%d %H:%M %Z}", "",
             "Reproduce: `benchmarks/gpu_wheels.sh` here, then `bash benchmarks/gpu.sh` on the "
             "GPU machine with `.whl` carried.", "", "```", env, "```", "",
             "## Pallas kernels vs their XLA twins (benchmarks/kernels.py)", "",
             *kernels_section(out / "kernels.json"), "",
             "## Training speed, CoLA-1B shape (benchmarks/train_speed.py)", "",
             *speed_section(out / "train_speed.json"), "",
             "## train.py end to end", "",
             *e2e_section(Path(a.train_metrics) if a.train_metrics else None), "",
             "## Attention, dense vs flash (benchmarks/attention.py)", "",
             *attention_section(out / "attention.json"), ""]
    text = "\n".join(lines)
    (out / "summary.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
