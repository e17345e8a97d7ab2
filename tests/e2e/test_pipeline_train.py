"""Pipeline stages (parallel.pp_stages) through train.py: a run with 2 stages, with and without
TP x ZeRO-3 inside them, logs the losses of the run without stages (8 simulated devices)."""

import json

from train_proc import TINY, TrainProcess, assert_same_metrics, train_env


def test_train_py_with_stages_learns_like_without(tmp_path):
    """train.py end to end (training, pipelined evaluation, checkpoint, summary) with 2 stages
    logs the losses of the run without stages (the same 8 sequences per step, split over 2
    stages x 4 data-parallel devices instead of 8), and so does vanilla TP x ZeRO-3 inside the
    stages: that run stalled within 4 steps when XLA:CPU's thread pool had one thread per
    simulated device (train.py sizes it itself: PJRT_NPROC is not passed on)."""
    env = train_env(str(tmp_path / "jax_cache"))
    env.pop("PJRT_NPROC", None)
    base = TINY + ["model.n_layers=3", "train.steps=4", "train.eval_every=4",
                   "logging.progress=false"]
    runs = {"flat": TrainProcess(tmp_path / "flat", env, *base, "train.micro_batches=1"),
            "pp": TrainProcess(tmp_path / "pp", env, *base, "train.micro_batches=2",
                               "parallel.pp_stages=2"),
            "tp": TrainProcess(tmp_path / "tp", env, *base, "train.micro_batches=4",
                               "parallel.pp_stages=2", "parallel.tp_mode=vanilla",
                               "parallel.tp_axes=[pair]", "parallel.plan=zero3")}
    for p in runs.values():
        assert p.wait() == 0, open(p.log).read()[-2000:]
    rows = {k: [json.loads(x) for x in open(tmp_path / k / "metrics.jsonl")] for k in runs}
    assert any("val_loss" in r for r in rows["pp"])
    assert_same_metrics(rows["flat"], rows["pp"])
    assert_same_metrics(rows["flat"], rows["tp"])
