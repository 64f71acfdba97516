"""cuDNN's flash attention over packed rows (GPUs): the segments of a row attend causally to
themselves alone, as :func:`xlafit.models.attention.attention` with a segment mask computes,
without the ``[B, heads, T, T]`` scores in HBM.

``jax.nn.dot_product_attention(implementation="cudnn")`` takes one sequence per row (its
lengths are padding); packed rows need cuDNN's packed layout (each segment's start and
length), which JAX's cuDNN module takes (``q_offsets``, ``kv_offsets``) but does not export
from ``jax.nn``: it is imported from there, bfloat16 or float16 only, on a GPU with cuDNN 9.
"""

from __future__ import annotations

import jax

from xlafit.models.attention import packed_segments_limit, segment_offsets

__all__ = ["packed_flash_attention"]


def packed_flash_attention(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array, scale: float) -> jax.Array:
    """Causal attention inside each segment of packed rows: queries ``[B, T, H, D]``, keys
    and values ``[B, T, KV, D]`` (KV dividing H), ``segment_ids [B, T]`` as
    :func:`xlafit.data.shapes.pack` makes them, at most
    :func:`~xlafit.models.attention.packed_segments_limit` segments a row (the llm recipe
    checks its data)."""
    # JAX's own module, not exported: imported where it is used, so that a JAX without it
    # fails only this path (no cycle: it imports nothing of xlafit's).
    from jax._src.cudnn.fused_attention_stablehlo import MaskType, dot_product_attention

    starts, lengths = segment_offsets(segment_ids, packed_segments_limit(q.shape[1]))
    return dot_product_attention(
        q,
        k,
        v,
        q_seqlen=lengths,
        kv_seqlen=lengths,
        q_offsets=starts,
        kv_offsets=starts,
        scale=scale,
        mask_type=MaskType.PADDING_CAUSAL,
        qkv_layout="BTNH",
    )
