"""The gated delta rule (Yang, Kautz & Hatamizadeh 2024, "Gated Delta Networks"): the linear
attention of Qwen3.5's Gated DeltaNet layers, in two forms that compute the same thing.

Each value head keeps a state ``S [k_dim, v_dim]``; at token ``t`` with decay ``g_t <= 0``
(log space) and write strength ``beta_t``::

    S = exp(g_t) S                       # forget
    S = S + k_t (beta_t (v_t - k_t S))   # write the part of v_t that S does not predict yet
    o_t = q_t S / sqrt(k_dim)            # read

:func:`recurrent_gated_delta_rule` runs it token by token (``lax.scan``): decoding, one token
per step with its state carried in the generation cache. :func:`chunk_gated_delta_rule` is
the training form: within a chunk of ``C`` tokens the writes are condensed into matrix
products by the UT transform (the inverse of a unit lower-triangular matrix), and a ``lax.scan`` carries the
state from chunk to chunk, so the sequential depth is ``T / C`` instead of ``T``. Both follow
transformers' ``torch_chunk_gated_delta_rule`` / ``torch_recurrent_gated_delta_rule`` (the
flash-linear-attention library's reference), in float32 whatever the inputs' dtype.

Packed rows: with ``segment_ids`` the state starts from zero at each segment's first token,
so a packed sequence computes what it does alone. Nothing is added to the decays (a ``-inf``
at a boundary would turn the in-chunk cumulative sums into ``inf - inf``); instead every
decay factor that would carry information across a boundary is multiplied by zero.

Example:
    >>> q = k = jnp.ones((1, 5, 2, 4)); v = jnp.ones((1, 5, 2, 3))
    >>> g, beta = -jnp.ones((1, 5, 2)), jnp.full((1, 5, 2), 0.5)
    >>> out, state = chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=2)
    >>> out.shape, state.shape
    ((1, 5, 2, 3), (1, 2, 4, 3))
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["chunk_gated_delta_rule", "l2_normalize", "recurrent_gated_delta_rule", "unit_lower_inverse"]


def l2_normalize(x: jax.Array, eps: float = 1e-6) -> jax.Array:
    """``x / sqrt(sum(x^2) + eps)`` over the last axis (the flash-linear-attention library's)."""
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def _heads_first(
    q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array, normalize_qk: bool
) -> tuple[jax.Array, ...]:
    """Float32 ``[B, H, T, ...]`` copies, each query/key head repeated for the value heads it
    serves (consecutive ones, as transformers' ``repeat_interleave``), queries scaled."""
    groups = v.shape[2] // k.shape[2]
    if groups > 1:
        q, k = jnp.repeat(q, groups, axis=2), jnp.repeat(k, groups, axis=2)
    q, k, v = (x.astype(jnp.float32).transpose(0, 2, 1, 3) for x in (q, k, v))
    g, beta = (x.astype(jnp.float32).transpose(0, 2, 1) for x in (g, beta))
    if normalize_qk:
        q, k = l2_normalize(q), l2_normalize(k)
    return q * q.shape[-1] ** -0.5, k, v, g, beta


def unit_lower_inverse(strict: jax.Array) -> jax.Array:
    """``(I + strict)^-1`` for strictly lower-triangular ``strict [..., C, C]``, ``C`` a power
    of two, by recursive block inversion: the diagonal blocks of sizes 1, 2, 4, ... inverted
    two at a time, ``[[A, 0], [B, D]]^-1 = [[A^-1, 0], [-D^-1 B A^-1, D^-1]]``.

    ``log2(C)`` levels of batched matrix products (what a TPU's matrix unit does well) instead
    of a triangular solve's ``C`` dependent steps; it also keeps every array in its default
    layout (XLA:CPU's triangular solve wants its operands transposed, which YNNPACK's fused
    kernels refuse).

    Example:
        >>> strict = jnp.array([[0.0, 0.0], [2.0, 0.0]])
        >>> unit_lower_inverse(strict).tolist()
        [[1.0, 0.0], [-2.0, 1.0]]
    """
    c = strict.shape[-1]
    batch = strict.shape[:-2]
    if c & (c - 1):
        raise ValueError(f"a chunk of {c} tokens: the chunk size must be a power of two (16, 32, 64, ...).")
    inverse = jnp.ones((*batch, c, 1, 1), strict.dtype)  # the 1 x 1 diagonal blocks
    size = 1
    while size < c:
        blocks = c // (2 * size)
        # The diagonal blocks of size 2 * size of the matrix: [..., blocks, 2 size, 2 size].
        tiles = strict.reshape(*batch, blocks, 2 * size, blocks, 2 * size)
        diagonal = jnp.moveaxis(jnp.diagonal(tiles, axis1=-4, axis2=-2), -1, -3)
        pairs = inverse.reshape(*batch, blocks, 2, size, size)
        first, second = pairs[..., 0, :, :], pairs[..., 1, :, :]
        below = -second @ diagonal[..., size:, :size] @ first
        top = jnp.concatenate([first, jnp.zeros_like(first)], axis=-1)
        inverse = jnp.concatenate([top, jnp.concatenate([below, second], axis=-1)], axis=-2)
        size *= 2
    return inverse.reshape(*batch, c, c)


def _initial(b: int, h: int, dk: int, dv: int, initial_state: jax.Array | None) -> jax.Array:
    if initial_state is None:
        return jnp.zeros((b, h, dk, dv), jnp.float32)
    return initial_state.astype(jnp.float32)


def recurrent_gated_delta_rule(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    *,
    initial_state: jax.Array | None = None,
    segment_ids: jax.Array | None = None,
    normalize_qk: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """The gated delta rule one token at a time.

    Args:
        q: queries ``[B, T, Hk, Dk]``.
        k: keys ``[B, T, Hk, Dk]``.
        v: values ``[B, T, H, Dv]``; ``H`` a multiple of ``Hk`` (each query/key head serves
            ``H / Hk`` consecutive value heads).
        g: log decays ``[B, T, H]`` (``<= 0``).
        beta: write strengths ``[B, T, H]`` (in ``(0, 1)``).
        initial_state: the state before the first token ``[B, H, Dk, Dv]`` (zeros if None).
        segment_ids: ``[B, T]`` packed segments: the state is zeroed where the id changes.
        normalize_qk: L2-normalize queries and keys first (Qwen3.5 does).

    Returns:
        The outputs ``[B, T, H, Dv]`` in ``q``'s dtype and the final state (float32).
    """
    dtype = q.dtype
    q, k, v, g, beta = _heads_first(q, k, v, g, beta, normalize_qk)
    b, h, t, dk = k.shape
    state = _initial(b, h, dk, v.shape[-1], initial_state)
    if segment_ids is None:
        keep = jnp.ones((b, t), jnp.float32)
    else:
        keep = jnp.pad(segment_ids[:, 1:] == segment_ids[:, :-1], ((0, 0), (1, 0)), constant_values=True)
        keep = keep.astype(jnp.float32)

    def step(state: jax.Array, xs: tuple[jax.Array, ...]) -> tuple[jax.Array, jax.Array]:
        q_t, k_t, v_t, g_t, beta_t, keep_t = xs  # [B, H, D], [B, H], [B]
        state = state * (jnp.exp(g_t) * keep_t[:, None])[..., None, None]
        predicted = jnp.einsum("bhk,bhkv->bhv", k_t, state)
        state = state + k_t[..., None] * ((v_t - predicted) * beta_t[..., None])[..., None, :]
        return state, jnp.einsum("bhk,bhkv->bhv", q_t, state)

    time_first = (q.transpose(2, 0, 1, 3), k.transpose(2, 0, 1, 3), v.transpose(2, 0, 1, 3))
    state, out = jax.lax.scan(step, state, (*time_first, g.transpose(2, 0, 1), beta.transpose(2, 0, 1), keep.T))
    return out.transpose(1, 0, 2, 3).astype(dtype), state


def chunk_gated_delta_rule(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    *,
    chunk_size: int = 64,
    initial_state: jax.Array | None = None,
    segment_ids: jax.Array | None = None,
    normalize_qk: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """The gated delta rule in chunks of ``chunk_size`` tokens (the training form).

    Takes and returns what :func:`recurrent_gated_delta_rule` does. The sequence is padded
    to a multiple of ``chunk_size`` (padding writes nothing and decays nothing). Memory
    beyond the inputs: ``[B, H, T, C]`` for the in-chunk products; the scan's carry is one
    state ``[B, H, Dk, Dv]``.
    """
    dtype = q.dtype
    q, k, v, g, beta = _heads_first(q, k, v, g, beta, normalize_qk)
    b, h, t, dk = k.shape
    dv = v.shape[-1]
    c = chunk_size
    pad = -t % c
    n = (t + pad) // c
    segments = jnp.zeros((b, t), jnp.int32) if segment_ids is None else segment_ids.astype(jnp.int32)
    # Padding at the end: zero keys, values, decays and strengths leave the state as it is;
    # it continues the last segment so that nothing resets it.
    q, k, v = (jnp.pad(x, ((0, 0), (0, 0), (0, pad), (0, 0))) for x in (q, k, v))
    g, beta = (jnp.pad(x, ((0, 0), (0, 0), (0, pad))) for x in (g, beta))
    segments = jnp.pad(segments, ((0, 0), (0, pad)), mode="edge")

    q, k, v = (x.reshape(b, h, n, c, x.shape[-1]) for x in (q, k, v))  # [B, H, N, C, D]
    g, beta = (x.reshape(b, h, n, c) for x in (g, beta))
    seg = segments.reshape(b, n, c)
    # The segment the state entering each chunk belongs to: the previous chunk's last token's
    # (the first chunk's: its first token's, so that an initial state carries into it).
    before = jnp.concatenate([seg[:, :1, 0], seg[:, :-1, -1]], axis=1)  # [B, N]
    same = (seg[:, :, :, None] == seg[:, :, None, :])[:, None]  # [B, 1, N, C, C]
    from_state = (seg == before[:, :, None])[:, None]  # [B, 1, N, C]: still the entering state's segment
    to_end = (seg == seg[:, :, -1:])[:, None]  # [B, 1, N, C]: in the chunk's last segment

    k_beta, v_beta = k * beta[..., None], v * beta[..., None]
    cum = jnp.cumsum(g, axis=-1)  # [B, H, N, C]: log decay from the chunk's start to each token
    lower = jnp.tril(jnp.ones((c, c), bool))[None, None, None]  # [1, 1, 1, C, C]
    # exp(cum_i - cum_j) for j <= i in one segment, else 0 (masked before exp: above the
    # diagonal the difference is positive and could overflow).
    diff = cum[..., :, None] - cum[..., None, :]
    decay = jnp.exp(jnp.where(lower & same, diff, -jnp.inf))  # [B, H, N, C, C]
    system = jnp.einsum("bhncd,bhnsd->bhncs", k_beta, k) * decay
    intra = jnp.einsum("bhncd,bhnsd->bhncs", q, k) * decay
    entering = jnp.where(from_state, jnp.exp(cum), 0.0)  # decay of the entering state at each token

    # The UT transform: (I + strictly_lower(system))^-1 applied to both right sides.
    inverse = unit_lower_inverse(jnp.where(jnp.tril(lower, -1), system, 0.0))
    new_values = jnp.einsum("bhncs,bhnsd->bhncd", inverse, v_beta)
    k_decayed = jnp.einsum("bhncs,bhnsd->bhncd", inverse, k_beta * entering[..., None])

    q_read = q * entering[..., None]
    k_write = k * jnp.where(to_end, jnp.exp(cum[..., -1:] - cum), 0.0)[..., None]
    chunk_decay = jnp.where(to_end[..., -1] & from_state[..., -1], jnp.exp(cum[..., -1]), 0.0)  # [B, H, N]

    def step(state: jax.Array, xs: tuple[jax.Array, ...]) -> tuple[jax.Array, jax.Array]:
        q_c, k_c, u_c, w_c, attn_c, decay_c = xs
        v_new = u_c - jnp.einsum("bhcd,bhdv->bhcv", w_c, state)  # what the entering state does not predict
        out = jnp.einsum("bhcd,bhdv->bhcv", q_c, state) + jnp.einsum("bhcs,bhsv->bhcv", attn_c, v_new)
        state = state * decay_c[..., None, None] + jnp.einsum("bhcd,bhcv->bhdv", k_c, v_new)
        return state, out

    chunks = (q_read, k_write, new_values, k_decayed, intra)
    xs = (*(jnp.moveaxis(x, 2, 0) for x in chunks), jnp.moveaxis(chunk_decay, 2, 0))
    state, out = jax.lax.scan(step, _initial(b, h, dk, dv, initial_state), xs)  # out: [N, B, H, C, Dv]
    out = out.transpose(1, 0, 3, 2, 4).reshape(b, n * c, h, dv)[:, :t]
    return out.astype(dtype), state
