"""A checkpoint read by the commands that read a run (``inspect``, ``export``, ``generate``),
which may be training meanwhile: a snapshot of hard links pins the files a rotation removes,
and a checkpoint removed while it was listed or read is looked up again, not called corrupt.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path

from xlafit.checkpoint import Checkpointer, CheckpointInfo, Read, in_words
from xlafit.errors import CheckpointError
from xlafit.integrity import Damaged
from xlafit.io.paths import is_url
from xlafit.orbax_loop import first_line

__all__ = ["read_checkpoint"]

_READ_TRIES = 5  # fresh looks at a directory whose run saves (and rotates) while it is read


def read_checkpoint(ckpt: Checkpointer, step: int | None = None, infos: Sequence[CheckpointInfo] | None = None) -> Read:
    """The whole saved state of checkpoint ``step`` (default: the newest that verifies and
    reads) as host arrays, with the metadata saved with them
    (:meth:`~xlafit.checkpoint.Checkpointer.restore_arrays`), for the commands that read a
    run (``inspect``, ``export``, ``generate``). Nothing is moved.

    A run that is training saves and rotates its checkpoints meanwhile: a checkpoint
    removed while it was listed or read is not called corrupt; the newest is looked up
    again (a few times at most).

    Args:
        step: this checkpoint, which must be intact (or unsealed) and readable.
        infos: :meth:`~xlafit.checkpoint.Checkpointer.list`'s answer, where the caller has it
            (it checksums every file).

    Raises:
        CheckpointError: ``step`` is absent, corrupt or unreadable, or (without ``step``)
            no checkpoint reads; the message says what is wrong with it and names the
            intact ones.
    """
    infos = ckpt.list() if infos is None else infos
    if step is not None:
        return _read_asked(ckpt, step, infos)
    for _ in range(_READ_TRIES):
        infos = ckpt.list() if infos is None else infos
        found, passed = None, []
        for info in reversed(infos):
            why = None if info.usable else info.status
            if why is None:
                try:
                    found = _read_pinned(ckpt, info.step)
                    break
                except Damaged as e:
                    why = f"corrupt: {e}"
                except Exception as e:  # unreadable despite the marker: the next older one
                    why = f"unreadable ({first_line(e)})"
            passed.append((info.step, why))
        if not passed or not ckpt.saved_since(infos[-1].step if infos else None):
            if found is None:
                raise CheckpointError(
                    f"no checkpoint in {ckpt.directory} can be read ({in_words(passed) or 'it holds none'}); "
                    "the run has to start over (xlafit train --restart) to write new ones."
                )
            return found._replace(passed_over=passed)
        infos = None  # the run saved meanwhile: what looked wrong may be what its rotation removed
    raise CheckpointError(
        f"the checkpoints in {ckpt.directory} were replaced while being read, {_READ_TRIES} times over: the run "
        "there saves faster than they can be read. Give --step a checkpoint it keeps (trainer.keep_every_steps), "
        "or read it once it stops."
    )


def _read_asked(ckpt: Checkpointer, step: int, infos: Sequence[CheckpointInfo]) -> Read:
    """:func:`read_checkpoint` of checkpoint ``step``."""
    intact = [i.step for i in infos if i.usable]
    asked = [i for i in infos if i.step == step]
    if not asked:
        raise CheckpointError(
            f"no checkpoint {step} in {ckpt.directory}; there are: {[i.step for i in infos]}, intact: {intact}."
        )
    why = None if asked[0].usable else asked[0].status
    if why is None:
        try:
            return _read_pinned(ckpt, step)
        except Damaged as e:
            why = f"corrupt: {e}"
        except Exception as e:  # unreadable despite the marker
            why = f"unreadable ({first_line(e)})"
        intact.remove(step)
        if ckpt.saved_since(infos[-1].step):
            raise CheckpointError(
                f"checkpoint {step} in {ckpt.directory} was removed while it was read: the run there saves and "
                f"keeps only its newest ones (now {ckpt.latest_step()}). Give a newer --step, or none "
                "for the newest."
            )
    raise CheckpointError(f"checkpoint {step} in {ckpt.directory} is {why}; intact: {intact}.")


def _read_pinned(ckpt: Checkpointer, step: int) -> Read:
    """:meth:`~xlafit.checkpoint.Checkpointer.read_one` of a snapshot of checkpoint ``step``:
    its files hard-linked into a hidden folder of the run directory, in a few milliseconds, so a running job's
    rotation that removes them meanwhile leaves the links' data to read. In place on a URL,
    or where links cannot be made (another filesystem, no permission to write)."""
    if is_url(ckpt.directory):
        return ckpt.read_one(step)
    try:
        root = Path(tempfile.mkdtemp(prefix=".xlafit-reading-", dir=Path(ckpt.directory).parent))
    except OSError:
        return ckpt.read_one(step)
    try:
        try:
            shutil.copytree(Path(ckpt.directory, str(step)), root / str(step), copy_function=os.link)
        except shutil.Error as e:  # files removed while linked: what the retry is for
            raise FileNotFoundError(f"checkpoint {step} lost files while it was read ({e})") from None
        except FileNotFoundError:
            raise
        except OSError:  # no hard links here
            return ckpt.read_one(step)
        pinned = Checkpointer(root)
        try:
            status = pinned.verify(step)
            if status.startswith("corrupt"):
                raise Damaged(status.removeprefix("corrupt: "))
            return pinned.read_one(step)
        finally:
            pinned.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)
