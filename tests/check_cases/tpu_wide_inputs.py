"""Each example is 64 MiB of input: the per-core batch that fits is a few dozen."""

import jax
import jax.numpy as jnp
import optax
from flax import nnx

model = nnx.eval_shape(lambda: nnx.Linear(2**14, 4, rngs=nnx.Rngs(0)))
batch = {"x": jax.ShapeDtypeStruct((8, 2**10, 2**14), jnp.float32)}
optimizer = optax.sgd(0.1)


def loss_fn(model, batch):
    return jnp.mean(jnp.tanh(model(batch["x"])) ** 2, axis=(-2, -1))
