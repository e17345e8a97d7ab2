"""Settings and inputs that used to be accepted and mean nothing are refused: a text corpus that
turns binary after its first 64 KiB (training and prepare), a rotary fraction that rounds to no
rotated dimension, profile steps outside the run."""

import re

import pytest

from boost_jax.config import load_config
from boost_jax.errors import UserError


def _late_binary(path, text_kib=200):
    path.write_bytes(b"def f(x):\n    return x\n" * (text_kib * 1024 // 24) + bytes(range(256)) * 400)
    return path


def test_a_text_file_that_turns_binary_late_is_refused(tmp_path):
    from boost_jax.data.prepare import prepare
    from boost_jax.data.sources import read_documents

    src = _late_binary(tmp_path / "late.txt")
    with pytest.raises(UserError, match=r"^data\.source '.*late\.txt' is not text \(it holds NUL "
                                        r"bytes at byte 131,072\); point data\.source at UTF-8"):
        read_documents(str(src), None)
    (tmp_path / "dir").mkdir()
    _late_binary(tmp_path / "dir" / "a.md")
    with pytest.raises(UserError, match=r"^data\.source file '.*a\.md' is not text \(it holds "
                                        r"NUL bytes at byte"):
        read_documents(str(tmp_path / "dir"), None)
    with pytest.raises(UserError, match=r"^SOURCE file '.*late\.txt' is not text \(it holds NUL "
                                        r"bytes at byte 131,072\)"):
        prepare(str(src), str(tmp_path / "o.bin"), "byte", progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dir", "late.txt"]
    latin = tmp_path / "latin.txt"  # a few stray bytes past the head stay accepted
    latin.write_bytes(b"caf\xe9 au lait\n" * 20000)
    assert read_documents(str(latin), None)


@pytest.mark.parametrize("pct,dims", [(0.01, 0), (0.015, 0)])
def test_a_rotary_fraction_that_rounds_to_no_dimension_is_refused(pct, dims):
    # head_dim 64: 0.01 -> 0.64 dims and 0.015 -> 0.96 both round down to none
    with pytest.raises(UserError, match=rf"^model\.rotary_pct={pct} rotates {dims} of the 64 "
                                        r"dims of a head, so RoPE encodes no position; use at "
                                        r"least 2/head_dim = 0\.03125$"):
        load_config(None, ["model.family=gpt_neox", "model.d_model=256", "model.n_heads=4",
                           f"model.rotary_pct={pct}"])
    cfg = load_config(None, ["model.family=gpt_neox", "model.d_model=256", "model.n_heads=4",
                             "model.rotary_pct=0.03125"])
    assert cfg.model.rotary_dims == 2


def test_profile_steps_outside_the_run_are_refused():
    for p in ("[5,12]", "[11,12]"):
        with pytest.raises(UserError, match=re.escape(f"train.profile_steps={p.replace(',', ', ')}")
                           + r" reaches past the run's last step \(train\.steps=10\)"):
            load_config(None, ["train.steps=10", f"train.profile_steps={p}"])
    assert load_config(None, ["train.steps=10", "train.profile_steps=[9,10]"])
