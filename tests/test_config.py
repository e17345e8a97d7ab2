import subprocess
import sys

import pytest

from boost_jax.config import ConfigError, load_config

ROOT = __file__.rsplit("/tests/", 1)[0]


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


def test_cli_error_is_one_line_exit_2():
    r = subprocess.run([sys.executable, f"{ROOT}/train.py", "--config", f"{ROOT}/configs/demo.yaml",
                        "train.stesp=3"], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 2
    assert r.stderr.strip() == "error: unknown config key 'train.stesp'; did you mean 'train.steps'?"


def _printed_vocab(*overrides):
    r = subprocess.run([sys.executable, f"{ROOT}/train.py", "--print-config", *overrides],
                       capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    model = r.stdout.split("model:", 1)[1]
    return int(model.split("vocab_size:", 1)[1].split()[0])


def test_vocab_size_follows_the_tokenizer_unless_set(tmp_path):
    from tokenizers import Tokenizer, models

    path = tmp_path / "wl.json"
    Tokenizer(models.WordLevel({f"w{i}": i for i in range(300)}, unk_token="w0")).save(str(path))
    assert _printed_vocab() == 256  # byte
    assert _printed_vocab("data.tokenizer=bpe") == 4096
    assert _printed_vocab("data.tokenizer=bpe", "data.bpe_vocab_size=1000") == 1024
    # 300 words + the EOS added for a tokenizer without one, rounded up to a multiple of 128
    assert _printed_vocab(f"data.tokenizer={path}") == 384
    assert _printed_vocab("data.tokenizer=bpe", "model.vocab_size=5000") == 5000
