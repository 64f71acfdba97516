"""Runs on the CPU, not on a TPU: a non-symmetric eigendecomposition is CPU-only in XLA."""

import jax.numpy as jnp
import numpy as np
from flax import nnx

model = nnx.Linear(4, 4, rngs=nnx.Rngs(0))
batch = {"x": np.ones((8, 4), np.float32)}


def loss_fn(model, batch):
    spectrum = jnp.linalg.eigvals(model.kernel[...])
    return jnp.abs(spectrum).sum() + model(batch["x"]).sum(-1)
