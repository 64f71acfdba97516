"""A small GPT written the way a user writes one: plain NNX, no sharding annotations."""

import jax
import jax.numpy as jnp
import optax
from flax import nnx

V, D, H, L, T = 32000, 768, 12, 12, 512


class Block(nnx.Module):
    def __init__(self, rngs):
        self.ln1 = nnx.LayerNorm(D, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(H, D, decode=False, rngs=rngs)
        self.ln2 = nnx.LayerNorm(D, rngs=rngs)
        self.up = nnx.Linear(D, 4 * D, rngs=rngs)
        self.down = nnx.Linear(4 * D, D, rngs=rngs)

    def __call__(self, x):
        mask = nnx.make_causal_mask(x[..., 0])
        x = x + self.attn(self.ln1(x), mask=mask)
        return x + self.down(jax.nn.gelu(self.up(self.ln2(x))))


class GPT(nnx.Module):
    def __init__(self, rngs):
        self.embed = nnx.Embed(V, D, rngs=rngs)
        self.pos = nnx.Param(jnp.zeros((T, D)))
        self.blocks = nnx.List([Block(rngs) for _ in range(L)])
        self.ln = nnx.LayerNorm(D, rngs=rngs)

    def __call__(self, tokens):
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        for b in self.blocks:
            x = b(x)
        return self.embed.attend(self.ln(x))


model = nnx.eval_shape(lambda: GPT(nnx.Rngs(0)))
batch = {"tokens": jax.ShapeDtypeStruct((8, T + 1), jnp.int32)}
optimizer = optax.adamw(3e-4)


def loss_fn(model, batch):
    logits = model(batch["tokens"][:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["tokens"][:, 1:]).mean(-1)
