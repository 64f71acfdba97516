"""The errors xlafit raises for a user's mistake or environment, and the command's exit codes.

Every one derives from :class:`XlafitError`, whose message says what happened and the fix,
and whose ``exit_code`` is what the ``xlafit`` command exits with: the command catches this
one class. Anything else reaching the user is a bug in xlafit.

Example:
    >>> from xlafit.errors import ConfigError, XlafitError
    >>> issubclass(ConfigError, XlafitError), ConfigError.exit_code
    (True, 2)
"""

from __future__ import annotations

import contextlib
import contextvars
import errno
import os
import signal
import sys
from collections.abc import Iterator

# Exit codes that schedulers and scripts can act on.
DAMAGED = 1  # xlafit inspect: the newest checkpoint is corrupt, or none is intact
USAGE = 2  # bad config, data, devices or checkpoint: the message says what to fix
NONFINITE = 3  # a non-finite loss or gradient under trainer.nan_policy=stop
BUSY = 73  # another process is training in the run directory (the message names it): run again once it has ended
STORAGE = 74  # EX_IOERR: a file of the run could not be written (a full disk, read-only): fix it, run again
PREEMPTED = 75  # EX_TEMPFAIL: stopped by SIGTERM/SIGINT after saving a checkpoint; run again to resume
INTERRUPTED = 130  # 128 + SIGINT: Ctrl-C where no checkpoint could be saved


class XlafitError(Exception):
    """An error a user can act on; the message names the problem and the fix."""

    exit_code = USAGE

    def _render_traceback_(self) -> list[str]:
        """What IPython (a Jupyter or Colab notebook) shows of it: its class and message, as the
        command's one line, not the frames of xlafit's internals that raised it."""
        return [f"{type(self).__name__}: {self}"]


class ConfigError(XlafitError, ValueError):
    """A configuration a user wrote is invalid; the message says how to fix it."""


class DataError(XlafitError, ValueError):
    """A data file is missing or malformed; the message names the file and the fix."""


class DeviceError(XlafitError, RuntimeError):
    """The requested devices cannot be had; the message says why and what to do."""


class StorageError(XlafitError, OSError):
    """A read or write of a URL failed (no such bucket, no permission, server unreachable);
    the message names the URL and the fix."""


class CheckpointError(XlafitError, RuntimeError):
    """No usable checkpoint, or one that cannot continue this run; the message says why."""


class WriteError(XlafitError, OSError):
    """A file of the run (its config, metrics, TensorBoard log, a checkpoint) could not be
    written: a full disk, a read-only directory, no permission. The message names the file and
    the fix; once that is fixed, the same command resumes the run, so the exit code is its own."""

    exit_code = STORAGE


class NoIntactCheckpoint(CheckpointError):
    """``xlafit inspect``: the run has checkpoints, and none of them is intact (each corrupt,
    unreadable or set aside); the message names what is wrong with them."""

    exit_code = DAMAGED


class CheckpointWriteError(CheckpointError, WriteError):
    """A checkpoint could not be written; the message names the newest complete one and the fix."""


class RunDirBusy(XlafitError):
    """Another process is training in the run directory; the message names its host and process."""

    exit_code = BUSY


class RecompileError(XlafitError, RuntimeError):
    """A step was about to compile more programs than allowed; the message names the input."""


class HFFormatError(XlafitError, ValueError):
    """A Hugging Face checkpoint that cannot become an xlafit model (BERT, ResNet), or a model
    that cannot become a Hugging Face one; the message says why."""


class BenchError(XlafitError, RuntimeError):
    """A benchmark configuration failed; the message holds the end of its output."""


class RewardError(XlafitError, ValueError):
    """A reward function of a GRPO run raised, or returned what is not one number per
    completion; the message names the function, the prompt and the fix. Nothing was trained
    on that batch."""


class NonFiniteError(XlafitError):
    """A non-finite loss or gradient under ``trainer.nan_policy=stop``; the message names it."""

    exit_code = NONFINITE


_WRITE_FIXES = {
    errno.ENOSPC: "Free disk space",
    errno.EDQUOT: "Free space within your disk quota",
    errno.EROFS: "Make the file system writable (it is mounted read-only)",
    errno.EACCES: "Make it writable (its permissions, or its directory's, forbid writing)",
    errno.EPERM: "Make it writable (its permissions, or its directory's, forbid writing)",
    errno.EFBIG: "Raise the file-size limit (ulimit -f) or free space",
}


def write_failed(path: str | os.PathLike[str], e: OSError) -> WriteError:
    """The one-line error for a file of the run that could not be written: the file, why, the
    fix, and that the same command resumes once it is fixed.

    Example:
        >>> full = OSError(errno.ENOSPC, "No space left on device")
        >>> print(write_failed("runs/a/metrics.jsonl", full))  # doctest: +ELLIPSIS
        cannot write runs/a/metrics.jsonl: No space left on device. Free disk space, then run ... to resume.
    """
    fix, then = _WRITE_FIXES.get(e.errno or 0, "Fix that"), resume_hint()
    return WriteError(f"cannot write {os.fspath(path)}: {e.strerror or e}. {fix}, then {then[0].lower()}{then[1:]}")


# How to go on after a stop where the same command would not: a run whose directory was made
# for it (the same command makes another). Set by the run around its training.
_GO_ON: contextvars.ContextVar[str | None] = contextvars.ContextVar("go_on", default=None)


@contextlib.contextmanager
def going_on_with(hint: str | None) -> Iterator[None]:
    """:func:`resume_hint` says ``hint`` (None: as it would) within the block."""
    token = _GO_ON.set(hint)
    try:
        yield
    finally:
        _GO_ON.reset(token)


def resume_hint() -> str:
    """How to go on after a stop: what :func:`going_on_with` set; in a notebook (an IPython
    kernel), the cell; else the command."""
    if (hint := _GO_ON.get()) is not None:
        return hint
    if "ipykernel" in sys.modules:
        return "Run the cell again (with the same run directory) to resume."
    return "Run the same command again to resume."


class Preempted(XlafitError):
    """Training stopped on SIGTERM/SIGINT at ``step``; ``where`` says what was saved.

    Running the same command (or calling :func:`xlafit.train_and_evaluate` / ``Trainer.fit``
    again with the same run directory) resumes from that checkpoint.
    """

    exit_code = PREEMPTED

    def __init__(
        self, step: int, signum: int, where: str, *, sync_point: bool = False, hint: str | None = None
    ) -> None:
        self.step, self.signum = step, signum
        how = " (at JAX's preemption sync point: the same step in every process)" if sync_point else ""
        super().__init__(
            f"{signal.Signals(signum).name} received: stopped at step {step}; {where}{how}. {hint or resume_hint()}"
        )
