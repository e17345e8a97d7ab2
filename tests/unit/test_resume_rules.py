"""What a resume may change (checkpoints/run_config.check_resume): a setting that gives the
train state other arrays is refused in one line, whatever checkpoint.accept_changes says, since
no restore could take it."""

import pytest

from boost_jax.config import load_config
from boost_jax.errors import UserError


def test_a_resume_that_would_change_the_state_arrays_is_refused_even_if_accepted():
    """model.param_dtype (bf16 adds an fp32 master copy), model.family, GPT-2's max_seq_len and
    Adafactor between a zero and a non-zero weight decay give the state other arrays: refused
    in one line whatever checkpoint.accept_changes says; a decay from 0.1 to 0.05 is not."""
    from boost_jax.checkpoints.run_config import check_resume

    for base, change in ((["model.param_dtype=float32"], "model.param_dtype=bfloat16"),
                         ([], "model.family=gpt_neox"),
                         (["model.family=gpt2"], "model.max_seq_len=512")):
        saved = load_config(None, base).to_dict()
        key = change.split("=")[0]
        with pytest.raises(UserError, match=rf"has a different model \({key} .*cannot take the"):
            check_resume(saved, load_config(None, [*base, change,
                                                   f"checkpoint.accept_changes=[{key}]"]),
                         8, "runs/x")
    ada = ["optim.name=adafactor", "optim.weight_decay=0.1"]
    saved = load_config(None, ada).to_dict()
    assert check_resume(saved, load_config(None, [*ada, "optim.weight_decay=0.05"]), 8, "r") \
        == [("optim.weight_decay", 0.1, 0.05)]
    with pytest.raises(UserError, match=r"holds Adafactor's state with its weight-decay stage, "
                                        r"which optim\.weight_decay 0\.1 -> 0\.0 would drop"):
        check_resume(saved, load_config(None, [*ada, "optim.weight_decay=0"]), 8, "r")


def test_a_resume_that_respreads_the_schedule_says_where_the_lr_lands():
    """Raising train.steps of a finished cosine run re-spreads the schedule: the resume warns
    with the next update's lr against the last one's (from the schedules themselves); a
    constant schedule moves nothing and says nothing."""
    from boost_jax.step.optim import lr_schedule
    from boost_jax.train.loop import _schedule_moved

    cfg = load_config(None, ["optim.schedule=cosine", "train.steps=10"])
    line = _schedule_moved(cfg, 6, [("train.steps", 6, 10)])
    was = lr_schedule(cfg.optim, 6)(6)  # the finished run's: its end value
    now = lr_schedule(cfg.optim, 10)(6)
    assert now > 2 * was and was == pytest.approx(cfg.optim.lr * cfg.optim.min_lr_ratio)
    assert line == (f"train.steps changed, so optim.schedule=cosine now spans train.steps=10: "
                    f"update 7 runs at lr {now:.3g}, where the saved run's schedule gives "
                    f"{was:.3g}")
    flat = load_config(None, ["optim.schedule=constant", "optim.warmup_frac=0", "train.steps=10"])
    assert _schedule_moved(flat, 6, [("train.steps", 6, 10)]) is None
    # not the schedule's settings, or the same schedule mid-warmup: nothing moved
    warm = load_config(None, ["train.steps=8", "optim.warmup_frac=0.5"])
    assert _schedule_moved(warm, 2, [("optim.clip_norm", 1.0, 0.4)]) is None
    assert _schedule_moved(cfg, 6, [("data.workers", 0, 2)]) is None
    assert "optim.lr changed" in _schedule_moved(cfg, 3, [("optim.lr", 0.1, cfg.optim.lr)])
