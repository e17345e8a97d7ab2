"""Cluster jobs: plan -> --emit-config -> python -m boost_jax.launch slurm -> a batch script.

The Frontier (48 nodes) and Perlmutter (8 nodes) scripts are read back: processes x devices =
the mesh, the profile's environment is exported, the train command carries the planned config.
A script for 2 "nodes" x 4 CPU devices runs through the local SLURM stand-in
(scripts/local_slurm.py: sbatch/srun/scancel/scontrol), is signalled like a job near its time
limit, requeues itself, resumes, and matches a 1-process x 8-device run step by step.
"""

import json
import math
import os
import re
import shlex
import subprocess
import sys
import time

import pytest

from boost_jax.config import load_config
from readme_errors import check_readme_table
from train_proc import ROOT, TINY, assert_same_metrics
from boost_jax.mesh import get_topology

STANDIN = os.path.join(ROOT, "scripts", "local_slurm")
RUN = TINY + ["train.steps=20", "train.eval_every=5", "checkpoint.every=5"]
LAYOUTS = {  # topology -> (nodes, planner overrides)
    "frontier": (48, ["parallel.plan=hierarchical", "parallel.tp_mode=btp",
                      "parallel.tp_axes=[pair,node]", "train.global_batch=768"]),
    "perlmutter": (8, ["parallel.plan=zero3", "parallel.tp_mode=btp", "parallel.tp_axes=[pair]",
                       "train.global_batch=64", "train.micro_batches=2"]),
}


def _cli(*args, env=None, timeout=300):
    env = dict(os.environ if env is None else env, PYTHONPATH=ROOT)
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True,
                          env=env, timeout=timeout)


def _parse_script(text: str) -> dict:
    sbatch = dict(re.findall(r"^#SBATCH --([\w-]+)(?:=(.*))?$", text, re.M))
    exports = dict(re.findall(r"^export (\w+)=(.*)$", text, re.M))
    exports = {k: shlex.split(v)[0] for k, v in exports.items()}
    modules = re.findall(r"^module load (\S+)", text, re.M)
    config = re.search(r"<<'(BOOST_JAX_CONFIG_\w+)'[^\n]*\n(.*?)\n\1$", text, re.S | re.M)
    sruns = re.findall(r"^srun (.*?[^\\])$", text, re.S | re.M)
    assert len(sruns) == 2 and "node_check.py" in sruns[0]  # the node check, then training
    srun = sruns[1]
    words = shlex.split(srun.replace("\\\n", " "))
    opts = dict(w[2:].split("=", 1) for w in words if w.startswith("--") and "=" in w
                and not w.startswith("--config"))
    return dict(sbatch=sbatch, env=exports, modules=modules, config=config.group(2),
                srun=words, srun_opts=opts)


@pytest.fixture(scope="module")
def cluster_scripts(tmp_path_factory):
    """plan --emit-config, then launch, for each cluster of the papers (analytic plan)."""
    tmp = tmp_path_factory.mktemp("clusters")
    out = {}
    for topo, (nodes, overrides) in LAYOUTS.items():
        cfg_path, job = str(tmp / f"{topo}.yaml"), str(tmp / f"{topo}.sbatch")
        r = _cli("-m", "boost_jax.plan", "--config", "configs/cola-7b.yaml", "--topology", topo,
                 "--nodes", str(nodes), *overrides, "--no-compile", "--emit-config", cfg_path,
                 "--allow-demo-data")
        assert r.returncode == 0, r.stderr
        r = _cli("-m", "boost_jax.launch", "slurm", "--config", cfg_path, "--account", "ABC123",
                 "--time", "01:30:00", "--out", job, "--allow-demo-data")
        assert r.returncode == 0, r.stderr
        assert f"submit with: sbatch {job}" in r.stderr
        with open(job) as f:
            out[topo] = (cfg_path, job, f.read())
        # the line names out_dir as the script sets it (a shell word, not quoted twice)
        expr = re.search(r"^OUT_DIR=(.*)$", out[topo][2], re.M).group(1)
        assert f"out_dir {expr}; submit with" in r.stderr, (expr, r.stderr)
    return out


@pytest.mark.parametrize("topo", sorted(LAYOUTS))
def test_cluster_script_runs_the_planned_mesh(cluster_scripts, topo, tmp_path):
    cfg_path, job, text = cluster_scripts[topo]
    nodes, overrides = LAYOUTS[topo]
    t = get_topology(topo)
    s = _parse_script(text)
    assert subprocess.run(["bash", "-n", job]).returncode == 0

    # the train command carries the planned config, unchanged
    (tmp_path / "embedded.yaml").write_text(s["config"])
    embedded = load_config(str(tmp_path / "embedded.yaml"))
    planned = load_config(cfg_path)
    assert embedded.to_dict() == planned.to_dict()
    want = load_config("configs/cola-7b.yaml", overrides)
    assert (embedded.parallel, embedded.train) == (want.parallel, want.train)
    assert embedded.model == want.model
    i = s["srun"].index("--config")
    assert s["srun"][i + 1] == "$CONFIG"
    assert s["srun"][i - 2:i] == ["-u", os.path.join(ROOT, "train.py")]
    assert 'CONFIG="$OUT_DIR/job_config.yaml"' in text and s["srun"][-1] == "$@"

    # tasks x devices per task = the mesh = nodes x devices per node
    mesh = embedded.mesh.shape
    ppn = int(s["sbatch"]["ntasks-per-node"])
    assert int(s["sbatch"]["nodes"]) == int(s["srun_opts"]["nodes"]) == nodes == mesh[2]
    assert int(s["srun_opts"]["ntasks"]) == nodes * ppn
    gpus = int(s["sbatch"]["gpus-per-node"])
    assert int(s["srun_opts"]["ntasks"]) * (gpus // ppn) == math.prod(mesh) \
        == nodes * t.devices_per_node
    assert ppn == gpus == t.devices_per_node  # one process per GPU, as JAX's SLURM setup wants
    assert s["srun_opts"]["gpu-bind"] == "none" and s["srun_opts"]["kill-on-bad-exit"] == "1"

    # the profile's environment, the scratch out_dir, the job's resources, resume on requeue
    for k, v in t.job.env:
        assert s["env"][k] == v
    assert {"NCCL_SOCKET_IFNAME", "FI_CXI_DISABLE_HOST_REGISTER", "FI_MR_CACHE_MONITOR"} \
        <= set(s["env"])
    assert s["env"]["JAX_PLATFORMS"] == {"frontier": "rocm", "perlmutter": "cuda"}[topo]
    assert "--xla_gpu_enable_latency_hiding_scheduler=true" in s["env"]["XLA_FLAGS"].split()
    assert float(s["env"]["XLA_PYTHON_CLIENT_MEM_FRACTION"]) == 0.9
    assert s["modules"] == list(t.job.modules) and s["modules"]
    scratch = {"frontier": '"$MEMBERWORK/abc123"/runs/cola-7b',
               "perlmutter": '"$PSCRATCH"/runs/cola-7b'}[topo]
    assert f"OUT_DIR={scratch}\n" in text
    assert s["sbatch"]["account"] == "ABC123" and s["sbatch"]["time"] == "01:30:00"
    assert "requeue" in s["sbatch"] and s["sbatch"]["signal"] == "TERM@300"
    assert re.search(r'if \[ "\$status" -eq 143 \]; then\n(.*\n)*?\s+scontrol requeue '
                     r'"\$SLURM_JOB_ID"', text)
    assert int(s["sbatch"]["cpus-per-task"]) == t.job.cpus_per_task


# --------------------------------------------------------------------------- bad input

BAD = {  # id -> (argv after `-m boost_jax.launch`, expected message regex after "error: ")
    "unknown_topology": (["slurm", "--topology", "summit", "--nodes", "2"],
                         r"unknown topology 'summit'; choose one of \["),
    "nodes_below_one": (["slurm", "--topology", "perlmutter", "--nodes", "0"],
                        r"--nodes 0 must be >= 1"),
    "no_nodes": (["slurm", "--topology", "perlmutter"], r"how many nodes\? pass --nodes N"),
    "mesh_not_fitting_node": (
        ["slurm", "--topology", "perlmutter", "--nodes", "2", "mesh.shape=[2,4,2]"],
        r"mesh\.shape=\[2, 4, 2\] puts pair 2 x node 4 = 8 devices on each node but a "
        r"perlmutter node has 4 \(NVIDIA A100-40GB\); use mesh\.shape=\[2,2,2\]"),
    "batch_not_dividing": (["slurm", "--topology", "perlmutter", "--nodes", "8"],
                           r"micro-batch of 16 sequences .* does not divide over 32 "
                           r"data-parallel devices"),
    "tp_not_dividing": (["slurm", "--topology", "frontier", "--nodes", "1", "--account", "a1",
                         "parallel.tp_mode=btp", "parallel.tp_axes=[pair,node]",
                         "model.n_heads=4"],
                        r"model\.n_heads=4 is not divisible by the tensor-parallel degree 8"),
    "no_account": (["slurm", "--topology", "frontier", "--nodes", "2"],
                   r"--account is needed on frontier"),
    "bad_time": (["slurm", "--topology", "cpu", "--nodes", "2", "--time", "2h"],
                 r"--time '2h' is not a SLURM time limit; use HH:MM:SS"),
    "time_below_margin": (["slurm", "--topology", "cpu", "--nodes", "2", "--time", "04:00"],
                          r"--time 04:00 leaves no time to train"),
    "unknown_launcher": (["pbs"], r"unknown launcher 'pbs'; use: python -m boost_jax.launch "
                                  r"slurm"),
    "unknown_option": (["slurm", "--nodse=2"], r"unrecognized arguments: --nodse=2; see "
                                                r"python -m boost_jax.launch slurm --help"),
}


@pytest.mark.parametrize("row", sorted(BAD))
def test_bad_input_is_one_line_exit_2(row, tmp_path):
    argv, msg = BAD[row]
    out = str(tmp_path / "job.sbatch")
    r = _cli("-m", "boost_jax.launch", *argv, "--config", "configs/demo.yaml", "--out", out)
    assert r.returncode == 2, r.stdout + r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and re.match("error: " + msg, lines[0]), r.stderr
    assert not os.path.exists(out)


def test_readme_launch_rows_are_the_messages_these_rows_check():
    assert check_readme_table("boost_jax.launch slurm` writes nothing", "In the job itself",
                              [msg for _, msg in BAD.values()]) >= 5


def test_cluster_jobs_refuse_the_demo_corpus(tmp_path):
    """48 Frontier nodes on the default config: one line naming data.source and the epochs;
    the same with data.sources, or --allow-demo-data, goes on."""
    out = tmp_path / "c.yaml"
    r = _cli("-m", "boost_jax.plan", "--topology", "frontier", "--nodes", "48", "--no-compile",
             "--emit-config", str(out), "train.steps=1000")
    assert r.returncode == 2 and not out.exists()
    m = re.fullmatch(r"error: data\.source=stdlib is the embedded demo corpus \(([\d.]+) M "
                     r"training tokens\): 1,000 steps x 16 sequences x 128 tokens on 48 nodes "
                     r"would make ([\d.]+) epochs of it; .* set data\.sources=.* or pass "
                     r"--allow-demo-data to run on it anyway\n", r.stderr)
    assert m, r.stderr
    assert abs(float(m.group(2)) - 1000 * 16 * 128 / (float(m.group(1)) * 1e6)) < 0.1
    job = tmp_path / "j.sbatch"
    launch = ["-m", "boost_jax.launch", "slurm", "--topology", "perlmutter", "--nodes", "2",
              "--out", str(job)]
    r = _cli(*launch)
    assert r.returncode == 2 and r.stderr.startswith("error: data.source=stdlib is the "
                                                     "embedded demo corpus") and not job.exists()
    r = _cli(*launch, "data.sources=[{path: /scratch/a.bin, weight: 1}]")
    assert r.returncode == 0 and "data.sources=" not in r.stderr, r.stderr
    r = _cli(*launch, "--allow-demo-data", "--force")
    assert r.returncode == 0, r.stderr


def test_planner_refuses_to_emit_a_layout_that_does_not_fit(tmp_path):
    out = tmp_path / "big.yaml"
    r = _cli("-m", "boost_jax.plan", "--config", "configs/cola-7b.yaml", "--topology",
             "perlmutter", "--nodes", "1", "parallel.plan=ddp", "train.global_batch=4",
             "train.micro_batches=1", "--no-compile", "--emit-config", str(out))
    assert r.returncode == 2
    assert re.fullmatch(r"error: this layout does not fit \(it needs [\d.]+ GiB per device, more "
                        r"than [\d.]+ GiB that fit \(90% of 37 GiB, less the model's safety "
                        r"margin\)\), so --emit-config '.*big\.yaml' was not written; "
                        r"--search lists layouts that fit\n", r.stderr), r.stderr
    assert not out.exists()


def test_the_planned_kernel_is_the_one_emitted_and_launched(tmp_path):
    """--attention flash on a dense config: the emitted config trains flash, so the launcher's
    own prediction agrees with the planner's header (dense would need 5x the memory)."""
    cfg, job = tmp_path / "att.yaml", tmp_path / "att.sbatch"
    r = _cli("-m", "boost_jax.plan", "--config", "configs/cola-1b.yaml", "--topology",
             "frontier", "--nodes", "1", "train.global_batch=8", "train.micro_batches=1",
             "data.seq_len=16384", "model.max_seq_len=16384", "model.attention=dense",
             "--attention", "flash", "--no-compile", "--emit-config", str(cfg),
             "--allow-demo-data")
    assert r.returncode == 0, r.stderr
    assert load_config(str(cfg)).model.attention == "flash"
    planned = re.search(r"# predicted \(analytic\): ([\d.]+ GiB per device of \d+ GiB, [\d.]+ s per step)"
                        r".*\(collectives overlapped as --overlap xla assumes\)", cfg.read_text())
    r = _cli("-m", "boost_jax.launch", "slurm", "--config", str(cfg), "--account", "abc",
             "--out", str(job), "--allow-demo-data")
    assert r.returncode == 0, r.stderr
    assert f"# planner (analytic): {planned.group(1)}" in job.read_text()


def test_the_planner_refuses_a_node_the_topology_does_not_have(tmp_path):
    out = tmp_path / "pm.yaml"
    r = _cli("-m", "boost_jax.plan", "--config", "configs/cola-7b.yaml", "--topology",
             "perlmutter", "--nodes", "48", "mesh.shape=[2,4,48]", "--no-compile",
             "--emit-config", str(out), "--allow-demo-data")
    assert r.returncode == 2 and not out.exists(), r.stderr
    assert r.stderr.startswith("error: mesh.shape=[2, 4, 48] puts pair 2 x node 4 = 8 devices on "
                               "each node but a perlmutter node has 4 "), r.stderr


# --------------------------------------------------------------------------- the stand-in


def _standin_env(tmp_path):
    env = dict(os.environ, PATH=STANDIN + os.pathsep + os.environ["PATH"],
               LOCAL_SLURM_STATE=str(tmp_path / "slurm_state"))
    env.pop("XLA_FLAGS", None)
    return env


def test_standin_srun_sets_slurm_variables_and_kills_on_bad_exit(tmp_path):
    job = tmp_path / "job.sbatch"
    show = ("import os, sys, time; e = os.environ; print('task', *(e[k] for k in ('SLURM_PROCID',"
            " 'SLURM_LOCALID', 'SLURM_NODEID', 'SLURM_NTASKS', 'SLURM_STEP_NODELIST',"
            " 'SLURMD_NODENAME', 'SLURM_JOB_NUM_NODES')), flush=True);"
            " sys.exit(3) if e['SLURM_PROCID'] == '2' else time.sleep(60 * (e['STEP'] == '2'))")
    job.write_text(f"#!/bin/bash\n#SBATCH --nodes=2\n#SBATCH --ntasks-per-node=2\n"
                   f"STEP=1 srun --nodes=2 --ntasks=3 --ntasks-per-node=2 {sys.executable} -c "
                   f"{shlex.quote(show)}\necho step1 $?\n"
                   f"STEP=2 srun --ntasks-per-node=2 --kill-on-bad-exit=1 {sys.executable} -c "
                   f"{shlex.quote(show)}\necho step2 $?\n")
    t0 = time.monotonic()
    r = subprocess.run(["sbatch", str(job)], env=_standin_env(tmp_path), capture_output=True,
                       text=True, timeout=60)
    assert time.monotonic() - t0 < 30  # the sleepers of step 2 were ended
    assert r.returncode == 0 and r.stdout.startswith("Submitted batch job "), r.stdout + r.stderr
    lines = r.stdout.splitlines()
    step1 = sorted(x for x in lines[1:lines.index("step1 3")] if x.startswith("task"))
    assert step1 == ["task 0 0 0 3 127.0.0.[1-2] 127.0.0.1 2",
                     "task 1 1 0 3 127.0.0.[1-2] 127.0.0.1 2",
                     "task 2 0 1 3 127.0.0.[1-2] 127.0.0.2 2"]
    assert lines[-1] in ("step2 3", "step2 143")


def test_local_job_trains_and_resumes_after_requeue_like_one_process(jax_cache, tmp_path):
    """2 nodes x 4 CPU devices through the generated script and the stand-in; SIGTERM to the
    step (what --signal=TERM@300 sends) -> save -> exit 143 -> scontrol requeue -> resume."""
    from boost_jax.train.loop import run

    one = str(tmp_path / "one")
    run(load_config(None, RUN + ["logging.progress=false", f"out_dir={one}"]))  # 1 x 8

    two, job = str(tmp_path / "two"), str(tmp_path / "job.sbatch")
    r = _cli("-m", "boost_jax.launch", "slurm", "--topology", "cpu", "--nodes", "2", *RUN,
             f"out_dir={two}", "--out", job)
    assert r.returncode == 0, r.stderr
    env = _standin_env(tmp_path)
    env.update(JAX_COMPILATION_CACHE_DIR=jax_cache, PYTHONPATH=ROOT,
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
               JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="-1")
    log = open(tmp_path / "job.log", "w+")
    proc = subprocess.Popen(["sbatch", job], env=env, stdout=log, stderr=subprocess.STDOUT,
                            text=True)
    metrics = os.path.join(two, "metrics.jsonl")
    deadline = time.monotonic() + 400
    while not (os.path.exists(metrics) and '"step": 2,' in open(metrics).read()):
        assert proc.poll() is None and time.monotonic() < deadline, open(log.name).read()
        time.sleep(0.05)
    job_id = open(log.name).readline().split()[-1]
    sig = subprocess.run(["scancel", "--signal=TERM", job_id], env=env, capture_output=True,
                         text=True)
    assert sig.returncode == 0, sig.stderr
    assert proc.wait(timeout=400) == 0
    out = open(log.name).read()
    assert f"requeueing job {job_id} to resume it" in out and "restart 1" in out, out
    stop = int(re.search(r"signal 15: saved step (\d+), exiting", out).group(1))
    assert 2 <= stop < 20 and f"resumed from step {stop}" in out
    assert "2 processes x 4 devices" in out and "step 20/20 | loss" in out
    assert "[Gloo]" not in out  # the CPU collectives' connection chatter is filtered

    def rows(d):
        return [json.loads(x) for x in open(os.path.join(d, "metrics.jsonl"))]

    a, b = rows(one), rows(two)
    assert [x["step"] for x in b if "loss" in x] == list(range(1, 21))  # re-done rows dropped
    assert_same_metrics(a, b)


def test_a_job_requeues_only_after_it_saved_a_new_step(tmp_path):
    """SIGTERM (exit 143) requeues the job when it saved a step past the one it started from;
    a job stopped before that (its time limit too short to start and compile) ends, instead of
    requeueing itself forever. A stand-in for Python saves step 5 in the first run only. An
    out_dir among the job's overrides is refused."""
    stub, out, job = tmp_path / "py", tmp_path / "run", tmp_path / "job.sbatch"
    stub.write_text('#!/bin/bash\ncase "$*" in *node_check*) exit 0;; esac\n'
                    'for a in "$@"; do case "$a" in out_dir=*) o="${a#out_dir=}";; esac; done\n'
                    'if [ "$SLURM_PROCID" = 0 ] && [ "${SLURM_RESTART_COUNT:-0}" = 0 ]; then\n'
                    '    mkdir -p "$o/checkpoints/5" "$o/checkpoints/12.orbax-checkpoint-tmp"\n'
                    'fi\nexit 143\n')
    stub.chmod(0o755)
    r = _cli("-m", "boost_jax.launch", "slurm", "--topology", "cpu", "--nodes", "2",
             "--python", str(stub), f"out_dir={out}", "--out", str(job))
    assert r.returncode == 0, r.stderr
    # an out_dir override would train elsewhere than the folder the script watches
    r = subprocess.run(["sbatch", str(job), "train.stop_after=3", f"out_dir={tmp_path}/x y"],
                       env=_standin_env(tmp_path), capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and f"boost_jax: this job trains in {out}; drop out_dir=" \
        f"{tmp_path}/x y, or write a job" in r.stderr and not out.exists(), r.stderr
    r = subprocess.run(["sbatch", str(job)], env=_standin_env(tmp_path), capture_output=True,
                       text=True, timeout=120)
    job_id = r.stdout.splitlines()[0].split()[-1]
    assert r.stdout.count(f"requeueing job {job_id} to resume it") == 1, r.stdout + r.stderr
    assert "boost_jax: SIGTERM came before a step past 5 was saved: the time limit leaves too " \
           "little to start and train; not requeueing (ask for more --time)" in r.stderr, r.stderr
    assert r.returncode == 1


def test_script_states_the_effective_layout_and_checks_nodes_first(cluster_scripts):
    """The header says what runs (roles after TP took their axes, stages, micro-batches); the
    job's first step runs node_check.py with the job's Python on one task per node."""
    _, _, text = cluster_scripts["frontier"]
    header = "\n".join(x for x in text.splitlines() if x.startswith("# "))
    assert "layout: plan hierarchical (params -, grads -, opt_state ['global'], secondary -); " \
           "TP btp over ['pair', 'node']" in header
    assert "this runs as zero1 over global" in header
    check = re.search(r"^srun (.*node_check\.py.*)$", text, re.M).group(1)
    words = shlex.split(check.split("||")[0])
    assert words[:3] == ["--nodes=48", "--ntasks=48", "--ntasks-per-node=1"]
    assert words[-2:] == ["gpu", "8"] and words[-3].endswith("boost_jax/launch/node_check.py")


def test_script_header_names_pipeline_stages(tmp_path):
    r = _cli("-m", "boost_jax.launch", "slurm", "--config", "configs/cola-13b.yaml",
             "--account", "ABC123", "--allow-demo-data")
    assert r.returncode == 0, r.stderr
    assert re.search(r"^# layout: plan \w+ .*; 2 pipeline stages \(1f1b\); 4 micro-batches",
                     r.stdout, re.M), r.stdout[:3000]
    assert "has no JAX GPU plugin" in r.stderr  # this test's Python is a CPU-only jaxlib


@pytest.mark.parametrize("want,code", [("gpu", 3), ("cpu", 0)])
def test_node_check_stops_a_job_without_gpus_in_one_line(want, code):
    r = subprocess.run([sys.executable, os.path.join(ROOT, "boost_jax", "launch", "node_check.py"),
                        want, "4"], capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert r.returncode == code, r.stderr
    if code:
        assert r.stderr.count("\n") == 1 and re.search(
            r"JAX sees \d+ cpu devices but the job needs 4 GPUs per node", r.stderr)


def test_the_jobs_config_is_never_an_input_or_a_users_file(tmp_path):
    """The job writes OUT_DIR/job_config.yaml at each start: the launcher refuses a --config or
    an --out at that path (the job would overwrite its own input), and the job refuses to
    replace a job_config.yaml it did not write (one line, exit 1, file unchanged); the one it
    wrote it rewrites at each start (the requeue test above)."""
    run = tmp_path / "run"
    run.mkdir()
    mine = run / "job_config.yaml"
    mine.write_text(open(os.path.join(ROOT, "configs", "demo.yaml")).read())
    base = ["-m", "boost_jax.launch", "slurm", "--topology", "cpu", "--nodes", "1", *RUN,
            f"out_dir={run}"]
    r = _cli(*base, "--config", str(mine), "--out", str(tmp_path / "job.sbatch"))
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert "out_dir/job_config.yaml) is --config" in r.stderr, r.stderr
    r = _cli(*base, "--out", str(mine), "--force")
    assert r.returncode == 2 and "out_dir/job_config.yaml) is --out" in r.stderr, r.stderr
    before = mine.read_text()
    job = tmp_path / "job.sbatch"
    assert _cli(*base, "--out", str(job)).returncode == 0
    r = subprocess.run(["sbatch", str(job)], env=_standin_env(tmp_path), capture_output=True,
                       text=True, timeout=120)
    assert r.returncode != 0 and "is not a file this job wrote; move it away" in r.stdout + \
        r.stderr, r.stdout + r.stderr
    assert mine.read_text() == before and "train.py" not in r.stdout


def test_the_job_rewrites_its_own_config_an_earlier_versions_and_no_users(tmp_path):
    """The job's config step alone (bash, the script's own lines): a job_config.yaml with the
    mark, or one an earlier version wrote (no mark, this out_dir and every section), is
    rewritten; notes of the user's at that name are not. A launch from a marked config in
    the out_dir is no input clash: the job rewrites what a job wrote."""
    from boost_jax.launch.slurm import JOB_CONFIG_MARK, _config_lines, make_job

    run = tmp_path / "run"
    cfg = load_config("configs/demo.yaml", [*RUN, f"out_dir={run}"])
    job = make_job(cfg, get_topology("cpu"), 1)
    step = tmp_path / "config_step.sh"
    step.write_text("\n".join(_config_lines(job)[1:]) + "\n")
    from boost_jax.config import config_to_yaml

    legacy = config_to_yaml(job.cfg)
    for before, ok in ((JOB_CONFIG_MARK + "\n" + legacy, True), (legacy, True),
                       ("# my notes\nout_dir: elsewhere\n", False), ("", False)):
        run.mkdir(exist_ok=True)
        (run / "job_config.yaml").write_text(before)
        r = subprocess.run(["bash", str(step)], capture_output=True, text=True, timeout=60)
        assert (r.returncode == 0) == ok, (before[:40], r.stderr)
        after = (run / "job_config.yaml").read_text()
        assert after == (JOB_CONFIG_MARK + "\n" + legacy if ok else before)
    (run / "job_config.yaml").write_text(JOB_CONFIG_MARK + "\n" + legacy)
    r = _cli("-m", "boost_jax.launch", "slurm", "--config", str(run / "job_config.yaml"),
             "--topology", "cpu", "--nodes", "1", "--out", str(tmp_path / "again.sbatch"))
    assert r.returncode == 0, r.stderr
