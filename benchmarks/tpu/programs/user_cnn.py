"""A small CNN with BatchNorm and Dropout, written as a user writes one (plain NNX)."""

import jax
import jax.numpy as jnp
import optax
from flax import nnx


class Net(nnx.Module):
    def __init__(self, rngs):
        self.c1 = nnx.Conv(3, 64, (3, 3), rngs=rngs)
        self.b1 = nnx.BatchNorm(64, rngs=rngs)
        self.c2 = nnx.Conv(64, 128, (3, 3), strides=2, rngs=rngs)
        self.b2 = nnx.BatchNorm(128, rngs=rngs)
        self.c3 = nnx.Conv(128, 256, (3, 3), strides=2, rngs=rngs)
        self.b3 = nnx.BatchNorm(256, rngs=rngs)
        self.drop = nnx.Dropout(0.2, rngs=rngs)
        self.head = nnx.Linear(256, 10, rngs=rngs)

    def __call__(self, x):
        x = jax.nn.relu(self.b1(self.c1(x)))
        x = jax.nn.relu(self.b2(self.c2(x)))
        x = jax.nn.relu(self.b3(self.c3(x)))
        return self.head(self.drop(x.mean(axis=(1, 2))))


model = Net(nnx.Rngs(0))
batch = {"image": jnp.zeros((64, 32, 32, 3)), "label": jnp.zeros((64,), jnp.int32)}
optimizer = optax.sgd(0.1, momentum=0.9)


def loss_fn(model, batch):
    logits = model(batch["image"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"])
