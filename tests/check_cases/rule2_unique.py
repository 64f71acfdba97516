import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

model = nnx.Linear(4, 3, rngs=nnx.Rngs(0))
batch = {"x": np.ones((8, 4), np.float32), "y": np.arange(8) % 3}


def loss_fn(model, batch):
    classes = jnp.unique(batch["y"])  # line 11: output size depends on the data
    losses = optax.softmax_cross_entropy_with_integer_labels(model(batch["x"]), batch["y"])
    return losses / classes.shape[0]
