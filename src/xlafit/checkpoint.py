"""Orbax checkpoints of the whole :class:`~xlafit.train.state.TrainState`, verified on load.

- Saves are asynchronous (training continues while the arrays are written) and atomic:
  Orbax writes into a temporary directory, renames it when complete and leaves a
  ``commit_success.txt`` marker, so an interrupted save never shadows the previous
  checkpoint.
- Each save records its arrays' checksums in the step's metadata, and once Orbax commits
  it, a background thread *seals* it (``xlafit-integrity.json``: the SHA-256 of every
  file), done before the next save starts (:mod:`xlafit.integrity`). On restore the
  newest checkpoint is verified first (its seal, then its arrays against their
  checksums: a checkpoint left unsealed by a kill -9 is checked too); a truncated,
  corrupted or half-deleted one is skipped with a warning naming it, and the newest
  intact one is used.
- Typed PRNG keys are stored as their raw ``uint32`` key data.
- Retention: the last ``keep`` checkpoints, plus every one whose step is a multiple of
  ``keep_every`` (kept for good).
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

import jax
import orbax.checkpoint as ocp
from etils import epath
from orbax.checkpoint import type_handlers

from xlafit.errors import CheckpointError, CheckpointWriteError, StorageError
from xlafit.integrity import (
    CHECKSUMS,
    Damaged,
    check_arrays,
    check_seal,
    check_shapes,
    checksum_record,
    split_record,
    write_seal,
)
from xlafit.integrity import SEAL as SEAL
from xlafit.io.paths import as_path, check_bucket, describe_error, files_under, is_url, move, refresh
from xlafit.logs import own_words_in_the_default_handler
from xlafit.orbax_loop import first_line, settle_orbax_reads
from xlafit.parallel.sharding import path_name
from xlafit.saveable import abstract, from_saveable, older_layout, to_saveable
from xlafit.saveable import fingerprint as fingerprint

COMMIT = "commit_success.txt"
ORBAX_METADATA = "_CHECKPOINT_METADATA"  # in every step's folder Orbax writes
SET_ASIDE = "corrupt-"  # the prefix of a checkpoint moved aside by the resume that found it corrupt


class _SaidByTheRun(logging.Filter):
    """Drops Orbax's warning that it removes a save a stopped process left unfinished
    (``<step>.orbax-checkpoint-tmp``) when the same step is saved again: the run has said so in
    its own words when it started (:func:`unfinished_saves`)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Removing existing directory since it is not finalized" not in record.getMessage()


logging.getLogger("absl").addFilter(_SaidByTheRun())
# Importing Orbax logs through absl, which installs basicConfig()'s handler where a program set
# none: xlafit's warnings print in their own words there too (xlafit.logs).
own_words_in_the_default_handler()


def _handler() -> ocp.StandardCheckpointHandler:
    """Orbax's handler of the state, with replica-parallel saving off where the devices are CPUs.

    Orbax splits a replicated array's save among its replicas (each chip copies its part to
    the host) by slicing it on each device: a program compiled for every array and part,
    eight an array on 8 simulated CPU devices (about 2 CPU-seconds a run of the MNIST CNN),
    for CPU devices that share one memory and copy nothing in parallel. The files are the
    same either way; accelerators keep Orbax's default, and so does an Orbax whose handlers
    are built otherwise (test_checkpoint counts the compiles of a save).
    """
    handler = ocp.StandardCheckpointHandler()
    if jax.default_backend() != "cpu" or not hasattr(handler, "_impl"):
        return handler
    default = type_handlers.get_type_handler(jax.Array)
    try:  # Orbax's own handler, with its metadata store, replica-parallel off
        whole = type_handlers.ArrayHandler(
            use_replica_parallel=False, array_metadata_store=getattr(default, "_array_metadata_store", None)
        )
        standard = [(t, type_handlers.get_type_handler(t)) for t in type_handlers.supported_types()]
        registry = type_handlers.create_type_handler_registry(*standard, (jax.Array, whole))
        # StandardCheckpointHandler takes no registry; its PyTree handler, built as it builds it, does.
        impl = ocp.PyTreeCheckpointHandler(
            save_concurrent_gb=96, restore_concurrent_gb=96, type_handler_registry=registry
        )
    except (TypeError, AttributeError, ValueError):  # an Orbax that builds them otherwise: its default
        return handler
    handler._impl = impl
    return handler


def check_directory(directory: str | Path | epath.Path) -> None:
    """Refuses a local checkpoint directory that is a file or lies under one, before anything
    lists or creates it (no-op for a URL).

    Raises:
        CheckpointError: naming the file and the fix.
    """
    if is_url(directory):
        return
    path = Path(directory).absolute()
    blocking = next((p for p in (path, *path.parents) if p.exists() and not p.is_dir()), None)
    if blocking is not None:
        raise CheckpointError(
            f"cannot keep checkpoints in {directory}: {blocking} is a file, not a directory. Choose another "
            "--checkpoint-dir (run.checkpoint_dir)."
        )


def set_aside(names: Sequence[str]) -> list[str]:
    """The names among ``names`` (a checkpoint directory's entries) of checkpoints a resume set
    aside as corrupt (``corrupt-<step>-<time>``)."""
    return [name for name in names if name.startswith(SET_ASIDE)]


def check_not_all_set_aside(directory: epath.Path) -> None:
    """Refuses to train from step 0 in a checkpoint directory that holds no checkpoint but
    the ones a resume set aside as corrupt: the run has a history (its metrics), which a
    start from step 0 would write over.

    Raises:
        CheckpointError: naming the checkpoints set aside and the fix.
    """
    names = sorted(p.name for p in directory.iterdir()) if directory.exists() else []
    left = set_aside(names)
    if left and not any(name.isdigit() for name in names):
        raise CheckpointError(
            f"no checkpoint to resume from in {directory}: each was found corrupt and set aside "
            f"({', '.join(left)}), and training from step 0 would write over the run's metrics. Start over with "
            "--restart (the earlier run moves aside, nothing is deleted; in Python: another run_dir)."
        )


def unfinished_saves(directory: epath.Path) -> list[int]:
    """The steps of saves that began in ``directory`` but never finished (Orbax's
    ``<step>.orbax-checkpoint-tmp`` folders: the process was killed while writing them)."""
    names = [p.name for p in directory.iterdir()] if directory.exists() else []
    return sorted(
        int(n.split(".", 1)[0]) for n in names if ".orbax-checkpoint-tmp" in n and n.split(".", 1)[0].isdigit()
    )


@dataclasses.dataclass
class CheckpointInfo:
    """One checkpoint on disk, as :meth:`Checkpointer.list` reports it."""

    step: int
    path: epath.Path
    time: datetime.datetime  # when the save was committed (see time_source)
    size_bytes: int
    status: str  # "intact", "unsealed" (committed, not yet checksummed) or "corrupt: <why>"
    # "commit": Orbax's record of the save; "mtime": the files' newest modification time,
    # for a checkpoint without a readable record (a damaged one, or older Orbax).
    time_source: str = "commit"

    @property
    def usable(self) -> bool:
        return usable(self.status)


def usable(status: str) -> bool:
    """Whether a checkpoint of :meth:`Checkpointer.verify`'s ``status`` may be restored: intact,
    or committed and not yet sealed (its arrays are checked as they are read)."""
    return not status.startswith("corrupt")


class Read(NamedTuple):
    """What :func:`~xlafit.checkpoint_read.read_checkpoint` found: a checkpoint's arrays, the
    metadata saved with them (the same save's: its checksums cover both) and the newer ones it
    passed over."""

    arrays: Any  # the whole saved state as host NumPy arrays in nested dicts
    step: int
    passed_over: list[tuple[int, str]]  # (step, what is wrong with it: "corrupt: <why>"), newest first
    metadata: dict[str, str]  # what Checkpointer.save was given as metadata

    def passed(self) -> str:
        """The checkpoints passed over, in words: ``checkpoint 3 is corrupt: <why>; ...``."""
        return in_words(self.passed_over)


def in_words(passed: Sequence[tuple[int, str]]) -> str:
    return "; ".join(f"checkpoint {step} is {why}" for step, why in passed)


class Checkpointer:
    """Keeps the checkpoints of a run under ``directory``: a local path, or a URL that
    Orbax and ``etils.epath`` can write (gs:// with ``gcsfs`` installed).

    Example:
        >>> import tempfile
        >>> import numpy as np
        >>> ckpt = Checkpointer(tempfile.mkdtemp(), keep=3)
        >>> ckpt.save(100, {"w": np.arange(3.0)}); ckpt.wait()
        >>> state, step = ckpt.restore({"w": np.zeros(3)})
        >>> step, state["w"].tolist(), [i.status for i in ckpt.list()]
        (100, [0.0, 1.0, 2.0], ['intact'])
        >>> ckpt.close()
    """

    def __init__(
        self,
        directory: str | Path,
        keep: int = 3,
        keep_every: int | None = None,
        async_save: bool = True,
    ) -> None:
        """Orbax lists the steps from their names alone, never reading each one's metadata
        file: one damaged there (a flipped bit renaming a key) made Orbax's manager raise
        while it opened, before any check here could pass it over; and a running job's
        rotation may remove a step between the two."""
        self.directory = as_path(directory)
        if is_url(directory):
            refresh(directory)  # another process may have written checkpoints since this one listed them
            try:  # gcsfs would create a missing bucket for Orbax's mkdir: refuse instead
                check_bucket(directory, "checkpoint directory")
            except StorageError as e:
                raise CheckpointError(str(e)) from None
        else:
            check_directory(directory)
            self.directory = epath.Path(Path(directory).absolute())
        settle_orbax_reads()
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep,
            keep_period=keep_every or None,
            create=True,
            enable_async_checkpointing=async_save,
            lightweight_initialize=True,  # see above: step metadata is read where it is checked
        )
        self._open = lambda: ocp.CheckpointManager(self.directory, options=options, item_handlers=_handler())
        self._manager = self._open()
        self.last_saved: int | None = None
        self._sealing: threading.Thread | None = None  # commits the newest save, then seals it
        self._sealing_error: Exception | None = None

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def save(self, step: int, state: Any, metadata: dict[str, str] | None = None) -> None:
        """Starts writing ``state`` as checkpoint ``step`` (returns before it is on disk).

        ``metadata`` (short strings: the fingerprint of a frozen base model) goes into the
        step's own metadata file, sealed with the arrays; :meth:`saved_metadata` reads it.
        The arrays' checksums go there too, and a background thread seals the checkpoint
        once Orbax has committed it (the next save, or :meth:`wait`, waits for it).

        Raises:
            CheckpointError: the previous save failed (disk full, no permission): the
                checkpoints before it are intact, and the message names the newest.
        """
        self.wait()
        self.last_saved = step
        saveable = to_saveable(state)
        # On every process: the sums are one program over the global arrays.
        record = {CHECKSUMS: checksum_record(saveable, metadata or {})}
        try:
            self._manager.save(
                step, args=ocp.args.StandardSave(saveable), force=True, custom_metadata={**(metadata or {}), **record}
            )
        except Exception as e:  # on a URL the first requests go out here, before the background write
            raise self._failed(e) from e
        self._sealing = threading.Thread(target=self._commit_and_seal, args=(step,), name="xlafit-seal", daemon=True)
        self._sealing.start()

    def _commit_and_seal(self, step: int) -> None:
        """Waits for Orbax to commit ``step``, then seals it (process 0): the window in which a
        kill -9 leaves it unsealed is the time to hash its files, not a whole save interval."""
        try:
            self._manager.wait_until_finished()
            if jax.process_index() == 0 and (self._step_dir(step) / COMMIT).exists():
                write_seal(self._step_dir(step), step)
        except Exception as e:  # Orbax re-raises the background writer's error here
            self._sealing_error = e

    def wait(self) -> None:
        """Blocks until every save started so far is on disk and sealed."""
        if self._sealing is not None:
            self._sealing.join()
            self._sealing = None
        error, self._sealing_error = self._sealing_error, None
        try:
            if error is not None:
                raise error
            self._manager.wait_until_finished()  # a save that started no thread (its start failed)
        except Exception as e:
            raise self._failed(e) from e

    def _failed(self, e: Exception) -> CheckpointWriteError:
        """The error for a failed save: what failed, the newest complete checkpoint, the fix.
        A checkpoint whose arrays are complete (committed) but whose seal could not be
        written is named as such: a resume loads it."""
        try:
            usable = [c for c in self.list() if c.usable]  # intact, or committed and not yet sealed
            what = f"writing checkpoint {self.last_saved} in {self.directory} failed"
            if usable and usable[-1].step == self.last_saved:
                what = f"checkpoint {self.last_saved} in {self.directory} was written, but not its checksums ({SEAL})"
                known = f"a resume loads checkpoint {self.last_saved}. "
            elif usable:
                known = f"checkpoint {usable[-1].step} is {'intact' if usable[-1].status == 'intact' else 'complete'}. "
            else:
                known = "no earlier checkpoint exists. "
        except Exception:  # the store is unreachable for reading too
            what = f"writing checkpoint {self.last_saved} in {self.directory} failed"
            known = "the checkpoints before it are untouched (a save never overwrites one); a resume verifies them. "
        if is_url(self.directory):
            return CheckpointWriteError(
                f"{what}: {describe_error(self.directory, e)} {known}Run again to resume once the storage answers."
            )
        reason = f"{e.strerror}" if isinstance(e, OSError) and e.strerror else first_line(e)
        fix = "Free disk space" if "No space left" in str(e) else "Free disk space (or fix the permissions)"
        return CheckpointWriteError(f"{what} ({reason}); {known}{fix}, then run the same command again to resume.")

    def _step_dir(self, step: int) -> epath.Path:
        return self.directory / str(step)

    def verify(self, step: int) -> str:
        """``"intact"``, ``"unsealed"`` or ``"corrupt: <why>"`` for checkpoint ``step``, from
        its files (an unsealed one's arrays are checked when they are read)."""
        directory = self._step_dir(step)
        if not (directory / COMMIT).exists():
            return f"corrupt: no commit marker ({COMMIT}): the save never finished"
        return check_seal(directory)

    def committed_at(self, step: int) -> datetime.datetime | None:
        """When checkpoint ``step`` was committed, from the step metadata Orbax writes with
        every save (and the seal checksums); ``None`` where it is absent or unreadable."""
        try:
            nsecs = self._manager.metadata(step).commit_timestamp_nsecs
        except Exception:  # a damaged metadata file: the caller falls back to the files' times
            return None
        return None if nsecs is None else datetime.datetime.fromtimestamp(nsecs / 1e9, datetime.UTC)

    def saved_metadata(self, step: int) -> dict[str, str]:
        """The ``metadata`` checkpoint ``step`` was saved with (empty when none or unreadable)."""
        try:
            saved = dict(self._manager.metadata(step).custom_metadata or {})
        except Exception:  # a damaged metadata file: the arrays' own check decides
            return {}
        saved.pop(CHECKSUMS, None)
        return saved

    def _recorded(self, step: int) -> tuple[dict[str, str], dict[str, Any] | None]:
        """Checkpoint ``step``'s saved metadata and the record of its checksums (:func:`split_record`).

        Raises:
            Damaged: unreadable, or not what the save recorded.
        """
        try:
            saved = self._manager.metadata(step).custom_metadata or {}
        except Exception as e:
            raise Damaged(f"its {ORBAX_METADATA} is unreadable ({first_line(e)})") from None
        return split_record(saved)

    def _shapes(self, step: int, record: dict[str, Any] | None) -> dict[str, tuple[tuple[int, ...], str]]:
        """The saved ``path -> (shape, dtype)`` of checkpoint ``step``, as Orbax's array
        metadata says, checked against the ``record`` (:func:`check_shapes`)."""
        try:
            leaves = jax.tree_util.tree_flatten_with_path(self.metadata(step))[0]
        except Exception as e:
            raise Damaged(f"its array metadata is unreadable ({first_line(e)})") from None
        saved = {path_name(p): (tuple(m.shape), str(m.dtype)) for p, m in leaves}
        check_shapes(record, saved)
        return saved

    def steps(self) -> list[int]:
        """The steps of the checkpoints on disk, oldest first, from their names (none verified:
        :meth:`verify` checks one)."""
        return sorted(self._manager.all_steps())

    def list(self) -> list[CheckpointInfo]:
        """Every checkpoint on disk, oldest first, verified."""
        infos = []
        for step in sorted(self._manager.all_steps()):
            directory = self._step_dir(step)
            try:
                stats = [p.stat() for p in files_under(directory).values()]
                status = self.verify(step)
            except FileNotFoundError:  # a file listed a moment ago is gone: a running job's rotation removes it
                continue
            # Modification times change when a file is touched or damaged after the save.
            committed = self.committed_at(step)
            modified = datetime.datetime.fromtimestamp(max((st.mtime for st in stats), default=0), datetime.UTC)
            infos.append(
                CheckpointInfo(
                    step=step,
                    path=directory,
                    time=committed or modified,
                    size_bytes=sum(st.length for st in stats),
                    status=status,
                    time_source="commit" if committed else "mtime",
                )
            )
        return infos

    def restore(self, like: Any, step: int | None = None) -> tuple[Any, int]:
        """Restores a checkpoint with the shapes and shardings of ``like``.

        Args:
            like: a state of the structure to restore (its values are not used).
            step: this checkpoint (nothing is set aside; one absent or damaged is refused);
                default: the newest one that verifies and reads. Each newer one is set aside
                (``corrupt-<step>-<time>``, a warning naming it) once an older one restores;
                with none intact, nothing moves.

        Returns:
            ``(state, step)``.

        Raises:
            CheckpointError: no intact checkpoint (the message names what is wrong with
                each), or one whose arrays do not match ``like`` (a model change): the
                message names the first difference.
        """
        steps = sorted(self._manager.all_steps(), reverse=True)
        if step is not None and step not in steps:
            raise CheckpointError(f"no checkpoint {step} in {self.directory}; there are: {sorted(steps)}.")
        candidates = [step] if step is not None else steps
        bad: list[tuple[int, str]] = []
        for s in candidates:
            status = self.verify(s)
            if status.startswith("corrupt"):
                bad.append((s, status))
                continue
            try:
                _, record = self._recorded(s)
                saved = self._shapes(s, record)
                self._check_structure(s, like, saved)  # a model change: refused, whatever the checkpoint
                raw = self._restore_as(s, abstract(like), saved, record)
            except Damaged as e:  # an unsealed one's changed bits: found by the checksums saved with it
                bad.append((s, f"corrupt: {e}"))
                continue
            except CheckpointError:
                raise
            except Exception as e:  # unreadable despite the marker: treat as corrupt
                bad.append((s, f"unreadable ({first_line(e)})"))
                continue
            # Moved only once the run goes on from an older one: with none intact, the run is
            # refused, and every later attempt must find them and refuse again.
            for b, why in bad:
                self._set_aside(b, why)
            return from_saveable(raw, like), s
        if step is not None:  # asked for: nothing older is tried in its place
            raise CheckpointError(f"{in_words(bad)}; the intact ones: {[i.step for i in self.list() if i.usable]}.")
        found = in_words(bad) or "it holds none"
        raise CheckpointError(
            f"no intact checkpoint in {self.directory} ({found}); nothing was moved. Start over with --restart "
            "(the earlier run moves aside, nothing is deleted; in Python: another run_dir)."
        )

    def _set_aside(self, step: int, why: str) -> None:
        """Warns about a bad checkpoint and renames it ``corrupt-<step>-<time>``, out of the
        way of the step that will be saved again under its number (kept for a post-mortem)."""
        source = self._step_dir(step)
        target = self.directory / f"{SET_ASIDE}{step}-{datetime.datetime.now(datetime.UTC):%Y%m%dT%H%M%S}"
        if jax.process_index() == 0:
            print(f"warning: checkpoint {step} ({source}) is {why}; not using it, moved to {target}", flush=True)
            move(source, target)
        self._relist()

    def _relist(self) -> None:
        """Orbax's list of steps read again from the names alone: its ``reload`` reads every
        step's metadata file, and raises on a damaged one."""
        self.wait()
        self._manager.close()
        self._manager = self._open()

    def metadata(self, step: int) -> Any:
        """The saved tree of array metadata (shape, dtype) of checkpoint ``step``."""
        return self._manager.item_metadata(step)

    def _restore_as(
        self, step: int, target: Any, saved: dict[str, tuple[tuple[int, ...], str]], record: dict[str, Any] | None
    ) -> Any:
        """Restores ``step`` onto ``target``'s shapes and shardings, checked against the
        ``record`` of its checksums; a leaf saved in an older layout (:data:`~xlafit.saveable.RESHAPED`) is
        read in its saved shape, replicated, then converted and placed on its target sharding.

        Raises:
            Damaged: an array read back is not what was saved.
        """

        def as_saved(path: tuple, x: jax.ShapeDtypeStruct) -> jax.ShapeDtypeStruct:
            shape = saved[path_name(path)][0]
            if shape == x.shape:
                return x
            sharding = x.sharding
            if isinstance(sharding, jax.sharding.NamedSharding):
                sharding = jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec())
            return jax.ShapeDtypeStruct(shape, x.dtype, sharding=sharding)

        raw = self._manager.restore(
            step, args=ocp.args.StandardRestore(jax.tree_util.tree_map_with_path(as_saved, target))
        )
        check_arrays(raw, record)  # one pass over the arrays where they landed, two words back each

        def convert(path: tuple, r: jax.Array, x: jax.ShapeDtypeStruct) -> jax.Array:
            older = older_layout(path_name(path), r.shape, x.shape)
            return r if older is None else jax.device_put(older(r), x.sharding)

        return jax.tree_util.tree_map_with_path(convert, raw, target)

    def _check_structure(self, step: int, like: Any, saved: dict[str, tuple[tuple[int, ...], str]]) -> None:
        """Checks the saved ``path -> (shape, dtype)`` against ``like``'s.

        Raises:
            CheckpointError: the first difference, and the fix.
        """
        wanted = {
            path_name(p): (tuple(x.shape), str(x.dtype))
            for p, x in jax.tree_util.tree_flatten_with_path(abstract(like))[0]
        }
        for path in sorted(set(saved) | set(wanted)):
            if path in saved and path in wanted and saved[path][1] == wanted[path][1]:
                if older_layout(path, saved[path][0], wanted[path][0]):
                    continue
            if saved.get(path) != wanted.get(path):
                have = "absent" if path not in saved else f"{saved[path][0]} {saved[path][1]}"
                want = "absent" if path not in wanted else f"{wanted[path][0]} {wanted[path][1]}"
                raise CheckpointError(
                    f"checkpoint {step} in {self.directory} does not fit this model: {path} is {have} there and "
                    f"{want} here. Resume with the config the run was started with, or start over with --restart or "
                    "another --run-dir (in Python: another run_dir)."
                )

    def restore_params(self, step: int) -> Any:
        """The ``params`` of checkpoint ``step`` as host NumPy arrays, without the model.

        For inspection: every array is read onto this process's first CPU device.
        """
        return self.restore_arrays(step)["params"]

    def restore_arrays(self, step: int) -> Any:
        """The whole saved state of checkpoint ``step`` (``params``, ``model_state`` with batch
        statistics, ``opt_state``, ``step``) as host NumPy arrays in nested dicts, without the
        model, checked against the checksums saved with it.

        Raises:
            Damaged: its metadata or arrays are not what was saved.
        """
        return self.read_one(step).arrays

    def read_one(self, step: int) -> Read:
        """Checkpoint ``step``'s arrays (on this process's first CPU device, then the host) and
        metadata, both checked against what its save recorded."""
        metadata, record = self._recorded(step)  # first: the arrays read next must be this save's
        self._shapes(step, record)
        device = jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0])
        target = jax.tree.map(
            lambda m: jax.ShapeDtypeStruct(tuple(m.shape), m.dtype, sharding=device), self.metadata(step)
        )
        arrays = self._manager.restore(step, args=ocp.args.StandardRestore(target))
        check_arrays(arrays, record)
        return Read(jax.device_get(arrays), step, [], metadata)

    def saved_since(self, newest: int | None) -> bool:
        """Whether a checkpoint newer than ``newest`` appeared: a run is saving here, and its
        rotation may have removed what was listed (a read that failed, or a file missing)."""
        self._relist()
        latest = self._manager.latest_step()
        return latest is not None and (newest is None or latest > newest)

    def close(self) -> None:
        """Waits for the saves in flight, then closes Orbax's manager; after a failed save (its
        error raised by :meth:`wait` or :meth:`save`), Orbax's close would raise it again, so
        the manager is left to the process's end."""
        try:
            self.wait()
        except CheckpointError:
            return
        self._manager.close()


def unfinished_save(directory: Any, step: int, restored: int | None) -> str:
    """What a run says of the save of ``step`` that a stopped process left unfinished in
    ``directory`` (Orbax discards it), resuming from ``restored`` (None: no checkpoint)."""
    unfinished = f"the save of step {step} did not finish (the process stopped while writing it; it is discarded)"
    if restored is None:
        return f"no complete checkpoint in {directory}: {unfinished}, so training starts again from step 0"
    return f"{unfinished}: going on from checkpoint {restored}"
