"""A model too big for one v5e core: 1.6 billion parameters, built abstractly.

With Adam, parameters + two moments + gradients take ~26 GiB per core, over v5e's 15.75
usable GiB and within v5p's 95.74. ``nnx.eval_shape`` allocates nothing, and ``batch``
holds shapes only.
"""

import jax
import jax.numpy as jnp
from flax import nnx

model = nnx.eval_shape(lambda: nnx.Linear(40_000, 40_000, use_bias=False, rngs=nnx.Rngs(0)))
batch = {"x": jax.ShapeDtypeStruct((8, 40_000), jnp.float32)}


def loss_fn(model, batch):
    return jnp.mean(model(batch["x"]) ** 2, axis=-1)
