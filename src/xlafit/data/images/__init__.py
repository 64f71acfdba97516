"""Image classification data: an image folder -> shards, and the Grain pipeline that trains on them.

- :mod:`~xlafit.data.images.preparation`: an ImageFolder -> Parquet shards of encoded
  images + ``manifest.json`` with per-shard SHA-256 (:func:`prepare`, :func:`read_manifest`);
- :mod:`~xlafit.data.images.cache`: a prepared split -> the encoded bytes, memory-mapped
  from the user cache after every shard's checksum is checked (:func:`load_split`);
- :mod:`~xlafit.data.images.transforms`: decode, random-resized-crop + flip (train),
  resize + centre crop (eval), as a pure function of ``(seed, epoch, example index)``;
- :mod:`~xlafit.data.images.dataset`: :class:`ImageDataset`, whose batches are decoded and
  augmented by Grain worker processes; :class:`SyntheticImages` for benchmarks.

Example:
    >>> prepare("imagenet/", "gs://bucket/imagenet-shards")                  # doctest: +SKIP
    >>> train = ImageDataset.from_prepared("gs://bucket/imagenet-shards", "train", workers=8)  # doctest: +SKIP
"""

from xlafit.data.images.cache import load_split
from xlafit.data.images.dataset import ImageDataset, SyntheticImages
from xlafit.data.images.preparation import FORMAT, MANIFEST, find_images, prepare, read_manifest
from xlafit.data.images.transforms import Augment

__all__ = [
    "FORMAT",
    "MANIFEST",
    "Augment",
    "ImageDataset",
    "SyntheticImages",
    "find_images",
    "load_split",
    "prepare",
    "read_manifest",
]
