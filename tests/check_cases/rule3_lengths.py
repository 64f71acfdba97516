import numpy as np
import optax
from flax import nnx

model = nnx.Linear(4, 3, rngs=nnx.Rngs(0))
batch = {"x": np.ones((8, 4), np.float32), "y": np.arange(8) % 3}
# 300 token sequences of 100 different lengths, fed one by one
dataset = [{"tokens": np.zeros(10 + i % 100, np.int32)} for i in range(300)]


def loss_fn(model, batch):
    return optax.softmax_cross_entropy_with_integer_labels(model(batch["x"]), batch["y"])
