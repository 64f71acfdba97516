"""Where prepared shards are written: an output directory, local or on any fsspec URL.

Shared by ``xlafit data mlm`` (:mod:`xlafit.data.mlm.preparation`) and ``xlafit data images``
(:mod:`xlafit.data.images.preparation`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import fsspec

from xlafit.data.dataset import DataError
from xlafit.paths import StorageError, check_bucket, describe_error, is_url


@contextlib.contextmanager
def writing(out: str | Path, what: str) -> Iterator[None]:
    """Turns a failed write under ``out`` (a 403, a full disk, an unreachable server) into a
    :class:`DataError` that names the cause and the fix, instead of the client's traceback.
    ``what`` names what was being written ("the MLM shards")."""
    try:
        yield
    except OSError as e:
        raise DataError(f"writing {what} failed: {describe_error(out, e)}") from e


def output_dir(out: str | Path, what: str) -> tuple[fsspec.AbstractFileSystem, str]:
    """The filesystem and root path of ``out``, created if missing; a bucket that does not
    exist is refused by name, never created (gcsfs's ``makedirs`` would create it)."""
    fs, root = fsspec.core.url_to_fs(out)
    root = root.rstrip("/")
    if is_url(out):
        try:
            check_bucket(str(out), "--out")
        except StorageError as e:
            raise DataError(str(e)) from None
    with writing(out, what):
        fs.makedirs(root, exist_ok=True)
    return fs, root
