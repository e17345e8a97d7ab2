"""out_dir's lock (train/run_lock.py) when a refused run removes it: the folders the run made go,
anything else stays, and a run that opened the removed file opens the path's file again."""

import os

import pytest

from boost_jax.errors import UserError
from boost_jax.train import run_lock


def _refused(out_dir, fresh, before=lambda: None):
    with pytest.raises(UserError, match="bad data"):
        with run_lock.hold_out_dir(str(out_dir), True, 1, print, fresh=fresh):
            before()
            raise UserError("bad data")


def test_a_refused_run_removes_only_what_it_made(tmp_path):
    out = tmp_path / "a" / "b"
    fresh = run_lock.fresh_dirs(str(out))
    assert fresh == [str(tmp_path / "a"), str(out)]
    out.mkdir(parents=True)
    _refused(out, fresh)
    assert os.listdir(tmp_path) == []  # out_dir and the parent it made are gone

    (tmp_path / "mine").mkdir()  # an empty folder of the user's: kept, left empty
    _refused(tmp_path / "mine", run_lock.fresh_dirs(str(tmp_path / "mine")))
    assert os.listdir(tmp_path / "mine") == []

    out.mkdir(parents=True)  # something written meanwhile: everything stays, lock included
    _refused(out, fresh, lambda: (out / "notes.txt").write_text("mine"))
    assert sorted(os.listdir(out)) == [run_lock.LOCK_FILE, "notes.txt"]
    assert run_lock.fresh_dirs(str(out)) is None  # and a folder that holds anything is not fresh


def test_a_lock_file_unlinked_after_another_run_opened_it_is_opened_anew(tmp_path, monkeypatch):
    first = run_lock.RunLock(str(tmp_path))
    assert first.acquire() == (True, None)
    opened, real_open = [], os.open

    def open_then_first_leaves(path, flags, mode=0o777):
        fd = real_open(path, flags, mode)
        if not opened:  # the second run has opened the file; the first one removes it
            first.release(remove=True)
        opened.append(fd)
        return fd

    monkeypatch.setattr(run_lock.os, "open", open_then_first_leaves)
    second = run_lock.RunLock(str(tmp_path))
    assert second.acquire() == (True, None)
    monkeypatch.undo()
    assert len(opened) == 2  # the unlinked file was let go, the path's new file locked
    assert os.path.samestat(os.fstat(second._fd), os.stat(second.path))
    with pytest.raises(run_lock.OutDirBusy):
        run_lock.RunLock(str(tmp_path)).acquire()
    second.release()


def test_a_lock_file_no_run_wrote_is_the_users(tmp_path):
    """A .lock holding anything but a run's record is refused, never emptied or taken over, and
    is no sign of a run (holds_run); an empty one or a dead run's record is."""
    from boost_jax.checkpoints.run_config import holds_run

    lock = tmp_path / run_lock.LOCK_FILE
    lock.write_text("my lock notes\n")
    with pytest.raises(UserError, match=r"holds \.lock, a file no run wrote .*; move it away"):
        run_lock.RunLock(str(tmp_path)).acquire()
    assert lock.read_text() == "my lock notes\n" and not holds_run(str(tmp_path))
    lock.write_text('{"pid": 12, "host": "n1", "started": 0, "argv": ["train.py"]}')
    assert holds_run(str(tmp_path))
    held = run_lock.RunLock(str(tmp_path))
    locked, stale = held.acquire()  # a dead run's record: taken over, reported
    assert locked and stale["pid"] == 12
    held.release()
    assert lock.read_text() == "" and holds_run(str(tmp_path))
    for crashed in (b"\0" * 64, b'{"pid": 12, "host": "n1", "sta'):  # zeros, or cut short
        lock.write_bytes(crashed)
        assert holds_run(str(tmp_path))
        held = run_lock.RunLock(str(tmp_path))
        assert held.acquire()[0]
        held.release()
