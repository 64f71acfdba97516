"""Recipe: ResNet image classification, data-parallel on every device.

Config + model + data wiring: images come from ``xlafit data images`` (``data.data_dir``)
or, with none, from the MNIST image demo (the 5,000 embedded digits written once as PNG
files and prepared: :mod:`xlafit.data.images.mnist_demo`); Grain worker processes decode
and augment them (:class:`~xlafit.data.images.ImageDataset`); they reach the devices as
``uint8`` and are normalised there, inside the loss; the loop is :class:`xlafit.Trainer`.

``model.preset`` chooses the network and the sizes the data section leaves null:

=========  =========================================  ==========  ============
preset     network                                    image size  global batch
=========  =========================================  ==========  ============
demo       ResNet-18, small stem (3x3, no max-pool),  28          128
           width 16 (a quarter: 2 CPU cores)
resnetN    ResNet-N v1.5 (18, 34, 50, 101, 152),      224         1024
           width 64
=========  =========================================  ==========  ============

1024 is Goyal et al. 2017's batch that trains ResNet-50 to 76% in 90 epochs at learning rate
0.1 x 1024 / 256 (linear scaling), and MLPerf's reference on 8 accelerators.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import sys
from pathlib import Path
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from xlafit import config as xconfig
from xlafit.config import Config
from xlafit.data import shards
from xlafit.data.images import Augment, ImageDataset, SyntheticImages, load_split, mnist_demo, read_manifest
from xlafit.errors import ConfigError
from xlafit.models.resnet import ResNet, ResNetConfig, train_flops_per_example
from xlafit.recipes.base import Recipe, Throughput

log = logging.getLogger("xlafit")

Preset = Literal["demo", "resnet18", "resnet34", "resnet50", "resnet101", "resnet152"]
CLASSES_FILE = "classes.json"  # in the run directory: the class names, label 0 first

# Per-channel mean and standard deviation of pixels / 255.
NORMALISATION = {
    "imagenet": ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225)),  # torchvision's ImageNet statistics
    "mnist": ((0.1307,), (0.3081,)),
}


@dataclasses.dataclass
class ResNetModelConfig:
    preset: Preset = "demo"  # demo: a small ResNet for the MNIST image demo; resnet18-152: the standard ones
    width: int | None = None  # stem channels; null: the preset's (demo 16, else 64)
    small_stem: bool | None = None  # null: the preset's (demo: yes)
    # Each block's last batch norm starts at scale 0 (Goyal et al. 2017). null: the preset's: on
    # for ImageNet; off for the demo, whose 200 steps cannot spare the ~40 it costs to leave identity.
    zero_init_residual: bool | None = None
    bn: Literal["global", "local"] = "global"  # batch statistics over the global batch, or per bn_group examples
    bn_group: int | None = None  # examples per statistics group for bn=local
    compute_dtype: Literal["float32", "bfloat16"] = "float32"  # bfloat16: mixed precision (parameters stay float32)
    label_smoothing: float = 0.0  # the share of the target spread over all classes (0.1 is usual)


@dataclasses.dataclass
class ResNetDataConfig(xconfig.DataConfig):
    """``data_dir``: a directory or URL written by ``xlafit data images`` (null: the MNIST image demo)."""

    source: Literal["images", "synthetic"] = "images"  # synthetic: ImageNet-shaped random images, no decode
    image_size: int | None = None  # null: the preset's (demo 28, else 224)
    workers: int = 2  # Grain worker processes that decode and augment training batches (0: in the main process)
    # ... and evaluation batches: each evaluation starts its own (~2 s on 2 cores), worth it for
    # ImageNet's 50,000 images, not for the demo's 1,000 PNGs (0: in the main process).
    eval_workers: int = 0
    on_corrupt: Literal["skip", "stop"] = "skip"  # an image that cannot be decoded: the next instead, or stop
    # Augmentation; null: the preset's. ImageNet: Inception's crops (area 0.08-1), flips, and
    # evaluation on the centre 87.5% (224 of 256). The demo's digits: area 0.5-1, no flips
    # (a flipped 2 is no digit), evaluation on the whole 28x28 image.
    crop_scale_min: float | None = None  # random-resized-crop's smallest area fraction
    hflip: bool | None = None  # random horizontal flips in training
    eval_crop_fraction: float | None = None  # evaluation: resize to size / fraction, crop the centre
    normalisation: Literal["imagenet", "mnist"] | None = None  # null: mnist for the demo, else imagenet
    num_classes: int | None = None  # null: the data's (a run records it)
    synthetic_examples: int = 10_000  # random images for data.source=synthetic
    synthetic_classes: int = 1000  # their classes


def data_config(cfg: Config) -> ResNetDataConfig:
    """``cfg.data`` as this recipe's :class:`ResNetDataConfig` (its own keys typed)."""
    if not isinstance(cfg.data, ResNetDataConfig):
        raise TypeError(f"a resnet config has a ResNetDataConfig, got {type(cfg.data).__name__}")
    return cfg.data


def _demo(cfg: Config) -> bool:
    return cfg.model.preset == "demo"


def image_size(cfg: Config) -> int:
    size = data_config(cfg).image_size
    if size is not None and size < 1:
        raise ConfigError(f"data.image_size={size} must be at least 1 (pixels a side; ImageNet: 224).")
    return size if size is not None else (28 if _demo(cfg) else 224)


Normalisation = Literal["imagenet", "mnist"]


def normalisation(cfg: Config) -> Normalisation:
    d = data_config(cfg)
    return d.normalisation or ("mnist" if _demo(cfg) and not d.data_dir else "imagenet")


@dataclasses.dataclass(frozen=True)
class _ModelSizes:
    width: int
    small_stem: bool
    zero_init_residual: bool


def _model_sizes(cfg: Config) -> _ModelSizes:
    m, demo = cfg.model, _demo(cfg)
    return _ModelSizes(
        width=m.width if m.width is not None else (16 if demo else 64),
        small_stem=m.small_stem if m.small_stem is not None else demo,
        zero_init_residual=m.zero_init_residual if m.zero_init_residual is not None else not demo,
    )


def resnet_config(cfg: Config, num_classes: int, channels: int) -> ResNetConfig:
    m = cfg.model
    depth = 18 if _demo(cfg) else int(m.preset.removeprefix("resnet"))
    sizes = _model_sizes(cfg)
    try:
        return ResNetConfig.for_depth(
            depth,
            num_classes,
            width=sizes.width,
            small_stem=sizes.small_stem,
            zero_init_residual=sizes.zero_init_residual,
            bn=m.bn,
            bn_group=m.bn_group,
            dtype=m.compute_dtype,
            num_channels=channels,
        )
    except ValueError as e:
        raise ConfigError(f"model: {e}") from None


# --------------------------------------------------------------------------- data


def augmentation(cfg: Config) -> tuple[float, bool, float]:
    """``(crop_scale_min, hflip, eval_crop_fraction)``: the config's, or the preset's where null."""
    d, demo = data_config(cfg), _demo(cfg)
    scale = d.crop_scale_min if d.crop_scale_min is not None else (0.5 if demo else 0.08)
    hflip = d.hflip if d.hflip is not None else not demo
    fraction = d.eval_crop_fraction if d.eval_crop_fraction is not None else (1.0 if demo else 0.875)
    if not 0.0 < scale <= 1.0 or not 0.0 < fraction <= 1.0:
        raise ConfigError(f"data.crop_scale_min={scale} and data.eval_crop_fraction={fraction} must lie in (0, 1].")
    return scale, hflip, fraction


def _augment(cfg: Config, train: bool, channels: int) -> Augment:
    scale, hflip, fraction = augmentation(cfg)
    return Augment(
        image_size=image_size(cfg),
        train=train,
        scale=(scale, 1.0),
        hflip=hflip,
        eval_crop_fraction=fraction,
        channels=channels,
        seed=data_config(cfg).seed,
    )


def load_data(cfg: Config) -> tuple[ImageDataset | SyntheticImages, ImageDataset | SyntheticImages | None]:
    """(train, eval): prepared images (``data.data_dir``, else the MNIST image demo), or synthetic ones.

    Data prepared with no held-out images (one folder, ``--eval-fraction 0``) trains without
    evaluation: eval is None, and a warning says how to hold some out.
    """
    d = data_config(cfg)
    image_size(cfg)  # a bad data.image_size is refused before any data is read or written
    if d.workers < 0 or d.eval_workers < 0:
        raise ConfigError("data.workers and data.eval_workers must be 0 (decode in the main process) or more.")
    if d.source == "synthetic":
        if d.data_dir:
            raise ConfigError("data.source=synthetic makes its own images: leave data.data_dir unset.")
        size, n, classes = image_size(cfg), d.synthetic_examples, d.synthetic_classes
        return SyntheticImages(n, size, 3, classes, d.seed), SyntheticImages(
            max(1, n // 10), size, 3, classes, d.seed + 1
        )
    where = d.data_dir or mnist_demo.build()

    train_split, manifest = load_split(where, "train")
    eval_split, _ = load_split(where, "eval")
    channels = int(manifest["channels"])
    classes = manifest["classes"]
    train = ImageDataset(
        train_split, _augment(cfg, True, channels), workers=d.workers, on_corrupt=d.on_corrupt, classes=classes
    )
    _say_what_it_reads(cfg, where, len(train_split), len(eval_split), classes, channels)
    if not len(eval_split):
        log.warning(
            "%s holds no evaluation images, so this run trains without evaluation; to evaluate, prepare the data "
            "again with --eval-fraction 0.05 (or from a folder with train/ and val/).",
            where,
        )
        return train, None
    evaluation = ImageDataset(
        eval_split, _augment(cfg, False, channels), workers=d.eval_workers, on_corrupt=d.on_corrupt, classes=classes
    )
    return train, evaluation


def _say_what_it_reads(cfg: Config, where: str, train: int, held: int, classes: list[str], channels: int) -> None:
    """The run's data line (as the bert and llm recipes say theirs): the images, the size and
    transforms they are trained at; and, for a user's images on the demo preset, what that
    preset is (28 px, no flips, a small stem that does not export to Hugging Face)."""
    scale, hflip, fraction = augmentation(cfg)
    print(
        f"data: {where}: {train} images of {len(classes)} classes, {channels} channel(s), trained at "
        f"{image_size(cfg)} px (random crops of {scale:.0%}-100% of the area{', flips' if hflip else ', no flips'}), "
        f"evaluated on the centre {fraction:.0%}; normalisation {normalisation(cfg)}; eval: {held} images",
        file=sys.stderr,
        flush=True,
    )
    if _demo(cfg) and data_config(cfg).data_dir:
        log.warning(
            "warning: model.preset=demo on your images: the MNIST demo's settings (data.image_size %d, no flips, "
            "the small stem, which does not export to Hugging Face); for your own images take a resnet* preset "
            "(model.preset=resnet18 ...) or set model.small_stem=false, data.image_size and data.hflip=true",
            image_size(cfg),
        )


def _classes(train: ImageDataset | SyntheticImages) -> int:
    return train.num_classes if isinstance(train, SyntheticImages) else len(train.classes)


def _channels(train: ImageDataset | SyntheticImages) -> int:
    return 3 if isinstance(train, SyntheticImages) else train.augment.channels


def from_data(cfg: Config, train: ImageDataset | SyntheticImages) -> Config:
    """``cfg`` with the image size, class count, normalisation and global batch the run uses.

    Raises:
        ConfigError: ``data.num_classes`` contradicts the data's classes.
    """
    d = data_config(cfg)
    classes = _classes(train)
    if d.num_classes is not None and d.num_classes != classes:
        raise ConfigError(
            f"data.num_classes={d.num_classes} but the data has {classes} classes; leave it unset (the data decides)."
        )
    global_batch = d.global_batch
    if d.global_batch is None and d.per_device_batch is None:
        global_batch = 128 if _demo(cfg) else 1024
    scale, hflip, fraction = augmentation(cfg)
    data = dataclasses.replace(
        d,
        image_size=image_size(cfg),
        num_classes=classes,
        normalisation=normalisation(cfg),
        crop_scale_min=scale,
        hflip=hflip,
        eval_crop_fraction=fraction,
        global_batch=global_batch,
    )
    model = dataclasses.replace(cfg.model, **dataclasses.asdict(_model_sizes(cfg)))
    return dataclasses.replace(cfg, data=data, model=model)


# --------------------------------------------------------------------------- model


class ImageClassifier(nnx.Module):
    """A network fed ``uint8`` images: scales and normalises them on the device first.

    Normalising on the device sends a quarter of float32's bytes from the host, and the
    constants are the data's (``data.normalisation``), not the network's.
    """

    def __init__(
        self, net: ResNet, mean: tuple[float, ...], std: tuple[float, ...], label_smoothing: float = 0.0
    ) -> None:
        self.net = net
        self.mean, self.std, self.label_smoothing = tuple(mean), tuple(std), label_smoothing

    def __call__(self, images: jax.Array) -> jax.Array:
        """``uint8 [B, H, W, C]`` -> float32 logits ``[B, classes]``."""
        x = images.astype(jnp.float32) * (1.0 / 255.0)
        shape = (1, 1, 1, len(self.mean))  # broadcast over [B, H, W, C] without rank promotion
        mean, std = jnp.asarray(self.mean).reshape(shape), jnp.asarray(self.std).reshape(shape)
        x = (x - mean) / std
        return self.net(x)


def check_bn_group(cfg: Config) -> None:
    """``model.bn_group`` must divide the examples one device normalises at a time, so that a
    group never spans devices (``bn=local`` means no communication, as in Goyal et al. and
    MLPerf): the per-device batch, over ``trainer.accumulate_steps`` micro-batches, or the
    rows of one ``trainer.invariant_chunks`` chunk. Unknown until the run has resolved its
    batch (``data.per_device_batch`` null): then nothing to check.

    ``bn=global`` cannot go with ``trainer.invariant_chunks`` or ``trainer.accumulate_steps``,
    which run each chunk or micro-batch of the batch on its own: its statistics would be the
    chunk's, not the global batch's. (With ``bn=local`` and accumulation, the running averages
    move once per micro-batch: their momentum acts ``accumulate_steps`` times a step.)

    Raises:
        ConfigError: it does not divide them, or bn=global with invariant chunks or accumulation.
    """
    m, t, per_device, global_batch = cfg.model, cfg.trainer, cfg.data.per_device_batch, cfg.data.global_batch
    if m.bn == "global" and t.invariant_chunks:
        raise ConfigError(
            f"model.bn=global normalises with the whole batch's statistics, but trainer.invariant_chunks="
            f"{t.invariant_chunks} computes each chunk of the batch on its own; use model.bn=local with a "
            "model.bn_group dividing a chunk, or trainer.invariant_chunks=null."
        )
    if m.bn == "global" and t.accumulate_steps > 1:
        raise ConfigError(
            f"model.bn=global normalises with the whole batch's statistics, but trainer.accumulate_steps="
            f"{t.accumulate_steps} runs the model on one micro-batch at a time; use model.bn=local with a "
            "model.bn_group dividing a micro-batch (statistics per group, as Goyal et al.), or "
            "trainer.accumulate_steps=1."
        )
    if m.bn != "local" or m.bn_group is None or per_device is None:
        return
    if t.invariant_chunks:
        if global_batch is None:
            return
        rows, where = global_batch // t.invariant_chunks, f"trainer.invariant_chunks={t.invariant_chunks}"
    else:
        rows, where = per_device // max(t.accumulate_steps, 1), f"trainer.accumulate_steps={t.accumulate_steps}"
    if rows % m.bn_group:
        divisors = [g for g in range(1, rows + 1) if rows % g == 0]
        raise ConfigError(
            f"model.bn_group={m.bn_group} does not divide the {rows} examples each device normalises at a time "
            f"(data.per_device_batch={per_device}, {where}), so its groups would span devices or not fit; "
            f"use one of {divisors} or a larger batch."
        )


def validate(cfg: Config) -> None:
    """The model settings' errors before the data is read (ImageNet's first read copies and
    checks about 140 GB): the architecture, label smoothing and the batch-norm groups as far
    as the batch is known yet (:func:`check_bn_group` runs again once it is).

    Raises:
        ConfigError: naming the setting and the fix.
    """
    resnet_config(cfg, 1, 3)  # the data decides classes and channels; any will do for these checks
    if not 0.0 <= cfg.model.label_smoothing < 1.0:
        raise ConfigError(f"model.label_smoothing={cfg.model.label_smoothing} must lie in [0, 1) (0.1 is usual).")
    check_bn_group(cfg)


def normalisation_for(cfg: Config, channels: int) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """The mean and standard deviation of each input channel (``data.normalisation``'s, their
    means repeated where its statistics have another channel count: MNIST's on colour images,
    ImageNet's on greyscale ones), as the model normalises its images."""
    mean, std = NORMALISATION[normalisation(cfg)]
    if len(mean) != channels:
        return (float(np.mean(mean)),) * channels, (float(np.mean(std)),) * channels
    return tuple(mean), tuple(std)


def build_model(cfg: Config, train: ImageDataset | SyntheticImages) -> ImageClassifier:
    validate(cfg)
    channels = _channels(train)
    mean, std = normalisation_for(cfg, channels)
    net = ResNet(config=resnet_config(cfg, _classes(train), channels), rngs=nnx.Rngs(params=cfg.trainer.seed))
    return ImageClassifier(net, mean, std, cfg.model.label_smoothing)


def loss_fn(model: ImageClassifier, batch: dict[str, jax.Array]) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Per-example cross-entropy (with ``model.label_smoothing``) and accuracy."""
    logits = model(batch["image"])  # (B, classes)
    if model.label_smoothing:
        targets = optax.smooth_labels(jax.nn.one_hot(batch["label"], logits.shape[-1]), model.label_smoothing)
        losses = optax.softmax_cross_entropy(logits, targets)
    else:
        losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"])
    return losses, {"accuracy": (logits.argmax(-1) == batch["label"]).astype(jnp.float32)}


def save_artifacts(cfg: Config, run_dir: Path, train: ImageDataset | SyntheticImages) -> None:
    """Writes the class names, label 0 first, to ``run_dir/classes.json``: ``xlafit export hf``
    names the exported model's labels with them (synthetic images have none); and the prepared
    data's shards (:data:`~xlafit.data.shards.FINGERPRINT_FILE`)."""
    if isinstance(train, ImageDataset):
        (run_dir / CLASSES_FILE).write_text(json.dumps(train.classes, ensure_ascii=False) + "\n")
        _, _, manifest = read_manifest(data_config(cfg).data_dir or mnist_demo.build())
        (run_dir / shards.FINGERPRINT_FILE).write_text(json.dumps(shards.fingerprint(manifest)) + "\n")


def throughput(cfg: Config, train: ImageDataset | SyntheticImages) -> Throughput:
    """Model FLOPs per training image (convolutions and the classifier, forward and backward)."""
    net = resnet_config(cfg, _classes(train), _channels(train))
    return {"flops_per_example": train_flops_per_example(net, image_size(cfg))}


RECIPE = Recipe(
    name="resnet",
    model_config=ResNetModelConfig,
    data_config=ResNetDataConfig,
    load_data=load_data,
    from_data=from_data,
    build_model=build_model,
    loss_fn=loss_fn,
    throughput=throughput,
    save_artifacts=save_artifacts,
    kept_files={
        CLASSES_FILE: "class names (the data's folders, in order); the checkpoints' outputs are the run's classes",
        shards.FINGERPRINT_FILE: "prepared images (the sha256 of each shard of its splits, from its manifest.json): "
        "the data in data.data_dir was prepared again since the run started",
    },
    validate=validate,
)
