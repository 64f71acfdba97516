"""Losses and metrics over padded, fixed-shape batches: weighted means over valid positions.

Static shapes mean padding: padded tokens, the empty slots of a fixed number of masked
positions, padding rows of a last batch. The rule (XLA rule 2 of the TPU guides) is to
compute everywhere and weight by a mask, never to index with a boolean mask, whose result
has a data-dependent shape.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from xlafit.data.clm import next_token_targets
from xlafit.models.quantized_embed import QuantizedKernel

# ``(model, rows, temperature) -> [R, T - 1]``: each row's next tokens' log-probabilities
# (:func:`next_token_targets` of ``rows``' ``input_ids`` and ``segment_ids``) under the model's
# logits divided by ``temperature``: how the preference and GRPO objectives get theirs
# (:func:`whole_token_logps`, or a recipe's that computes the logits in blocks).
TokenLogps = Callable[[Any, dict[str, jax.Array], float], jax.Array]


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


def token_logps_of(logits: jax.Array, labels: jax.Array, temperature: float = 1.0) -> jax.Array:
    """Each position's log-probability ``[...]`` of its label under ``logits [..., V] / temperature``."""
    scaled = logits if temperature == 1.0 else logits / temperature
    return -optax.softmax_cross_entropy_with_integer_labels(scaled, labels)


def whole_token_logps(model: Any, rows: dict[str, jax.Array], temperature: float = 1.0) -> jax.Array:
    """A :data:`TokenLogps` from the whole float32 logits ``[R, T, V]`` of
    ``model(input_ids, segment_ids, positions)``."""
    targets, _ = next_token_targets(rows["input_ids"], rows["segment_ids"])
    logits = model(rows["input_ids"], rows["segment_ids"], rows["positions"])
    return token_logps_of(logits[:, :-1], targets, temperature)


# --------------------------------------------------------------------------- an evaluation's rows

_EVALUATED_ROWS: contextvars.ContextVar[jax.Array | None] = contextvars.ContextVar("xlafit_eval_rows", default=None)


@contextlib.contextmanager
def evaluating_rows(mask: jax.Array) -> Iterator[None]:
    """While an eval step's loss is traced: ``mask`` ``[B]`` (1 for an example, 0 for a row
    that pads the last partial batch, which the step weighs 0) is :func:`evaluated_rows`'s."""
    token = _EVALUATED_ROWS.set(mask)
    try:
        yield
    finally:
        _EVALUATED_ROWS.reset(token)


def evaluated_rows() -> jax.Array | None:
    """The rows an evaluation counts (``[B]``, 0 for padding rows), while its loss is traced,
    else None: for a loss whose batch-wide statistics (a router's tokens per expert) would
    otherwise count the padding rows, which the per-row weights leave out of everything else."""
    return _EVALUATED_ROWS.get()


# --------------------------------------------------------------------------- the loss in blocks

# A block of logits the blockwise loss holds at once: rows (positions x rows of the batch)
# times vocabulary columns, float32. The backward pass holds about three such blocks (the
# logits, their softmax, its gradient in the compute dtype).
BLOCK_BYTES = 256 * 2**20
# Rows of a block: enough that each pass over the output layer's kernel (read once per
# chunk of positions) feeds a large matrix product.
BLOCK_ROWS = 4096
LANES = 128  # a vocabulary tile is a multiple of this (the TPU's vector width), unless the vocabulary is smaller


def whole_logits_bytes(rows: int, seq_len: int, vocab: int) -> int:
    """Bytes of a batch's float32 logits ``[rows, seq_len, vocab]`` and their gradient: what
    the whole cross-entropy holds at once, and the blockwise one never does."""
    return 2 * rows * seq_len * vocab * 4


def blocks_for(rows: int, seq_len: int, vocab: int, chunk: int | None = None) -> tuple[int, int]:
    """``(positions per chunk, vocabulary columns per tile)`` of :func:`blockwise_cross_entropy`
    for a batch of ``rows`` sequences of ``seq_len`` positions over ``vocab`` columns.

    ``chunk`` (the positions per chunk) is given, or chosen so that a chunk has
    :data:`BLOCK_ROWS` rows (positions times sequences, at most the whole sequence); the
    vocabulary is split into tiles (a multiple of :data:`LANES` columns) only where one chunk's
    float32 logits would exceed :data:`BLOCK_BYTES`: Llama 3's 128,256 columns or Gemma's 262,144
    at 4,096 rows, not a 32,000-token vocabulary at 2,048.

    Example:
        >>> blocks_for(rows=1, seq_len=8192, vocab=262144)  # Gemma: 4,096 positions, 16 tiles
        (4096, 16384)
        >>> blocks_for(rows=8, seq_len=256, vocab=2000)  # the demo: one chunk, one tile
        (256, 2000)
    """
    if chunk is None:
        chunk = max(1, BLOCK_ROWS // rows)
    chunk = min(chunk, seq_len)
    tiles = -(-rows * chunk * vocab * 4 // BLOCK_BYTES)
    if tiles <= 1:
        return chunk, vocab
    tile = -(-vocab // tiles)
    return chunk, min(vocab, -(-tile // LANES) * LANES)


def blockwise_cross_entropy(
    hidden: jax.Array,
    kernel: jax.Array | QuantizedKernel,
    labels: jax.Array,
    weights: jax.Array,
    *,
    chunk: int,
    tile: int | None = None,
    softcap: float | None = None,
    dtype: Any = None,
    layout: Callable[[jax.Array], jax.Array] | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Per-row weighted mean cross-entropy and accuracy of the logits ``hidden @ kernel``
    against ``labels``, never holding the ``[B, T, V]`` logits.

    The logits go in blocks of ``chunk`` positions by ``tile`` vocabulary columns: a block is
    computed, folded into a running maximum and sum of exponentials per position (an online
    logsumexp), the label's logit and the running arg-max, and dropped. The backward pass (a
    custom VJP) recomputes each block from ``hidden``, ``kernel`` and the saved logsumexp
    ``[B, T]``, so no logits outlive their block: memory ``O(B x chunk x tile)`` instead of
    ``O(B x T x V)``, for one more product with the output layer's kernel. Soft-capping
    (Gemma 2's ``cap * tanh(logits / cap)``) is applied to every block and differentiated
    exactly. Equal to the whole computation (``masked_mean`` of
    ``optax.softmax_cross_entropy_with_integer_labels`` and :func:`masked_accuracy`) up to
    float summation order, the gradients with respect to ``hidden`` and ``kernel`` too (tested).

    Args:
        hidden: final hidden states ``[B, T, H]``.
        kernel: the output layer ``[H, V]`` (a tied embedding's transpose), or a quantized
            table's (:class:`~xlafit.models.quantized_embed.QuantizedKernel`: each tile's
            columns dequantized as the tile is computed, again in the backward pass; frozen,
            its gradient zero).
        labels: ``[B, T]`` integer targets.
        weights: ``[B, T]`` (0 for padding and positions the loss skips).
        chunk: positions per block (any; the last block is padded).
        tile: vocabulary columns per block (default: all of them; any, the last tile
            overlaps the one before it rather than reading past the end).
        softcap: the logits' soft-cap, or None.
        dtype: the product's dtype (the model's compute dtype); default ``hidden``'s. The
            logits are float32 after it.
        layout: applied to every block of logits ``[B, chunk, tile]`` (a sharding hint).

    Returns:
        ``(loss [B], accuracy [B])``: each row's weighted means (0 for a row of no weight).

    Example:
        >>> h, k = jnp.ones((2, 5, 4)), jnp.ones((4, 7))
        >>> loss, accuracy = blockwise_cross_entropy(h, k, jnp.zeros((2, 5), jnp.int32), jnp.ones((2, 5)), chunk=2)
        >>> [round(float(x), 4) for x in loss]  # seven equal logits: log 7
        [1.9459, 1.9459]
    """
    w = weights.astype(jnp.float32)
    nll, correct = _per_position(hidden, kernel, labels, chunk, tile, softcap, dtype, layout)
    count = jnp.maximum(jnp.sum(w, axis=-1), 1e-9)
    return jnp.sum(nll * w, axis=-1) / count, jnp.sum(correct * w, axis=-1) / count


def blockwise_token_logps(
    hidden: jax.Array,
    kernel: jax.Array | QuantizedKernel,
    labels: jax.Array,
    *,
    chunk: int,
    tile: int | None = None,
    softcap: float | None = None,
    dtype: Any = None,
    layout: Callable[[jax.Array], jax.Array] | None = None,
    temperature: float = 1.0,
) -> jax.Array:
    """Each position's log-probability ``[B, T]`` of its label under the logits
    ``hidden @ kernel`` (soft-capped, then divided by ``temperature``), in the blocks of
    :func:`blockwise_cross_entropy` (the same computation: minus its per-position loss), never
    holding the ``[B, T, V]`` logits; what the preference and GRPO objectives sum or weigh per
    token. Equal to ``-optax.softmax_cross_entropy_with_integer_labels(logits / temperature,
    labels)`` up to float summation order, its gradients too (tested). Arguments as
    :func:`blockwise_cross_entropy`'s.

    Example:
        >>> h, k = jnp.ones((1, 3, 4)), jnp.ones((4, 7))
        >>> logps = blockwise_token_logps(h, k, jnp.zeros((1, 3), jnp.int32), chunk=2)
        >>> [round(float(x), 4) for x in logps[0]]  # seven equal logits: -log 7
        [-1.9459, -1.9459, -1.9459]
    """
    nll, _ = _per_position(hidden, kernel, labels, chunk, tile, softcap, dtype, layout, temperature)
    return -nll


def _per_position(
    hidden: jax.Array,
    kernel: jax.Array | QuantizedKernel,
    labels: jax.Array,
    chunk: int,
    tile: int | None,
    softcap: float | None,
    dtype: Any,
    layout: Callable[[jax.Array], jax.Array] | None,
    temperature: float = 1.0,
) -> tuple[jax.Array, jax.Array]:
    """Each position's cross-entropy and whether its arg-max is the label (float32), ``[B, T]``,
    a block at a time (:func:`blockwise_cross_entropy`)."""
    b, t, _ = hidden.shape
    vocab = kernel.shape[1]
    chunk, tile = min(chunk, t), min(tile or vocab, vocab)
    pieces = -(-t // chunk)
    if pieces * chunk > t:  # padded positions are cut off again below
        pad = pieces * chunk - t
        hidden = jnp.pad(hidden, ((0, 0), (0, pad), (0, 0)))
        labels = jnp.pad(labels, ((0, 0), (0, pad)))

    def split(x: jax.Array) -> jax.Array:  # (B, T, ...) -> (pieces, B, chunk, ...)
        return jnp.moveaxis(x.reshape(b, pieces, chunk, *x.shape[2:]), 1, 0)

    def join(x: jax.Array) -> jax.Array:  # (pieces, B, chunk) -> (B, T)
        return jnp.moveaxis(x, 0, 1).reshape(b, pieces * chunk)[:, :t]

    blocks = _Blocks(tile, -(-vocab // tile), softcap, dtype or hidden.dtype, layout or (lambda z: z), temperature)
    nll, correct = _blockwise(blocks, split(hidden), kernel, split(labels))
    return join(nll), join(correct)


@dataclasses.dataclass(frozen=True)
class _Blocks:
    """How :func:`blockwise_cross_entropy` tiles the vocabulary and computes a block."""

    tile: int
    tiles: int
    softcap: float | None
    dtype: Any
    layout: Callable[[jax.Array], jax.Array]
    temperature: float = 1.0

    def columns(
        self, kernel: jax.Array | QuantizedKernel, j: jax.Array
    ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
        """Tile ``j`` of ``kernel [H, V]``: ``(kernel [H, tile], its first column, column ids
        [1, 1, tile], fresh [1, 1, tile])``. The last tile starts early enough to end at
        ``V``; the columns it shares with the tile before are not ``fresh`` (counted there).
        A quantized kernel's tile is dequantized here, once per tile and pass (the chunks of
        positions reuse it): ``[H, tile]`` in the compute dtype at a time, the whole table only
        where one tile is the whole vocabulary (a vocabulary small enough, or split over a
        tensor-parallel mesh axis)."""
        start = jnp.minimum(j * self.tile, kernel.shape[1] - self.tile)
        cols = (start + jnp.arange(self.tile))[None, None, :]
        if isinstance(kernel, QuantizedKernel):
            k = kernel.columns(start, self.tile, self.dtype)
        else:
            k = jax.lax.dynamic_slice_in_dim(kernel, start, self.tile, axis=1)
        return k, start, cols, cols >= j * self.tile

    def logits(self, h: jax.Array, k: jax.Array) -> jax.Array:
        """Float32 logits ``[B, chunk, tile]`` of ``h [B, chunk, H]``, capped where the model caps
        them, divided by the temperature."""
        z = jnp.einsum("bch,hv->bcv", h.astype(self.dtype), k.astype(self.dtype)).astype(jnp.float32)
        if self.softcap:
            z = jnp.tanh(z / self.softcap) * self.softcap
        if self.temperature != 1.0:
            z = z / self.temperature
        return self.layout(z)

    def product_gradient(self, z: jax.Array, dz: jax.Array) -> jax.Array:
        """The gradient with respect to the product ``h @ k`` from that with respect to
        :meth:`logits`'s ``z``: through the temperature, then the soft-cap's ``1 - (z / cap)^2``."""
        if self.temperature != 1.0:
            dz = dz / self.temperature
            z = z * self.temperature
        if self.softcap:
            dz = dz * (1.0 - jnp.square(z / self.softcap))
        return dz


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _blockwise(
    blocks: _Blocks, hs: jax.Array, kernel: jax.Array | QuantizedKernel, ys: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Each position's loss and whether its arg-max is the label ``[n, B, c]``, from ``hs [n, B, c, H]``."""
    (nll, correct), _ = _forward(blocks, hs, kernel, ys)
    return nll, correct


def _forward(
    blocks: _Blocks, hs: jax.Array, kernel: jax.Array | QuantizedKernel, ys: jax.Array
) -> tuple[tuple[jax.Array, jax.Array], jax.Array]:
    """Over the vocabulary's tiles (the kernel read once), each tile over the chunks of
    positions: per position the running max ``m``, sum ``s`` of ``exp(z - m)``, label logit
    and arg-max. Returns the per-position loss and hits and the logsumexp ``[n, B, c]``."""
    Stats = tuple[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array]

    def tile_step(stats: Stats, j: jax.Array) -> tuple[Stats, None]:
        k, start, cols, fresh = blocks.columns(kernel, j)

        def chunk_step(_: None, xs: tuple[jax.Array, ...]) -> tuple[None, Stats]:
            h, y, m, s, zy, best, arg = xs
            z = jnp.where(fresh, blocks.logits(h, k), -jnp.inf)  # (B, c, tile)
            top = z.max(-1)
            m_new = jnp.maximum(m, top)
            s = s * jnp.exp(m - m_new) + jnp.exp(z - m_new[..., None]).sum(-1)
            hit = (cols == y[..., None]) & fresh  # a label's column is fresh in one tile only
            zy = zy + jnp.where(hit, z, 0.0).sum(-1)
            better = top > best  # ties keep the earlier column, as argmax does
            arg = jnp.where(better, start + jnp.argmax(z, -1).astype(jnp.int32), arg)
            return None, (m_new, s, zy, jnp.maximum(best, top), arg)

        _, stats = jax.lax.scan(chunk_step, None, (hs, ys, *stats))
        return stats, None

    shape = ys.shape
    minus = jnp.full(shape, -jnp.inf, jnp.float32)
    zeros = jnp.zeros(shape, jnp.float32)
    init = (minus, zeros, zeros, minus, jnp.zeros(shape, jnp.int32))
    (m, s, zy, _, arg), _ = jax.lax.scan(tile_step, init, jnp.arange(blocks.tiles))
    lse = m + jnp.log(s)
    return (lse - zy, (arg == ys).astype(jnp.float32)), lse


def _blockwise_fwd(
    blocks: _Blocks, hs: jax.Array, kernel: jax.Array | QuantizedKernel, ys: jax.Array
) -> tuple[tuple[jax.Array, jax.Array], tuple[Any, ...]]:
    out, lse = _forward(blocks, hs, kernel, ys)
    return out, (hs, kernel, ys, lse)


def _blockwise_bwd(
    blocks: _Blocks, residuals: tuple[Any, ...], cotangents: tuple[jax.Array, jax.Array]
) -> tuple[jax.Array, Any, None]:
    """Each block recomputed: ``d loss / d z = (softmax(z) - onehot(label)) x the position's
    cotangent`` (the hits have none), through the temperature and the soft-cap's
    ``1 - (z / cap)^2`` (:meth:`_Blocks.product_gradient`), then
    into ``hidden`` and ``kernel`` in the compute dtype with float32 sums, as autodiff of the
    whole computation does. A quantized kernel is frozen: its gradient is zero, not computed."""
    hs, kernel, ys, lse = residuals
    coef = cotangents[0]  # (n, B, c)
    frozen = isinstance(kernel, QuantizedKernel)

    def tile_step(carry: tuple[jax.Array, Any], j: jax.Array) -> tuple[tuple[jax.Array, Any], None]:
        dhs, dkernel = carry
        k, start, cols, fresh = blocks.columns(kernel, j)
        k_dt = k.astype(blocks.dtype)

        def chunk_step(dk: Any, xs: tuple[jax.Array, ...]) -> tuple[Any, jax.Array]:
            h, y, lse_c, coef_c = xs
            z = blocks.logits(h, k)
            p = jnp.where(fresh, jnp.exp(z - lse_c[..., None]), 0.0)
            dz = (p - ((cols == y[..., None]) & fresh)) * coef_c[..., None]
            du = blocks.product_gradient(z, dz).astype(blocks.dtype)
            dh = jnp.einsum("bcv,hv->bch", du, k_dt, preferred_element_type=jnp.float32)
            if not frozen:
                dk = dk + jnp.einsum("bch,bcv->hv", h.astype(blocks.dtype), du, preferred_element_type=jnp.float32)
            return dk, dh

        dk: Any
        dk, dh = jax.lax.scan(chunk_step, None if frozen else jnp.zeros(k.shape, jnp.float32), (hs, ys, lse, coef))
        if not frozen:  # the shared columns of the last tile hold 0 here: added, not written over
            seen = jax.lax.dynamic_slice_in_dim(dkernel, start, blocks.tile, axis=1)
            dkernel = jax.lax.dynamic_update_slice_in_dim(dkernel, seen + dk, start, axis=1)
        return (dhs + dh, dkernel), None

    init = (jnp.zeros(hs.shape, jnp.float32), None if frozen else jnp.zeros(kernel.shape, jnp.float32))
    dkernel: Any
    (dhs, dkernel), _ = jax.lax.scan(tile_step, init, jnp.arange(blocks.tiles))
    if frozen:
        return dhs.astype(hs.dtype), jax.tree.map(_zero_cotangent, kernel), None
    return dhs.astype(hs.dtype), dkernel.astype(kernel.dtype), None


def _zero_cotangent(x: jax.Array) -> Any:
    """A zero cotangent of ``x``: float0 for integer codes, as JAX requires."""
    if jnp.issubdtype(x.dtype, jnp.inexact):
        return jnp.zeros_like(x)
    return np.zeros(x.shape, jax.dtypes.float0)


_blockwise.defvjp(_blockwise_fwd, _blockwise_bwd)
