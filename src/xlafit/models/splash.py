"""Causal attention on TPUs with splash attention, JAX's Pallas flash-attention kernel.

XLA's attention materialises each layer's ``[heads, T, T]`` scores (and their gradient):
at a sequence of 8192 that is 8 GiB per sequence and layer in float32, more than a v6e
core holds beside an 8B model. Splash attention (``jax.experimental.pallas.ops.tpu.
splash_attention``, the kernel MaxText runs) streams blocks of keys past each block of
queries and keeps only a running maximum and sum, so memory grows linearly with the
sequence, and it skips the blocks the causal mask hides.

The kernel runs per shard: inside a training step it is wrapped in ``shard_map`` over the
step's mesh (:func:`xlafit.parallel.sharding.active_layout`), the batch split over
``data`` x ``fsdp`` and the heads over the axis that the rules give ``heads`` (when both
the query and the key/value heads divide over it). Packed rows pass their segment ids: a
token attends only within its own segment, as with the XLA path's mask.

XLA's cost analysis cannot see inside a Pallas kernel (a custom call), so ``check`` and
``plan`` add the kernel's FLOPs from :func:`xlafit.predict.hlo.kernel_flops`.
"""

from __future__ import annotations

import functools
import math
import typing

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as masks
from jax.sharding import PartitionSpec

from xlafit.parallel.sharding import active_layout, batch_axes

BLOCKS = (512, 256, 128)  # the kernel's tile along the sequence: the largest that divides it


def block_size(seq_len: int) -> int | None:
    """The kernel's tile for ``seq_len`` (a multiple of 128), or None when none divides it."""
    return next((b for b in BLOCKS if seq_len % b == 0), None)


def unsupported(seq_len: int, head_size: int) -> str | None:
    """Why splash attention cannot run these shapes, or None when it can."""
    if block_size(seq_len) is None:
        return f"the sequence length {seq_len} is not a multiple of 128 (pad data.seq_len up to one)"
    if head_size % 64:
        return f"the head size {head_size} is not a multiple of 64"
    return None


def on_tpu() -> bool:
    """True while a step is traced for TPU devices (a real slice, or a ``check``/``plan``
    target compiled by libtpu on the CPU)."""
    layout = active_layout()
    if layout is None:
        return jax.default_backend() == "tpu"
    return layout[0].devices.flat[0].platform == "tpu"


@functools.cache
def _kernel(
    seq_len: int, heads: int, interpret: bool, window: int | None = None, softcap: float | None = None
) -> splash.SplashAttentionKernel:
    block = block_size(seq_len)
    assert block is not None
    sizes = splash.BlockSizes(
        block_q=block,
        block_kv=block,
        block_kv_compute=block,
        block_q_dkv=block,
        block_kv_dkv=block,
        block_kv_dkv_compute=block,
        block_q_dq=block,
        block_kv_dq=block,
    )
    # Causal, or causal within a window: a query sees itself and the window - 1 keys before it.
    one = (
        masks.LocalMask((seq_len, seq_len), window_size=(window - 1, 0), offset=0)
        if window
        else masks.CausalMask((seq_len, seq_len))
    )
    mask = masks.MultiHeadMask([one for _ in range(heads)])
    # Built on first use, often inside a trace: its mask tables must be constants, not
    # tracers of that trace (the kernel is cached and reused by later ones).
    with jax.ensure_compile_time_eval():
        return splash.make_splash_mha(
            mask, block_sizes=sizes, head_shards=1, q_seq_shards=1, interpret=interpret, attn_logits_soft_cap=softcap
        )


def splash_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    segment_ids: jax.Array | None = None,
    interpret: bool = False,
    *,
    window: int | None = None,
    scale: float | None = None,
    softcap: float | None = None,
) -> jax.Array:
    """Causal attention ``[B, T, H, D]`` from queries ``[B, T, H, D]`` and keys and values
    ``[B, T, KV, D]`` (KV dividing H: grouped-query attention), scaled by ``scale`` (default
    ``1/sqrt(D)``), within the segments of ``segment_ids`` ``[B, T]`` when given; with
    ``window``, each query sees the last ``window`` keys; ``softcap`` caps the scores
    (``cap * tanh(s / cap)``). ``interpret`` runs the kernel in Python on any backend (tests)."""
    b, t, h, d = q.shape
    why = unsupported(t, d)
    if why is not None:
        raise ValueError(f"splash attention: {why}; use model.attention=xla.")
    q = (q * jnp.asarray(scale or 1 / math.sqrt(d), q.dtype)).transpose(0, 2, 1, 3)  # (B, H, T, D)
    k, v = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)

    def per_shard(q: jax.Array, k: jax.Array, v: jax.Array, segments: jax.Array | None) -> jax.Array:
        kernel = _kernel(q.shape[2], q.shape[1], interpret, window, softcap)  # the output alone (no residuals)
        if segments is None:
            return typing.cast(jax.Array, jax.vmap(kernel)(q, k, v))
        run = jax.vmap(lambda q, k, v, s: kernel(q, k, v, segment_ids=splash.SegmentIds(s, s)))
        return typing.cast(jax.Array, run(q, k, v, segments))

    layout = active_layout()
    if layout is None:
        out = per_shard(q, k, v, segment_ids)
    else:
        mesh, rules = layout
        sizes = dict(mesh.shape)
        heads = rules.get("heads")
        if heads is None or sizes.get(heads, 1) == 1 or h % sizes[heads] or k.shape[1] % sizes[heads]:
            heads = None
        qkv = PartitionSpec(batch_axes(mesh, b), heads, None, None)
        rows = PartitionSpec(batch_axes(mesh, b), None)
        run = jax.shard_map(
            per_shard,
            mesh=mesh,
            in_specs=(qkv, qkv, qkv, None if segment_ids is None else rows),
            out_specs=qkv,
            check_vma=False,
        )
        out = run(q, k, v, segment_ids)
    return out.transpose(0, 2, 1, 3)
