"""Recipe: the pytorch/examples MNIST CNN, data-parallel on every device.

Config + model + data wiring, nothing else: the run is :mod:`xlafit.run`, the loop
:class:`xlafit.Trainer`.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from xlafit.config import Config
from xlafit.data import mnist
from xlafit.models.cnn import MnistCNN
from xlafit.recipes.base import Recipe


@dataclasses.dataclass
class MnistModelConfig:
    dropout1: float = 0.25  # after the convolutions (pytorch/examples' Net)
    dropout2: float = 0.5  # after the first dense layer
    compute_dtype: Literal["float32", "bfloat16"] = "float32"  # bfloat16: mixed precision (parameters stay float32)


def build_model(cfg: Config, train: object = None) -> MnistCNN:
    dtype = jnp.bfloat16 if cfg.model.compute_dtype == "bfloat16" else None
    rngs = nnx.Rngs(params=cfg.trainer.seed, dropout=cfg.trainer.seed + 1)
    return MnistCNN(dropout1=cfg.model.dropout1, dropout2=cfg.model.dropout2, dtype=dtype, rngs=rngs)


def loss_fn(model: MnistCNN, batch: dict[str, jax.Array]) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Per-example cross-entropy and accuracy."""
    logits = model(batch["image"])  # (B, 10)
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"])
    return losses, {"accuracy": (logits.argmax(-1) == batch["label"]).astype(jnp.float32)}


def load_data(cfg: Config) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """(train, eval) arrays: the embedded 4,000/1,000 split, or ``data.data_dir`` IDX files."""
    splits = mnist.load_idx_dir(cfg.data.data_dir) if cfg.data.data_dir else mnist.load_embedded()
    return splits["train"], splits["test"]


RECIPE = Recipe(
    name="mnist",
    model_config=MnistModelConfig,
    load_data=load_data,
    build_model=build_model,
    loss_fn=loss_fn,
    bit_identical_chunks=True,  # tests/test_trainer.py, test_multiprocess.py
)
