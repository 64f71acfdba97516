"""Losses and metrics over padded, fixed-shape batches: weighted means over valid positions.

Static shapes mean padding: padded tokens, the empty slots of a fixed number of masked
positions, padding rows of a last batch. The rule (XLA rule 2 of the TPU guides) is to
compute everywhere and weight by a mask, never to index with a boolean mask, whose result
has a data-dependent shape.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def masked_mean(values: jax.Array, weights: jax.Array, axis: int | tuple[int, ...] = -1) -> jax.Array:
    """``sum(values * weights) / sum(weights)`` along ``axis``; 0 where every weight is 0.

    Example:
        >>> float(masked_mean(jnp.array([1.0, 3.0, 100.0]), jnp.array([1.0, 1.0, 0.0])))
        2.0
    """
    weights = weights.astype(values.dtype)
    total = jnp.sum(values * weights, axis=axis)
    count = jnp.sum(weights, axis=axis)
    return total / jnp.maximum(count, 1e-9)


def masked_accuracy(logits: jax.Array, labels: jax.Array, weights: jax.Array) -> jax.Array:
    """Share of the weighted positions whose arg-max is the label; ``[..., V] -> [...]``."""
    return masked_mean((logits.argmax(-1) == labels).astype(jnp.float32), weights)
