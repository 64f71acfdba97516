"""Images/s of decode + augment: per decoder in one process, and per Grain worker process.

Part 1 (one process, interleaved rounds, median): one ImageNet-sized photo (matplotlib's
``grace_hopper.jpg``, 512x600, 61 KB, or --jpeg FILE) through the training transform
(random-resized-crop to 224 + flip), decoded three ways:

- ``pillow``: Pillow's decoder at full size, then crop + resize (torchvision's way);
- ``simplejpeg-full``: libjpeg-turbo via simplejpeg at full size, then the same;
- ``xlafit``: what :class:`xlafit.data.images.Augment` does: simplejpeg at the smallest DCT
  scale (1/2, 1/4, 1/8) that keeps >= 224 pixels across the crop.

Part 2: the same photo N times as a prepared folder, streamed by :class:`ImageDataset` with
1 and 2 Grain worker processes (batches of 64); images/s after the first batch (worker
start-up excluded).

    python benchmarks/speed/image_decode.py --repeats 5
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np


def pillow_full(aug, encoded: bytes, epoch: int, index: int) -> np.ndarray:
    from PIL import Image

    img = Image.open(io.BytesIO(encoded)).convert("RGB")
    box = aug.box(img.width, img.height, epoch, index)
    out = np.asarray(img.resize((aug.image_size,) * 2, Image.Resampling.BILINEAR, box=box))
    return out[:, ::-1] if aug.flip(epoch, index) else out


def simplejpeg_full(aug, encoded: bytes, epoch: int, index: int) -> np.ndarray:
    import simplejpeg
    from PIL import Image

    img = Image.fromarray(simplejpeg.decode_jpeg(encoded, colorspace="RGB"))
    box = aug.box(img.width, img.height, epoch, index)
    out = np.asarray(img.resize((aug.image_size,) * 2, Image.Resampling.BILINEAR, box=box))
    return out[:, ::-1] if aug.flip(epoch, index) else out


def per_decoder(encoded: bytes, n: int, repeats: int) -> dict[str, list[float]]:
    from xlafit.data.images import Augment

    aug = Augment(224)
    rows = {"pillow": pillow_full, "simplejpeg-full": simplejpeg_full, "xlafit": lambda a, e, ep, i: a(e, ep, i)}
    rates: dict[str, list[float]] = {name: [] for name in rows}
    for _ in range(repeats):
        for name, fn in rows.items():  # interleaved: machine noise hits every row alike
            t0 = time.perf_counter()
            for i in range(n):
                fn(aug, encoded, 0, i)
            rates[name].append(n / (time.perf_counter() - t0))
    return rates


def per_worker(encoded: bytes, n: int, workers_list: list[int], repeats: int) -> dict[int, list[float]]:
    from PIL import Image  # noqa: F401  (the folder's images are written as bytes)

    from xlafit.data.images import Augment, ImageDataset, prepare
    from xlafit.data.loader import TakeRequests, TrainOrder

    rates: dict[int, list[float]] = {w: [] for w in workers_list}
    with tempfile.TemporaryDirectory() as tmp:
        for c in range(4):
            (Path(tmp) / "in" / str(c)).mkdir(parents=True)
            for i in range(n // 4):
                (Path(tmp) / "in" / str(c) / f"{i}.jpg").write_bytes(encoded)
        import os

        os.environ["XLAFIT_CACHE"] = str(Path(tmp) / "cache")
        prepare(Path(tmp) / "in", str(Path(tmp) / "out"), workers=1)
        ds = ImageDataset.from_prepared(str(Path(tmp) / "out"), "train", Augment(224))
        order = TrainOrder(len(ds), 64, 0)
        requests = TakeRequests.between(order, 0, order.steps_per_epoch, 1)
        for _ in range(repeats):
            for w in workers_list:
                ds.workers = w
                stream = ds.stream(requests)
                next(stream)  # start-up and the first batch
                t0 = time.perf_counter()
                count = sum(len(b["label"]) for b in stream)
                rates[w].append(count / (time.perf_counter() - t0))
    return rates


def main() -> None:
    import matplotlib

    p = argparse.ArgumentParser()
    p.add_argument("--jpeg", default=str(Path(matplotlib.get_data_path()) / "sample_data" / "grace_hopper.jpg"))
    p.add_argument("--images", type=int, default=200, help="per decoder and round")
    p.add_argument("--stream-images", type=int, default=1024)
    p.add_argument("--workers", default="1,2")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json")
    args = p.parse_args()
    encoded = Path(args.jpeg).read_bytes()
    decoders = per_decoder(encoded, args.images, args.repeats)
    base = statistics.median(decoders["pillow"])
    print(f"{args.jpeg} ({len(encoded) / 1e3:.0f} KB): decode + random-resized-crop 224 + flip, one process")
    for name, r in decoders.items():
        m = statistics.median(r)
        print(f"  {name:16s} {m:7.0f} images/s  (min {min(r):.0f}, max {max(r):.0f})  {m / base:.2f}x pillow")
    workers = per_worker(encoded, args.stream_images, [int(w) for w in args.workers.split(",")], args.repeats)
    print(f"ImageDataset.stream, batches of 64, {args.stream_images} images, after the first batch")
    for w, r in workers.items():
        m = statistics.median(r)
        print(f"  {w} worker(s)       {m:7.0f} images/s  (min {min(r):.0f}, max {max(r):.0f})  {m / w:.0f} per worker")
    if args.json:
        Path(args.json).write_text(json.dumps({"decoders": decoders, "workers": workers}, indent=2))


if __name__ == "__main__":
    main()
