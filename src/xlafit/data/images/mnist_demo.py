"""The image demo: the 5,000 embedded MNIST digits as an image folder of PNG files, prepared.

Built once into the user cache (``$XLAFIT_CACHE/mnist-images-<hash>/``): ``folder/`` is an
ordinary ImageFolder (``train/<digit>/<n>.png``, ``test/<digit>/<n>.png``, the fixed
4,000/1,000 split of :func:`xlafit.data.mnist.load_embedded`) and ``shards/`` what
``xlafit data images`` makes of it, so the resnet recipe's demo reads real files through
the whole pipeline with no download.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from pathlib import Path

from xlafit.data import mnist
from xlafit.data.images.preparation import FORMAT, MANIFEST, prepare
from xlafit.io.cache import cache_dir

_VERSION = 1  # bump when the folder's layout changes


def build() -> str:
    """Writes (once) the digits as PNG files and prepares them; returns the shards' directory.

    Written to a temporary directory and renamed into place, so concurrent processes never
    see half of it.

    Example:
        >>> from xlafit.data.images import ImageDataset, Augment
        >>> train = ImageDataset.from_prepared(build(), "train", Augment(28, channels=1))  # doctest: +SKIP
    """
    from PIL import Image

    key = json.dumps([_VERSION, FORMAT])
    target = cache_dir() / f"mnist-images-{hashlib.sha256(key.encode()).hexdigest()[:12]}"
    if (target / "shards" / MANIFEST).exists():
        return str(target / "shards")
    target.parent.mkdir(parents=True, exist_ok=True)
    print(f"writing the 5,000 embedded MNIST digits as PNG files into {target} (once)", flush=True)
    tmp = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
    try:
        for split, arrays in mnist.load_embedded(as_uint8=True).items():
            for n, (image, label) in enumerate(zip(arrays["image"], arrays["label"], strict=True)):
                folder = tmp / "folder" / split / str(int(label))
                folder.mkdir(parents=True, exist_ok=True)
                Image.fromarray(image).save(folder / f"{n:05d}.png")
        prepare(tmp / "folder", str(tmp / "shards"), shard_size=1000, workers=1)
        try:
            tmp.rename(target)
        except OSError:  # another process finished first
            if not (target / "shards" / MANIFEST).exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return str(target / "shards")
