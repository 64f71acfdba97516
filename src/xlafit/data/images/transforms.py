"""Decode + augment one image as a pure function of ``(seed, epoch, example index)``.

Training: Inception-style random-resized-crop (torchvision's ``RandomResizedCrop``: an area
fraction in ``scale``, an aspect ratio log-uniform in ``ratio``, 10 tries, then the
centre) and a horizontal flip with probability 1/2. Evaluation: resize the shorter side to
``image_size / eval_crop_fraction`` and crop the centre ``image_size`` square. Each image
becomes ``uint8 [image_size, image_size, channels]``: normalisation happens on the device.

The random draws come from a counter-based hash of ``(seed, epoch, index, stream)``
(:func:`xlafit.data.hashing.hash_uniform`): no generator state, so a resumed run, any number of
worker processes and any device count see the same pixels. The crop and resize are one
Pillow call (``resize(box=...)``, antialiased bilinear); a JPEG is decoded by libjpeg-turbo
(``simplejpeg``) at the smallest DCT scale (1/2, 1/4, 1/8) that still gives the crop at
least ``image_size`` pixels a side, which is most of the speed-up on ImageNet's photos.
"""

from __future__ import annotations

import dataclasses
import io
import math

import numpy as np

from xlafit.data.hashing import hash_uniform

_TRIES = 10  # torchvision's RandomResizedCrop
_JPEG_MAGIC = b"\xff\xd8"


@dataclasses.dataclass(frozen=True)
class Augment:
    """What every image becomes: the crop, its size and the flip.

    Example:
        >>> aug = Augment(image_size=4, train=False, channels=1)
        >>> aug.box(8, 6, epoch=0, index=3)
        (1.375, 0.375, 6.625, 5.625)
    """

    image_size: int = 224
    train: bool = True
    scale: tuple[float, float] = (0.08, 1.0)  # area fraction of the random crop
    ratio: tuple[float, float] = (3 / 4, 4 / 3)  # its aspect ratio (width / height)
    hflip: bool = True
    eval_crop_fraction: float = 0.875  # 224 of 256, the ResNet papers' evaluation
    channels: int = 3
    seed: int = 0

    def box(self, width: int, height: int, epoch: int, index: int) -> tuple[float, float, float, float]:
        """The ``(left, top, right, bottom)`` region of a ``width x height`` image that becomes the output."""
        if not self.train:
            side = min(width, height) * self.eval_crop_fraction
            left, top = (width - side) / 2, (height - side) / 2
            return left, top, left + side, top + side
        area = width * height
        tries = np.arange(_TRIES)
        u_scale = hash_uniform(self.seed, epoch, index, 2 * tries)
        u_ratio = hash_uniform(self.seed, epoch, index, 2 * tries + 1)
        target = area * (self.scale[0] + (self.scale[1] - self.scale[0]) * u_scale)
        log_lo, log_hi = math.log(self.ratio[0]), math.log(self.ratio[1])
        aspect = np.exp(log_lo + (log_hi - log_lo) * u_ratio)
        w = np.round(np.sqrt(target * aspect))
        h = np.round(np.sqrt(target / aspect))
        fits = np.flatnonzero((w > 0) & (w <= width) & (h > 0) & (h <= height))
        if fits.size:
            cw, ch = int(w[fits[0]]), int(h[fits[0]])
        else:  # the centre, with the aspect ratio clamped into ``ratio``
            in_ratio = width / height
            if in_ratio < self.ratio[0]:
                cw, ch = width, round(width / self.ratio[0])
            elif in_ratio > self.ratio[1]:
                cw, ch = round(height * self.ratio[1]), height
            else:
                cw, ch = width, height
            return (width - cw) / 2, (height - ch) / 2, (width + cw) / 2, (height + ch) / 2
        u_top, u_left = hash_uniform(self.seed, epoch, index, np.array([2 * _TRIES, 2 * _TRIES + 1]))
        top = min(int(u_top * (height - ch + 1)), height - ch)
        left = min(int(u_left * (width - cw + 1)), width - cw)
        return float(left), float(top), float(left + cw), float(top + ch)

    def flip(self, epoch: int, index: int) -> bool:
        return self.train and self.hflip and bool(hash_uniform(self.seed, epoch, index, 2 * _TRIES + 2) < 0.5)

    def __call__(self, encoded: bytes, epoch: int, index: int) -> np.ndarray:
        """``uint8 [image_size, image_size, channels]`` from the encoded bytes of example ``index``.

        Raises:
            Exception: whatever the decoder raises for a damaged image (the caller names the file).
        """
        from PIL import Image

        size = self.image_size
        if encoded[:2] == _JPEG_MAGIC:
            import simplejpeg

            height, width, _, _ = simplejpeg.decode_jpeg_header(encoded)
            left, top, right, bottom = self.box(width, height, epoch, index)
            # The smallest DCT scale that keeps >= size pixels across the crop: a quarter of
            # the pixels at 1/2, a sixteenth at 1/4, ... decoded instead of all of them.
            min_w = math.ceil(width * size / max(right - left, 1))
            min_h = math.ceil(height * size / max(bottom - top, 1))
            pixels = simplejpeg.decode_jpeg(
                encoded, colorspace="GRAY" if self.channels == 1 else "RGB", min_width=min_w, min_height=min_h
            )
            sx, sy = pixels.shape[1] / width, pixels.shape[0] / height
            img = Image.fromarray(pixels[..., 0] if self.channels == 1 else pixels)
            box = (left * sx, top * sy, right * sx, bottom * sy)
        else:
            img = Image.open(io.BytesIO(encoded))
            img.load()
            if img.mode.startswith("I"):  # a 16-bit grey PNG: Pillow's convert clips it at 255 instead of scaling
                img = Image.fromarray((np.asarray(img) >> 8).astype(np.uint8))
            img = img.convert("L" if self.channels == 1 else "RGB")
            box = self.box(img.width, img.height, epoch, index)
        out = np.asarray(img.resize((size, size), Image.Resampling.BILINEAR, box=box))
        if self.flip(epoch, index):
            out = out[:, ::-1]
        return np.ascontiguousarray(out).reshape(size, size, self.channels)
