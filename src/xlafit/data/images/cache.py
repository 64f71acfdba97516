"""A prepared image split -> its encoded images, memory-mapped from the user cache.

:func:`load_split` checks every shard against the manifest (SHA-256 and example count) and
copies the encoded images once into ``$XLAFIT_CACHE/images/<url>-<split>-<manifest>/``:
``images.bin`` (every image's bytes, back to back), ``offsets.npy`` (``[N + 1]`` int64),
``labels.npy`` and ``files.npy`` (each image's name in the original folder, for messages).
Worker processes open the same files memory-mapped: ImageNet's 140 GB of JPEGs train on a
host with less memory, and the page cache serves what every worker reads.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import logging
import shutil
import tempfile
from pathlib import Path

import numpy as np

from xlafit.data.images.preparation import MANIFEST, read_manifest
from xlafit.data.shards import read_shard
from xlafit.errors import DataError
from xlafit.io.cache import COMPLETE, cache_dir, publish

log = logging.getLogger("xlafit")


@dataclasses.dataclass
class ImageSplit:
    """One split's encoded images, memory-mapped (or in memory): image ``i`` is
    ``data[offsets[i]:offsets[i + 1]]``."""

    data: np.ndarray  # uint8 [total bytes]
    offsets: np.ndarray  # int64 [N + 1]
    labels: np.ndarray  # int32 [N]
    files: np.ndarray  # bytes [N]: names relative to the prepared folder
    where: Path | None = None  # the cache directory, when memory-mapped

    def __len__(self) -> int:
        return len(self.labels)

    def encoded(self, i: int) -> bytes:
        return self.data[self.offsets[i] : self.offsets[i + 1]].tobytes()

    def file(self, i: int) -> str:
        return self.files[i].decode()

    def __getstate__(self) -> dict:
        # Worker processes reopen the memory maps instead of receiving a pickled copy of them.
        if self.where is not None:
            return {"where": self.where}
        return dataclasses.asdict(self)

    def __setstate__(self, state: dict) -> None:
        if "data" in state:
            self.__dict__.update(state)
        else:
            self.__dict__.update(dataclasses.asdict(_open(state["where"])))


def _open(where: Path) -> ImageSplit:
    return ImageSplit(
        data=np.load(where / "images.npy", mmap_mode="r"),
        offsets=np.load(where / "offsets.npy"),
        labels=np.load(where / "labels.npy"),
        files=np.load(where / "files.npy", mmap_mode="r"),
        where=where,
    )


def load_split(url: str, split: str) -> tuple[ImageSplit, dict]:
    """The encoded images, labels and file names of one split of data ``xlafit data images`` wrote.

    Every shard is checked against the manifest (sha256 and example count) as it is copied
    into the cache: a damaged or changed shard fails here, named, rather than training on
    other data. Later runs (and the worker processes) open the cache without reading the
    shards again; preparing the data again makes a new cache entry and drops the old.

    Returns:
        The split and the manifest.

    Example:
        >>> images, manifest = load_split("data/images", "train")  # doctest: +SKIP
        >>> len(images), manifest["classes"][images.labels[0]]     # doctest: +SKIP
        (1281167, 'n01440764')
    """
    fs, root, manifest = read_manifest(url)
    if split not in manifest["splits"]:
        raise DataError(f"{url}/{MANIFEST} has no {split} split (it has {', '.join(manifest['splits'])}).")
    digest = lambda text: hashlib.sha256(text.encode()).hexdigest()[:16]  # noqa: E731
    where = (
        cache_dir()
        / "images"
        / f"{digest(fs.unstrip_protocol(root))}-{split}-{digest(json.dumps(manifest, sort_keys=True))}"
    )
    if not (where / COMPLETE).exists():
        _build(fs, root, manifest, split, where)
    return _open(where), manifest


def _npy_header(size: int) -> bytes:
    """The ``.npy`` header of a uint8 ``[size]`` array, padded to 128 bytes whatever the size."""
    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(buf, {"descr": "|u1", "fortran_order": False, "shape": (size,)})
    header = buf.getvalue()
    assert len(header) == 128, len(header)
    return header


def _build(fs, root: str, manifest: dict, split: str, where: Path) -> None:
    """Copies the split's shards into ``where`` (through a temporary directory renamed into
    place: a process that finds ``where`` finds it whole) and removes older versions."""
    info = manifest["splits"][split]
    where.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f"{where.name}.", suffix=".tmp", dir=where.parent))
    num_classes = len(manifest["classes"])
    try:
        offsets, labels, files = [0], [], []
        with open(tmp / "images.npy", "wb") as out:
            out.write(_npy_header(0))  # rewritten with the size at the end; the same length
            for shard in info["shards"]:
                table = read_shard(fs, root, shard, "image", rows="examples")
                shard_labels = table.column("label").to_numpy()
                if len(shard_labels) and (shard_labels.min() < 0 or shard_labels.max() >= num_classes):
                    raise DataError(
                        f"shard {root}/{shard['path']} has labels outside 0..{num_classes - 1}; prepare the data again."
                    )
                for blob in table.column("image").to_pylist():
                    out.write(blob)
                    offsets.append(offsets[-1] + len(blob))
                labels.append(shard_labels.astype(np.int32))
                files.extend(table.column("file").to_pylist())
            out.seek(0)
            out.write(_npy_header(offsets[-1]))
        np.save(tmp / "offsets.npy", np.array(offsets, np.int64))
        np.save(tmp / "labels.npy", np.concatenate(labels) if labels else np.zeros(0, np.int32))
        np.save(tmp / "files.npy", np.array([f.encode() for f in files], dtype=bytes))
        publish(tmp, where)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
