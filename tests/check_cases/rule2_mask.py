import numpy as np
import optax
from flax import nnx

model = nnx.Linear(4, 3, rngs=nnx.Rngs(0))
batch = {"x": np.ones((8, 4), np.float32), "y": np.arange(8) % 3, "mask": np.arange(8) < 6}


def loss_fn(model, batch):
    losses = optax.softmax_cross_entropy_with_integer_labels(model(batch["x"]), batch["y"])
    kept = losses[batch["mask"]]  # line 11: boolean-mask indexing
    return kept.mean() * losses
