"""A compiled Keras 3 model: `xlafit check` takes it as it takes an nnx.Module."""

import os

os.environ.setdefault("KERAS_BACKEND", "jax")

import keras  # noqa: E402
import numpy as np  # noqa: E402

model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(3)])
model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
batch = {"x": np.ones((4, 8), np.float32), "y": np.arange(4) % 3}
