"""Checkpoints with orbax: train state, data-iterator state and run metadata, saved together.

A restore into abstract arrays with shardings reshards on the fly: a checkpoint written under one
plan, mesh shape or process count restores under another. Every process calls save/restore (orbax
writes and reads each process's shards; process 0 finalises the step once all are done).
Crash safety:
* orbax writes ``<step>.orbax-checkpoint-tmp`` and renames it ``<step>`` once every item of every
  process is written, so a process killed mid-save (SIGKILL, node loss) leaves a tmp directory,
  never a half-written ``<step>``: the next run reports and removes it, resuming from the last
  finalised step.
* Any changed byte is caught, twice over: every save records exact checksums of each array as it
  is on the devices in the step's metadata (``state_checksums``: integer sums of the bit patterns,
  the same under any sharding), refuses to write a non-finite value, and seals the step with the
  CRC-32 of every file written before it is renamed into place (seal.py). A restore checks both; a
  step that cannot be read or does not match is reported, moved to ``checkpoints_unusable/`` next
  to the checkpoint directory (nothing is deleted) and the previous step is tried;
  generate/evaluate/export refuse it. Cost (2-core VM, loaded): checksums 0.17 s/GiB of state,
  CRC-32 0.75-1.5 s/GiB of files per core; on the demo (4.3 MiB state, 1.4 MiB of files, one CPU
  device) 2-4 + 3-7 ms of a 250-490 ms save, about 2-3%.
* A failed save (disk full, permission denied, …) raises :class:`CheckpointSaveError` naming the
  step, the reason and the earlier checkpoints, which stay intact (orbax prunes old steps only
  after a save has finalised); async saves report it at the next save or at close (the last step's
  too: train/loop.py closes inside its error handling). The failed step's tmp directory is removed
  once the run has stopped (``discard_failed``), or else by the next start.
"""

from __future__ import annotations

import errno
import os
import shutil
import time
import warnings
from typing import Any, Callable, Optional

import numpy as np
import orbax.checkpoint as ocp

from boost_jax.backends.cpu import dev_compile_options
from boost_jax.checkpoints import restage
from boost_jax.checkpoints.seal import SEAL_FILE, check_seal, sealed, write_seal
from boost_jax.config import CheckpointConfig
from boost_jax.errors import UserError
from boost_jax.names import UNUSABLE_DIR

TMP_MARK = ".orbax-checkpoint-tmp"  # orbax's suffix for a step still being written


class CheckpointSaveError(UserError):
    """A checkpoint could not be written; the earlier ones are intact."""


class NonFiniteStateError(UserError):
    """The state holds NaN/inf: it is never written."""


def error_reason(e: BaseException) -> str:
    """One line for an exception, preferring the OS error at its root (disk full, permission)."""
    seen, cur, found = set(), e, []
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        if isinstance(cur, OSError) and cur.strerror:
            found.append(cur)
        cur = cur.__cause__ or cur.__context__
    # orbax's clean-up of the half-written directory can fail on top of the real error
    # (ENOTEMPTY/ENOENT from racing writer threads): report the cause, not the clean-up
    causes = [x for x in found if x.errno not in (errno.ENOTEMPTY, errno.ENOENT)] or found
    if causes:
        cur = causes[-1]
        where = f": {cur.filename}" if cur.filename else ""
        return f"{cur.strerror}{where}"
    text = str(e).strip().splitlines()
    first = text[0] if text else ""
    for code, what in _STATUS.items():  # tensorstore reports OS errors as status codes
        if code in first:
            return f"{what}: {first[first.index(code):][:120]}"
    if len(first) > 160:
        first = first[:157] + "..."
    return f"{type(e).__name__}: {first}" if first else type(e).__name__


_STATUS = {"RESOURCE_EXHAUSTED": "no space left on device",
           "PERMISSION_DENIED": "permission denied"}


def _attempt(fn):
    """(fn(), None), or (None, why) where reading a step raised."""
    try:
        return fn(), None
    except Exception as e:  # noqa: BLE001
        _silence_closed_loop_callbacks()
        return None, f"it cannot be read: {error_reason(e)}"


def _silence_closed_loop_callbacks() -> None:
    """After a failed read, tensorstore completes the reads still in flight and calls back into
    orbax's asyncio loop, which is closed by then; each callback prints a 'RuntimeError: Event
    loop is closed' traceback. They mean nothing (the failure is reported once, by us), so drop
    exactly those and pass every other exception to the previous hooks."""
    import sys

    if getattr(sys.excepthook, "_boost_jax", False):
        return

    def closed_loop(exc) -> bool:
        return isinstance(exc, RuntimeError) and str(exc) == "Event loop is closed"

    prev_except, prev_unraisable = sys.excepthook, sys.unraisablehook

    def excepthook(tp, value, tb):
        if not closed_loop(value):
            prev_except(tp, value, tb)

    def unraisablehook(info):
        if not closed_loop(info.exc_value):
            prev_unraisable(info)

    excepthook._boost_jax = True
    sys.excepthook, sys.unraisablehook = excepthook, unraisablehook


# --------------------------------------------------------------------------- checksums


_CHECKSUM_FNS: dict = {}
CHECKSUM_KIND = "u32-multiset-2"  # what meta["checksums"] holds (state_checksums)


def _mix(b):
    """A bijection of uint32 with _mix(0) == 0 (so zero padding adds nothing)."""
    import jax.numpy as jnp

    b = b * jnp.uint32(0x9E3779B1)
    b = b ^ (b >> 15)
    return b * jnp.uint32(0x85EBCA77)


def _bits(x):
    """Every element's bit pattern, zero-extended to uint32 (8-byte types as two words)."""
    import jax
    import jax.numpy as jnp

    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint32)
    word = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint32}[x.dtype.itemsize]
    return jax.lax.bitcast_convert_type(x, word).astype(jnp.uint32)


def _checksum_rows(xs):
    """[n, 3] uint32: Σ bits, Σ mix(bits), count of non-finite elements, per array. One
    variadic reduction per array (one pass over memory; separate integer sums are several
    times slower on XLA:CPU)."""
    import jax
    import jax.numpy as jnp

    rows = []
    for x in xs:
        b = _bits(x)
        bad = (~jnp.isfinite(x) if jnp.issubdtype(x.dtype, jnp.inexact)
               else jnp.zeros(x.shape, bool)).astype(jnp.uint32)
        bad = jnp.broadcast_to(bad.reshape(bad.shape + (1,) * (b.ndim - bad.ndim)), b.shape)
        zero = jnp.uint32(0)
        sums = jax.lax.reduce((b, _mix(b), bad), (zero, zero, zero),
                              lambda p, q: tuple(u + v for u, v in zip(p, q)),
                              tuple(range(b.ndim)))
        rows.append(jnp.stack(sums))
    return jnp.stack(rows)


def state_checksums(state: Any) -> tuple[dict[str, list[int]], bool]:
    """({array path: [c1, c2]}, every array finite) of a state, computed on its devices.

    c1 = Σ bits and c2 = Σ mix(bits) over the elements' bit patterns, modulo 2**32: exact
    integers (no tolerance), so a change of any one element (any changed bit) changes both;
    changes of several elements pass only by a 2**-64 coincidence. Integer sums do not depend on
    the order of reduction, on zero padding or on where the elements sit, so the checksums are
    the same on every process and check a restore under another plan, mesh, process count or
    stage count (boost_jax/checkpoints/restage.py) too. One pass over each array: 0.17 s/GiB on
    one core of the development VM (the float sums it replaces: 0.16 s/GiB), 2-4 ms for the
    demo's state.
    """
    import jax
    from jax.sharding import NamedSharding, PartitionSpec as P

    flat, treedef = jax.tree_util.tree_flatten_with_path(state)
    paths = [jax.tree_util.keystr(p) for p, _ in flat]
    leaves = [x for _, x in flat]
    key = (treedef, tuple((x.shape, str(x.dtype), getattr(x, "sharding", None)) for x in leaves))
    fn = _CHECKSUM_FNS.get(key)
    if fn is None:
        mesh = next((x.sharding.mesh for x in leaves if hasattr(getattr(x, "sharding", None),
                                                                "mesh")), None)
        out = NamedSharding(mesh, P()) if mesh is not None else None
        # integer sums: exact at any optimisation level
        fn = jax.jit(_checksum_rows, out_shardings=out, compiler_options=dev_compile_options())
        if len(_CHECKSUM_FNS) > 8:
            _CHECKSUM_FNS.clear()
        _CHECKSUM_FNS[key] = fn
    rows = np.asarray(jax.device_get(fn(leaves)), dtype=np.uint32)
    return {p: [int(r[0]), int(r[1])] for p, r in zip(paths, rows)}, not rows[:, 2].any()


def checksum_mismatch(got: dict, meta: dict) -> Optional[str]:
    """None if `got` equals the checksums saved in `meta` on the arrays both have; else which
    array differs. A step saved before checksums were recorded has nothing to compare."""
    want = (meta or {}).get("checksums")
    if not isinstance(want, dict) or want.get("kind") != CHECKSUM_KIND:
        return None
    arrays = want.get("arrays") or {}
    for path in sorted(set(got) & set(arrays)):
        if list(got[path]) != list(arrays[path]):
            return f"array {path} of the state does not match the checksum saved with it"
    return None


def _meta_problem(step: int, meta: Any) -> Optional[str]:
    """Why a step's readable meta item cannot be the step's: not a mapping, or saved as
    another step (steps saved before the step was recorded have none to compare)."""
    if not isinstance(meta, dict):
        return f"its metadata is a JSON {type(meta).__name__}, not an object"
    saved = meta.get("step", step)
    if saved != step:
        return f"it holds step {saved!r} (its folder was renamed or copied)"
    return None


def _one_writer_per_shard(nproc: int) -> None:
    """In one process, orbax writes each replicated shard from one replica rather than 1/R of
    it from each: the process writes every byte either way, and the split costs a slice kernel
    per replica and array, each compiled at the first save.
    Across processes the split spreads the writes over hosts: orbax's default stays. Once per
    process, and quietly: orbax logs every override, and a refused run must not write that
    line into the run log of an out_dir it does not own."""
    global _ONE_WRITER
    if nproc != 1 or _ONE_WRITER:
        return
    import logging

    import jax

    absl = logging.getLogger("absl")  # orbax's logger
    level = absl.level
    absl.setLevel(logging.ERROR)
    try:
        old = ocp.type_handlers.get_type_handler(jax.Array)  # keep its array-metadata store
        ocp.type_handlers.register_type_handler(jax.Array, ocp.type_handlers.ArrayHandler(
            use_replica_parallel=False,
            array_metadata_store=getattr(old, "_array_metadata_store", None)), override=True)
    finally:
        absl.setLevel(level)
    _ONE_WRITER = True


_ONE_WRITER = False


# --------------------------------------------------------------------------- the checkpointer


class Checkpointer:
    def __init__(self, directory: str, cfg: CheckpointConfig,
                 warn: Optional[Callable[[str], None]] = None, stages: tuple = (1, 1)):
        import jax

        self.directory = os.path.abspath(directory)
        self.stages = stages  # (stages, virtual) of the state restored into (restage.py)
        self.async_save = cfg.async_save
        self._warn = warn or (lambda msg: None)
        self._pid = jax.process_index()
        self._primary = self._pid == 0
        self._nproc = jax.process_count()
        self._pending: Optional[int] = None  # step of the save still running in the background
        self._failed = False
        self._failed_step: Optional[int] = None
        self.interrupted = self._interrupted_saves()
        for step, name in self.interrupted:
            self._warn(f"checkpoint step {step} in {self.directory} is incomplete (its save was "
                       f"interrupted: {name} was never finalised); ignoring and removing it")
            if self._primary:  # now, not lazily at the first save as orbax would
                shutil.rmtree(os.path.join(self.directory, name), ignore_errors=True)
        if self._nproc > 1:  # every process, whatever its own listing saw: all meet here
            from jax.experimental import multihost_utils

            multihost_utils.sync_global_devices("boost_jax:checkpoint_tmp_removed")
        self._sealing: Optional[int] = None  # step whose save the seal callback belongs to
        # always orbax's async path: its post-finalisation hook seals the step before the
        # rename; a sync save waits for it at once (save)
        _one_writer_per_shard(self._nproc)
        options = ocp.CheckpointManagerOptions(
            max_to_keep=cfg.keep, enable_async_checkpointing=True, create=True,
            cleanup_tmp_directories=True,
            async_options=ocp.AsyncOptions(post_finalization_callback=self._seal))
        try:
            self.mngr = ocp.CheckpointManager(self.directory, options=options,
                                              item_names=("state", "data", "meta"))
        except OSError as e:
            raise UserError(f"cannot use checkpoint directory {self.directory!r} "
                            f"({error_reason(e)}); choose a writable out_dir") from None

    # ------------------------------------------------------------------ listing

    def _interrupted_saves(self) -> list[tuple[Optional[int], str]]:
        try:
            names = os.listdir(self.directory)
        except OSError:
            return []
        out = []
        for name in sorted(names):
            if TMP_MARK in name:
                head = name.split(TMP_MARK)[0].split("_")[-1]
                out.append((int(head) if head.isdigit() else None, name))
        return out

    def steps_on_disk(self) -> list[int]:
        """Finalised step directories present now (independent of orbax's cached list)."""
        try:
            return sorted(int(n) for n in os.listdir(self.directory) if n.isdigit())
        except OSError:
            return []

    def latest_step(self) -> Optional[int]:
        return self.mngr.latest_step()

    def all_steps(self) -> list[int]:
        return list(self.mngr.all_steps())

    # ------------------------------------------------------------------ saving

    def save(self, step: int, state: Any, data_state: dict, meta: dict,
             force: bool = False) -> bool:
        sums, finite = state_checksums(state)
        if not finite:
            raise NonFiniteStateError(
                f"the state at step {step} holds non-finite values; not writing checkpoint step "
                f"{step} (the earlier ones in {self.directory} are intact)")
        self._wait()  # a failed background save surfaces here, before starting another
        # the step inside: a step folder copied or renamed to another number is not that step
        meta = dict(meta, step=step, checksums={"kind": CHECKSUM_KIND, "arrays": sums},
                    seal=SEAL_FILE)
        self._sealing = step
        try:
            saved = self.mngr.save(step, args=ocp.args.Composite(
                state=ocp.args.StandardSave(state), data=ocp.args.JsonSave(data_state),
                meta=ocp.args.JsonSave(meta)), force=force)
        except Exception as e:  # noqa: BLE001 - orbax wraps OS errors in several types
            self._save_failed(step, e)
        if saved:
            self._pending = step
            if not self.async_save:
                self._wait()
        return saved

    def _seal(self) -> None:
        """orbax's post-finalisation callback (process 0, in its writer thread, once every
        process has written its share): every item is written and merged, and the step is
        still in its tmp directory (this orbax renames it next; a later orbax that renamed
        first would leave a moment in which a kill leaves a step without seal, which resume
        sets aside like any unusable step). Records the CRC-32 of the step's files."""
        if not self._primary:
            return
        step = self._sealing
        names = [n for s, n in self._interrupted_saves() if s == step] + [str(step)]
        found = [os.path.join(self.directory, n) for n in names
                 if os.path.isdir(os.path.join(self.directory, n))]
        if not found:
            raise FileNotFoundError(errno.ENOENT, "the step to seal is gone",
                                    os.path.join(self.directory, str(step)))
        write_seal(found[0])

    def _wait(self) -> None:
        try:
            self.mngr.wait_until_finished()
        except Exception as e:  # noqa: BLE001
            step, self._pending = self._pending, None
            self._save_failed(step, e)
        self._pending = None

    def _save_failed(self, step: Optional[int], e: BaseException) -> None:
        # The partial step stays in its tmp directory (writes of other arrays may still be in
        # flight); the next start reports and removes it. Finalised steps are never touched.
        self._failed, self._failed_step = True, step
        intact = [s for s in self.steps_on_disk() if s != step]
        what = f"step {step}" if step is not None else "a step"
        listed = (f"checkpoint (step {intact[0]})" if len(intact) == 1 else
                  f"checkpoints (steps {', '.join(map(str, intact))})")
        keep = (f"the earlier {listed} in {self.directory} "
                f"{'is' if len(intact) == 1 else 'are'} intact; fix the cause (disk space, "
                f"permissions) and rerun the same command to resume from step {intact[-1]}"
                if intact else
                "no earlier checkpoint exists; fix the cause (disk space, permissions) and rerun")
        error = CheckpointSaveError(f"saving checkpoint {what} failed ({error_reason(e)}); {keep}")
        error.detail = e  # the full chain, for the run log
        raise error from None

    # ------------------------------------------------------------------ restoring

    def restore(self, step: int, abstract_state: Any):
        old = restage.saved_stages(self.restore_meta(step))
        target = abstract_state if old == self.stages else restage.restore_target(
            abstract_state, restage.saved_shapes(os.path.join(self.directory, str(step))), old,
            self.stages)
        out = self.mngr.restore(step, args=ocp.args.Composite(
            # strict=False: padded shapes differ between plans/meshes; padding is zeros at the end
            state=ocp.args.StandardRestore(target, strict=False),
            data=ocp.args.JsonRestore(), meta=ocp.args.JsonRestore()))
        state = restage.convert(out["state"], abstract_state, old, self.stages)
        return state, out["data"], out["meta"]

    def restore_meta(self, step: int) -> dict:
        return self.mngr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]

    def _check_seal(self, step: int, meta: dict, item: Optional[str] = None) -> Optional[str]:
        """The step's files against its seal (each process checks its share of the files, or
        all of `item`'s); None for a step saved before seals were written (seal.sealed)."""
        step_dir = os.path.join(self.directory, str(step))
        if not sealed(step_dir, meta):
            return None
        if item is not None:
            return check_seal(step_dir, item=item)
        return check_seal(step_dir, self._pid, self._nproc)

    def _agree(self, ok: bool) -> bool:
        """True only if every process says ok (processes must take the same fallback)."""
        if self._nproc == 1:
            return ok
        from jax.experimental import multihost_utils

        flags = multihost_utils.process_allgather(np.array([int(ok)], np.int32))
        return bool(np.min(flags))

    def restore_latest(self, abstract_state: Any,
                       check_meta: Callable[[int, dict], None] = lambda step, meta: None):
        """(step, state, data_state, meta) of the newest usable checkpoint, or None if none exist.

        `check_meta(step, meta)` may raise a UserError (e.g. a different model): that stops the
        run (nothing is moved). Unreadable or corrupted steps are reported, moved aside and the
        previous one tried; if no step is usable a UserError lists them and nothing is moved.
        """
        bad: list[tuple[int, str]] = []
        found = None
        for step in sorted(self.all_steps(), reverse=True):
            meta, err = None, None
            try:
                meta = self.restore_meta(step)
            except Exception as e:  # noqa: BLE001
                # a sealed step names the changed file (the metadata's own, say)
                err = self._check_seal(step, {}) or \
                    f"its metadata cannot be read: {error_reason(e)}"
            # the metadata's own files first (they are small): a changed one must not be
            # taken for another config by check_meta
            err = err or self._check_seal(step, meta, "meta") or _meta_problem(step, meta)
            if not self._agree(err is None):
                bad.append((step, err or "another process could not read its metadata"))
                continue
            check_meta(step, meta)
            # each check agreed before the next collective (orbax's restore barrier, the
            # checksums' reduction): a process whose own files fail must not skip one alone
            err = self._check_seal(step, meta)
            if not self._agree(err is None):
                bad.append((step, err or "another process's share of it is not what was written"))
                continue
            got, err = self._read_agreed(step, abstract_state)
            if got is None:
                bad.append((step, err))
                continue
            found = (step, *got)
            break
        if bad and found is None:
            listing = "; ".join(f"step {s}: {why}" for s, why in bad)
            raise UserError(f"no usable checkpoint in {self.directory} ({listing}); move those "
                            "steps away to start over, or use another out_dir")
        if bad:
            self._set_aside(bad, found[0])
        return found

    def _read_agreed(self, step: int, abstract_state: Any):
        """((state, data_state, meta), None) once every process has read the step and matched
        its checksums, else (None, why). Each outcome is agreed before the next collective
        (orbax's restore barrier, the checksums' reduction): no process takes one alone."""
        got, err = _attempt(lambda: self.restore(step, abstract_state))
        if self._agree(err is None):
            mismatch, err = _attempt(lambda: checksum_mismatch(state_checksums(got[0])[0],
                                                               got[2]))
            err = err or mismatch
            if self._agree(err is None):
                return got, None
        return None, err or "another process could not read it"

    def _set_aside(self, bad: list[tuple[int, str]], good: int) -> None:
        """Process 0 moves the unusable steps to UNUSABLE_DIR; every process learns whether
        it could (a failed move is one line on each, none waits for the others)."""
        dest_root = os.path.join(os.path.dirname(self.directory), UNUSABLE_DIR)
        moved, failed = {}, None
        for step, why in bad:
            dest = os.path.join(dest_root, str(step))
            if os.path.exists(dest):
                dest = f"{dest}-{int(time.time())}"
            moved[step] = dest
            if self._primary and failed is None:
                try:
                    os.makedirs(dest_root, exist_ok=True)
                    shutil.move(os.path.join(self.directory, str(step)), dest)
                except OSError as e:
                    failed = (f"checkpoint step {step} in {self.directory} is unusable ({why}) "
                              f"and could not be moved to {dest} ({error_reason(e)}); move it "
                              "away yourself and rerun")
        if not self._agree(failed is None):
            raise UserError(failed or f"process 0 could not move unusable checkpoint steps of "
                            f"{self.directory} aside (its error says why); move them away "
                            "yourself and rerun")
        self.mngr.reload()
        for step, why in bad:
            self._warn(f"checkpoint step {step} in {self.directory} is unusable ({why}); moved it "
                       f"to {moved[step]} and falling back to step {good}")

    # ------------------------------------------------------------------ shutdown

    def wait(self) -> None:
        self._wait()

    def close(self) -> None:
        self._wait()
        self.mngr.close()

    def discard_failed(self) -> None:
        """After abandon(): remove the failed step's partial directory now (process 0) instead of
        at the next start, so a full disk gets its space back at once. Finalised steps are never
        touched."""
        if self._failed:
            # the failed save's writes that never ran are collected at exit, each with a
            # "coroutine ... was never awaited" warning: noise after the run's one-line error
            warnings.filterwarnings("ignore", message="coroutine .* was never awaited",
                                    category=RuntimeWarning)
        if not self._failed or not self._primary:
            return
        for step, name in self._interrupted_saves():
            if step == self._failed_step or self._failed_step is None:
                _remove_settled(os.path.join(self.directory, name))

    def abandon(self) -> None:
        """On an error elsewhere: let a running save finish (it is valid) but raise nothing."""
        if not self._failed:
            try:
                self.mngr.wait_until_finished()
            except Exception as e:  # noqa: BLE001
                self._warn(f"the checkpoint save of step {self._pending} failed as well "
                           f"({error_reason(e)})")
        try:
            self.mngr.close()
        except Exception:  # noqa: BLE001
            pass


def _remove_settled(path: str, settle_s: float = 0.3, limit_s: float = 5.0) -> None:
    """rmtree `path` until it stays gone for `settle_s`: orbax's writer threads of a failed save
    can still create files in it for a moment after the save has been reported failed."""
    deadline = time.monotonic() + limit_s
    while True:
        shutil.rmtree(path, ignore_errors=True)
        time.sleep(settle_s)
        if not os.path.exists(path) or time.monotonic() > deadline:
            return
