"""Nothing lost: boost_jax/safe_write.py's rules one by one, in-process. The rules that need a
second process, and every command that writes run as a subprocess on the cases that lost data:
tests/e2e/test_safe_write.py."""

import os
import re

import pytest

from boost_jax import safe_write as sw
from boost_jax.safe_write import Refused
from file_modes import _mode, _umask


# --------------------------------------------------------------------------- the module


def test_train_outputs_never_touch_data_source_or_init_from(tmp_path):
    from types import SimpleNamespace

    from boost_jax.checkpoints.run_config import check_inputs

    corpus = tmp_path / "corpus"
    corpus.mkdir()

    def cfg(source, init_from=None, tokenizer="byte"):
        return SimpleNamespace(data=SimpleNamespace(source=str(source), sources=None,
                                                    tokenizer=tokenizer),
                               model=SimpleNamespace(init_from=init_from))

    with pytest.raises(Refused, match=r"^the run's config\.yaml '.*/corpus/run/config\.yaml' "
                                      r"lies inside data\.source '.*/corpus'; .*: choose another "
                                      r"out_dir=\.\.\.$"):
        check_inputs(cfg(corpus), str(corpus / "run"))  # its metrics.jsonl would be read back
    with pytest.raises(Refused, match=r"^the run's metrics\.jsonl .* is data\.source"):
        check_inputs(cfg(tmp_path / "r" / "metrics.jsonl"), str(tmp_path / "r"))
    with pytest.raises(Refused, match=r"^the run's checkpoints .* contains model\.init_from"):
        check_inputs(cfg("stdlib", str(tmp_path / "r" / "checkpoints" / "hf")), str(tmp_path / "r"))
    with pytest.raises(Refused, match=r"^the run's summary\.json .* is the metadata of "
                                      r"data\.source"):  # its .json is not named in the config
        check_inputs(cfg(tmp_path / "r" / "summary.bin"), str(tmp_path / "r"))
    with pytest.raises(Refused, match=r"^the run's tokenizer .* contains data\.tokenizer"):
        check_inputs(cfg("stdlib", tokenizer=str(tmp_path / "r" / "tokenizer" / "t.json")),
                     str(tmp_path / "r"))
    check_inputs(cfg(corpus / "a.txt"), str(tmp_path / "run"))  # beside the data: fine
    check_inputs(cfg("stdlib"), str(tmp_path / "run"))


def test_refuse_existing_names_every_file_unless_forced(tmp_path):
    a, b, c = (str(tmp_path / n) for n in "abc")
    open(a, "w").close()
    open(b, "w").close()
    with pytest.raises(Refused, match=r"^'.*/a' and '.*/b' already exist; pass --force to "
                                      r"replace them, or fix it$"):
        sw.refuse_existing([a, b, c], False, "fix it")
    sw.refuse_existing([a, b, c], True, "fix it")
    sw.refuse_existing([c], False, "fix it")


@pytest.mark.parametrize("anonymous", [True, False], ids=["o_tmpfile", "named_temp"])
def test_write_text_publishes_whole_with_the_umask_and_never_replaces_unforced(
        tmp_path, monkeypatch, anonymous):
    if not anonymous:
        monkeypatch.setattr(sw, "_anonymous", lambda d: None)
    target = str(tmp_path / "job.sbatch")
    with _umask(0o027):
        sw.write_text(target, "#!/bin/bash\n", force=False, executable=True)
        assert _mode(target) == 0o750
        sw.write_text(str(tmp_path / "c.yaml"), "a: 1\n", force=False)
        assert _mode(tmp_path / "c.yaml") == 0o640
    with pytest.raises(Refused, match="appeared while this command was writing it"):
        sw.write_text(target, "other\n", force=False)
    assert open(target).read() == "#!/bin/bash\n"
    sw.write_text(target, "new\n", force=True)
    assert open(target).read() == "new\n"
    assert sorted(os.listdir(tmp_path)) == ["c.yaml", "job.sbatch"]  # no temp file left


def test_a_failed_write_leaves_no_temp_file(tmp_path, monkeypatch):
    for anonymous in (True, False):
        if not anonymous:
            monkeypatch.setattr(sw, "_anonymous", lambda d: None)
        with pytest.raises(ZeroDivisionError):
            with sw.Staged(str(tmp_path / "x.bin")) as s:
                s.file.write(b"half")
                1 / 0
        assert os.listdir(tmp_path) == []


def test_publish_pair_metadata_first_and_takes_back_a_half_pair(tmp_path):
    meta, data = str(tmp_path / "c.json"), str(tmp_path / "c.bin")
    open(data, "wb").write(b"someone else's")
    m, d = sw.Staged(meta, text=True), sw.Staged(data)
    m.file.write("{}")
    d.file.write(b"ids")
    with pytest.raises(Refused):  # the data target exists: the metadata is taken back
        sw.publish([m, d], replace=False)
    assert sorted(os.listdir(tmp_path)) == ["c.bin"]
    assert open(data, "rb").read() == b"someone else's"
    m, d = sw.Staged(meta, text=True), sw.Staged(data)
    m.file.write("{}")
    d.file.write(b"ids")
    sw.publish([m, d], replace=True)
    assert open(data, "rb").read() == b"ids" and open(meta).read() == "{}"


def test_folders_follow_the_umask_and_replace_only_when_asked(tmp_path):
    target = str(tmp_path / "export")
    with _umask(0o022):
        tmp = sw.staged_dir(target)
        assert _mode(tmp) == 0o755  # mkdtemp alone makes 0700
    open(os.path.join(tmp, "a"), "w").close()
    sw.publish_dir(tmp, target, replace=False)
    tmp = sw.staged_dir(target)
    open(os.path.join(tmp, "b"), "w").close()
    with pytest.raises(Refused, match="appeared while"):
        sw.publish_dir(tmp, target, replace=False)
    sw.publish_dir(tmp, target, replace=True)
    assert os.listdir(target) == ["b"] and sorted(os.listdir(tmp_path)) == ["export"]


def test_out_dir_entries_of_the_wrong_kind_are_one_line(tmp_path):
    """A run folder whose lock or metrics.jsonl is a folder, or whose configs/ is a file, is
    refused before the run starts (it raised IsADirectoryError / FileExistsError mid-run)."""
    from boost_jax.checkpoints import run_config

    for name, folder, kind in ((".lock", True, "folder"), ("metrics.jsonl", True, "folder"),
                               ("configs", False, "file"), ("checkpoints", False, "file")):
        d = tmp_path / name.strip(".")
        d.mkdir()
        (d / name).mkdir() if folder else (d / name).write_text("x")
        with pytest.raises(Refused, match=f"holds {name} as a {kind} where a run keeps"):
            run_config.check_out_dir(str(d), force=True)


def test_a_hand_edited_config_yaml_is_kept_and_old_runs_are_runs(tmp_path):
    """record(): config.yaml edited by hand since the run wrote it (and perhaps given back as
    --config) is kept as configs/NNN-edited.yaml before the new one is written; an unchanged
    one is not copied. holds_run: a run from before locks and seals (checkpoint steps with
    their state/data/meta items) is a run; a bare checkpoints/3/ is not."""
    from boost_jax.checkpoints import run_config as rc
    from boost_jax.config import load_config

    run = str(tmp_path / "run")
    rc.record(run, load_config(None, ["train.steps=100"]), 0)
    rc.record(run, load_config(None, ["train.steps=100"]), 10)
    assert os.listdir(os.path.join(run, "configs")) == ["000-step0.yaml"]
    cfg = os.path.join(run, "config.yaml")
    edited = open(cfg).read().replace("steps: 100", "steps: 200  # mine")
    with open(cfg, "w") as f:
        f.write(edited)
    rc.record(run, load_config(cfg, ["train.steps=300"]), 50)
    assert sorted(os.listdir(os.path.join(run, "configs"))) == \
        ["000-step0.yaml", "001-edited.yaml", "002-step50.yaml"]
    assert open(os.path.join(run, "configs", "001-edited.yaml")).read() == edited
    assert "steps: 300" in open(cfg).read()
    old = tmp_path / "old"
    for item in ("state", "data", "meta"):
        (old / "checkpoints" / "100" / item).mkdir(parents=True)
    (old / "summary.json").write_text("{}")
    assert rc.holds_run(str(old))
    rc.check_out_dir(str(old), force=False)
    bare = tmp_path / "bare"
    (bare / "checkpoints" / "3").mkdir(parents=True)
    assert not rc.holds_run(str(bare))


def test_a_config_yaml_that_is_not_utf8_reads_as_none(tmp_path):
    """load_saved (resume checks, generate/evaluate) treats bytes that are not UTF-8 like any
    unreadable config, not as a UnicodeDecodeError traceback."""
    from boost_jax.checkpoints.run_config import load_saved

    (tmp_path / "config.yaml").write_bytes(b"model: [\n\x00\xff\xfe")
    assert load_saved(str(tmp_path / "config.yaml")) is None


def test_run_files_that_are_links_or_fifos_are_refused_even_forced(tmp_path):
    """summary.json, metrics.jsonl, run.log and loss.png are written or appended through a link:
    a link to the user's file would be overwritten; a FIFO would block the run."""
    import os

    from boost_jax.checkpoints import run_config

    victim = tmp_path / "victim.txt"
    victim.write_text("keep")
    for name in ("summary.json", "metrics.jsonl", "run.log", "loss.png", "wandb_run_id"):
        d = tmp_path / f"l_{name}"
        d.mkdir()
        os.symlink(victim, d / name)
        with pytest.raises(Refused, match=rf"^the run's {re.escape(name)} '.*' is a link \(to "
                                          r"'.*victim\.txt'\)"):
            run_config.check_out_dir(str(d), force=True)
    d = tmp_path / "fifo"
    d.mkdir()
    os.mkfifo(d / "tb")
    with pytest.raises(Refused, match=r"^the run's tb '.*' is a FIFO, not a folder"):
        run_config.check_out_dir(str(d), force=True)
    assert victim.read_text() == "keep"


def test_an_input_named_as_a_writers_lock_or_temp_file_is_refused(tmp_path):
    """A writer takes .NAME.lock and .NAME.*.boost_jax.tmp beside its target: an input of those
    names is refused (its lock would empty it, its sweep delete it), even forced; a run's lock
    is never its data.source."""
    from types import SimpleNamespace

    from boost_jax.checkpoints.run_config import check_inputs

    out = str(tmp_path / "d.bin")
    for name in (".d.bin.lock", ".d.bin.x1.boost_jax.tmp"):
        with pytest.raises(Refused, match=r"^OUT .* would write its lock or temp file over "
                                          rf"SOURCE '.*/\.d\.bin\..*'; .*\(--force does not"):
            sw.refuse_inputs(out, {"SOURCE": str(tmp_path / name)}, f"OUT {out!r}", "fix")
    sw.refuse_inputs(out, {"SOURCE": str(tmp_path / ".d.bin.notes")}, "OUT", "fix")
    cfg = SimpleNamespace(data=SimpleNamespace(source=str(tmp_path / "r" / ".lock"),
                                               sources=None, tokenizer="byte"),
                          model=SimpleNamespace(init_from=None))
    with pytest.raises(Refused, match=r"^the run's \.lock .* is data\.source"):
        check_inputs(cfg, str(tmp_path / "r"))


def test_a_file_target_is_never_a_link_an_empty_path_or_a_folders_name(tmp_path):
    (tmp_path / "user.txt").write_text("mine")
    os.symlink("user.txt", tmp_path / "ul")
    cases = {str(tmp_path / "ul"): r"is a link \(to '.*/user\.txt'\), not a regular file",
             "": r"is an empty path", str(tmp_path / "new") + "/": r"names a folder, not a file",
             ".": r"names a folder"}
    for target, why in cases.items():
        with pytest.raises(Refused, match=rf"^--out {re.escape(repr(target))} {why}"):
            sw.check_target(target, {}, True, f"--out {target!r}", "choose another --out")
    assert os.path.islink(tmp_path / "ul") and (tmp_path / "user.txt").read_text() == "mine"
    assert not os.path.exists(tmp_path / "new")
    sw.check_target(str(tmp_path / "user.txt"), {}, True, "--out", "fix")  # a file: forced, ok
    # what a config names (prepare's OUT, an export) cannot hold a control character
    sw.check_target(str(tmp_path / "nl\nx.yaml"), {}, True, "--out", "fix")
    with pytest.raises(Refused, match=r"^OUT '.*' holds a control character \(\\n\), which "
                                      r"no config can name; fix$"):
        sw.refuse_unusable(str(tmp_path / "nl\nx.bin"), f"OUT {str(tmp_path / 'nl')!r}", "fix",
                           config_value=True)
    with pytest.raises(Refused, match=r"holds a control character \(\\t\)"):
        sw.refuse_unusable(str(tmp_path / "a\tb"), "--out", "fix", folder=True,
                           config_value=True)
    # nor bytes that are not UTF-8 (train.py refused the data.source prepare printed)
    with pytest.raises(Refused, match=r"^OUT is not UTF-8 text, which no config can name; fix$"):
        sw.refuse_unusable(str(tmp_path / "o\udcffut.bin"), "OUT", "fix", config_value=True)


def test_prepare_never_writes_over_a_file_it_reads_through_a_link_in_source(tmp_path):
    from boost_jax.data.prepare import prepare

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("a document\n")
    (tmp_path / "old.json").write_text("precious notes\n")
    os.symlink("../old.json", corpus / "link.txt")
    (tmp_path / "old.bin").write_bytes(b"x")
    with pytest.raises(Refused, match=r"^the metadata file '.*old\.json' of OUT is a file of "
                                      r"SOURCE, '.*link\.txt', linked to '.*old\.json'; .*"
                                      r"\(--force does not"):
        prepare(str(corpus), str(tmp_path / "old.bin"), "byte", force=True, progress=False)
    assert (tmp_path / "old.json").read_text() == "precious notes\n"
    assert (tmp_path / "old.bin").read_bytes() == b"x"


def test_publish_dir_replaces_the_folder_it_runs_in(tmp_path, monkeypatch):
    """export --force --out . from inside an earlier export: "." cannot be renamed (EBUSY), its
    full path can."""
    target = tmp_path / "hf"
    target.mkdir()
    (target / "old.json").write_text("x")
    monkeypatch.chdir(target)
    tmp = sw.staged_dir(".")
    with open(os.path.join(tmp, "new.json"), "w") as f:
        f.write("y")
    sw.publish_dir(tmp, ".", replace=True)
    assert os.listdir(target) == ["new.json"]


def test_export_never_replaces_the_folder_of_the_tokenizer_it_exports(tmp_path, monkeypatch):
    """The run's data.tokenizer is read to be exported: an --out that holds it is refused, even
    with --force, before anything is written."""
    import types

    from boost_jax import export
    from boost_jax.infer import load

    earlier = tmp_path / "hf" / "a"
    earlier.mkdir(parents=True)
    (earlier / "tokenizer.json").write_text("the tokenizer the run trained with")
    from boost_jax.export_manifest import write_manifest

    write_manifest(str(earlier))  # an earlier export, which --force alone would replace
    data = types.SimpleNamespace(tokenizer=str(earlier / "tokenizer.json"))
    run = types.SimpleNamespace(cfg=types.SimpleNamespace(data=data))
    monkeypatch.setattr(load, "open_run", lambda run_dir, step: run)
    with pytest.raises(Refused, match=r"--out '.*/hf/a' contains data\.tokenizer '.*'"):
        export.export(str(tmp_path / "run"), str(earlier), force=True)
    assert sorted(os.listdir(earlier)) == ["boost_jax_export.json", "tokenizer.json"]
