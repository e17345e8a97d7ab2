"""benchmarks/README.md shows every results file exactly as its script wrote it, and `make bench`
runs every script that writes one."""

import glob
import os
import re

from benchmarks.common import README, RESULTS, readme_blocks, readme_body
from train_proc import ROOT


def test_readme_copies_equal_the_results_files():
    blocks = readme_blocks(open(README).read())
    files = {"results/" + os.path.basename(p) for p in glob.glob(os.path.join(RESULTS, "*.md"))}
    assert set(blocks) == files, "a results file is not embedded, or a block has no file"
    for name, body in blocks.items():
        want = readme_body(os.path.join(os.path.dirname(RESULTS), name))
        assert body == want, f"{name} differs from its copy in benchmarks/README.md: re-run " \
                             f"its script (it calls benchmarks.common.sync_readme)"


def test_make_bench_runs_every_script_that_writes_a_results_file():
    """`make bench` regenerates every CPU figure but learning per FLOP, which has its own
    target (`make convergence`: an hour of training on its own), and the GPU-compiled step
    (`make gpu-compile-bench`: it needs the gpu-compile extra's 4.4 GB venv)."""
    make = open(os.path.join(ROOT, "Makefile")).read()
    recipe = make.split("\nbench:", 1)[1].split("\n\n", 1)[0]
    apart = make.split("\nconvergence:", 1)[1].split("\n\n", 1)[0]
    gpuc = make.split("\ngpu-compile-bench:", 1)[1].split("\n\n", 1)[0]
    for path in glob.glob(os.path.join(RESULTS, "*.md")):
        m = re.search(r"benchmarks/(\w+)\.py", open(path).read())
        assert m, f"{path} does not name the script that wrote it"
        if os.path.basename(path) == "convergence.md":
            assert m.group(0) in apart, "make convergence does not run benchmarks/convergence.py"
            continue
        if os.path.basename(path) in ("gpu_compile.md", "gpu_overlap.md", "gpu_kernels.md",
                                      "gpu_scan_layers.md"):
            assert m.group(0) in gpuc, f"make gpu-compile-bench does not run {m.group(0)}"
            continue
        assert f"benchmarks/{m.group(1)}.py" in recipe, f"make bench does not run {m.group(0)}"


def test_validation_page_is_what_its_script_writes_today():
    """benchmarks/validation.py is the cost model alone (seconds): its page must be what the
    code predicts now, so a change that moves a figure cannot land without re-running it."""
    from benchmarks import validation

    with open(os.path.join(RESULTS, "validation.md")) as f:
        assert f.read() == validation.build(), \
            "benchmarks/results/validation.md is stale: run .venv/bin/python benchmarks/validation.py"


def test_every_script_with_an_out_guards_it():
    """Each benchmark script that takes --out or --json checks it before measuring (guard_out)."""
    for path in glob.glob(os.path.join(ROOT, "benchmarks", "*.py")):
        src = open(path).read()
        if '"--out"' in src or "add_out(" in src:
            assert "guard_out(" in src, f"{path} takes --out but never calls guard_out"
        if path.endswith("common.py"):
            continue
        assert '"--json", default=' not in src, f"{path}: a --json FILE comes from add_json"
        if "add_json(" in src:
            assert re.search(r"guard_out\([^)]*json", src), f"{path}: --json never guarded"


def test_attention_table_names_the_fastest_and_what_auto_picks():
    import argparse

    from benchmarks import attention

    rows = [dict(platform="cpu", seq=s, impl=n, auto=(n == "blockwise") == (s >= 256), ms=ms,
                 temp_bytes=2 ** 20) for s, n, ms in
            [(64, "dense", 1.0), (64, "blockwise", 2.0), (256, "dense", 9.0),
             (256, "blockwise", 3.0)]]
    a = argparse.Namespace(batch=2, heads=4, head_dim=32, dtype="float32", reps=3)
    table = attention.report(rows, a, ["--lengths", "64,256"]).splitlines()
    assert "| fastest | dense | blockwise |" in table
    assert "| `auto` picks | dense | blockwise |" in table
    assert "| dense (ms) | 1 | 9 |" in table


def test_only_a_results_file_itself_updates_its_readme_block(tmp_path, monkeypatch):
    """A file in a sub-folder of results/ (a GPU run's folder) never replaces the block of the
    results file that shares its name; the results file itself does."""
    from benchmarks import common

    (tmp_path / "results" / "gpu_run").mkdir(parents=True)
    readme = tmp_path / "README.md"
    readme.write_text("<!-- results/x.md -->\nold\n<!-- end results/x.md -->\n")
    monkeypatch.setattr(common, "RESULTS", str(tmp_path / "results"))
    monkeypatch.setattr(common, "README", str(readme))
    common.write_result(str(tmp_path / "results" / "gpu_run" / "x.md"), "from a run folder")
    assert "old" in readme.read_text()
    common.write_result(str(tmp_path / "results" / "x.md"), "new")
    assert readme.read_text() == "<!-- results/x.md -->\nnew\n<!-- end results/x.md -->\n"
