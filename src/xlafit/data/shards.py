"""Prepared shards and their manifest, local or on any fsspec URL: where they are written,
and reading them back with every failure named (a missing, damaged or changed file, no
permission, an unreachable server) instead of the client's traceback.

Shared by ``xlafit data mlm`` (:mod:`xlafit.data.mlm`) and ``xlafit data images``
(:mod:`xlafit.data.images`).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import re
import secrets
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import fsspec

from xlafit.errors import DataError, StorageError
from xlafit.io.paths import RUN_MARKERS, check_bucket, describe_error, filesystem, is_url

if TYPE_CHECKING:
    import pyarrow as pa

log = logging.getLogger("xlafit")


# A run's record of the prepared data it trained on (:func:`fingerprint`), beside its checkpoints.
FINGERPRINT_FILE = "data_shards.json"


def fingerprint(manifest: dict) -> dict[str, list[str]]:
    """The sha256 of each shard of each split of a prepared directory's ``manifest``: what a
    run keeps of its data (:data:`FINGERPRINT_FILE`), so that data prepared again in place (its
    images or documents, its split) is seen when the run resumes or is scored. The time of the
    preparation and the input's path are left out: the same preparation gives the same record.

    Example:
        >>> fingerprint({"splits": {"train": {"shards": [{"path": "train-00000.parquet", "sha256": "ab"}]}}})
        {'train': ['ab']}
    """
    return {split: [shard["sha256"] for shard in record["shards"]] for split, record in manifest["splits"].items()}


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
    """The filesystem and root path of ``out``, created if missing.

    A bucket that does not exist is refused by name, never created (gcsfs's ``makedirs``
    would create it), and so is a run directory (:data:`~xlafit.io.paths.RUN_MARKERS`): the
    shards would sit among its files and replace its ``tokenizer/``, which its export reads."""
    fs, root = filesystem(out)
    root = root.rstrip("/")
    if is_url(out):
        try:
            check_bucket(str(out), "--out")
        except StorageError as e:
            raise DataError(str(e)) from None
    with writing(out, what):
        if fs.isfile(root):
            raise DataError(f"--out {out} is a file; give a directory for {what} (it is created if missing).")
        run_files = [name for name in RUN_MARKERS if fs.exists(f"{root}/{name}")]
        if run_files:  # shards among a run's files, and its tokenizer/ replaced: the run could not be exported
            raise DataError(
                f"--out {out} is a run directory of `xlafit train` (it holds {', '.join(run_files)}); "
                f"give a new directory for {what}."
            )
        fs.makedirs(root, exist_ok=True)
    return fs, root


# What each manifest format holds, for a message that finds one where another was expected.
KINDS = {"xlafit-mlm-v1": "MLM shards of `xlafit data mlm`", "xlafit-images-v1": "image shards of `xlafit data images`"}
SHARD_NAME = re.compile(r"(train|eval)-\d{5,}(\.[0-9a-f]{8})?\.parquet")  # shard_name's


def earlier_preparation(
    fs: fsspec.AbstractFileSystem,
    root: str,
    out: str | Path,
    manifest: str,
    data: str,
    what: str,
    overwrite: bool,
    fmt: str,
) -> list[str]:
    """The shards (:data:`SHARD_NAME`) an earlier preparation left in ``root``, for
    :func:`publish` to clear once the new manifest is written.

    Shards without a manifest (an interrupted preparation: unusable) are replaced. A manifest
    is refused unless ``overwrite``; with it, the earlier manifest and shards stay as they are
    until the new data is complete: the new shards take names of their own (:func:`shard_tag`),
    the new manifest replaces the old in one write (:func:`publish`), and only then are the
    old shards removed. A preparation that fails or is interrupted before then (a corrupt
    image, no text, Ctrl-C) leaves the earlier data usable; its own shards are removed
    (:func:`discarded_on_failure`), or by the next preparation. ``data`` names the data for
    messages ("images", "MLM data"), ``what`` the files being written ("the MLM shards"),
    ``fmt`` the manifest's format: data of another format is refused even with ``overwrite``.

    Raises:
        DataError: ``root`` holds a manifest and not ``overwrite``, or one of another kind of
            data; nothing was written.
    """
    with writing(out, what):
        try:
            names = sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(root, detail=False))
        except FileNotFoundError:  # an object store's new "directory" holds nothing yet
            names = []
    earlier = [n for n in names if n == manifest or SHARD_NAME.fullmatch(n)]
    other = _format_of(fs, f"{root}/{manifest}") if manifest in earlier else fmt
    if other != fmt and other in KINDS:
        raise DataError(f"--out {out} holds {KINDS[other]}, not {data}; give a new directory for {what}.")
    if earlier and manifest not in earlier:
        log.warning("--out %s: %d shard(s) of an unfinished preparation are replaced", out, len(earlier))
    elif earlier and not overwrite:
        found = ", ".join(earlier[:3]) + (", ..." if len(earlier) > 3 else "")
        raise DataError(
            f"--out {out} already holds prepared {data} ({found}); "
            "choose an empty directory, or pass --overwrite to replace them."
        )
    return [n for n in earlier if n != manifest]


def _format_of(fs: fsspec.AbstractFileSystem, path: str) -> str | None:
    """The ``format`` of the manifest at ``path``; None where it has none or cannot be read."""
    try:
        with fs.open(path, "r") as f:
            manifest = json.load(f)
    except (OSError, ValueError):
        return None
    return manifest.get("format") if isinstance(manifest, dict) else None


def shard_tag(earlier: Sequence[str], manifest: str, fs: fsspec.AbstractFileSystem, root: str) -> str:
    """``""`` where no manifest lists shards in ``root``; else a tag new to it (``.1a2b3c4d``)
    that keeps the new shards' names (:func:`shard_name`) off those the earlier manifest lists."""
    if not earlier or not fs.exists(f"{root}/{manifest}"):
        return ""
    return "." + secrets.token_hex(4)


def shard_name(split: str, index: int, tag: str) -> str:
    """``<split>-NNNNN<tag>.parquet``: the ``index``-th shard of ``split``."""
    return f"{split}-{index:05d}{tag}.parquet"


@contextlib.contextmanager
def discarded_on_failure(fs: fsspec.AbstractFileSystem, root: str, tag: str) -> Iterator[None]:
    """Removes the shards named with ``tag`` (:func:`shard_tag`) when the block fails or is
    interrupted, leaving ``root`` as the earlier preparation left it; a removal that fails is
    left to the next preparation (the block's error is the one to report)."""
    try:
        yield
    except BaseException:
        if tag:
            with contextlib.suppress(OSError):
                for path in fs.ls(root, detail=False):
                    name = path.rstrip("/").rsplit("/", 1)[-1]
                    if SHARD_NAME.fullmatch(name) and name.endswith(f"{tag}.parquet"):
                        fs.rm(path)
        raise


def publish(
    fs: fsspec.AbstractFileSystem,
    root: str,
    out: str | Path,
    what: str,
    name: str,
    manifest: dict,
    earlier: Sequence[str],
) -> None:
    """Writes ``manifest`` as ``root/name`` (written beside it, then renamed over the earlier
    one: a reader finds one manifest or the other, whole), then
    removes the shards of ``earlier`` (:func:`earlier_preparation`) that it does not list."""
    listed = {s["path"] for info in manifest["splits"].values() for s in info["shards"]}
    with writing(out, what):
        with fs.open(f"{root}/.{name}.tmp", "w") as f:
            json.dump(manifest, f, indent=2)
        fs.mv(f"{root}/.{name}.tmp", f"{root}/{name}")  # a rename where the filesystem has one
        for shard in earlier:
            if shard not in listed:
                fs.rm(f"{root}/{shard}")


@contextlib.contextmanager
def reading(url: str, what: str) -> Iterator[None]:
    """Turns a failed read of prepared data (no permission, an unreachable server) into a
    :class:`DataError` that names the URL, the cause and the fix. ``what`` names the data
    ("the prepared image data"). A missing file passes through: the caller names what is missing."""
    try:
        yield
    except FileNotFoundError:
        raise
    except Exception as e:
        # gcsfs raises aiohttp's errors, which are not all OSErrors ("Server disconnected")
        if not isinstance(e, OSError) and not type(e).__module__.startswith("aiohttp"):
            raise
        raise DataError(f"reading {what} failed: {describe_error(url, e)}") from e


def read_manifest(
    url: str, name: str, fmt: str, kind: str, prepare: str, required: Sequence[str] = ()
) -> tuple[fsspec.AbstractFileSystem, str, dict]:
    """The filesystem, root path (no trailing ``/``) and manifest (``name``, JSON) under ``url``.

    Args:
        url: the prepared directory.
        name: the manifest's file name.
        fmt: the ``format`` the manifest must have.
        kind: the data, for messages ("image", "MLM").
        prepare: the command that prepares it, without ``--out``, for messages.
        required: keys the manifest must hold.

    Raises:
        DataError: no manifest, not JSON, another format or keys missing (each says how to
            prepare the data), or the storage cannot be read.
    """
    with reading(url, f"the prepared {kind} data"):
        fs, root = filesystem(url)
        path = f"{root.rstrip('/')}/{name}"
        if not fs.exists(path):
            raise DataError(f"{url} has no {name}; prepare the data with `{prepare} --out {url}`.")
        with fs.open(path, "r") as f:
            try:
                manifest = json.load(f)
            except json.JSONDecodeError as e:
                again = f"{prepare} --out {url} --overwrite"
                raise DataError(f"{url}/{name} is damaged ({e}); prepare the data again (`{again}`).") from None
    found = manifest.get("format") if isinstance(manifest, dict) else None
    if found != fmt:
        if found in KINDS:
            what = f"{url} holds {KINDS[found]}, not {kind} data"
        else:
            what = f"{url}/{name} is not an xlafit {kind} manifest ({fmt})"
        raise DataError(
            f"{what}; prepare the data in a new directory (`{prepare} --out NEWDIR`) and point the run at it."
        )
    missing = [key for key in required if key not in manifest]
    if missing:
        raise DataError(
            f"{url}/{name} is damaged: it lacks {', '.join(missing)}; prepare the data again "
            f"(`{prepare} --out {url} --overwrite`)."
        )
    return fs, root.rstrip("/"), manifest


def read_shard(fs: fsspec.AbstractFileSystem, root: str, shard: dict, kind: str, rows: str) -> pa.Table:
    """The Parquet table of the shard the manifest lists as ``shard`` (``path``, ``sha256`` and
    its row count under the key ``rows``), checked against the manifest.

    Raises:
        DataError: the shard is missing or cannot be read, its SHA-256 differs from the
            manifest's (damaged, or changed since it was prepared), it is not Parquet, or its
            row count differs.
    """
    path = f"{root}/{shard['path']}"
    try:
        with reading(fs.unstrip_protocol(path), f"the prepared {kind} data"):
            data = fs.cat_file(path)
    except FileNotFoundError:
        raise DataError(f"shard {path} listed in the manifest is missing; prepare the data again.") from None
    if "sha256" in shard and hashlib.sha256(data).hexdigest() != shard["sha256"]:
        raise DataError(
            f"shard {path} is damaged or was changed: its sha256 differs from the manifest's; prepare the data again."
        )
    try:
        table = parquet_table(data)
    except Exception as e:  # pyarrow raises its own types for damaged files
        raise DataError(f"shard {path} cannot be read ({e}); prepare the data again.") from None
    if table.num_rows != shard[rows]:
        raise DataError(f"shard {path} holds {table.num_rows} {rows}, the manifest says {shard[rows]}.")
    return table


def parquet_table(data: bytes) -> pa.Table:
    """The table of a Parquet file's bytes, read from Arrow's own copy of them.

    Arrow reading Python's ``bytes`` holds them through a reference that one of its threads
    may drop last, after the read; dropping it takes the GIL, which a thread cannot take once
    the interpreter is exiting (an error a moment later), and the process then aborts
    (SIGABRT, "terminate called without an active exception"). A copy in Arrow's memory holds
    nothing of Python's.
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    sink = pa.BufferOutputStream()
    sink.write(data)
    return pq.read_table(pa.BufferReader(sink.getvalue()))
