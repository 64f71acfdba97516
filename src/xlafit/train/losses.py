"""Losses and metrics over padded, fixed-shape batches: weighted means over valid positions.

Static shapes mean padding: padded tokens, the empty slots of a fixed number of masked
positions, padding rows of a last batch. The rule (XLA rule 2 of the TPU guides) is to
compute everywhere and weight by a mask, never to index with a boolean mask, whose result
has a data-dependent shape.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax


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


def chunked_cross_entropy(
    logits_fn: Callable[[jax.Array], jax.Array],
    hidden: jax.Array,
    labels: jax.Array,
    weights: jax.Array,
    chunk: int,
) -> tuple[jax.Array, jax.Array]:
    """Per-row weighted mean cross-entropy and accuracy of ``logits_fn(hidden)`` ``[B, T, V]``
    against ``labels [B, T]``, without holding the ``[B, T, V]`` logits: the positions go
    ``chunk`` at a time through a loop, and each chunk's logits are recomputed in the
    backward pass instead of kept (one more forward product of the output layer).

    Equal to ``masked_mean(softmax_cross_entropy(logits_fn(hidden), labels), weights)`` and
    :func:`masked_accuracy` up to float summation order (tested).
    """
    b, t, _ = hidden.shape
    chunk = min(chunk, t)
    pieces = -(-t // chunk)
    pad = pieces * chunk - t
    if pad:  # padded positions weigh nothing
        hidden = jnp.pad(hidden, ((0, 0), (0, pad), (0, 0)))
        labels = jnp.pad(labels, ((0, 0), (0, pad)))
        weights = jnp.pad(weights, ((0, 0), (0, pad)))

    def split(x: jax.Array) -> jax.Array:  # (B, T, ...) -> (pieces, B, chunk, ...)
        return jnp.moveaxis(x.reshape(b, pieces, chunk, *x.shape[2:]), 1, 0)

    @jax.checkpoint
    def piece(h: jax.Array, y: jax.Array, w: jax.Array) -> tuple[jax.Array, jax.Array]:
        logits = logits_fn(h)
        w = w.astype(jnp.float32)
        losses = optax.softmax_cross_entropy_with_integer_labels(logits, y)
        return jnp.sum(losses * w, axis=-1), jnp.sum((logits.argmax(-1) == y) * w, axis=-1)

    Pair = tuple[jax.Array, jax.Array]

    def step(totals: Pair, xs: tuple[jax.Array, jax.Array, jax.Array]) -> tuple[Pair, None]:
        loss, correct = piece(*xs)
        return (totals[0] + loss, totals[1] + correct), None

    zeros = jnp.zeros((b,), jnp.float32)
    (loss, correct), _ = jax.lax.scan(step, (zeros, zeros), (split(hidden), split(labels), split(weights)))
    count = jnp.maximum(jnp.sum(weights.astype(jnp.float32), axis=-1), 1e-9)
    return loss / count, correct / count
