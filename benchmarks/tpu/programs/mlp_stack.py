"""A stack of 8 MLP blocks, as users write deep models: scanned (nnx.scan over nnx.vmap-created
layers), or with ``MLP_STACK=unrolled`` the same blocks in a Python loop. XLA's cost analysis
counts a scanned layer once; ``xlafit check`` counts every layer either way:

    JAX_PLATFORMS=cpu xlafit check benchmarks/tpu/programs/mlp_stack.py --tpu v5e-8 --json
    MLP_STACK=unrolled JAX_PLATFORMS=cpu xlafit check benchmarks/tpu/programs/mlp_stack.py --tpu v5e-8 --json
"""

import os

import jax
import jax.numpy as jnp
from flax import nnx

L, D = 8, 512
SCANNED = os.environ.get("MLP_STACK", "scanned") == "scanned"


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


class Unrolled(nnx.Module):
    def __init__(self, rngs):
        self.blocks = nnx.List([Block(rngs) for _ in range(L)])

    def __call__(self, x):
        for block in self.blocks:
            x = block(x)
        return x


model = nnx.eval_shape(lambda: (Stack if SCANNED else Unrolled)(nnx.Rngs(0)))
batch = {"x": jax.ShapeDtypeStruct((64, D), jnp.float32)}


def loss_fn(model, batch):
    return jnp.mean(model(batch["x"]) ** 2, axis=-1)
