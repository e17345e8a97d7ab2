import pytest

from boost_jax.config import ConfigError, load_config
from train_proc import ROOT


def test_defaults_and_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("model:\n  d_model: 64\n  n_heads: 4\ntrain:\n  steps: 7\n")
    cfg = load_config(str(path), ["train.steps=9", "optim.lr=1e-3", "parallel.tp_mode=btp",
                                  "parallel.tp_axes=[pair,node]", "out_dir=runs/x"])
    assert cfg.model.d_model == 64 and cfg.train.steps == 9
    assert cfg.optim.lr == pytest.approx(1e-3)
    assert cfg.parallel.tp_axes == ["pair", "node"]
    assert cfg.out_dir == "runs/x"
    assert cfg.model.r == 16  # rank defaults to d/4


def test_int_promotes_to_float_not_reverse():
    assert load_config(None, ["optim.lr=1"]).optim.lr == 1.0
    with pytest.raises(ConfigError, match="train.steps"):
        load_config(None, ["train.steps=1.5"])


@pytest.mark.parametrize("override,match", [
    ("train.stesp=3", "did you mean 'train.steps'"),
    ("modle.d_model=3", "did you mean 'model.d_model'"),
    ("optim.lr=fast", "optim.lr='fast' has the wrong type"),
    ("model.arch=dense", "model.arch='dense' is not valid"),
    ("train.steps=0", "train.steps=0 must be > 0"),
    ("model.n_heads=3", "not divisible by model.n_heads=3"),
    ("parallel.tp_axes=[pear]", "unknown mesh axis 'pear'"),
    ("parallel.tp_mode=btp", "needs parallel.tp_axes"),
    ("train.micro_batches=3", "not divisible by train.micro_batches=3"),
    ("data.seq_len=4096", "exceeds model.max_seq_len"),
    ("steps", "must look like key=value"),
])
def test_bad_input_errors(override, match):
    with pytest.raises(ConfigError, match=match):
        load_config(None, [override])


def test_all_shipped_configs_load():
    import glob

    paths = sorted(glob.glob(f"{ROOT}/configs/*.yaml"))
    assert len(paths) >= 11
    for p in paths:
        load_config(p)
