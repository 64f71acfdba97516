"""Orbax checkpoints of the whole :class:`~xlafit.train.step.TrainState`, verified on load.

- Saves are asynchronous (training continues while the arrays are written) and atomic:
  Orbax writes into a temporary directory, renames it when complete and leaves a
  ``commit_success.txt`` marker, so an interrupted save never shadows the previous
  checkpoint.
- Once a save is complete, xlafit *seals* it: ``xlafit-integrity.json`` beside it holds
  the SHA-256 of every file. On restore the newest checkpoint is verified first; a
  truncated, corrupted or half-deleted one is skipped with a warning naming it, and the
  newest intact one is used.
- Typed PRNG keys are stored as their raw ``uint32`` key data.
- Retention: the last ``keep`` checkpoints, plus every one whose step is a multiple of
  ``keep_every`` (kept for good).
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import hashlib
import json
import math
import re
import time
from collections.abc import Callable, Coroutine, Sequence
from pathlib import Path
from typing import Any, NamedTuple, TypeVar

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from xlafit.errors import CheckpointError, CheckpointWriteError, StorageError
from xlafit.io.paths import as_path, check_bucket, describe_error, files_under, is_url, move, refresh
from xlafit.models.bert import qkv_from_matrix
from xlafit.parallel.mesh import is_prng_key
from xlafit.parallel.sharding import path_name

SEAL = "xlafit-integrity.json"
COMMIT = "commit_success.txt"
ORBAX_METADATA = "_CHECKPOINT_METADATA"  # in every step's folder Orbax writes
SET_ASIDE = "corrupt-"  # the prefix of a checkpoint moved aside by the resume that found it corrupt

_T = TypeVar("_T")


_SETTLE_S = 60.0  # the longest a failed call waits for its other reads (a slow store): then it closes anyway


def _run_until_settled(coro: Coroutine[Any, Any, _T]) -> _T:
    """Orbax's way to run a coroutine from synchronous code (a new event loop, closed after
    it), where a failure first lets the loop's other tasks finish (for :data:`_SETTLE_S` at
    most).

    A restore reads every array at once (``asyncio.gather``). When one read fails (a
    truncated file), gather raises at once, and Orbax closed its loop with the other reads
    in flight: TensorStore then delivered each into the closed loop ("RuntimeError: Event
    loop is closed", a traceback per read), and the abandoned reads printed "Exception
    ignored" when collected. Cancelling them is not enough: TensorStore still calls back into
    the loop from its own threads after a cancel. So they run to their end (a failed
    restore costs the rest of its reads, as a successful one would). ``asyncio.all_tasks``
    takes this loop's tasks only, retrying its walk over a set other threads change (the
    reason Orbax does not use ``asyncio.run``). A call that succeeds, or stops on Ctrl-C,
    closes its loop at once, as Orbax does.
    """
    loop = asyncio.new_event_loop()
    try:
        asyncio.set_event_loop(loop)
        return loop.run_until_complete(coro)
    except Exception:
        deadline = time.monotonic() + _SETTLE_S
        while (pending := asyncio.all_tasks(loop)) and (left := deadline - time.monotonic()) > 0:
            done, _ = loop.run_until_complete(asyncio.wait(pending, timeout=left))  # it may start others
            for task in done:  # their errors are the first one's echoes: retrieved, so never logged
                _ = task.cancelled() or task.exception()
        raise
    finally:
        asyncio.set_event_loop(None)
        loop.close()


def _settle_orbax_reads() -> None:
    """Makes Orbax's synchronous calls finish their reads before closing their event loop
    (:func:`_run_until_settled`). Idempotent. The function replaced is a private one of
    Orbax's: with a version that lacks it, nothing is replaced and a failed restore is only
    noisier (``test_checkpoint`` says when that happens)."""
    try:
        from orbax.checkpoint._src import asyncio_utils
    except ImportError:
        return
    if hasattr(asyncio_utils, "_run_sync_via_new_loop"):
        asyncio_utils._run_sync_via_new_loop = _run_until_settled


# Parameters whose layout changed with their values kept: a checkpoint that holds one in its
# older shape (the same number of elements) restores into the new one. Path suffix -> (the
# older layout, the conversion of an array in it).
RESHAPED: dict[str, tuple[str, Callable[[Any], Any]]] = {
    "attention/qkv/kernel": ("BERT's (hidden, 3 * hidden) [q|k|v] matrix, xlafit before 2026-11-24", qkv_from_matrix),
    "attention/qkv/bias": ("BERT's (3 * hidden,) [q|k|v] bias", lambda a: a.reshape(*a.shape[:-1], 3, -1)),
}


def older_layout(path: str, saved: tuple[int, ...], wanted: tuple[int, ...]) -> Callable[[Any], Any] | None:
    """The conversion of ``path``'s array from the older layout it was saved in
    (:data:`RESHAPED`), or None when it was saved as ``wanted``."""
    if saved == wanted or math.prod(saved) != math.prod(wanted):
        return None
    name = path.removesuffix("/value")
    return next((convert for suffix, (_, convert) in RESHAPED.items() if name.endswith(suffix)), None)


def to_saveable(tree: Any) -> Any:
    """Replaces typed PRNG key arrays by their ``uint32`` key data."""
    return jax.tree.map(lambda x: jax.random.key_data(x) if is_prng_key(x) else x, tree)


def from_saveable(raw: Any, like: Any) -> Any:
    """Inverse of :func:`to_saveable`, using ``like`` to know which leaves were keys."""
    return jax.tree.map(
        lambda r, ref: jax.random.wrap_key_data(r, impl=jax.random.key_impl(ref)) if is_prng_key(ref) else r, raw, like
    )


def _abstract(tree: Any) -> Any:
    def leaf(x: Any) -> jax.ShapeDtypeStruct:
        data = jax.random.key_data(x) if is_prng_key(x) else x
        return jax.ShapeDtypeStruct(data.shape, data.dtype, sharding=getattr(x, "sharding", None))

    return jax.tree.map(leaf, tree)


def fingerprint(params: Any) -> str:
    """SHA-256 over every parameter's path, shape, dtype and bytes, in sorted path order.

    Two runs that end with this fingerprint hold bit-identical parameters.

    Example:
        >>> fingerprint({"w": np.zeros(2, np.float32)}) == fingerprint({"w": np.zeros(2, np.float32)})
        True
    """
    digest = hashlib.sha256()
    leaves = jax.tree_util.tree_flatten_with_path(to_saveable(params))[0]  # a PRNG key as its key data
    for path, leaf in sorted(leaves, key=lambda pl: path_name(pl[0])):
        value = np.ascontiguousarray(jax.device_get(leaf))
        digest.update(f"{path_name(path)}|{value.shape}|{value.dtype}|".encode())
        digest.update(value.tobytes())
    return digest.hexdigest()


def _files(directory: epath.Path) -> dict[str, epath.Path]:
    """Every file under ``directory`` by its relative name (local paths or gs:// URLs)."""
    return files_under(directory)


def _file_hashes(directory: epath.Path) -> dict[str, str]:
    hashes = {}
    for name, path in sorted(_files(directory).items()):
        if path.name.startswith(SEAL):
            continue
        digest = hashlib.sha256()
        with path.open("rb") as f:
            while block := f.read(1 << 20):
                digest.update(block)
        hashes[name] = digest.hexdigest()
    return hashes


def first_line(e: BaseException) -> str:
    """The innermost cause of ``e``, its type and first line: Orbax wraps a TensorStore read
    error (the array, the file, the byte range) in one that appends the array's whole
    TensorStore spec, some 60 lines.

    Example:
        >>> try:
        ...     try:
        ...         raise ValueError("OUT_OF_RANGE: w/0.0")
        ...     except ValueError as inner:
        ...         raise Exception("error reading w; spec:\\n{...}") from inner
        ... except Exception as e:
        ...     first_line(e)
        'ValueError: OUT_OF_RANGE: w/0.0'
        >>> first_line(ValueError("OUT_OF_RANGE: size 10 [tensorstore_spec='{\\"driver\\":\\"zarr\\"}']"))
        'ValueError: OUT_OF_RANGE: size 10'
    """
    while e.__cause__ is not None:
        e = e.__cause__
    # TensorStore appends the array's whole spec to the line itself (some 1,400 characters)
    lines = [_SPEC.sub("", line) for line in str(e).strip().splitlines()]
    return f"{type(e).__name__}: {lines[0]}" if lines else type(e).__name__


_SPEC = re.compile(r"\s*\[tensorstore_spec='.*?'\]")


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
        return not self.status.startswith("corrupt")


class Read(NamedTuple):
    """What :meth:`Checkpointer.read` found: a checkpoint's arrays and the newer ones it passed over."""

    arrays: Any  # the whole saved state as host NumPy arrays in nested dicts
    step: int
    passed_over: list[tuple[int, str]]  # (step, what is wrong with it: "corrupt: <why>"), newest first

    def passed(self) -> str:
        """The checkpoints passed over, in words: ``checkpoint 3 is corrupt: <why>; ...``."""
        return _in_words(self.passed_over)


def _in_words(passed: Sequence[tuple[int, str]]) -> str:
    return "; ".join(f"checkpoint {step} is {why}" for step, why in passed)


class Checkpointer:
    """Keeps the checkpoints of a run under ``directory``: a local path, or a URL that
    Orbax and ``etils.epath`` can write (gs:// with ``gcsfs`` installed).

    Example:
        >>> import tempfile
        >>> ckpt = Checkpointer(tempfile.mkdtemp(), keep=3)
        >>> ckpt.save(100, {"w": np.arange(3.0)}); ckpt.wait()
        >>> state, step = ckpt.restore({"w": np.zeros(3)})
        >>> step, state["w"].tolist(), [i.status for i in ckpt.list()]
        (100, [0.0, 1.0, 2.0], ['intact'])
        >>> ckpt.close()
    """

    def __init__(
        self, directory: str | Path, keep: int = 3, keep_every: int | None = None, async_save: bool = True
    ) -> None:
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
        _settle_orbax_reads()
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep, keep_period=keep_every or None, create=True, enable_async_checkpointing=async_save
        )
        self._manager = ocp.CheckpointManager(
            self.directory, options=options, item_handlers=ocp.StandardCheckpointHandler()
        )
        self.last_saved: int | None = None
        self._sealed: set[int] = set()  # steps whose seal exists

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def save(self, step: int, state: Any, metadata: dict[str, str] | None = None) -> None:
        """Starts writing ``state`` as checkpoint ``step`` (returns before it is on disk).

        ``metadata`` (short strings: the fingerprint of a frozen base model) goes into the
        step's own metadata file, sealed with the arrays; :meth:`saved_metadata` reads it.

        Raises:
            CheckpointError: the previous save failed (disk full, no permission): the
                checkpoints before it are intact, and the message names the newest.
        """
        self.wait()
        self.last_saved = step
        self._sealed.discard(step)  # a step saved again (after a rollback) is sealed again
        try:
            self._manager.save(
                step, args=ocp.args.StandardSave(to_saveable(state)), force=True, custom_metadata=metadata or {}
            )
        except Exception as e:  # on a URL the first requests go out here, before the background write
            raise self._failed(e) from e

    def wait(self) -> None:
        """Blocks until every save started so far is on disk, then seals it."""
        try:
            self._manager.wait_until_finished()
            if jax.process_index() == 0:
                for step in self._manager.all_steps():
                    if step not in self._sealed:  # one look per checkpoint, not per save (requests on gs://)
                        self._seal(step)
        except Exception as e:  # Orbax re-raises the background writer's error here
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

    def _seal(self, step: int) -> None:
        directory = self._step_dir(step)
        if (directory / SEAL).exists():
            self._sealed.add(step)
            return
        if not (directory / COMMIT).exists():
            return
        seal = json.dumps({"step": step, "sha256": _file_hashes(directory)}, indent=1)
        if is_url(directory):
            (directory / SEAL).write_text(seal)  # object stores write an object whole or not at all
        else:
            tmp = directory / f"{SEAL}.tmp"
            tmp.write_text(seal)
            tmp.replace(directory / SEAL)  # atomic rename: a seal is whole or absent
        self._sealed.add(step)

    def verify(self, step: int) -> str:
        """``"intact"``, ``"unsealed"`` or ``"corrupt: <why>"`` for checkpoint ``step``."""
        directory = self._step_dir(step)
        if not (directory / COMMIT).exists():
            return f"corrupt: no commit marker ({COMMIT}): the save never finished"
        if not (directory / SEAL).exists():
            return "unsealed"
        try:
            expected = json.loads((directory / SEAL).read_text())["sha256"]
        except (OSError, ValueError, KeyError) as e:
            return f"corrupt: unreadable {SEAL} ({e})"
        actual = _file_hashes(directory)
        for name, digest in expected.items():
            if name not in actual:
                return f"corrupt: {name} is missing"
            if actual[name] != digest:
                return f"corrupt: {name} does not match its checksum"
        return "intact"

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
            return dict(self._manager.metadata(step).custom_metadata or {})
        except Exception:  # a damaged metadata file: the arrays' own check decides
            return {}

    def list(self) -> list[CheckpointInfo]:
        """Every checkpoint on disk, oldest first, verified."""
        infos = []
        for step in sorted(self._manager.all_steps()):
            directory = self._step_dir(step)
            stats = [p.stat() for p in _files(directory).values()]
            # Modification times change when a file is touched or damaged after the save.
            committed = self.committed_at(step)
            modified = datetime.datetime.fromtimestamp(max((st.mtime for st in stats), default=0), datetime.UTC)
            infos.append(
                CheckpointInfo(
                    step=step,
                    path=directory,
                    time=committed or modified,
                    size_bytes=sum(st.length for st in stats),
                    status=self.verify(step),
                    time_source="commit" if committed else "mtime",
                )
            )
        return infos

    def restore(self, like: Any, step: int | None = None) -> tuple[Any, int]:
        """Restores a checkpoint with the shapes and shardings of ``like``.

        Args:
            like: a state of the structure to restore (its values are not used).
            step: this checkpoint; default: the newest one that verifies and reads. Each
                newer one is set aside (``corrupt-<step>-<time>``, a warning naming it) once
                an older one restores; with none intact, nothing moves.

        Returns:
            ``(state, step)``.

        Raises:
            CheckpointError: no intact checkpoint (the message names what is wrong with
                each), or one whose arrays do not match ``like`` (a model change): the
                message names the first difference.
        """
        candidates = [step] if step is not None else sorted(self._manager.all_steps(), reverse=True)
        bad: list[tuple[int, str]] = []
        for s in candidates:
            status = self.verify(s)
            if status.startswith("corrupt"):
                bad.append((s, status))
                continue
            saved = self._check_structure(s, like)
            try:
                raw = self._restore_as(s, _abstract(like), saved)
            except Exception as e:  # unreadable despite the marker: treat as corrupt
                bad.append((s, f"unreadable ({first_line(e)})"))
                continue
            # Moved only once the run goes on from an older one: with none intact, the run is
            # refused, and every later attempt must find them and refuse again.
            for b, why in bad:
                self._set_aside(b, why)
            return from_saveable(raw, like), s
        found = _in_words(bad) or "it holds none"
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
        self._manager.reload()

    def metadata(self, step: int) -> Any:
        """The saved tree of array metadata (shape, dtype) of checkpoint ``step``."""
        return self._manager.item_metadata(step)

    def _restore_as(self, step: int, target: Any, saved: dict[str, tuple[tuple[int, ...], str]]) -> Any:
        """Restores ``step`` onto ``target``'s shapes and shardings; a leaf saved in an older
        layout (:data:`RESHAPED`) is read in its saved shape, replicated, then converted and
        placed on its target sharding."""

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

        def convert(path: tuple, r: jax.Array, x: jax.ShapeDtypeStruct) -> jax.Array:
            older = older_layout(path_name(path), r.shape, x.shape)
            return r if older is None else jax.device_put(older(r), x.sharding)

        return jax.tree_util.tree_map_with_path(convert, raw, target)

    def _check_structure(self, step: int, like: Any) -> dict[str, tuple[tuple[int, ...], str]]:
        """The saved ``path -> (shape, dtype)``, checked against ``like``'s."""
        saved = {
            path_name(p): (tuple(m.shape), str(m.dtype))
            for p, m in jax.tree_util.tree_flatten_with_path(self.metadata(step))[0]
        }
        wanted = {
            path_name(p): (tuple(x.shape), str(x.dtype))
            for p, x in jax.tree_util.tree_flatten_with_path(_abstract(like))[0]
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
        return saved

    def restore_params(self, step: int) -> Any:
        """The ``params`` of checkpoint ``step`` as host NumPy arrays, without the model.

        For inspection: every array is read onto this process's first CPU device.
        """
        return self.restore_arrays(step)["params"]

    def restore_arrays(self, step: int) -> Any:
        """The whole saved state of checkpoint ``step`` (``params``, ``model_state`` with batch
        statistics, ``opt_state``, ``step``) as host NumPy arrays in nested dicts, without the model."""
        device = jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0])
        target = jax.tree.map(
            lambda m: jax.ShapeDtypeStruct(tuple(m.shape), m.dtype, sharding=device), self.metadata(step)
        )
        return jax.device_get(self._manager.restore(step, args=ocp.args.StandardRestore(target)))

    def read(self, step: int | None = None, infos: Sequence[CheckpointInfo] | None = None) -> Read:
        """The whole saved state of checkpoint ``step`` (default: the newest that verifies and
        reads) as host arrays (:meth:`restore_arrays`), for the commands that read a run
        (``inspect``, ``export``, ``generate``). Nothing is moved.

        Args:
            step: this checkpoint, which must be intact (or unsealed) and readable.
            infos: :meth:`list`'s answer, where the caller has it (it checksums every file).

        Raises:
            CheckpointError: ``step`` is absent, corrupt or unreadable, or (without ``step``)
                no checkpoint reads; the message says what is wrong with it and names the
                intact ones.
        """
        infos = self.list() if infos is None else infos
        intact = [i.step for i in infos if i.usable]
        if step is not None:
            asked = [i for i in infos if i.step == step]
            if not asked:
                raise CheckpointError(
                    f"no checkpoint {step} in {self.directory}; there are: {[i.step for i in infos]}, intact: {intact}."
                )
            why = None if asked[0].usable else asked[0].status
            if why is None:
                try:
                    return Read(self.restore_arrays(step), step, [])
                except Exception as e:  # unreadable despite the marker
                    why = f"unreadable ({first_line(e)})"
                    intact.remove(step)
            raise CheckpointError(f"checkpoint {step} in {self.directory} is {why}; intact: {intact}.")
        passed: list[tuple[int, str]] = []
        for info in reversed(infos):
            if info.usable:
                try:
                    return Read(self.restore_arrays(info.step), info.step, passed)
                except Exception as e:  # unreadable despite the marker: the next older one
                    passed.append((info.step, f"unreadable ({first_line(e)})"))
            else:
                passed.append((info.step, info.status))
        raise CheckpointError(
            f"no checkpoint in {self.directory} can be read ({_in_words(passed) or 'it holds none'}); the run has "
            "to start over (xlafit train --restart) to write new ones."
        )

    def close(self) -> None:
        self._manager.close()
