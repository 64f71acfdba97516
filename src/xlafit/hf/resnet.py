"""Weights between :class:`~xlafit.models.resnet.ResNet` and Hugging Face's ``ResNetForImageClassification``.

The Hugging Face side is the files ``save_pretrained`` writes and ``from_pretrained`` reads
(the layout of ``microsoft/resnet-50``): ``config.json`` and ``model.safetensors`` in
PyTorch's layout (convolutions ``[out, in, kh, kw]``, ours ``[kh, kw, in, out]``; linear
``[out, in]``, ours ``[in, out]``). Nothing here imports PyTorch or transformers.

Names, per block ``resnet.encoder.stages.{i}.layers.{j}``: ``layer.{k}.convolution.weight``
and ``layer.{k}.normalization.{weight,bias,running_mean,running_var}`` for the block's
convolutions, ``shortcut.convolution`` / ``shortcut.normalization`` for its projection;
the stem is ``resnet.embedder.embedder``, the classifier ``classifier.1``.

Example:
    >>> save_hf(model, "exported/")   # doctest: +SKIP
    >>> model = from_hf("exported/")  # doctest: +SKIP
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from xlafit.errors import HFFormatError
from xlafit.hf.files import load_safetensors, read_json
from xlafit.models.resnet import ConvBN, ResNet, ResNetConfig, classifier


def hf_config(cfg: ResNetConfig, labels: Sequence[str] | None = None) -> dict[str, Any]:
    """The ``config.json`` of a Hugging Face ``ResNetForImageClassification`` with ``cfg``'s layout.

    Raises:
        HFFormatError: ``cfg`` has the small stem, which Hugging Face's ResNet does not have.
    """
    if cfg.small_stem:
        raise HFFormatError(
            "this ResNet has the small (3x3, no max-pool) stem; Hugging Face's ResNetForImageClassification "
            "only has the 7x7 stem, so it cannot be exported as one. Train with model.small_stem=false (the resnet "
            "recipe's demo preset uses the small one) to export."
        )
    if labels is not None and len(labels) != cfg.num_classes:
        raise ValueError(f"{len(labels)} labels for a model with {cfg.num_classes} classes.")
    names = list(labels) if labels is not None else [f"LABEL_{i}" for i in range(cfg.num_classes)]
    return {
        "architectures": ["ResNetForImageClassification"],
        "model_type": "resnet",
        "num_channels": cfg.num_channels,
        "embedding_size": cfg.embedding_size,
        "hidden_sizes": list(cfg.hidden_sizes),
        "depths": list(cfg.depths),
        "layer_type": "bottleneck" if cfg.bottleneck else "basic",
        "hidden_act": "relu",
        "downsample_in_first_stage": cfg.downsample_in_first_stage,
        "downsample_in_bottleneck": cfg.downsample_in_bottleneck,
        "id2label": {str(i): name for i, name in enumerate(names)},
        "label2id": {name: i for i, name in enumerate(names)},
        "torch_dtype": "float32",
    }


def config_from_hf(hf: dict[str, Any], **overrides: Any) -> ResNetConfig:
    """A :class:`ResNetConfig` from a Hugging Face ``config.json`` dict; ``overrides`` set
    xlafit's own options (``bn``, ``bn_group``, ``dtype``, ``num_classes``...)."""
    if hf.get("model_type", "resnet") != "resnet":
        raise HFFormatError(f"config.json describes a {hf.get('model_type')!r} model, not a ResNet.")
    if hf.get("hidden_act", "relu") != "relu":
        raise HFFormatError(f"hidden_act={hf['hidden_act']!r} is not supported: xlafit's ResNet uses ReLU.")
    layer_type = hf.get("layer_type", "bottleneck")
    if layer_type not in ("basic", "bottleneck"):
        raise HFFormatError(f"layer_type={layer_type!r}: expected 'basic' or 'bottleneck'.")
    if "id2label" in hf:
        num_classes = len(hf["id2label"])
    else:
        num_classes = int(hf.get("num_labels", 2))  # transformers' PretrainedConfig default
    fields: dict[str, Any] = {
        "depths": tuple(hf.get("depths", (3, 4, 6, 3))),
        "hidden_sizes": tuple(hf.get("hidden_sizes", (256, 512, 1024, 2048))),
        "embedding_size": int(hf.get("embedding_size", 64)),
        "bottleneck": layer_type == "bottleneck",
        "num_classes": num_classes,
        "num_channels": int(hf.get("num_channels", 3)),
        "downsample_in_first_stage": bool(hf.get("downsample_in_first_stage", False)),
        "downsample_in_bottleneck": bool(hf.get("downsample_in_bottleneck", False)),
    }
    try:
        return ResNetConfig(**{**fields, **overrides})
    except ValueError as e:
        raise HFFormatError(f"config.json: {e}") from None


def _layers(model: ResNet) -> Iterator[tuple[str, ConvBN]]:
    """``(Hugging Face prefix, our conv + batch norm)`` for every convolution."""
    yield "resnet.embedder.embedder", model.stem
    for i, stage in enumerate(model.stages):
        for j, block in enumerate(stage):
            p = f"resnet.encoder.stages.{i}.layers.{j}"
            for k, conv in enumerate(block.convs):
                yield f"{p}.layer.{k}", conv
            if block.shortcut is not None:
                yield f"{p}.shortcut", block.shortcut


def _tensors(model: ResNet) -> Iterator[tuple[str, nnx.Variable, tuple[int, ...] | None]]:
    """``(Hugging Face name, our variable, transpose from ours to PyTorch's or None)``."""
    for prefix, layer in _layers(model):
        yield f"{prefix}.convolution.weight", layer.conv.kernel, (3, 2, 0, 1)
        n = layer.norm
        yield f"{prefix}.normalization.weight", n.scale, None
        yield f"{prefix}.normalization.bias", n.bias, None
        yield f"{prefix}.normalization.running_mean", n.mean, None
        yield f"{prefix}.normalization.running_var", n.var, None
    yield "classifier.1.weight", model.head.kernel, (1, 0)
    if model.head.bias is None:
        raise ValueError("the classifier has no bias; xlafit's ResNet always builds it.")
    yield "classifier.1.bias", model.head.bias, None


def to_hf_state(model: ResNet) -> dict[str, np.ndarray]:
    """Hugging Face ``ResNetForImageClassification`` tensors (float32 NumPy, PyTorch layout),
    with ``num_batches_tracked`` (int64 0: it only matters to PyTorch's ``momentum=None``)."""
    state: dict[str, np.ndarray] = {}
    for name, var, perm in _tensors(model):
        value = np.asarray(var[...], np.float32)
        state[name] = value.transpose(perm) if perm else value
    for prefix, _ in _layers(model):
        state[f"{prefix}.normalization.num_batches_tracked"] = np.zeros((), np.int64)
    return {k: np.ascontiguousarray(v) if v.ndim else v for k, v in state.items()}  # (0-d stays 0-d)


def from_hf_state(model: ResNet, state: dict[str, np.ndarray]) -> None:
    """Loads Hugging Face tensors into ``model`` in place, checking every name and shape.

    A bare ``ResNetModel`` checkpoint (no ``resnet.`` prefix, no classifier) loads its
    backbone; the classifier keeps its initial values (a new head to fine-tune).
    """
    if not any(k.startswith("resnet.") for k in state):
        state = {f"resnet.{k}": v for k, v in state.items()}
    headless = "classifier.1.weight" not in state
    for name, var, perm in _tensors(model):
        if headless and name.startswith("classifier."):
            continue
        shape = tuple(var.get_value().shape)
        expected = tuple(shape[p] for p in perm) if perm else shape
        if name not in state:
            raise HFFormatError(f"the checkpoint has no tensor {name!r}; is it a ResNetForImageClassification?")
        value = np.asarray(state[name], np.float32)
        if value.shape != expected:
            raise HFFormatError(f"{name} has shape {value.shape}, expected {expected} from config.json.")
        # set_value replaces the array (var[...] = would compile a scatter per shape) and fills
        # the abstract variables of a model built by nnx.eval_shape.
        var.set_value(jnp.asarray(value.transpose(np.argsort(perm)) if perm else value))


def image_processor_config(
    image_size: int, crop_fraction: float, mean: Sequence[float], std: Sequence[float]
) -> dict[str, Any]:
    """``preprocessor_config.json`` for Hugging Face's ``ConvNextImageProcessor`` (the one
    ``microsoft/resnet-50`` ships) that prepares images as xlafit's evaluation does: the
    shorter side resized to ``image_size / crop_fraction`` (Pillow bilinear), the centre
    ``image_size`` square cropped, pixels / 255 normalised with ``mean`` and ``std``.

    (xlafit crops the centre square of the original, then resizes: the same region, pixels
    that differ by the rounding of one resize. At ``image_size`` >= 384 ConvNext's processor
    resizes to the square without cropping.)

    Example:
        >>> image_processor_config(224, 0.875, (0.485, 0.456, 0.406), (0.229, 0.224, 0.225))["crop_pct"]
        0.875
    """
    return {
        "image_processor_type": "ConvNextImageProcessor",
        "do_resize": True,
        "size": {"shortest_edge": image_size},
        "crop_pct": crop_fraction,
        "resample": 2,  # PIL.Image.Resampling.BILINEAR, as xlafit.data.images.transforms
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "image_mean": list(mean),
        "image_std": list(std),
    }


def save_hf(
    model: ResNet,
    directory: str | Path,
    labels: Sequence[str] | None = None,
    processor: dict[str, Any] | None = None,
) -> Path:
    """Writes ``config.json`` and ``model.safetensors`` to ``directory``, and
    ``preprocessor_config.json`` when ``processor`` is given (:func:`image_processor_config`).

    The result loads with ``transformers.ResNetForImageClassification.from_pretrained(directory)``
    and gives the same logits in eval mode; with the processor, ``pipeline("image-classification",
    model=directory)`` takes image files and names the classes by ``labels``.

    Example:
        >>> save_hf(ResNet(50, 1000, rngs=nnx.Rngs(0)), "resnet50-hf/")  # doctest: +SKIP
    """
    from safetensors.numpy import save_file

    config = hf_config(model.cfg, labels)  # raises for the small stem before anything is written
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file(to_hf_state(model), str(out / "model.safetensors"), metadata={"format": "pt"})
    if processor is not None:
        (out / "preprocessor_config.json").write_text(json.dumps(processor, indent=2) + "\n")
    return out


def from_hf(directory: str | Path, rngs: nnx.Rngs | None = None, **overrides: Any) -> ResNet:
    """A :class:`ResNet` with the weights of a Hugging Face checkpoint directory (eval mode).

    ``overrides`` are :class:`ResNetConfig` fields: ``bn``/``bn_group`` and ``dtype`` for
    training; ``num_classes`` for a new head to fine-tune on other classes (the imported
    classifier is then left out, and the new one initialised from ``rngs``).

    Example:
        >>> model = from_hf("resnet-50/", num_classes=10, dtype="bfloat16")  # doctest: +SKIP
    """
    d = Path(directory).expanduser()
    if not (d / "config.json").exists():
        raise HFFormatError(f"{d} has no config.json; give a directory written by save_pretrained or xlafit export hf.")
    hf = read_json(d / "config.json")
    cfg = config_from_hf(hf, **overrides)
    weights, index = d / "model.safetensors", d / "model.safetensors.index.json"
    if weights.exists():
        files = [weights]
    elif index.exists():  # save_pretrained(max_shard_size=...): shards listed in the index
        files = [d / name for name in sorted(set(read_json(index)["weight_map"].values()))]
    else:
        raise HFFormatError(
            f"{d} has no model.safetensors (only safetensors is read; convert a pytorch_model.bin with transformers: "
            "ResNetForImageClassification.from_pretrained(d).save_pretrained(d, safe_serialization=True))."
        )
    # Built abstract (nothing allocated or initialised: eager initialisation compiles a random
    # kernel per parameter shape, seconds), then every variable is filled from the checkpoint.
    model = nnx.eval_shape(lambda: ResNet(config=cfg, rngs=nnx.Rngs(0)))
    state = {k: v for f in files for k, v in load_safetensors(f).items()}
    if cfg.num_classes != config_from_hf(hf).num_classes:  # a new head: keep only the backbone
        state = {k: v for k, v in state.items() if not k.startswith("classifier.")}
        model.head = classifier(cfg, rngs or nnx.Rngs(0))
    elif "classifier.1.weight" not in state:
        model.head = classifier(cfg, rngs or nnx.Rngs(0))  # a bare ResNetModel: a new head
    from_hf_state(model, state)
    assert all(isinstance(x, jax.Array) for x in jax.tree.leaves(nnx.state(model))), "a variable was not loaded"
    return model
