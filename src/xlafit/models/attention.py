"""Attention pieces the decoder families share: rotary position embeddings (Hugging Face's
conventions, Llama 3's and linear scaling) and attention over explicit masks with a scale,
a logit soft-cap (Gemma 2) and grouped-query heads, in float32 scores as ``transformers``'
eager implementation computes them.

Example:
    >>> causal_mask(4, window=2).astype(int).tolist()[3]
    [0, 0, 1, 1]
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from xlafit.models.llama_config import LlamaConfig

__all__ = [
    "apply_rope",
    "attention",
    "causal_mask",
    "packed_segments_limit",
    "rope_frequencies",
    "rotate_half",
    "segment_offsets",
]


def rope_frequencies(cfg: LlamaConfig, local: bool = False, head_dim: int | None = None) -> np.ndarray:
    """The rotary inverse frequencies (float32) of a head of ``head_dim`` (default the
    config's), Llama 3's or linear scaling applied; a sliding layer of Gemma 3 or 4 (``local``)
    has its own base, no scaling and turns the whole head.

    ``partial_rotary_factor`` below 1 turns part of the head: ``[rotary_dim / 2]`` frequencies
    for the first ``rotary_dim`` (``head_dim`` times the factor) dimensions, spaced over them
    (Qwen3.5; :func:`apply_rope` passes the rest), or with ``rope_type="proportional"``
    (Gemma 4's global layers) ``[head_dim / 2]`` frequencies spaced over the whole head, the
    first that share of the pairs turning and the others at frequency 0 (kept where they are).

    Computed as Hugging Face does (``_compute_default_rope_parameters``,
    ``_compute_llama3_parameters``, ``_compute_linear_scaling_rope_parameters``,
    ``_compute_proportional_rope_parameters``), in float32, so the angles agree bit for bit.
    """
    head = head_dim or cfg.head_size
    share = 1.0 if local else cfg.partial_rotary_factor
    theta = cfg.rope_local_theta if local and cfg.rope_local_theta else cfg.rope_theta
    if cfg.rope_type == "proportional" and not local:
        turned = int(share * head // 2)
        inv_freq = (1.0 / (theta ** (np.arange(0, 2 * turned, 2).astype(np.float32) / head))).astype(np.float32)
        inv_freq = np.concatenate([inv_freq, np.zeros(head // 2 - turned, np.float32)])
        return (inv_freq / np.float32(cfg.rope_factor)).astype(np.float32)
    d = int(head * share)
    inv_freq = (1.0 / (theta ** (np.arange(0, d, 2).astype(np.float32) / d))).astype(np.float32)
    if cfg.rope_type == "default" or (local and cfg.rope_local_theta):
        return inv_freq
    if cfg.rope_type == "linear":
        return (inv_freq / np.float32(cfg.rope_factor)).astype(np.float32)
    factor, low, high = cfg.rope_factor, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor
    old = cfg.rope_original_max_position_embeddings
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > old / low, inv_freq / factor, inv_freq)  # long waves: stretched
    smooth = (old / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old / high) & ~(wavelen > old / low)  # between: interpolated
    return np.where(medium, smoothed, scaled).astype(np.float32)


def rotate_half(x: jax.Array) -> jax.Array:
    """Hugging Face's rotation: halves ``(x1, x2) -> (-x2, x1)`` (not interleaved pairs)."""
    x1, x2 = jnp.split(x, 2, axis=-1)
    return jnp.concatenate([-x2, x1], axis=-1)


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: np.ndarray) -> jax.Array:
    """Rotates ``x [B, T, heads, head_dim]`` by the angles of ``positions [B, T]``: its first
    ``2 * len(inv_freq)`` dimensions, the rest as they are (a partial rotary factor).

    The angles are float32 (bf16 positions past 256 would round), cos and sin are cast to
    ``x``'s dtype before the products, as in Hugging Face.
    """
    rotary = 2 * len(inv_freq)
    if rotary < x.shape[-1]:
        return jnp.concatenate([apply_rope(x[..., :rotary], positions, inv_freq), x[..., rotary:]], axis=-1)
    freqs = positions.astype(jnp.float32)[:, :, None] * jnp.asarray(inv_freq)[None, None, :]  # (B, T, d/2)
    angles = jnp.concatenate([freqs, freqs], axis=-1)[:, :, None, :]  # (B, T, 1, d)
    cos, sin = jnp.cos(angles).astype(x.dtype), jnp.sin(angles).astype(x.dtype)
    return x * cos + rotate_half(x) * sin


def causal_mask(length: int, window: int | None = None) -> np.ndarray:
    """``[T, T]`` booleans: query ``i`` sees key ``j`` when ``j <= i`` (and ``i - j <
    window``)."""
    i, j = np.arange(length)[:, None], np.arange(length)[None, :]
    return (j <= i) & ((i - j < window) if window else True)


def attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    mask: jax.Array,
    scale: float,
    softcap: float | None = None,
) -> jax.Array:
    """``softmax(cap(q k^T scale) + mask) v``: queries ``[B, T, H, D]``, keys and values
    ``[B, S, KV, D]`` (KV dividing H), ``mask [B or 1, 1, T, S]`` (True: attend). Scores in
    float32; a row that sees no key gives zeros' average (never NaN)."""
    b, t, h, d = q.shape
    kv = k.shape[2]
    q = q.reshape(b, t, kv, h // kv, d)
    scores = jnp.einsum("btkgd,bskd->bkgts", q, k, preferred_element_type=jnp.float32) * scale
    if softcap:
        scores = jnp.tanh(scores / softcap) * softcap
    scores = jnp.where(mask[:, :, None], scores, jnp.finfo(jnp.float32).min)  # (B, KV, G, T, S)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    return jnp.einsum("bkgts,bskd->btkgd", probs, v).reshape(b, t, h, d)


def default_scale(cfg: LlamaConfig, head_dim: int | None = None) -> float:
    """``1 / sqrt(head_dim)`` (the layer's, default the config's), or Gemma's
    ``query_pre_attn_scalar ** -0.5`` (Gemma 4's is 1: its queries and keys are normed)."""
    return 1.0 / math.sqrt(cfg.query_pre_attn_scalar or head_dim or cfg.head_size)


def packed_segments_limit(seq_len: int) -> int:
    """How many segments a packed row of ``seq_len`` tokens may hold for cuDNN's packed
    attention (:func:`segment_offsets`: a static bound, one slot per segment)."""
    return max(1, seq_len // 4)


def segment_offsets(segment_ids: jax.Array, max_segments: int) -> tuple[jax.Array, jax.Array]:
    """Rows packed as :func:`xlafit.data.shapes.pack` packs them (segments ``1, 2, ...`` one
    after another from the row's start, ``0`` for the padding after them) in cuDNN's packed
    layout: each row's segment starts ``[B, max_segments + 1]`` and lengths ``[B,
    max_segments]``, ``-1`` past its last segment.

    Example:
        >>> starts, lengths = segment_offsets(jnp.array([[1, 1, 2, 2, 2, 0]]), 3)
        >>> starts.tolist(), lengths.tolist()
        ([[0, 2, -1, -1]], [[2, 3, -1]])
    """
    ids = jnp.arange(1, max_segments + 1, dtype=segment_ids.dtype)
    lengths = jnp.sum(segment_ids[:, :, None] == ids[None, None, :], axis=1, dtype=jnp.int32)  # (B, M)
    starts = jnp.cumsum(lengths, axis=1, dtype=jnp.int32) - lengths
    present = lengths > 0
    none = jnp.full((segment_ids.shape[0], 1), -1, jnp.int32)
    starts = jnp.concatenate([jnp.where(present, starts, -1), none], axis=1)
    return starts, jnp.where(present, lengths, -1)
