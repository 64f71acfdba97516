import numpy as np
import optax
from flax import nnx

model = nnx.Linear(4, 3, rngs=nnx.Rngs(0))
batch = {"x": np.ones((8, 4), np.float32), "y": np.arange(8) % 3}


def loss_fn(model, batch):
    logits = model(batch["x"])
    if logits.mean() > 0:  # line 11: a Python branch on a traced value
        logits = logits * 2
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])
