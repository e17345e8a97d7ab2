import pytest

from boost_jax.config import ConfigError, load_config
from boost_jax.errors import UserError
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
    ("data.seq_len=4096", "exceeds model.max_seq_len=.*; set model.max_seq_len=4096"),
    ("data.seq_len=2000000", "exceeds model.max_seq_len=128; set a data.seq_len <= 128 "
     "\\(model.max_seq_len can go up to 1048576"),
    ("steps", "must look like key=value"),
    ("model.max_seq_len=99999999999", "is above 1048576 .2\\^20. tokens"),
    ("model.init_std=1e308", "far above any useful scale"),
    # 0 in fp32: the Pallas norms' padded rows then gave an all-NaN gradient of the gain
    ("model.norm_eps=1e-50", r"below float32's smallest normal number \(1\.2e-38\)"),
    ("data.sources=[{path: a.bin, weight: 1e308}, {path: b.bin, weight: 1e308}]",
     "are out of scale"),
    # a whole section set to a scalar used to fall back to the defaults without a word
    ("model=0", r"^model=0 sets a whole section: give its keys, e\.g\. model\.KEY=VALUE"),
    ("model=null", "model=None sets a whole section"),
    ("train=[]", r"train=\[\] sets a whole section"),
    # YAML 1.1 read these as octal 8 and base-60 90
    ("train.steps=010", "train.steps='010' has the wrong type"),
    ("train.steps=1:30", "train.steps='1:30' has the wrong type"),
    ("model.vocab_size=1000000000000", r"is above 2147483647 \(int32 token ids\)"),
    ("model.n_kv_heads=0", "model.n_kv_heads=0 must be > 0"),
    ("train.eval_batches=1000000000000", "tokens of eval batches .* use at most"),
    # one batch alone too many: fewer batches cannot help
    ("train.global_batch=10000000", "one batch alone holds too many: use a smaller "
                                    r"train\.global_batch or data\.seq_len$"),
    ("distributed.init_timeout_s=2147483648", r"must be in 1\.\.2147483647 seconds"),
    # a wrong field of a mixture entry is named, not the whole list's type
    ("data.sources=[{path: a.bin, weight: abc}]",
     r"^data\.sources\[0\]\.weight='abc' has the wrong type: expected float$"),
    # what was typed, not the on/off YAML turned the boolean into
    ("model.lax_gate=no", r"^model\.lax_gate=false \(YAML reads no/off as a boolean\) is not "
                          r"valid: expected one of 'identity', 'gate'$"),
    ("optim.lr=١e-٣", r"optim\.lr='١e-٣' has the wrong type"),  # not 0.001
])
def test_bad_input_errors(override, match):
    with pytest.raises(ConfigError, match=match):
        load_config(None, [override])


def test_a_section_override_merges_and_a_file_reads_numbers_as_written(tmp_path):
    """`optim={lr: ...}` changes that key of the file's optim section and keeps the rest; a
    file's `1:30` or `010` is text, refused where a number goes."""
    path = tmp_path / "c.yaml"
    path.write_text("optim:\n  lr: 0.01\n  warmup_frac: 0.05\nmodel:\n")
    cfg = load_config(str(path), ["optim={lr: 0.001}"])
    assert cfg.optim.lr == pytest.approx(1e-3) and cfg.optim.warmup_frac == pytest.approx(0.05)
    assert cfg.model.d_model == load_config(None).model.d_model  # an empty section: defaults
    path.write_text("train:\n  stop_after: 1:30\n")
    with pytest.raises(ConfigError, match="train.stop_after='1:30' has the wrong type"):
        load_config(str(path))
    with pytest.raises(UserError, match=r"data\.bpe_vocab_size=999999999999 is above "):
        load_config(None, ["data.tokenizer=bpe", "data.bpe_vocab_size=999999999999"])


def test_all_shipped_configs_load():
    import glob

    paths = sorted(glob.glob(f"{ROOT}/configs/*.yaml"))
    assert len(paths) >= 11
    for p in paths:
        load_config(p)


def test_text_keys_take_the_value_as_typed_others_as_yaml():
    """`out_dir=/a #b` is that path (YAML would cut the comment), `yes` a name, not true; a
    YAML null is None only where the key allows it; other keys are read as YAML."""
    for raw in ("/tmp/a #b", "yes", "'q'", " sp ", "[a]", "1e3"):
        assert load_config(None, [f"out_dir={raw}"]).out_dir == raw
    assert load_config(None, ["model.init_from=null"]).model.init_from is None
    assert load_config(None, ["model.init_from=runs/x #1"],
                       validate=False).model.init_from == "runs/x #1"
    cfg = load_config(None, ["optim.lr=1e-3", "train.steps=7"])
    assert (cfg.optim.lr, cfg.train.steps) == (1e-3, 7)
    with pytest.raises(ConfigError, match="control character"):
        load_config(None, ["out_dir=a\x85b"])


def test_deep_nesting_and_a_folder_are_one_line(tmp_path):
    """A config or override nested past Python's recursion limit, and a folder given as the
    config file: ConfigErrors that say so, not a RecursionError or 'does not exist'."""
    deep = tmp_path / "deep.yaml"
    deep.write_text("a: " + "[" * 100_000 + "]" * 100_000 + "\n")
    with pytest.raises(ConfigError, match="nests too deeply"):
        load_config(str(deep))
    with pytest.raises(ConfigError, match="nests too deeply"):
        load_config(None, ["train.steps=" + "[" * 5000 + "]" * 5000])
    with pytest.raises(ConfigError, match="is a folder"):
        load_config(str(tmp_path))


@pytest.mark.parametrize("argv", [["--cpu-devcies", "8"], ["a.b=1", "--cpu-devcies", "8"],
                                  ["--cpu-devcies", "8", "a.b=1"]])
def test_an_unknown_option_reads_the_same_wherever_it_stands(argv, capsys):
    from boost_jax.cli import OverrideParser

    with pytest.raises(SystemExit) as e:
        OverrideParser(prog="train.py").parse(argv)
    assert e.value.code == 2
    assert capsys.readouterr().err == ("error: unrecognized arguments: --cpu-devcies; see "
                                       "train.py --help\n")


def test_a_second_config_is_refused_not_dropped(capsys):
    from boost_jax.cli import OverrideParser

    with pytest.raises(SystemExit) as e:
        OverrideParser(prog="train.py").parse(["--config", "a.yaml", "x=1", "--config", "b.yaml"])
    assert e.value.code == 2
    assert capsys.readouterr().err.startswith(
        "error: --config is given twice ('a.yaml' and 'b.yaml'); give one")
    assert OverrideParser(prog="train.py").parse(["--config", "a.yaml"]).config == "a.yaml"


def test_a_file_read_strictly_but_never_endlessly(tmp_path):
    """A self-referencing alias, aliases that expand a tiny file to billions of items, a
    dotted key in a file, and an empty section overridden: one short line each, or defaults."""
    path = tmp_path / "c.yaml"
    cases = [("train: &a {x: *a}\n", r"^unknown config key 'train\.x\.x\.x\.x\.x'; "),
             ("model: [" + ", ".join(f"&a{i} [" + ", ".join([f"*a{i - 1}" if i else "x"] * 10)
                                      + "]" for i in range(8)) + "]\n",
              r"^model must be a mapping, got \[\["),
             ("train.steps: 5\n", r"^config key 'train\.steps' is written dotted in a file; "
                                  r"nest it: train: on one line, then steps: \.\.\. indented")]
    for text, match in cases:
        path.write_text(text)
        with pytest.raises(ConfigError, match=match) as e:
            load_config(str(path))
        assert len(str(e.value)) < 300
    path.write_text("model:\ntrain:\n  steps: 10\n")
    for override in ("model.d_model=64", "model={d_model: 64}"):
        cfg = load_config(str(path), [override])
        assert (cfg.model.d_model, cfg.train.steps) == (64, 10)
