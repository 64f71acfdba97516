"""One training process per run directory: :func:`hold_run_dir`.

Two processes training in one run directory (the same command started twice: a notebook cell
run again, a retry loop, an ssh session that dropped while its command went on) delete each
other's checkpoints and interleave their metrics. Process 0 of a run therefore holds the run
directory's lock while it trains, and a second run is refused in one line naming the holder's
host and process. The commands that only read a run (``inspect``, ``export``, ``generate``)
take no lock; neither do the other processes of a multi-process job (process 0 holds it for
the job).

- A local run directory: ``fcntl.flock`` on ``.xlafit-lock`` in it, which also holds the
  holder's host, process id, start time and command. The kernel releases the lock when the
  process ends, however it ends (``kill -9`` included), so a new run takes over at once.
  Processes started by fork would share the lock; xlafit's worker processes are spawned.
- A URL (``gs://bucket/run``): the object ``.xlafit-lock``, created only where none exists
  (a generation precondition, ``ifGenerationMatch=0``: of two processes, one creates it). The
  holder renews it every :data:`RENEW_S` seconds; a lock not renewed for :data:`LEASE_S`
  seconds (by the store's clock against this host's) belongs to a process that died without
  releasing it, and a new run deletes it (on the condition that it is still that generation),
  takes it and says so. Renewals and deletions name the generation they expect, so a holder
  that finds its lock taken over warns instead of writing over it.

The lock file is hidden: a run directory holding only it is still an empty one, and
``--restart`` leaves it in place (it moves the run's other files aside).
"""

from __future__ import annotations

import datetime
import errno
import fcntl
import json
import logging
import os
import socket
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from etils import epath

from xlafit.errors import RunDirBusy, StorageError, write_failed
from xlafit.io.paths import describe_error, filesystem, is_url

log = logging.getLogger("xlafit")

LOCK = ".xlafit-lock"
LEASE_S = 300.0  # a URL lock not renewed for this long is a dead holder's
RENEW_S = 60.0  # how often the holder of a URL lock renews it


def holder_record() -> dict[str, Any]:
    """What the lock says of its holder: this host, this process, when and how it started."""
    return {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "started": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]) if sys.argv and sys.argv[0] else "python",
        "token": uuid.uuid4().hex,  # this holding, whichever host and pid
    }


def describe(holder: dict[str, Any] | None) -> str:
    """The holder in words: ``process 1234 on host-a (started ...: xlafit train mnist ...)``."""
    if not holder:
        return "another process (which has not written its name yet)"
    command = str(holder.get("command", ""))
    command = command if len(command) <= 120 else command[:117] + "..."
    return f"process {holder.get('pid')} on {holder.get('host')} (started {holder.get('started')}: {command})"


def _busy(run_dir: Any, holder: dict[str, Any] | None) -> RunDirBusy:
    return RunDirBusy(
        f"the run directory {run_dir} is in use by {describe(holder)}: one run directory takes one training at a "
        "time. Wait for that run to end (or stop it), then run again to resume; or give another --run-dir."
    )


@contextmanager
def hold_run_dir(run_dir: epath.Path | Path | str) -> Iterator[list[str]]:
    """Holds the lock of ``run_dir`` (which must exist, for a local one) for the ``with`` block.

    Yields:
        The lines to print: a URL lock taken over from a holder whose lease ended.

    Raises:
        RunDirBusy: another process holds it; the message names its host and process.
        StorageError: a URL whose lock object cannot be read or written.

    Example:
        >>> import tempfile
        >>> run = tempfile.mkdtemp()
        >>> with hold_run_dir(run):
        ...     try:
        ...         with hold_run_dir(run):
        ...             pass
        ...     except RunDirBusy as e:
        ...         f"process {os.getpid()} on" in str(e)
        True
    """
    lock: _LocalLock | _UrlLock = _UrlLock(run_dir) if is_url(run_dir) else _LocalLock(Path(run_dir))
    lines = lock.acquire()
    try:
        yield lines
    finally:
        lock.release()


class _LocalLock:
    def __init__(self, run_dir: Path) -> None:
        self.run_dir, self.path = run_dir, run_dir / LOCK
        self._fd: int | None = None

    def acquire(self) -> list[str]:
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise write_failed(self.path, e) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise
            raise _busy(self.run_dir, self._holder()) from None
        # Never unlinked: a process that opened it before an unlink would lock a file that
        # no longer has a name, beside the one that a third process creates and locks.
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps(holder_record()).encode(), 0)
        except OSError as e:
            os.close(fd)
            raise write_failed(self.path, e) from None
        self._fd = fd
        return []

    def _holder(self) -> dict[str, Any] | None:
        for _ in range(20):  # the holder writes its name just after taking the lock
            try:
                return dict(json.loads(self.path.read_text()))
            except (OSError, ValueError, TypeError):
                time.sleep(0.05)
        return None

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # the kernel releases the flock with the last descriptor
            self._fd = None


class _UrlLock:
    def __init__(self, run_dir: Any) -> None:
        self.run_dir = run_dir
        self.url = f"{os.fspath(run_dir).rstrip('/')}/{LOCK}"
        self.fs, self.key = filesystem(self.url)
        self.bucket, _, self.name = self.key.partition("/")
        # GCS's generation preconditions; another store (s3://) gets a lock without them, which
        # two runs started within the same moment can both take.
        self._gcs = "gs" in self.fs.protocol
        self.record = holder_record()
        self.generation: str | None = None
        self._stop = threading.Event()
        self._renewer: threading.Thread | None = None

    def acquire(self) -> list[str]:
        lines: list[str] = []
        try:
            if not self._create():
                found = self._read()
                if found is None:  # released between our create and our read
                    if not self._create():
                        raise _busy(self.run_dir, None)
                else:
                    holder, generation, age = found
                    if age < LEASE_S:
                        raise _busy(self.run_dir, holder)
                    self._delete(generation)
                    if not self._create():  # another newcomer took it first
                        raise _busy(self.run_dir, (self._read() or (None, 0, 0))[0])
                    lines.append(
                        f"took over the lock of {self.run_dir} from {describe(holder)}: it was last renewed "
                        f"{age:.0f} s ago (a holder renews it every {RENEW_S:.0f} s), so that process ended without "
                        "releasing it"
                    )
        except (RunDirBusy, StorageError):
            raise
        except Exception as e:
            raise StorageError(f"cannot take the run directory's lock: {describe_error(self.url, e)}") from e
        self._renewer = threading.Thread(target=self._renew_every, name="xlafit-run-lock", daemon=True)
        self._renewer.start()
        return lines

    def _body(self) -> bytes:
        now = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
        return json.dumps({**self.record, "renewed": now}).encode()

    def _create(self) -> bool:
        """Creates the lock object where none exists; False where one does."""
        try:
            if self._gcs:
                self.fs.pipe_file(self.key, self._body(), mode="create")  # ifGenerationMatch=0
            elif self.fs.exists(self.key):
                return False
            else:
                self.fs.pipe_file(self.key, self._body())
        except FileExistsError:
            return False
        self.fs.invalidate_cache(self.key)
        self.generation = str(self.fs.info(self.key).get("generation", "written"))
        return True

    def _read(self) -> tuple[dict[str, Any] | None, str, float] | None:
        """(holder, generation, seconds since it was last written), or None when there is none."""
        self.fs.invalidate_cache(self.key)
        try:
            info = self.fs.info(self.key)
            body = self.fs.cat_file(self.key)
        except FileNotFoundError:
            return None
        try:
            holder: dict[str, Any] | None = dict(json.loads(body))
        except (ValueError, TypeError):
            holder = None
        updated = info.get("mtime") or info.get("updated")
        if isinstance(updated, str):
            updated = datetime.datetime.fromisoformat(updated.replace("Z", "+00:00"))
        age = (datetime.datetime.now(datetime.UTC) - updated).total_seconds() if updated else float("inf")
        return holder, str(info.get("generation", "written")), age

    def _delete(self, generation: str) -> None:
        """Deletes the lock object if it is still ``generation`` (GCS's precondition)."""
        try:
            if self._gcs:
                self.fs.call("DELETE", "b/{}/o/{}", self.bucket, self.name, ifGenerationMatch=generation)
            else:
                self.fs.rm_file(self.key)
        except FileNotFoundError:
            pass  # gone already
        except Exception as e:
            if "412" not in str(e) and "recondition" not in str(e):
                raise
        self.fs.invalidate_cache(self.key)

    def _renew_every(self) -> None:
        while not self._stop.wait(RENEW_S):
            try:
                self._renew()
            except Exception as e:  # a store that does not answer now may answer at the next renewal
                log.warning("warning: could not renew the lock %s: %s", self.url, e)

    def _renew(self) -> None:
        found = self._read()
        holder = found[0] if found else None
        if not holder or holder.get("token") != self.record["token"]:
            log.warning(
                "warning: the lock of %s was taken over by %s (this process's renewals stopped for %.0f s): two "
                "processes now write in the run directory; stop one of them",
                self.run_dir,
                describe(holder),
                LEASE_S,
            )
            self._stop.set()
            return
        if not self._gcs:
            self.fs.pipe_file(self.key, self._body())
            return
        path = f"{self.fs._location}/upload/storage/v1/b/{self.bucket}/o"
        out = self.fs.call(
            "POST", path, uploadType="media", name=self.name, ifGenerationMatch=self.generation,
            data=self._body(), json_out=True,
        )  # fmt: skip
        self.generation = str(out["generation"])

    def release(self) -> None:
        self._stop.set()
        if self._renewer is not None:
            self._renewer.join(timeout=10)
        if self.generation is None:
            return
        try:
            self._delete(self.generation)
        except Exception as e:  # at the end: say so, never raise (the lease ends on its own)
            log.warning("warning: could not release the lock %s (%s); it lapses in %.0f s", self.url, e, LEASE_S)
        self.generation = None
