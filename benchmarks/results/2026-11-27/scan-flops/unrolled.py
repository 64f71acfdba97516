"""A stack of 8 MLP blocks, scanned (nnx.scan over nnx.vmap-created layers), as users write deep models."""

import jax
import jax.numpy as jnp
from flax import nnx

L, D = 8, 512


class Block(nnx.Module):
    def __init__(self, rngs):
        self.up = nnx.Linear(D, 4 * D, rngs=rngs)
        self.down = nnx.Linear(4 * D, D, rngs=rngs)

    def __call__(self, x):
        return x + self.down(jax.nn.gelu(self.up(x)))


class Stack(nnx.Module):
    def __init__(self, rngs):
        self.blocks = nnx.List([Block(rngs) for _ in range(L)])

    def __call__(self, x):
        for block in self.blocks:
            x = block(x)
        return x


model = nnx.eval_shape(lambda: Stack(nnx.Rngs(0)))
batch = {"x": jax.ShapeDtypeStruct((64, D), jnp.float32)}


def loss_fn(model, batch):
    return jnp.mean(model(batch["x"]) ** 2, axis=-1)
