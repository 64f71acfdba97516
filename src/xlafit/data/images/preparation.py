"""An image folder -> Parquet shards of encoded images + labels, and ``manifest.json``.

:func:`prepare` reads an ImageFolder (``class/*.jpg|png``, the layout of torchvision's
``ImageFolder``; or ``train/class/...`` and ``val/class/...`` for two splits) and writes
the images *as they are encoded* (JPEG stays JPEG: decoding is the training pipeline's
job, in worker processes) with their labels and file names, to a local path or any fsspec
URL. Every image is decoded once here, so a file that cannot be read is named now
(skipped and listed in the manifest, or a stop), not in the middle of a run. The
manifest's per-shard SHA-256 pins the content: a changed shard is refused by name
(:mod:`xlafit.data.images.cache`).

:func:`read_manifest` opens what :func:`prepare` wrote.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import hashlib
import io
import logging
import multiprocessing
import multiprocessing.pool
import multiprocessing.resource_tracker
import os
import signal
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Literal

import fsspec
import numpy as np

from xlafit.data import shards
from xlafit.data.hashing import hash_uniform
from xlafit.data.shards import output_dir, shard_name, writing
from xlafit.errors import DataError
from xlafit.io.paths import is_url

log = logging.getLogger("xlafit")
MANIFEST = "manifest.json"
FORMAT = "xlafit-images-v1"
EXTENSIONS = (".jpg", ".jpeg", ".png")
EVAL_NAMES = ("val", "validation", "valid", "eval", "test")  # the held-out split's folder, first found
OnCorrupt = Literal["skip", "stop"]


def find_images(
    directory: str | Path, eval_fraction: float = 0.0, seed: int = 0
) -> tuple[dict[str, list[tuple[str, int]]], list[str]]:
    """``({split: [(file, label), ...]}, classes)`` of an image folder, classes numbered in sorted order.

    ``directory`` is either one ImageFolder (``class/*.jpg``; ``eval_fraction`` of its files,
    by a hash of their names, go to ``eval``), or holds ``train/`` and one of ``val/``,
    ``validation/``, ``valid/``, ``eval/``, ``test/`` (ImageNet's layout), each an ImageFolder
    with the same classes. A ``train/`` alone is read as the ImageFolder, split by
    ``eval_fraction``: split folders are never taken for classes. (A folder with one of
    these names is a split when it holds folders only, and a class when it holds images.)

    Raises:
        DataError: no class folders, no images, one class, a training class folder with no image,
            splits whose classes differ, a held-out folder without ``train/``, or an
            ``eval_fraction`` for a folder that has its own held-out split.
    """
    root = Path(directory)
    if not root.is_dir():
        raise DataError(f"--input {directory} is not a directory; point it at an image folder (class/*.jpg).")
    held_out = next((root / n for n in EVAL_NAMES if _is_split(root / n)), None)
    has_train = _is_split(root / "train")
    if not has_train and held_out is not None:
        raise DataError(
            f"{root} has a {held_out.name}/ folder but no train/ beside it; name the training split's "
            f"folder train/ (then {held_out.name}/ is held out), or point --input at one image folder."
        )
    if has_train and held_out is None:
        root = root / "train"  # the training split alone: hold out eval_fraction of it
    elif held_out is not None:
        if eval_fraction:
            raise DataError(
                f"--eval-fraction {eval_fraction} holds out part of an image folder, but {root} has its own "
                f"held-out split ({held_out.name}/); drop --eval-fraction to evaluate on {held_out.name}/."
            )
        train, classes = _image_folder(root / "train")
        evaluation, eval_classes = _image_folder(held_out)
        if eval_classes != classes:
            extra = sorted(set(eval_classes) ^ set(classes))[:5]
            raise DataError(
                f"{root / 'train'} and {held_out} have different class folders (e.g. {', '.join(extra)}); "
                "both splits need the same classes."
            )
        _no_empty_classes(root / "train", train, classes)
        _two_classes_or_more(root / "train", classes)
        return {"train": train, "eval": evaluation}, classes
    files, classes = _image_folder(root)
    _no_empty_classes(root, files, classes)
    _two_classes_or_more(root, classes)
    if not 0.0 <= eval_fraction <= 1.0:
        raise DataError(
            f"--eval-fraction {eval_fraction} must lie in [0, 1] (1: every image held out, data to score a run on "
            "with xlafit eval --data)."
        )
    if eval_fraction == 1.0:  # data to score with, not to train on
        return {"train": [], "eval": files}, classes
    # os.fsencode: a name that is not UTF-8 (bytes the file system kept as they were) hashes too
    names = [hashlib.sha256(os.fsencode(os.path.relpath(f, root))).digest() for f, _ in files]
    keys = np.array([int.from_bytes(d[:4], "little") for d in names], np.int64)
    draws = hash_uniform(np.full(len(files), seed), keys, 11) if files else np.zeros(0)
    splits = {
        "train": [f for f, u in zip(files, draws, strict=True) if u >= eval_fraction],
        "eval": [f for f, u in zip(files, draws, strict=True) if u < eval_fraction],
    }
    held = _classes_without_images(splits["train"], classes)
    if held:  # a small class whose every image was drawn for evaluation
        raise DataError(
            f"--eval-fraction {eval_fraction} holds out every image of the class(es) {', '.join(held[:5])} of {root}, "
            "so they would have no training image; use a smaller --eval-fraction or add images to them."
        )
    unseen = _classes_without_images(splits["eval"], classes) if eval_fraction > 0 else []
    if unseen:  # drawn image by image: a small class may keep every image for training
        log.warning(
            "--eval-fraction %s held out no image of the class(es) %s of %s (each image is drawn alone, and they "
            "have few): the evaluation does not measure them; add images to them, or give a folder with train/ and "
            "val/ to choose the held-out images",
            eval_fraction,
            ", ".join(unseen[:5]),
            root,
        )
    return splits, classes


def _is_split(path: Path) -> bool:
    """A split's folder (``train/``, ``val/``, ...) holds class folders; a class's folder, images."""
    if not path.is_dir():
        return False
    children = [c for c in path.iterdir() if not c.name.startswith(".")]
    return any(c.is_dir() for c in children) and not any(c.suffix.lower() in EXTENSIONS for c in children)


def _image_folder(root: Path) -> tuple[list[tuple[str, int]], list[str]]:
    classes = sorted(p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
    # images directly in root, which an image folder does not read: their folder is their class
    loose = [p for p in root.iterdir() if p.suffix.lower() in EXTENSIONS and p.is_file()]
    per_class = f"one folder per class ({root / 'cat'}/*.jpg, {root / 'dog'}/*.jpg, ...)"
    if not classes:
        if loose:
            raise DataError(
                f"the {len(loose)} image(s) of {root} sit directly in it, with no class folders; "
                f"move them into {per_class}, as torchvision's ImageFolder reads."
            )
        raise DataError(
            f"{root} has no class folders; an image folder holds one folder per class with its images "
            "(e.g. cat/1.jpg, dog/2.png), as torchvision's ImageFolder reads."
        )
    files = [
        (str(p), label)
        for label, name in enumerate(classes)
        for p in sorted((root / name).rglob("*"))
        if p.suffix.lower() in EXTENSIONS and p.is_file()
    ]
    if not files:
        if loose:
            raise DataError(
                f"the {len(loose)} image(s) of {root} sit directly in it, and its folder(s) "
                f"{', '.join(classes[:5])} hold none; move the images into {per_class}."
            )
        raise DataError(f"{root} holds no {', '.join(EXTENSIONS)} files under its class folders.")
    return files, classes


def _holds_images(folder: Path) -> bool:
    """Whether ``folder``'s subfolders hold image files (an image folder's classes, or its splits')."""
    return any(p.suffix.lower() in EXTENSIONS for p in folder.glob("*/*")) or any(
        p.suffix.lower() in EXTENSIONS for p in folder.glob("*/*/*")
    )


def _not_images(root: Path, splits: dict[str, list[tuple[str, int]]]) -> list[str]:
    """Files under ``root``'s folders that are left out for their extension (a ``.webp``, a
    ``.txt``), relative to ``root``; hidden files are not counted."""
    taken = {f for files in splits.values() for f, _ in files}
    left_out = []
    for p in root.rglob("*"):
        relative = p.relative_to(root)
        hidden = any(part.startswith(".") for part in relative.parts)
        if p.is_file() and str(p) not in taken and len(relative.parts) > 1 and not hidden:
            left_out.append(_printable(str(relative)))
    return sorted(left_out)


def _classes_without_images(files: list[tuple[str, int]], classes: list[str]) -> list[str]:
    return sorted(set(classes) - {classes[label] for _, label in files})


def _no_empty_classes(root: Path, files: list[tuple[str, int]], classes: list[str]) -> None:
    empty = _classes_without_images(files, classes)
    if empty:
        raise DataError(
            f"the class folder(s) {', '.join(empty[:5])} of {root} hold no {', '.join(EXTENSIONS)} files, so their "
            "labels would have no training image; add images or remove the folder(s)."
        )


def _two_classes_or_more(root: Path, classes: list[str]) -> None:
    """Refuses one class: every label is the same, so a run learns nothing and reports a loss
    of 0 and an accuracy of 1."""
    if len(classes) < 2:
        raise DataError(
            f"{root} has one class ({classes[0]}): a classifier needs two or more; add a folder of images for "
            "each other class beside it."
        )


def _printable(name: str) -> str:
    """``name`` as valid UTF-8 (for the shards' ``file`` column and messages): bytes of a file
    name that are not UTF-8 become ``\\xNN``."""
    return os.fsencode(name).decode("utf-8", "backslashreplace")


def _check_image(path: str) -> tuple[bytes, int, str | None]:
    """The file's bytes, its channel count (1 grey, 3 colour) and why it cannot be decoded (None: fine)."""
    from PIL import Image

    try:
        data = Path(path).read_bytes()
        with Image.open(io.BytesIO(data)) as img:
            img.load()  # a full decode: truncated files fail here, not in training
            channels = 1 if img.mode in ("1", "L", "I;16", "I", "F") else 3
        return data, channels, None
    except Image.UnidentifiedImageError:
        return b"", 0, "not a JPEG or PNG image Pillow can read"
    except Exception as e:  # PIL raises many types (OSError, SyntaxError, DecompressionBombError)
        return b"", 0, f"{type(e).__name__}: {e}"


def _write_shard(fs: fsspec.AbstractFileSystem, path: str, rows: list[tuple[bytes, int, str]]) -> str:
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table(
        {
            "image": pa.array([r[0] for r in rows], pa.binary()),
            "label": pa.array([r[1] for r in rows], pa.int32()),
            "file": pa.array([r[2] for r in rows], pa.string()),
        }
    )
    buffer = pa.BufferOutputStream()
    pq.write_table(table, buffer, compression="none")  # JPEG/PNG bytes do not compress further
    data = buffer.getvalue().to_pybytes()
    with fs.open(path, "wb") as f:
        f.write(data)
    return hashlib.sha256(data).hexdigest()


def _write_split(
    split: str,
    files: list[tuple[str, int]],
    decode: Callable[..., Iterator[tuple[bytes, int, str | None]]],
    fs: fsspec.AbstractFileSystem,
    where: tuple[str, str],
    out: str,
    root_dir: Path,
    shard_size: int,
    on_corrupt: OnCorrupt,
) -> tuple[dict, int]:
    """One split's images, checked by ``decode`` (in worker processes), as shards of
    ``shard_size`` in ``where`` (the root path and :func:`~xlafit.data.shards.shard_tag`'s tag
    of the names): ``(its manifest entry, the most channels seen)``."""
    root, tag = where
    shards: list[dict] = []
    skipped: list[dict] = []
    rows: list[tuple[bytes, int, str]] = []
    channels = 1

    def flush() -> None:
        if rows:
            name = shard_name(split, len(shards), tag)
            with writing(out, "the image shards"):
                digest = _write_shard(fs, f"{root}/{name}", rows)
            shards.append(
                {"path": name, "examples": len(rows), "bytes": sum(len(r[0]) for r in rows), "sha256": digest}
            )
            rows.clear()

    paths = [f for f, _ in files]
    seen: set[int] = set()  # the labels written
    for (path, label), (data, ch, error) in zip(files, decode(_check_image, paths), strict=True):
        name = _printable(os.path.relpath(path, root_dir))
        if error is not None:
            if on_corrupt == "stop":
                raise DataError(
                    f"{_printable(path)} cannot be decoded ({error}); remove or replace it, or pass "
                    "--on-corrupt skip to leave it out (it is then listed in the manifest)."
                )
            skipped.append({"file": name, "error": error})
            continue
        channels = max(channels, ch)
        rows.append((data, label, name))
        seen.add(label)
        if len(rows) >= shard_size:
            flush()
    flush()
    examples = sum(s["examples"] for s in shards)
    return {"examples": examples, "classes": len(seen), "shards": shards, "skipped": skipped}, channels


def prepare(
    input_dir: str | Path,
    out: str,
    *,
    eval_fraction: float = 0.0,
    seed: int = 0,
    shard_size: int = 1024,
    on_corrupt: OnCorrupt = "skip",
    workers: int | None = None,
    overwrite: bool = False,
) -> dict:
    """Writes the images of ``input_dir`` as Parquet shards + ``manifest.json`` under ``out``.

    Args:
        input_dir: an image folder (see :func:`find_images`).
        out: a local directory or fsspec URL (``gs://bucket/imagenet-shards``).
        eval_fraction: for a single image folder, the share of files held out as ``eval``.
        shard_size: images per shard (ImageNet's ~110 KB JPEGs: 1024 a shard is ~110 MB).
        on_corrupt: an image that cannot be decoded is ``skip``-ped (named in the manifest's
            ``skipped``) or a ``stop`` (a :class:`DataError` naming it).
        workers: processes that decode to check the images (default: every core).
        overwrite: replace images prepared in ``out`` before; without it they are refused. The
            earlier images stay usable until the new manifest replaces theirs: a preparation
            that fails (a corrupt image with ``stop``) or is interrupted loses nothing
            (:func:`xlafit.data.shards.earlier_preparation`).

    Returns:
        The manifest (also written to ``out/manifest.json``).

    Example:
        >>> prepare("imagenet/", "gs://bucket/imagenet-shards")  # doctest: +SKIP
    """
    if shard_size < 1:
        raise DataError(f"--shard-size {shard_size} must be at least 1.")
    _out_outside_input(input_dir, out)
    splits, classes = find_images(input_dir, eval_fraction, seed)
    root_dir = Path(input_dir)
    ignored = _not_images(root_dir, splits)
    if ignored:
        names = ", ".join(ignored[:5]) + (f" and {len(ignored) - 5} more" if len(ignored) > 5 else "")
        log.warning(
            "--input %s: %d file(s) are not %s images and are left out: %s (listed in the manifest's 'ignored')",
            input_dir,
            len(ignored),
            "/".join(EXTENSIONS),
            names,
        )
    fs, root = output_dir(out, "the image shards")
    earlier = shards.earlier_preparation(fs, root, out, MANIFEST, "images", "the image shards", overwrite, FORMAT)
    tag = shards.shard_tag(earlier, MANIFEST, fs, root)
    manifest_splits: dict[str, dict] = {}
    channels = 1
    workers = workers or os.cpu_count() or 1
    total = sum(map(len, splits.values()))
    with shards.discarded_on_failure(fs, root, tag), contextlib.ExitStack() as stack:
        decode: Callable[..., Iterator[tuple[bytes, int, str | None]]] = map
        if workers > 1 and total >= 2048:  # a pool of fresh interpreters costs ~2 s to start
            pool = stack.enter_context(_worker_pool(workers))
            decode = functools.partial(pool.imap, chunksize=64)
        for split, files in splits.items():
            manifest_splits[split], ch = _write_split(
                split, files, decode, fs, (root, tag), out, root_dir, shard_size, on_corrupt
            )
            channels = max(channels, ch)
        if not manifest_splits["train"]["examples"] and eval_fraction < 1.0:
            raise DataError(f"{input_dir}: no training image could be decoded.")
    manifest = {
        "format": FORMAT,
        "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "input": str(input_dir),
        "classes": classes,
        "channels": channels,
        "seed": seed,
        "eval_fraction": eval_fraction,
        "splits": manifest_splits,
        "ignored": ignored,
    }
    shards.publish(fs, root, out, "the image shards", MANIFEST, manifest, earlier)
    return manifest


def _out_outside_input(input_dir: str | Path, out: str) -> None:
    """Refuses an ``out`` that is ``input_dir`` or lies inside it: its shards folder would be
    read as a class folder (or its shards as images) by this preparation or the next."""
    if is_url(out) or is_url(str(input_dir)):
        return
    source, target = Path(input_dir).expanduser().resolve(), Path(out).expanduser().resolve()
    if target == source or source in target.parents:
        raise DataError(
            f"--out {out} lies inside --input {input_dir}, where its folder would be taken for a class; "
            "give an --out outside the image folder."
        )


@contextlib.contextmanager
def _worker_pool(workers: int) -> Iterator[multiprocessing.pool.Pool]:
    """A pool of ``workers`` fresh interpreters that leave Ctrl-C to this process.

    Ctrl-C reaches the whole process group. Each worker ignores SIGINT, so that this process
    alone acts on it (it stops them) instead of each printing a traceback. A worker cannot
    ignore it before its interpreter has started, which takes a second: SIGINT is blocked
    while the workers start, they are born with it blocked, and their initializer ignores it
    (discarding one that waited) before unblocking it. Here, one that arrived meanwhile is
    delivered when the mask is restored. (``spawn``: a fork after JAX's threads started can
    deadlock.) The pool's resource tracker is started first: starting it unblocks SIGINT in the
    calling thread (``multiprocessing.resource_tracker``), which would leave the workers born
    with it deliverable.

    On leaving normally the pool finishes its work; on an interruption or an error its workers
    are terminated at once (:func:`_stop`), so that the command ends promptly and none is left.
    """
    multiprocessing.resource_tracker.ensure_running()
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        pool = multiprocessing.get_context("spawn").Pool(workers, initializer=_leave_sigint_to_parent)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    try:
        yield pool
    except BaseException:
        _stop(pool)
        raise
    pool.close()
    pool.join()


STOP_WAIT_S = 5.0


def _stop(pool: multiprocessing.pool.Pool, wait_s: float | None = None) -> None:
    """``pool.terminate()``, given ``wait_s`` seconds (default :data:`STOP_WAIT_S`): it joins
    the pool's threads and can wait on a queue lock a worker holds; past that, the workers are
    killed and the pool's threads left behind, so that the command still ends."""
    wait_s = STOP_WAIT_S if wait_s is None else wait_s
    stopper = threading.Thread(target=pool.terminate, name="xlafit-pool-stop", daemon=True)
    stopper.start()
    stopper.join(wait_s)
    if stopper.is_alive():  # the work was asked to stop: killing its workers is no news to the user
        log.info("the image workers did not stop within %.0f s; killing them", wait_s)
        for worker in pool._pool:  # type: ignore[attr-defined]  # no public handle on the processes
            worker.kill()


def _leave_sigint_to_parent() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # also discards one pending while blocked
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def read_manifest(url: str) -> tuple[fsspec.AbstractFileSystem, str, dict]:
    """The filesystem, root path (no trailing ``/``) and manifest of data :func:`prepare` wrote.

    Raises:
        DataError: ``url`` holds no manifest, a damaged one or not one of this format, or
            cannot be read (:func:`xlafit.data.shards.read_manifest`).

    Example:
        >>> fs, root, manifest = read_manifest("data/images")  # doctest: +SKIP
        >>> len(manifest["classes"])                            # doctest: +SKIP
        1000
    """
    prepare = "xlafit data images --input DIR"
    folder = Path(url)
    if not is_url(url) and folder.is_dir() and not (folder / MANIFEST).exists() and _holds_images(folder):
        raise DataError(
            f"{url} is an image folder, not prepared images: prepare it with `xlafit data images --input {url} "
            f"--out {url.rstrip('/')}-prepared` and point the run at {url.rstrip('/')}-prepared."
        )
    fs, root, manifest = shards.read_manifest(
        url, MANIFEST, FORMAT, "image", prepare, ("classes", "channels", "splits")
    )
    if "train" not in manifest["splits"]:
        raise DataError(
            f"{url}/{MANIFEST} is damaged: it lacks the train split; prepare the data again "
            f"(`{prepare} --out {url} --overwrite`)."
        )
    return fs, root, manifest
