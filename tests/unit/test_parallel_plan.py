"""The parallel layout (boost_jax/sharding/parallel.py): checked once, resolved into one value that
the engine and the pipeline take instead of the Config."""

import ast
import inspect
import pathlib

import pytest

from boost_jax.backends import cpu as cpu_backend
from boost_jax.config import load_config
from boost_jax.errors import ConfigError
from boost_jax.layers import forward
from boost_jax.mesh import make_mesh
from boost_jax.sharding import parallel
from boost_jax.sharding.tp.btp import BTPOps
from boost_jax.step.engine import Engine
from boost_jax.step.pipeline import Pipeline
from boost_jax.step.build import abstract_params
from train_proc import ROOT

PACKAGE = pathlib.Path(ROOT) / "boost_jax"
TINY = ["model.d_model=32", "model.n_layers=2", "model.n_heads=4", "model.d_ff=64",
        "model.rank=8", "model.vocab_size=256", "model.max_seq_len=16", "data.seq_len=16",
        "train.global_batch=8"]


@pytest.fixture(scope="module")
def mesh():
    return make_mesh("cpu", shape=[2, 2, 2])


def _cfg(*extra):
    return load_config(None, TINY + list(extra))


def _one_line_error(cfg, mesh) -> str:
    with pytest.raises(ConfigError) as e:
        parallel.resolve(cfg, mesh)
    assert "\n" not in str(e.value), str(e.value)
    return str(e.value)


def test_resolve_rejects_a_bad_tp_cut(mesh):
    cfg = _cfg("parallel.tp_mode=btp", "parallel.tp_axes=[pair]", "model.n_heads=3",
               "model.d_model=48")
    msg = _one_line_error(cfg, mesh)
    assert msg.startswith("model.n_heads=3 is not divisible by the tensor-parallel degree 2")
    with pytest.raises(ConfigError, match="not divisible by the tensor-parallel degree 2"):
        parallel.check(cfg, mesh)


def test_resolve_rejects_a_bad_pipeline_split(mesh):
    cfg = _cfg()
    cfg.parallel.pp_stages = 3  # past Config.validate: resolve must catch it on its own
    msg = _one_line_error(cfg, mesh)
    assert msg.startswith("parallel.pp_stages=3 is more stages than the model's 2 layers"), msg


def test_an_empty_chunk_of_virtual_stages_names_chunks_and_a_fix_that_works():
    from boost_jax.sharding.stages import layers_per_stage

    with pytest.raises(ConfigError) as e:
        layers_per_stage(5, 2, 2)  # 4 chunks of 2 layers: the 4th would hold none
    assert "leaves chunk 3 without a layer" in str(e.value)
    assert str(e.value).endswith("e.g. parallel.pp_virtual=1")
    assert layers_per_stage(5, 2, 1) == 3
    with pytest.raises(ConfigError, match="stages that divide 13$"):
        layers_per_stage(13, 6, 2)  # 6 stages leave one empty too
    with pytest.raises(ConfigError, match="leaves stage 3 without a layer"):
        layers_per_stage(5, 4, 1)


def test_tensor_parallelism_over_an_axis_of_one_device_says_so():
    """Stages can take all of `global`: TP named over it runs at degree 1, which the run's
    header notes (placement notes) instead of passing over it."""
    from boost_jax.sharding.placement import make_placement

    small = make_mesh("cpu", shape=[2, 2, 1])
    cfg = _cfg("parallel.tp_mode=btp", "parallel.tp_axes=[global]")
    notes = make_placement(cfg, small).notes
    assert any("parallel.tp_axes=['global'] spans 1 device" in n and "degree 1" in n
               for n in notes), notes
    assert not any("degree 1" in n for n in make_placement(cfg, make_mesh(
        "cpu", shape=[2, 2, 2])).notes)


def test_resolve_holds_what_the_engine_needs(mesh):
    cfg = _cfg("parallel.tp_mode=btp", "parallel.tp_axes=[pair]", "model.arch=cola",
               "train.micro_batches=2", "train.remat=lowrank")
    layout = parallel.resolve(cfg, mesh, abstract_params(cfg.model, cfg.train)[1])
    assert layout.model is cfg.model and layout.mesh is mesh
    assert layout.placement.layouts is not None and layout.placement.tp_axes == ("pair",)
    assert layout.tp.mode == "btp" and layout.tp.t == 2 and isinstance(layout.ops(), BTPOps)
    assert (layout.remat, layout.micro_batches, layout.pipeline) == ("lowrank", 2, None)
    assert layout.check_vma == cpu_backend.check_vma(cfg)
    local = parallel.resolve(_cfg(), mesh)
    assert local.tp is None and isinstance(local.ops(), forward.Local)
    assert parallel.resolve_layers(cfg, mesh).placement is None


@pytest.mark.parametrize("scan", [True, False])
def test_unscanned_layers_keep_their_backward_replay_apart(mesh, scan):
    """A Python loop of layers (train.scan_layers=false) is checkpointed with prevent_cse, so
    XLA cannot merge a layer's backward replay (its gathers) into its forward; a scan's body
    needs no barrier (tests/unit/test_gpu_compile.py holds the compiled effect on an A100)."""
    import jax
    import jax.numpy as jnp

    cfg = _cfg("parallel.plan=zero3", f"train.scan_layers={str(scan).lower()}")
    layout = parallel.resolve(cfg, mesh, abstract_params(cfg.model, cfg.train)[1])
    layer = layout.checkpoint(True)(lambda w, h: jnp.sin(w * h))
    jaxpr = jax.make_jaxpr(jax.grad(lambda w, h: layer(w, h).sum()))(1.0, jnp.ones(3))
    remat = [e for e in jaxpr.eqns if "prevent_cse" in e.params]
    assert remat and all(e.params["prevent_cse"] is not scan for e in remat)


def test_engine_and_pipeline_take_no_config():
    def params(f):
        return inspect.signature(f).parameters

    assert list(params(Engine)) == ["layout"]
    for name, p in {**params(Engine), **params(Pipeline),
                    **params(cpu_backend.untyped_tp_grads)}.items():
        assert name not in ("cfg", "config", "engine"), name
        assert "Config" not in str(p.annotation), (name, p.annotation)


def _calls(tree: ast.AST, name: str) -> int:
    def called(f):
        return (isinstance(f, ast.Name) and f.id == name) or (
            isinstance(f, ast.Attribute) and f.attr == name)

    return sum(isinstance(n, ast.Call) and called(n.func) for n in ast.walk(tree))


def test_validate_tp_is_called_from_parallel_check_only():
    callers = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        n = _calls(ast.parse(path.read_text(encoding="utf-8")), "validate_tp")
        if n:
            callers[path.relative_to(PACKAGE.parent).as_posix()] = n
    assert callers == {"boost_jax/sharding/parallel.py": 1}, callers


def test_the_plan_lists_the_collectives_the_formulas_count(mesh):
    """layout.collectives() is the list sharding/formulas.py sums: the same bytes per level."""
    from boost_jax.sharding import formulas, step_collectives

    cfg = _cfg("parallel.plan=hierarchical", "train.micro_batches=2", "train.global_batch=16")
    layout = parallel.resolve(cfg, mesh, abstract_params(cfg.model, cfg.train)[1])
    got = step_collectives.bytes_by_level(layout.collectives())
    want = formulas.comm_per_step(layout.placement, 2, tied=cfg.model.tie_embeddings)
    assert got and all(got[k] == pytest.approx(want[k]) for k in got), (got, want)
    assert any(c.kind == "all-gather" for c in layout.collectives())


def test_processes_holding_the_same_rows_read_the_same_windows():
    """row_group: the batch's row sets by process, as a sharding places them. Data parallel
    over every process: one group each; TP across a process pair: the pair shares a group."""
    from boost_jax.sharding.placement import process_rows, row_group

    rows = lambda a, b: frozenset(range(a, b))  # noqa: E731
    ddp = {0: rows(0, 4), 1: rows(4, 8)}
    assert [row_group(ddp, p) for p in (0, 1)] == [(0, 2), (1, 2)]
    tp = {0: rows(0, 4), 1: rows(0, 4), 2: rows(4, 8), 3: rows(4, 8)}
    assert [row_group(tp, p) for p in range(4)] == [(0, 2), (0, 2), (1, 2), (1, 2)]
    assert row_group({0: rows(0, 8), 1: rows(0, 8)}, 1) == (0, 1)  # replicated: one group
    with pytest.raises(ConfigError, match="overlapping or unequal rows"):
        row_group({0: rows(0, 6), 1: rows(4, 8)}, 0)
    # one process here: every batch sharding is one group
    from jax.sharding import NamedSharding, PartitionSpec as P

    sh = NamedSharding(make_mesh("cpu", (2, 2, 2)), P(("node", "global")))
    assert process_rows(sh, (8, 16)) == (0, 1)
