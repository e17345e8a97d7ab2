"""The rule every command that writes follows (train.py, export, data.prepare, plan
--emit-config, launch slurm, analysis.comm --dump-hlo):

1. It never deletes or overwrites a file it did not create in this run unless the user passed
   --force (`refuse_existing`); never, even forced, anything but a regular file or folder (a
   device, FIFO, socket, or a link where a file goes: `refuse_special`), an empty path or a
   folder's name for a file (`refuse_unusable`).
2. With or without --force it refuses a target that is, contains or lies inside one of its
   inputs (the run it reads, the source, the config, the tokenizer), or whose lock or temp
   file would take an input's name (`refuse_inputs`).
3. A file is published whole: written to a temp file in the target's own directory, then linked
   or renamed onto the target in one step (`Staged`). Where the filesystem supports it the temp
   file has no name at all (O_TMPFILE), so a process killed mid-write leaves nothing behind;
   elsewhere it is a unique `.NAME.*.boost_jax.tmp` (TMP_SUFFIX: the only names a later
   writer's sweep removes). Files that go together (a .bin and its metadata) are published
   metadata first, data last (`publish`): no reader finds data without its metadata.
4. Concurrent writers of one target: one wins, the other stops with one line. Without --force a
   target is created with link(), which fails if it appeared meanwhile; long writers also hold
   `exclusive`, an flock on `.NAME.lock` next to the target, from the start. Whatever else
   holds that name (a symlink, a folder, a FIFO, a file without a lock record) is the user's:
   refused, never written through or removed.

Published files and folders follow the umask (0644 / 0755 under umask 022) whatever mode the
temp file was created with.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import re
import secrets
import shutil
import socket
import stat
import tempfile
from typing import IO, Iterable, Optional

from boost_jax.errors import UserError


# the end of every temp name our writers make: what a later writer's sweep may remove
TMP_SUFFIX = ".boost_jax.tmp"
# what a lock file holds (empty where the disk was full): a file of that name holding anything
# else is the user's
LOCK_RECORD = re.compile(r"pid \d+ on host \S*")


class Refused(UserError):
    """A write the rule forbids; one line naming the problem and the fix."""


def umask() -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)  # no other way to read it; restored at once
    os.umask(mask)
    return mask


def file_mode(executable: bool = False) -> int:
    return (0o777 if executable else 0o666) & ~umask()


def dir_mode() -> int:
    return 0o777 & ~umask()


# --------------------------------------------------------------------------- what may be written


def _real(path: str) -> str:
    return os.path.realpath(os.path.abspath(path))


def _inside(path: str, folder: str) -> bool:
    return os.path.commonpath([path, folder]) == folder and path != folder


def _same(a: str, b: str) -> bool:
    try:
        return os.path.samefile(a, b)  # also hard links and bind mounts
    except OSError:
        return _real(a) == _real(b)


def refuse_inputs(target: str, inputs: dict, what: str, fix: str) -> None:
    """Refuse `target` (labelled `what`, e.g. "--out 'x'") if it is, contains or lies inside an
    input ({label: path}; None paths are skipped), or if an input bears a name the writer of
    `target` takes beside it (its lock file, its temp files). --force does not lift this."""
    t = _real(target)
    for label, path in inputs.items():
        if not path:
            continue
        p = _real(path)
        if _same(target, path):
            how = "is"
        elif _inside(p, t):
            how = "contains"
        elif _inside(t, p):
            how = "lies inside"
        elif _beside(target, path):
            how = "would write its lock or temp file over"
        else:
            continue
        raise Refused(f"{what} {how} {label} {path!r}; writing it would destroy what this "
                      f"command reads (--force does not change that): {fix}")


def _beside(target: str, path: str) -> bool:
    """`path` is the lock file of `target` or named as one of its temp files (`_sweep`)."""
    if _same(lock_path(target), path):
        return True
    d, name = os.path.split(_real(target))
    pd, pname = os.path.split(_real(path))
    return pd == d and pname.startswith(f".{name}.") and pname.endswith(TMP_SUFFIX)


def leaving(paths: list, folder: str) -> list:
    """Those of `paths` whose real location lies outside `folder` (reached through a link):
    what a check of `folder` as a whole does not cover."""
    root = _real(folder)
    return [p for p in paths if not _inside(_real(p), root) and _real(p) != root]


def refuse_unusable(target: str, what: str, fix: str, folder: bool = False,
                    config_value: bool = False) -> None:
    """Refuse an empty path, and where a file is to be written (not a `folder`) one that ends
    in a separator (a folder's name). With `config_value` (what is written is named in a
    config: a corpus, an export), also one holding a control character, which a config value
    may not hold."""
    from boost_jax.errors import control_char, lone_surrogate

    if not target:
        raise Refused(f"{what} is an empty path; {fix}")
    bad = control_char(target) if config_value else None
    if bad is not None:
        raise Refused(f"{what} holds a control character ({bad}), which no config can name; "
                      f"{fix}")
    if config_value and lone_surrogate(target) is not None:  # argv bytes that are not UTF-8
        raise Refused(f"{what} is not UTF-8 text, which no config can name; {fix}")
    if folder:
        return
    if target.endswith((os.sep, "/.", "/..")) or target in (".", ".."):
        raise Refused(f"{what} names a folder, not a file; {fix}")


def _names(paths: list) -> str:
    quoted = [repr(p) for p in paths]
    return quoted[0] if len(quoted) == 1 else ", ".join(quoted[:-1]) + " and " + quoted[-1]


def refuse_existing(paths: Iterable[str], force: bool, fix: str, what: str = "") -> None:
    """Without --force, refuse if any of `paths` exists (named in the line, or called `what`)."""
    if force:
        return
    there = [p for p in paths if os.path.lexists(p)]
    if there:
        one = len(there) == 1
        raise Refused(f"{what or _names(there)} already {'exists' if one else 'exist'}; pass "
                      f"--force to replace {'it' if one else 'them'}, or {fix}")


def refuse_special(target: str, what: str, fix: str, folder: bool = False) -> None:
    """Refuse a target that exists as anything but a regular file (or, with `folder`, a
    directory): a device, FIFO or socket is the machine's, never ours to replace, and a file
    target that is a link is the user's (replacing it would drop the link, writing through it
    would write elsewhere); --force does not lift this."""
    from boost_jax.file_kind import special

    kind = special(target, folder)
    if kind is None and not folder and os.path.islink(target):
        kind = f"a link (to {os.path.realpath(target)!r})"
    if kind is not None:
        raise Refused(f"{what} is {kind}, not a {'folder' if folder else 'regular file'}; a "
                      f"command replaces only what it could have written (--force does not "
                      f"change that): {fix}")


def check_target(target: str, inputs: dict, force: bool, what: str, fix: str) -> None:
    """The checks for one file a command is about to write."""
    refuse_unusable(target, what, fix)
    refuse_inputs(target, inputs, what, fix)
    refuse_special(target, what, fix)
    refuse_existing([target], force, fix, what)


# --------------------------------------------------------------------------- single files


def _anonymous(directory: str) -> Optional[int]:
    """An unnamed file in `directory` (O_TMPFILE), or None where that is not supported."""
    flag = getattr(os, "O_TMPFILE", None)
    if flag is None or not os.path.isdir("/proc/self/fd"):
        return None
    try:
        return os.open(directory, flag | os.O_RDWR, 0o600)
    except OSError as e:
        if e.errno in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL, errno.ENOENT):
            return None
        raise


class Staged:
    """A temp file in the directory of `target`, invisible to readers until `publish`. Use as a
    context manager: leaving it unpublished (an error) removes the temp file."""

    def __init__(self, target: str, executable: bool = False, text: bool = False):
        self.target = os.path.abspath(target)
        self.dir, self.name = os.path.split(self.target)
        self.mode = file_mode(executable)
        self.path: Optional[str] = None  # named temp file (fallback)
        fd = _anonymous(self.dir)
        if fd is None:
            fd, self.path = tempfile.mkstemp(prefix=f".{self.name}.", suffix=TMP_SUFFIX,
                                             dir=self.dir)
        self.fd = fd
        self.file: IO = os.fdopen(fd, "w" if text else "wb", closefd=False,
                                  **({"encoding": "utf-8"} if text else {}))
        self.published = False

    def __enter__(self) -> "Staged":
        return self

    def __exit__(self, *exc) -> None:
        self.discard()

    def finish(self) -> None:
        """Flush, sync and set the mode: call before publishing (a full disk fails here)."""
        self.file.flush()
        os.fsync(self.fd)
        os.fchmod(self.fd, self.mode)

    def _named(self) -> str:
        """The temp file under a unique name in the target's directory."""
        if self.path is not None:
            return self.path
        dfd = os.open(self.dir, os.O_RDONLY | os.O_DIRECTORY)
        try:
            while True:
                name = f".{self.name}.{secrets.token_hex(4)}{TMP_SUFFIX}"
                try:
                    os.link(f"/proc/self/fd/{self.fd}", name, dst_dir_fd=dfd)
                    break
                except FileExistsError:
                    continue
        finally:
            os.close(dfd)
        self.path = os.path.join(self.dir, name)
        return self.path

    def _link_new(self) -> None:
        """Create the target atomically; FileExistsError if it exists."""
        if self.path is None:
            dfd = os.open(self.dir, os.O_RDONLY | os.O_DIRECTORY)
            try:
                os.link(f"/proc/self/fd/{self.fd}", self.name, dst_dir_fd=dfd)
            finally:
                os.close(dfd)
            return
        try:
            os.link(self.path, self.target)
        except OSError as e:  # a filesystem without hard links: check, then rename
            if e.errno == errno.EEXIST:
                raise
            if os.path.lexists(self.target):
                raise FileExistsError(errno.EEXIST, "File exists", self.target) from None
            os.replace(self.path, self.target)
            self.path = None
            return
        os.remove(self.path)
        self.path = None

    def publish(self, replace: bool) -> None:
        """Make the temp file the target, in one step. Without `replace` a target that exists
        (another writer was faster) is left alone and Refused is raised."""
        self.finish()
        if replace:
            refuse_special(self.target, repr(self.target), "choose another path")
            os.replace(self._named(), self.target)
            self.path = None
        else:
            try:
                self._link_new()
            except FileExistsError:
                raise Refused(f"{self.target!r} appeared while this command was writing it "
                              "(another writer was faster); it was left as that writer made it, "
                              "nothing of this run was published") from None
        self.published = True
        self.discard()

    def discard(self) -> None:
        """Close; remove the temp file unless it was published."""
        if self.fd is None:
            return
        with contextlib.suppress(OSError):
            self.file.close()
        with contextlib.suppress(OSError):
            os.close(self.fd)
        self.fd = None
        if self.path is not None and not self.published:
            with contextlib.suppress(OSError):
                os.remove(self.path)


def publish(staged: list[Staged], replace: bool) -> None:
    """Publish files that belong together in the order given (metadata first, data last). With
    `replace` the old last file (the data) is removed first, so old data never meets new
    metadata; without it, a refusal takes back what this call had published."""
    for s in staged:
        s.finish()
        refuse_special(s.target, repr(s.target), "choose another path")
    if replace and os.path.lexists(staged[-1].target):
        os.remove(staged[-1].target)
    done: list[Staged] = []
    try:
        for s in staged:
            s.publish(replace)
            done.append(s)
    except BaseException:
        for s in done:  # created by this run a moment ago: ours to take back
            with contextlib.suppress(OSError):
                os.remove(s.target)
        raise


def write_text(target: str, text: str, force: bool, executable: bool = False) -> None:
    """`text` as `target`, whole or not at all. Without `force` an existing target is Refused."""
    with Staged(target, executable, text=True) as s:
        s.file.write(text)
        s.publish(replace=force)


# --------------------------------------------------------------------------- folders


def staged_dir(target: str) -> str:
    """A temp folder next to `target` (made with the umask's mode) to build it in."""
    target = os.path.abspath(target)
    d = tempfile.mkdtemp(prefix=f".{os.path.basename(target)}.", suffix=TMP_SUFFIX,
                         dir=os.path.dirname(target))
    os.chmod(d, dir_mode())
    return d


def publish_dir(tmp: str, target: str, replace: bool) -> None:
    """Rename the finished folder `tmp` onto `target`. With `replace` an existing target is moved
    aside first and removed only once the new one is in place."""
    old, target = None, os.path.abspath(target)  # "." cannot be renamed; its full path can
    refuse_special(target, repr(target), "choose another folder", folder=True)
    if replace and os.path.lexists(target):
        old = f"{tmp}.old"
        os.rename(target, old)
    try:
        os.rename(tmp, target)
    except OSError as e:
        if old is not None:
            os.rename(old, target)
        if e.errno in (errno.EEXIST, errno.ENOTEMPTY):
            raise Refused(f"{target!r} appeared while this command was writing it (another "
                          "writer was faster); it was left as that writer made it") from None
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


# --------------------------------------------------------------------------- concurrent writers


def lock_path(target: str) -> str:
    d, name = os.path.split(os.path.abspath(target))
    return os.path.join(d, f".{name}.lock")


def _holder(fd: int) -> str:
    raw = os.pread(fd, 256, 0).decode("utf-8", "replace").strip()
    return f" ({raw})" if raw else ""


def _sweep(target: str) -> None:
    """Remove named temp files and folders of `target` left by a writer that was killed (call
    only while holding its lock: then no live writer owns them); only those named as ours are,
    never through a link (a `.old` folder, the previous target set aside, is kept)."""
    d, name = os.path.split(os.path.abspath(target))
    # exactly the names our writers give (mkstemp / mkdtemp / token_hex(4): 8 characters):
    # `.m.v2.*` is another target's, whose writer holds its own lock
    ours = re.compile(rf"\.{re.escape(name)}\.[a-z0-9_]{{8}}{re.escape(TMP_SUFFIX)}")
    try:
        entries = os.listdir(d)
    except OSError:  # a folder we may write but not list: nothing to sweep
        return
    for entry in entries:
        path = os.path.join(d, entry)
        if ours.fullmatch(entry):
            with contextlib.suppress(OSError):
                mode = os.lstat(path).st_mode
                if stat.S_ISREG(mode):
                    os.remove(path)
                elif stat.S_ISDIR(mode):
                    shutil.rmtree(path)


@contextlib.contextmanager
def exclusive(targets: list[str], what: str, fix: str):
    """Hold `.NAME.lock` next to the first of `targets` for the body; Refused if another process
    holds it. The kernel drops the lock however the holder ends, so a stale lock file is taken
    over, and temp files a killed holder left of any of `targets` are removed."""
    path = lock_path(targets[0])
    fd = _lock(path, what, fix)
    if fd is None:  # no locks on this filesystem: the link() at publish still decides
        yield
        return
    try:
        for t in targets:
            _sweep(t)
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"pid {os.getpid()} on host {socket.gethostname()}".encode(), 0)
        except OSError:
            pass  # a full disk: the lock holds without the record
        yield
    finally:
        with contextlib.suppress(OSError):
            if os.path.samestat(os.lstat(path), os.fstat(fd)):  # never what replaced it
                os.remove(path)
        os.close(fd)


def _lock(path: str, what: str, fix: str) -> Optional[int]:
    """The locked descriptor of the lock file at `path` (None: the filesystem cannot lock)."""
    while True:
        fd = _open_lock(path, what, fix)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            who = _holder(fd)
            os.close(fd)
            raise Refused(f"{what} is being written by another process{who}; wait for it to "
                          f"finish, or {fix}") from None
        except OSError:
            os.close(fd)
            return None
        try:  # the holder we waited on may have removed the file: lock the one at the path
            if os.path.samestat(os.lstat(path), os.fstat(fd)):
                return fd
        except FileNotFoundError:
            pass
        os.close(fd)


def _open_lock(path: str, what: str, fix: str) -> int:
    """The lock file at `path`, created here or left by an earlier writer (a regular file,
    empty or holding a LOCK_RECORD); anything else of that name is the user's: Refused."""
    with contextlib.suppress(FileExistsError):
        return os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o666)
    kind = None
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY)
    except OSError as e:  # a symlink (ELOOP), a folder (EISDIR), ...
        kind = "a symlink" if os.path.islink(path) else f"not a file ({e.strerror})"
    else:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            kind = "not a regular file"
        elif st.st_size and not LOCK_RECORD.fullmatch(
                os.pread(fd, 256, 0).decode("utf-8", "replace").strip()):
            kind = "a file that holds no lock record"
        if kind is None:
            return fd
        os.close(fd)
    raise Refused(f"{what}: {path!r}, the name of its lock file, is {kind} this command did "
                  f"not write; move it away, or {fix}")
