"""A quantized frozen base for LoRA (QLoRA, Dettmers et al. 2023): dense layers whose weights are
4-bit NormalFloat (``nf4``), ``int4`` or ``int8`` blocks, stored and dequantized with Qwix.

:class:`QuantizedLinear` stands in for a frozen ``nnx.Linear``: ``qvalue`` holds the kernel's
quantized values (Qwix's uint4 codes for NF4, int4 or int8; the 4-bit ones two a byte,
:func:`pack`) and ``scale`` one float32
absmax scale per block of ``block`` consecutive input features of each output column
(``[in / block, out]``), as bitsandbytes' NF4 blocks of 64 along PyTorch's ``[out, in]`` rows.
Both are :class:`QuantizedParam` (an ``nnx.Param`` that is never trained), so the trainer's
frozen filter keeps them out of the optimizer and out of checkpoints and fingerprints them, as
any frozen base. Their logical axes are the kernel's, so the quantized base shards as the
bfloat16 weights would.

The forward pass dequantizes each kernel where the layer runs (``jax.checkpoint``: the
backward pass dequantizes it again rather than keeping a bfloat16 copy of every layer alive
between the passes). The values themselves are Qwix's (``qwix.quantize`` /
``qwix.dequantize``), quantized on the host CPU a slice of rows at a time
(:func:`quantize_kernel`: Qwix's NF4 rounding compares each value with the 16 levels, a
temporary 16 times the slice), so a base read from safetensors costs one tensor plus the
quantized model (:mod:`xlafit.hf.quantized`).

Example:
    >>> layer = nnx.Linear(64, 8, rngs=nnx.Rngs(0))
    >>> q = QuantizedLinear.of(layer, "nf4", block=64)
    >>> q.qvalue.shape, q.scale.shape, str(q.qvalue.dtype)  # two 4-bit codes a byte
    ((32, 8), (1, 8), 'uint8')
    >>> float(jnp.abs(q(jnp.ones((1, 64))) - layer(jnp.ones((1, 64)))).max()) < 0.5
    True
"""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
import qwix
from flax import nnx

from xlafit.errors import ConfigError
from xlafit.models.moe import EXPERT_WEIGHTS, ExpertAdapters, Experts, dense_experts, ragged_experts
from xlafit.parallel.sharding import logical_axes

QType = Literal["nf4", "int4", "int8"]
QTYPES: tuple[str, ...] = ("nf4", "int4", "int8")
BLOCK = 64  # bitsandbytes' NF4 block (QLoRA's): one absmax scale per 64 weights
# The output layer and embeddings stay in bfloat16 unless asked (lora.quantize_embeddings:
# xlafit.models.quantized_embed): a few percent of most 1B+ models' weights, and the ones whose
# error reaches every logit directly.
UNQUANTIZED = ("lm_head",)
# Rows of one slice that quantize_kernel hands Qwix at a time: about 2**20 weights, a
# temporary of 64 MB for NF4's comparison with its 16 levels.
_SLICE_WEIGHTS = 2**20


class QuantizedParam(nnx.Param):
    """A quantized base weight (its codes or scales): a ``Param`` the trainer never trains."""


def _storage(qtype: str) -> Any:
    """Qwix's logical type of ``qtype``: the string for NF4 (uint4 codes), the dtype for ints."""
    return "nf4" if qtype == "nf4" else jnp.dtype(qtype)


def check_tiling(name: str, shape: Sequence[int], block: int, qtype: str) -> None:
    """Refuses a kernel whose input dimension (``shape[-2]``) is not a multiple of ``block``
    (:func:`check_tilings` of one).

    Raises:
        ConfigError: naming the layer, its dimension, a block that divides it and the alternative.
    """
    check_tilings([(name, shape)], block, qtype)


def check_tilings(shapes: Sequence[tuple[str, Sequence[int]]], block: int, qtype: str) -> None:
    """Refuses kernels (``(name, shape)``, input dimension ``shape[-2]``) that ``block`` does
    not divide, all in one message: each layer that fails (a layer index as ``*``) and the
    largest block that divides every one of ``shapes``, so that one retry works.

    Raises:
        ConfigError: naming the layers, their dimensions and the block or the alternative.
    """
    failing: dict[int, list[str]] = {}
    for name, shape in shapes:
        name = re.sub(r"(^|\.)layers\.\d+\.", r"\1layers.*.", name)
        if int(shape[-2]) % block and name not in failing.get(int(shape[-2]), []):
            failing.setdefault(int(shape[-2]), []).append(name)
    if not failing:
        return
    rows = {int(shape[-2]) for _, shape in shapes}
    fits = [b for b in (256, 128, 64, 32, 16, 8) if all(r % b == 0 for r in rows)]
    widths = ", ".join(map(str, sorted(rows)))
    which = f"divides {widths}" if len(rows) == 1 else f"divides every quantized layer's: {widths}"
    use = f"lora.base_block={fits[0]} ({which})" if fits else "lora.base_dtype=bfloat16"
    named = [
        f"{width} ({', '.join(names[:2])}{f' and {len(names) - 2} more' if len(names) > 2 else ''})"
        for width, names in sorted(failing.items(), reverse=True)
    ]
    raise ConfigError(
        f"lora.base_dtype={qtype}: lora.base_block={block} does not divide these layers' input features (Qwix "
        f"quantizes blocks of lora.base_block weights along them): {'; '.join(named)}; use {use}, or leave the base "
        "unquantized with lora.base_dtype=bfloat16."
    )


def qwix_quantize(kernel: jax.Array, qtype: str, block: int) -> qwix.QArray:
    """Qwix's blocks of ``kernel`` (``[..., in, out]``): codes ``[..., in, out]``, float32
    scales ``[..., in / block, out]`` (each stacked layer and output column its own)."""
    axis = kernel.ndim - 2
    channels = tuple(a for a in range(kernel.ndim) if a != axis)
    return qwix.quantize(
        kernel.astype(jnp.float32), _storage(qtype), channelwise_axes=channels, tiled_axes={axis: block}
    )


def pack(codes: jax.Array, qtype: str) -> jax.Array:
    """Qwix's codes as stored: int8 as they are; 4-bit ones two to a byte (uint8
    ``[..., in / 2, out]``, row ``2i`` in the low nibble, ``2i + 1`` in the high one), so no
    sub-byte array ever leaves a computation (XLA:CPU lays them out unpacked when they are
    put on a mesh, and a compiled step refuses them)."""
    if qtype == "int8":
        return codes
    # int4: the low nibble of its two's complement (a bit cast: a conversion saturates at 0)
    nibbles = jax.lax.bitcast_convert_type(codes.astype(jnp.int8), jnp.uint8) & 0xF
    return nibbles[..., 0::2, :] | (nibbles[..., 1::2, :] << 4)


def unpack(stored: jax.Array, qtype: str) -> jax.Array:
    """The codes :func:`pack` stored, as Qwix holds them (uint4 for NF4, int4, int8)."""
    if qtype == "int8":
        return stored
    pairs = jnp.stack([stored & 0xF, stored >> 4], axis=-2)  # [..., in / 2, 2, out]
    nibbles = pairs.reshape(*stored.shape[:-2], 2 * stored.shape[-2], stored.shape[-1])
    if qtype == "nf4":
        return nibbles.astype(jnp.uint4)
    return ((nibbles.astype(jnp.int8) ^ 8) - 8).astype(jnp.int4)  # the nibble's sign extended


def _quantize(kernel: jax.Array, qtype: str, block: int) -> tuple[jax.Array, jax.Array]:
    """:func:`qwix_quantize`'s codes as stored (:func:`pack`) and its scales."""
    q = qwix_quantize(kernel, qtype, block)
    return pack(q.qvalue, qtype), q.scale


@functools.partial(jax.jit, static_argnums=(1, 2))
def _quantize_jit(kernel: jax.Array, qtype: str, block: int) -> tuple[jax.Array, jax.Array]:
    return _quantize(kernel, qtype, block)


def quantize_kernel(kernel: Any, qtype: str, block: int) -> tuple[jax.Array, jax.Array]:
    """Qwix's quantized values and scales of a host kernel ``[in, out]`` (NumPy), computed on
    the CPU a slice of rows at a time: the same values on every platform (the fingerprint a
    checkpoint records), and a temporary of one slice, whatever the kernel's size.

    Example:
        >>> codes, scales = quantize_kernel(np.ones((128, 4), np.float32), "int8", 64)
        >>> codes.shape, scales.shape
        ((128, 4), (2, 4))
    """
    step = max(block, (_SLICE_WEIGHTS // max(kernel.shape[1], 1)) // block * block)
    return in_slices(kernel, step, lambda piece: _quantize_jit(piece, qtype, block))


def in_slices(array: Any, step: int, quantize: Any) -> tuple[jax.Array, jax.Array]:
    """``quantize`` (a slice -> its codes and scales) of ``array``, ``step`` rows at a time on
    the CPU, joined: one slice's float32 copy at most beside the codes."""
    cpu = jax.devices("cpu")[0]
    codes, scales = [], []
    for start in range(0, array.shape[0], step):
        piece = jax.device_put(np.asarray(array[start : start + step], np.float32), cpu)
        # JAX dispatches asynchronously: without the wait the loop runs ahead of a busy CPU and
        # holds many slices' float32 copies at once (2x the quantized model, measured under load).
        q, s = jax.block_until_ready(quantize(piece))
        codes.append(q)
        scales.append(s)
        del piece
    if len(codes) == 1:
        return codes[0], scales[0]
    return jnp.concatenate(codes), jnp.concatenate(scales)


@functools.cache
def nf4_levels() -> tuple[float, ...]:
    """NF4's 16 levels, as Qwix dequantizes the codes 0..15 (a unit scale)."""
    with jax.ensure_compile_time_eval():  # a constant even when first asked inside a trace
        codes = jnp.arange(16, dtype=jnp.uint4).reshape(16, 1)
        levels = qwix.dequantize(qwix.QArray(codes, jnp.ones((1, 1)), None, "nf4"))
        return tuple(float(v) for v in np.asarray(levels).ravel())


def dequantize(qvalue: jax.Array, scale: jax.Array, qtype: str, dtype: Any = jnp.float32) -> jax.Array:
    """The kernel Qwix's values stand for (``qvalue`` as :func:`pack` stores them): each
    code's level (NF4's table, or the integer) times its block's scale, as ``dtype``.

    int4 and int8 go through ``qwix.dequantize``. NF4's levels are picked by a chain of
    selects on the code instead of Qwix's table lookup (a gather of every weight, which made
    the TPU compiler's program of an 8B model gigabytes of code); the values are the same.
    """
    if qtype != "nf4":
        return qwix.dequantize(qwix.QArray(unpack(qvalue, qtype), scale, None, _storage(qtype))).astype(dtype)
    codes = unpack(qvalue, qtype).astype(jnp.uint8)
    levels = jnp.zeros(codes.shape, jnp.float32)
    for code, level in enumerate(nf4_levels()):
        levels = jnp.where(codes == code, jnp.float32(level), levels)
    *lead, rows, cols = levels.shape
    blocks = scale.shape[-2]  # [..., blocks, rows / blocks, out] x [..., blocks, 1, out]
    grouped = levels.reshape(*lead, blocks, rows // blocks, cols) * scale.astype(jnp.float32)[..., :, None, :]
    return grouped.reshape(levels.shape).astype(dtype)


def _matmul(x: jax.Array, qvalue: jax.Array, scale: jax.Array, qtype: str, dtype: Any) -> jax.Array:
    return x @ dequantize(qvalue, scale, qtype, dtype)


# The backward pass dequantizes again instead of keeping every layer's dequantized kernel
# between the passes (a whole bfloat16 model, the memory the quantization saves).
dequantized_matmul = jax.checkpoint(_matmul, static_argnums=(3, 4), policy=jax.checkpoint_policies.nothing_saveable)


class QuantizedLinear(nnx.Module):
    """A frozen ``nnx.Linear`` whose kernel is Qwix's quantized blocks: ``x @ dequant(W) + b``.

    Build one from a layer with :meth:`of`, or from values already quantized with
    :meth:`from_values` (what a safetensors reader does). ``in_features``, ``out_features``
    and ``dtype`` are the layer's, so :class:`~xlafit.models.lora.LoRA` wraps it as it wraps
    an ``nnx.Linear``.

    Args:
        qvalue: the codes as :func:`pack` stores them: ``[..., in, out]`` int8, or
            ``[..., in / 2, out]`` uint8 (two 4-bit codes a byte); a leading ``layers`` axis
            when stacked.
        scale: float32 scales ``[..., in / block, out]``.
        bias: the layer's bias ``[..., out]`` (unquantized), or None.
        qtype: ``nf4``, ``int4`` or ``int8``.
        dtype: the compute dtype (the kernel is dequantized to it).
        axes: the kernel's logical axis names (None: unannotated).
        bias_axes: the bias's logical axis names.
    """

    def __init__(
        self,
        qvalue: jax.Array,
        scale: jax.Array,
        bias: jax.Array | None,
        *,
        qtype: str,
        dtype: Any,
        axes: tuple[str | None, ...] | None = None,
        bias_axes: tuple[str | None, ...] | None = None,
    ) -> None:
        def meta(names: tuple[str | None, ...] | None) -> dict[str, Any]:
            return {} if names is None else {"out_sharding": names, "eager_sharding": False}

        self.qtype, self.dtype = qtype, dtype
        rows = int(qvalue.shape[-2]) * (1 if qtype == "int8" else 2)  # 4-bit codes: two rows a byte
        self.in_features, self.out_features = rows, int(qvalue.shape[-1])
        self.block = self.in_features // int(scale.shape[-2])
        self.qvalue = QuantizedParam(qvalue, **meta(axes))
        # The blocks' axis is replicated: an input dimension's blocks need not divide over the
        # mesh axis its weights split over (the fsdp fallback splits what divides).
        self.scale = QuantizedParam(scale, **meta(None if axes is None else (*axes[:-2], None, axes[-1])))
        self.bias = None if bias is None else nnx.Param(bias, **meta(bias_axes))

    @classmethod
    def of(cls, layer: nnx.Linear, qtype: str, block: int = BLOCK, name: str = "layer") -> QuantizedLinear:
        """``layer`` quantized (traceable: inside ``jit`` or ``nnx.eval_shape`` too).

        Raises:
            ConfigError: the kernel's input dimension is no multiple of ``block``.
        """
        kernel = layer.kernel.get_value()
        check_tiling(name, kernel.shape, block, qtype)
        qvalue, scale = _quantize(jnp.asarray(kernel), qtype, block)
        bias = None if layer.bias is None else layer.bias.get_value()
        return cls(
            qvalue,
            scale,
            bias,
            qtype=qtype,
            dtype=layer.dtype,
            axes=logical_axes(layer.kernel),
            bias_axes=None if layer.bias is None else logical_axes(layer.bias),
        )

    def kernel(self, dtype: Any = jnp.float32) -> jax.Array:
        """The dequantized kernel ``[..., in, out]``."""
        return dequantize(self.qvalue.get_value(), self.scale.get_value(), self.qtype, dtype)

    def __call__(self, x: jax.Array) -> jax.Array:
        dtype = self.dtype or x.dtype
        y = dequantized_matmul(x.astype(dtype), self.qvalue.get_value(), self.scale.get_value(), self.qtype, dtype)
        if self.bias is not None:
            y = y + self.bias.get_value().astype(dtype).reshape((1,) * (y.ndim - 1) + (-1,))
        return y

    def dequantized(self, dtype: Any = jnp.bfloat16, delta: jax.Array | None = None) -> nnx.Linear:
        """A plain ``nnx.Linear`` of the dequantized kernel (plus ``delta``, float32) in ``dtype``,
        with the kernel's logical axes: what a merged export writes."""
        kernel = self.kernel(jnp.float32)
        if delta is not None:
            kernel = kernel + delta
        axes = logical_axes(self.qvalue)
        bias = self.bias
        linear = nnx.eval_shape(
            lambda: nnx.Linear(
                self.in_features,
                self.out_features,
                use_bias=bias is not None,
                dtype=self.dtype,
                param_dtype=dtype,
                rngs=nnx.Rngs(0),
            )
        )
        linear.kernel.set_value(kernel.astype(dtype))
        if axes is not None:
            linear.kernel.set_metadata(out_sharding=axes, eager_sharding=False)
        if bias is not None and linear.bias is not None:
            linear.bias.set_value(bias.get_value().astype(dtype))
            linear.bias.set_metadata(**bias.get_metadata())
        return linear


def _experts_of_codes(
    tokens: jax.Array,
    weights: jax.Array,
    experts: jax.Array,
    stored: tuple[tuple[jax.Array, jax.Array], ...],
    lora: tuple[jax.Array, ...] | None,
    scaling: float,
    qtype: str,
    impl: str,
    activation: str,
    dtype: Any,
) -> jax.Array:
    gate, up, down = (dequantize(q, s, qtype, dtype) for q, s in stored)
    adapters = None
    if lora is not None:
        gate_up_a, gate_up_b, down_a, down_b = lora
        adapters = ExpertAdapters(gate_up_a, gate_up_b, down_a, down_b, scaling)
    run = ragged_experts if impl == "ragged" else dense_experts
    return run(tokens, weights, experts, gate, up, down, activation, adapters)


# As dequantized_matmul: the backward pass dequantizes the experts again (and runs their
# forward again) instead of keeping every layer's bfloat16 experts between the passes.
_quantized_experts = jax.checkpoint(
    _experts_of_codes, static_argnums=(5, 6, 7, 8, 9), policy=jax.checkpoint_policies.nothing_saveable
)


class QuantizedExperts(nnx.Module):
    """Frozen :class:`~xlafit.models.moe.Experts` whose stacked weights are Qwix's quantized
    blocks: ``gate_proj``, ``up_proj`` and ``down_proj`` are :class:`QuantizedLinear` of the
    stacked ``[..., E, in, out]`` kernels (each expert's blocks along its own input features),
    dequantized where the experts run. Build one with :meth:`of`.

    Args:
        gate_proj: the quantized ``[..., E, hidden, f]``; ``up_proj`` the same; ``down_proj``
            ``[..., E, f, hidden]``.
        impl, activation, dtype: the experts' (:class:`~xlafit.models.moe.Experts`).
    """

    def __init__(
        self,
        gate_proj: QuantizedLinear,
        up_proj: QuantizedLinear,
        down_proj: QuantizedLinear,
        *,
        impl: str,
        activation: str,
        dtype: Any,
    ) -> None:
        self.gate_proj, self.up_proj, self.down_proj = gate_proj, up_proj, down_proj
        self.impl, self.activation, self.dtype = impl, activation, dtype

    @classmethod
    def of(cls, experts: Experts, qtype: str, block: int = BLOCK, name: str = "experts") -> QuantizedExperts:
        """``experts`` quantized (traceable).

        Raises:
            ConfigError: an expert's input dimension (hidden or f) is no multiple of ``block``.
        """
        parts = []
        for weight in EXPERT_WEIGHTS:
            param = getattr(experts, weight)
            check_tiling(f"{name}.{weight}", param.get_value().shape, block, qtype)
            qvalue, scale = _quantize(jnp.asarray(param.get_value()), qtype, block)
            parts.append(
                QuantizedLinear(qvalue, scale, None, qtype=qtype, dtype=experts.dtype, axes=logical_axes(param))
            )
        return cls(*parts, impl=experts.impl, activation=experts.activation, dtype=experts.dtype)

    @property
    def qtype(self) -> str:
        return self.gate_proj.qtype

    @property
    def shape(self) -> tuple[int, ...]:
        """The gate projection's unquantized shape: ``(..., E, hidden, f)``."""
        gate = self.gate_proj
        return (*gate.qvalue.get_value().shape[:-2], gate.in_features, gate.out_features)

    def weights(self, dtype: Any) -> tuple[jax.Array, jax.Array, jax.Array]:
        """``(gate, up, down)`` dequantized, as ``dtype``."""
        gate, up, down = (getattr(self, w).kernel(dtype) for w in EXPERT_WEIGHTS)
        return gate, up, down

    def __call__(
        self, tokens: jax.Array, weights: jax.Array, experts: jax.Array, adapters: ExpertAdapters | None = None
    ) -> jax.Array:
        """As :meth:`Experts.__call__ <xlafit.models.moe.Experts.__call__>`, the weights dequantized."""
        stored = tuple(
            (getattr(self, w).qvalue.get_value(), getattr(self, w).scale.get_value()) for w in EXPERT_WEIGHTS
        )
        lora, scaling = None, 0.0
        if adapters is not None:
            lora = (adapters.gate_up_a, adapters.gate_up_b, adapters.down_a, adapters.down_b)
            scaling = adapters.scaling
        return _quantized_experts(
            tokens, weights, experts, stored, lora, scaling, self.qtype, self.impl, self.activation, self.dtype
        )

    def dequantized(self, dtype: Any = jnp.bfloat16) -> Experts:
        """Plain :class:`~xlafit.models.moe.Experts` of the dequantized weights in ``dtype``,
        with their logical axes: what a merged export writes."""

        def param(weight: str) -> nnx.Param:
            layer = getattr(self, weight)
            axes, value = logical_axes(layer.qvalue), layer.kernel(jnp.float32).astype(dtype)
            return nnx.Param(value) if axes is None else nnx.Param(value, out_sharding=axes, eager_sharding=False)

        gate, up, down = (param(w) for w in EXPERT_WEIGHTS)
        return Experts(gate, up, down, impl=self.impl, activation=self.activation, dtype=self.dtype)


def set_child(model: nnx.Module, path: tuple, module: nnx.Module) -> None:
    """Puts ``module`` at ``path`` (attribute names and list indices, as nnx.iter_modules)."""
    parent: Any = model
    for key in path[:-1]:
        parent = parent[key] if isinstance(key, int) else getattr(parent, key)
    if isinstance(path[-1], int):
        parent[path[-1]] = module
    else:
        setattr(parent, path[-1], module)


def _path(path: tuple) -> str:
    return ".".join(str(p) for p in path if p != "base_module")


def quantizable(model: nnx.Module, skip: Sequence[str] = UNQUANTIZED) -> list[tuple[tuple, nnx.Linear]]:
    """``(path, layer)`` of every ``nnx.Linear`` of ``model`` a quantized base quantizes: all
    but those named in ``skip`` (the output layer)."""
    return [
        (path, m)
        for path, m in nnx.iter_modules(model)
        if isinstance(m, nnx.Linear) and path and _path(path).rsplit(".", 1)[-1] not in skip
    ]


def quantize_linears(
    model: nnx.Module, qtype: str, block: int = BLOCK, skip: Sequence[str] = UNQUANTIZED
) -> nnx.Module:
    """Replaces every ``nnx.Linear`` of ``model`` (those under LoRA adapters too; not those
    named in ``skip``) with its :class:`QuantizedLinear`, in place; traceable.

    Raises:
        ConfigError: ``qtype`` is unknown, or a layer's input dimension is no multiple of ``block``.
    """
    check_qtype(qtype)
    for path, layer in quantizable(model, skip):
        set_child(model, path, QuantizedLinear.of(layer, qtype, block, name=_path(path)))
    return model


def quantize_experts(model: nnx.Module, qtype: str, block: int = BLOCK) -> nnx.Module:
    """Replaces every :class:`~xlafit.models.moe.Experts` of ``model`` (those under LoRA
    adapters too) with its :class:`QuantizedExperts`, in place; traceable.

    Raises:
        ConfigError: an expert's input dimension is no multiple of ``block``.
    """
    check_qtype(qtype)
    for path, experts in [(p, m) for p, m in nnx.iter_modules(model) if isinstance(m, Experts) and p]:
        set_child(model, path, QuantizedExperts.of(experts, qtype, block, name=_path(path)))
    return model


def quantize_base(model: nnx.Module, qtype: str, block: int = BLOCK, skip: Sequence[str] = UNQUANTIZED) -> nnx.Module:
    """``model``'s quantized base, in place: its dense layers and a mixture of experts' experts
    quantized (:func:`quantize_linears`, :func:`quantize_experts`; those already quantized
    kept) and every other float parameter but the adapters in bfloat16."""
    model = quantize_experts(model, qtype, block)
    model = quantize_linears(model, qtype, block, skip)
    rest = nnx.All(nnx.Param, nnx.Not(nnx.LoRAParam), nnx.Not(QuantizedParam))
    nnx.update(model, jax.tree.map(lambda x: x.astype(jnp.bfloat16), nnx.state(model, rest)))
    return model


def check_qtype(qtype: str) -> None:
    if qtype not in QTYPES:
        raise ConfigError(f"unknown quantized base type {qtype!r}: use one of {', '.join(QTYPES)}.")


def quantized_layers(model: nnx.Module) -> list[tuple[tuple, QuantizedLinear]]:
    """``(path, layer)`` of every :class:`QuantizedLinear` in ``model`` (those of quantized
    experts too)."""
    return [(path, m) for path, m in nnx.iter_modules(model) if isinstance(m, QuantizedLinear)]


def dequantize_linears(model: nnx.Module, dtype: Any = jnp.bfloat16) -> nnx.Module:
    """Every :class:`QuantizedExperts` and :class:`QuantizedLinear` of ``model`` back to plain
    :class:`~xlafit.models.moe.Experts` and ``nnx.Linear`` of the dequantized weights in
    ``dtype``, in place (what a merged export of a quantized base writes)."""
    for path, experts in [(p, m) for p, m in nnx.iter_modules(model) if isinstance(m, QuantizedExperts)]:
        set_child(model, path, experts.dequantized(dtype))
    for path, layer in quantized_layers(model):
        set_child(model, path, layer.dequantized(dtype))
    return model


def is_quantized(model: nnx.Module) -> bool:
    return bool(quantized_layers(model))


def param_bytes(model: nnx.Module) -> int:
    """Bytes of ``model``'s parameters as stored (a quantized base's packed codes and scales)."""
    total = 0
    for _, var in nnx.state(model, nnx.Param).flat_state():
        value = var.get_value() if isinstance(var, nnx.Variable) else var
        total += int(np.prod(value.shape)) * jnp.dtype(value.dtype).itemsize
    return total
