"""Quantized embedding tables and output layer for a quantized LoRA base
(``lora.quantize_embeddings``): the token embeddings (and an untied output layer, a tied one
being the same table) stored as Qwix blocks in the dense layers' type and block size.

A vocabulary of 262,144 tokens makes the table a large share of a small model (Gemma 3 1B's
262,144 x 1,152 is 0.3B of its 1B parameters), which a 4-bit base otherwise keeps in bfloat16.

:class:`QuantizedEmbed` holds a ``[V, H]`` table as the blocks of its transpose, a kernel
``[H, V]`` quantized as :class:`~xlafit.models.quantized.QuantizedLinear` quantizes one (a
float32 scale per ``block`` consecutive features of each token), stored a row per token:
codes ``[V, H / 2]`` (4-bit, two a byte) or ``[V, H]`` (int8) and scales ``[V, H / block]``.
A lookup gathers its tokens' rows of codes and scales and dequantizes those rows alone; the
output layer dequantizes where it runs: the whole table for whole logits (recomputed in the
backward pass, as the dense layers are), a tile of the vocabulary at a time for the loss in
blocks (:class:`QuantizedKernel`, read by :func:`xlafit.train.losses.blockwise_cross_entropy`).

Example:
    >>> table = nnx.Embed(100, 64, rngs=nnx.Rngs(0))
    >>> q = QuantizedEmbed.of(table, "nf4", block=64)
    >>> q.qvalue.shape, q.scale.shape  # a row per token: 32 bytes of codes and one scale
    ((100, 32), (100, 1))
    >>> ids = jnp.array([[3, 7]])
    >>> float(jnp.abs(q.lookup(ids) - table(ids)).max()) < 0.5
    True
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from xlafit.models.quantized import (
    UNQUANTIZED,
    QuantizedParam,
    check_qtype,
    check_tiling,
    dequantize,
    dequantized_matmul,
    in_slices,
    pack,
    qwix_quantize,
    set_child,
)
from xlafit.parallel.sharding import logical_axes

# Rows of one slice that quantize_table hands Qwix at a time: about 2**18 weights (a
# temporary of 16 MB for NF4's comparison with its 16 levels), whatever the vocabulary. A
# quarter of quantize_kernel's slice: with the table quantized too, the quantized model is
# small beside the slices' temporaries (a 32,000 x 512 table's load peaked 72-88 MB over
# its level with these slices, 98-160 MB with 2**20-weight ones, for a 27 MB quantized model).
_SLICE_WEIGHTS = 2**18


def _quantize_rows(table: jax.Array, qtype: str, block: int) -> tuple[jax.Array, jax.Array]:
    """The stored codes ``[V, H / 2]`` (or ``[V, H]``) and scales ``[V, H / block]`` of a table
    ``[V, H]``: its transpose's blocks (those of a kernel ``[H, V]``), a row per token."""
    q = qwix_quantize(table.T, qtype, block)
    return pack(q.qvalue, qtype).T, q.scale.T


@functools.partial(jax.jit, static_argnums=(1, 2))
def _quantize_rows_jit(table: jax.Array, qtype: str, block: int) -> tuple[jax.Array, jax.Array]:
    return _quantize_rows(table, qtype, block)


def quantize_table(table: Any, qtype: str, block: int) -> tuple[jax.Array, jax.Array]:
    """:class:`QuantizedEmbed`'s codes and scales of a host table ``[V, H]`` (NumPy, or a view
    of one), computed on the CPU a slice of rows at a time, as
    :func:`~xlafit.models.quantized.quantize_kernel` does a kernel's.

    Example:
        >>> import numpy as np
        >>> codes, scales = quantize_table(np.ones((10, 128), np.float32), "nf4", 64)
        >>> codes.shape, scales.shape
        ((10, 64), (10, 2))
    """
    step = max(1, _SLICE_WEIGHTS // max(table.shape[1], 1))
    return in_slices(table, step, lambda piece: _quantize_rows_jit(piece, qtype, block))


def dequantize_rows(qvalue: jax.Array, scale: jax.Array, qtype: str, dtype: Any = jnp.float32) -> jax.Array:
    """The rows ``[..., N, H]`` that stored rows of codes ``[..., N, H / 2]`` and scales
    ``[..., N, H / block]`` stand for (:func:`~xlafit.models.quantized.dequantize` of their
    transposes)."""
    kernel = dequantize(jnp.swapaxes(qvalue, -1, -2), jnp.swapaxes(scale, -1, -2), qtype, dtype)
    return jnp.swapaxes(kernel, -1, -2)


@functools.partial(jax.tree_util.register_dataclass, data_fields=("qvalue", "scale"), meta_fields=("qtype",))
class QuantizedKernel:
    """An output kernel ``[H, V]`` stored as the quantized rows of its transpose (a
    :class:`QuantizedEmbed`'s codes and scales): what
    :func:`~xlafit.train.losses.blockwise_cross_entropy` takes in place of the array, reading
    a tile of columns at a time. Frozen: its gradient is zero.

    Args:
        qvalue: the codes ``[V, H / 2]`` (4-bit) or ``[V, H]`` (int8).
        scale: float32 scales ``[V, H / block]``.
        qtype: ``nf4``, ``int4`` or ``int8``.
    """

    def __init__(self, qvalue: jax.Array, scale: jax.Array, qtype: str) -> None:
        self.qvalue, self.scale, self.qtype = qvalue, scale, qtype

    @property
    def shape(self) -> tuple[int, int]:
        """``(H, V)``: the kernel's."""
        rows, width = self.qvalue.shape
        return width * (1 if self.qtype == "int8" else 2), rows

    def columns(self, start: jax.Array | int, size: int, dtype: Any) -> jax.Array:
        """Columns ``start .. start + size`` of the kernel ``[H, size]``, dequantized as ``dtype``:
        only those tokens' rows are read."""
        q = jax.lax.dynamic_slice_in_dim(self.qvalue, start, size, axis=0)
        s = jax.lax.dynamic_slice_in_dim(self.scale, start, size, axis=0)
        return dequantize(q.T, s.T, self.qtype, dtype)


class QuantizedEmbed(nnx.Module):
    """A frozen ``nnx.Embed`` (or the untied output layer, ``linear``) whose table ``[V, H]`` is
    Qwix's quantized blocks, a row per token (the module's docstring). Build one with
    :meth:`of`, or from values already quantized (what a safetensors reader does).

    Args:
        qvalue: the codes ``[V, H / 2]`` uint8 (two 4-bit codes a byte) or ``[V, H]`` int8.
        scale: float32 scales ``[V, H / block]``.
        qtype: ``nf4``, ``int4`` or ``int8``.
        dtype: the compute dtype (rows and tiles are dequantized to it).
        axes: the table's logical axis names (``("vocab", "embed")``), or None.
        linear: the output layer ``nnx.Linear`` (kernel ``[H, V]``) rather than an embedding:
            what :meth:`dequantized` gives back.
    """

    def __init__(
        self,
        qvalue: jax.Array,
        scale: jax.Array,
        *,
        qtype: str,
        dtype: Any,
        axes: tuple[str | None, ...] | None = None,
        linear: bool = False,
    ) -> None:
        def meta(names: tuple[str | None, ...] | None) -> dict[str, Any]:
            return {} if names is None else {"out_sharding": names, "eager_sharding": False}

        self.qtype, self.dtype, self.linear = qtype, dtype, linear
        self.num_embeddings = int(qvalue.shape[0])
        self.features = int(qvalue.shape[1]) * (1 if qtype == "int8" else 2)
        self.block = self.features // int(scale.shape[1])
        self.qvalue = QuantizedParam(qvalue, **meta(axes))
        # The blocks' axis is replicated, as QuantizedLinear's (they need not divide over a mesh axis).
        self.scale = QuantizedParam(scale, **meta(None if axes is None else (axes[0], None)))

    @classmethod
    def of(cls, module: nnx.Embed | nnx.Linear, qtype: str, block: int, name: str = "embed_tokens") -> QuantizedEmbed:
        """An embedding's table (or an output layer's transposed kernel) quantized; traceable.

        Raises:
            ConfigError: the table's width is no multiple of ``block``.
        """
        param, linear = table_param(module)
        table = jnp.asarray(param.get_value())
        table = table.T if linear else table
        check_tiling(name, table.T.shape, block, qtype)
        return cls.from_values(module, *_quantize_rows(table, qtype, block), qtype=qtype)

    @classmethod
    def from_values(
        cls, module: nnx.Embed | nnx.Linear, qvalue: jax.Array, scale: jax.Array, *, qtype: str
    ) -> QuantizedEmbed:
        """``module``'s stand-in of its table's codes and scales (:func:`quantize_table`'s), with
        its compute dtype and logical axes."""
        param, linear = table_param(module)
        axes = logical_axes(param)
        axes = None if axes is None else (tuple(reversed(axes)) if linear else axes)
        return cls(qvalue, scale, qtype=qtype, dtype=module.dtype, axes=axes, linear=linear)

    def kernel(self) -> QuantizedKernel:
        """The output kernel ``[H, V]`` this table stands for, read a tile at a time by the loss in blocks."""
        return QuantizedKernel(self.qvalue.get_value(), self.scale.get_value(), self.qtype)

    def table(self, dtype: Any = jnp.float32) -> jax.Array:
        """The whole dequantized table ``[V, H]``."""
        return dequantize_rows(self.qvalue.get_value(), self.scale.get_value(), self.qtype, dtype)

    def lookup(self, ids: jax.Array) -> jax.Array:
        """The rows of ``ids`` ``[..., H]`` in the compute dtype: their codes and scales gathered,
        then dequantized (never the whole table)."""
        q = jnp.take(self.qvalue.get_value(), ids, axis=0)
        s = jnp.take(self.scale.get_value(), ids, axis=0)
        return dequantize_rows(q, s, self.qtype, self.dtype or jnp.float32)

    def attend(self, x: jax.Array) -> jax.Array:
        """``x [..., H] @ table.T``: the logits ``[..., V]``, the whole table dequantized where
        it runs (the backward pass dequantizes it again rather than keeping it)."""
        dtype = self.dtype or x.dtype
        q, s = self.qvalue.get_value(), self.scale.get_value()
        return dequantized_matmul(x.astype(dtype), q.T, s.T, self.qtype, dtype)

    def dequantized(self, dtype: Any = jnp.bfloat16) -> nnx.Embed | nnx.Linear:
        """A plain ``nnx.Embed`` (or ``nnx.Linear``, the output layer) of the dequantized table in
        ``dtype``, with its logical axes: what a merged export writes."""
        table = self.table(jnp.float32).astype(dtype)
        axes = logical_axes(self.qvalue)
        v, h, compute = self.num_embeddings, self.features, self.dtype
        if self.linear:
            linear = nnx.eval_shape(
                lambda: nnx.Linear(h, v, use_bias=False, dtype=compute, param_dtype=dtype, rngs=nnx.Rngs(0))
            )
            linear.kernel.set_value(table.T)
            if axes is not None:
                linear.kernel.set_metadata(out_sharding=tuple(reversed(axes)), eager_sharding=False)
            return linear
        embed = nnx.eval_shape(lambda: nnx.Embed(v, h, dtype=compute, param_dtype=dtype, rngs=nnx.Rngs(0)))
        embed.embedding.set_value(table)
        if axes is not None:
            embed.embedding.set_metadata(out_sharding=axes, eager_sharding=False)
        return embed


def table_param(module: nnx.Embed | nnx.Linear) -> tuple[nnx.Param, bool]:
    """A table's parameter and whether it is an output layer's kernel ``[H, V]`` (the table transposed)."""
    if isinstance(module, nnx.Linear):
        return module.kernel, True
    return module.embedding, False


def _name(path: tuple) -> str:
    return ".".join(str(p) for p in path)


def tables(model: nnx.Module) -> list[tuple[tuple, nnx.Embed | nnx.Linear]]:
    """``(path, module)`` of every table :func:`quantize_embeddings` quantizes: each
    ``nnx.Embed`` and the untied output layer (a plain ``nnx.Linear`` named ``lm_head``, not one
    LoRA adapts)."""
    return [
        (path, m)
        for path, m in nnx.iter_modules(model)
        if isinstance(m, nnx.Embed) or (isinstance(m, nnx.Linear) and len(path) == 1 and path[0] in UNQUANTIZED)
    ]


def check_tables(model: nnx.Module, qtype: str, block: int) -> None:
    """Refuses a table whose width ``block`` does not divide (before any is quantized).

    Raises:
        ConfigError: naming the table and a block that divides it.
    """
    for path, m in tables(model):
        param, linear = table_param(m)
        shape = param.get_value().shape
        check_tiling(_name(path), shape if linear else shape[::-1], block, qtype)


def quantize_embeddings(model: nnx.Module, qtype: str, block: int) -> nnx.Module:
    """Replaces every table of ``model`` (:func:`tables`) with its :class:`QuantizedEmbed`, in
    place; traceable. Those already quantized are kept.

    Raises:
        ConfigError: ``qtype`` is unknown, or a table's width is no multiple of ``block``.
    """
    check_qtype(qtype)
    check_tables(model, qtype, block)
    for path, m in tables(model):
        set_child(model, path, QuantizedEmbed.of(m, qtype, block, name=_name(path)))
    return model


def quantized_tables(model: nnx.Module) -> list[tuple[tuple, QuantizedEmbed]]:
    """``(path, table)`` of every :class:`QuantizedEmbed` in ``model``."""
    return [(path, m) for path, m in nnx.iter_modules(model) if isinstance(m, QuantizedEmbed)]


def dequantize_embeddings(model: nnx.Module, dtype: Any = jnp.bfloat16) -> nnx.Module:
    """Every :class:`QuantizedEmbed` of ``model`` back to a plain ``nnx.Embed`` (or the output
    layer's ``nnx.Linear``) of the dequantized table in ``dtype``, in place."""
    for path, m in quantized_tables(model):
        set_child(model, path, m.dequantized(dtype))
    return model
