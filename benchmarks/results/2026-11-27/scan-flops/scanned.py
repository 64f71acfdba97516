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
        @nnx.split_rngs(splits=L)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make(rngs):
            return Block(rngs)

        self.blocks = make(rngs)

    def __call__(self, x):
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def body(x, block):
            return block(x)

        return body(x, self.blocks)


model = nnx.eval_shape(lambda: Stack(nnx.Rngs(0)))
batch = {"x": jax.ShapeDtypeStruct((64, D), jnp.float32)}


def loss_fn(model, batch):
    return jnp.mean(model(batch["x"]) ** 2, axis=-1)
