"""Activations with derivative rules of their own, so that a training step's forward pass
keeps the fewest arrays for its backward.

Differentiating ``jax.nn.gelu(x, approximate=False)`` keeps three arrays of ``x``'s shape
for the backward (half the input, ``erfc`` of it, the input) and ``jax.nn.silu(g) * u``
keeps five (seven with GeGLU's tanh GELU); the backward reads each back from HBM. With the
rules here the forward pass computes the slopes in the kernel that computes the value, and
keeps them alone: one array for :func:`gelu`, two for :func:`gated` (a gated MLP's inner
product). Values are computed
in float32 and returned in the inputs' dtype; the rules are forward-mode (``jax.custom_jvp``),
so ``jax.jvp`` and higher derivatives work as with the plain functions.

Example:
    >>> import jax.numpy as jnp
    >>> [round(float(v), 4) for v in gelu(jnp.array([-1.0, 0.0, 2.0]))]
    [-0.1587, 0.0, 1.9545]
    >>> round(float(gated(jnp.array(1.0), jnp.array(2.0), "silu")), 4)  # silu(1) * 2
    1.4621
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["GATED", "gated", "gelu", "rms"]

GATED = ("silu", "gelu_tanh")  # the activations of gated MLPs: SwiGLU (Llama), GeGLU (Gemma)

_SQRT_HALF = np.float32(1 / np.sqrt(2))
_INV_SQRT_2PI = np.float32(1 / np.sqrt(2 * np.pi))
_TANH_C = np.float32(np.sqrt(2 / np.pi))


def _gelu_and_slope(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The exact GELU ``x / 2 * (1 + erf(x / sqrt(2)))`` and its derivative, in float32."""
    cdf = 0.5 * (1.0 + jax.lax.erf(x * _SQRT_HALF))
    return x * cdf, cdf + x * jnp.exp(-0.5 * x * x) * _INV_SQRT_2PI


@jax.custom_jvp
def gelu(x: jax.Array) -> jax.Array:
    """The exact (erf) GELU of BERT and Hugging Face's ``"gelu"``, as ``transformers``
    computes it; not the tanh approximation. The backward keeps the derivative alone."""
    x = jnp.asarray(x)
    return _gelu_and_slope(x.astype(jnp.float32))[0].astype(x.dtype)


@gelu.defjvp
def _gelu_jvp(primals: tuple[jax.Array], tangents: tuple[jax.Array]) -> tuple[jax.Array, jax.Array]:
    (x,), (dx,) = (jnp.asarray(primals[0]),), tangents
    y, slope = _gelu_and_slope(x.astype(jnp.float32))
    return y.astype(x.dtype), dx * slope.astype(x.dtype)


def rms(x: jax.Array, eps: float) -> jax.Array:
    """``x`` over its root mean square along the last axis, in float32: an RMSNorm without
    weights (Zhang & Sennrich 2019), the part every decoder norm shares.

    Example:
        >>> [round(float(v), 4) for v in rms(jnp.array([3.0, 4.0]), 0.0)]
        [0.8485, 1.1314]
    """
    x32 = jnp.asarray(x).astype(jnp.float32)
    return x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)


def _activation_and_slope(g: jax.Array, activation: str) -> tuple[jax.Array, jax.Array]:
    """SiLU ``g * sigmoid(g)`` or the tanh GELU, and its derivative, in float32."""
    if activation == "silu":
        s = jax.nn.sigmoid(g)
        return g * s, s * (1.0 + g * (1.0 - s))
    inner = _TANH_C * (g + 0.044715 * g * g * g)
    t = jnp.tanh(inner)
    slope = 0.5 * (1.0 + t) + 0.5 * g * (1.0 - t * t) * _TANH_C * (1.0 + 3 * 0.044715 * g * g)
    return 0.5 * g * (1.0 + t), slope


@functools.partial(jax.custom_jvp, nondiff_argnums=(2,))
def gated(gate: jax.Array, up: jax.Array, activation: str) -> jax.Array:
    """``act(gate) * up`` of a gated MLP, ``act`` one of :data:`GATED`; the backward keeps
    ``act(gate)`` and ``up * act'(gate)``."""
    gate, up = jnp.asarray(gate), jnp.asarray(up)
    a, _ = _activation_and_slope(gate.astype(jnp.float32), activation)
    return (a * up.astype(jnp.float32)).astype(up.dtype)


@gated.defjvp
def _gated_jvp(
    activation: str, primals: tuple[jax.Array, jax.Array], tangents: tuple[jax.Array, jax.Array]
) -> tuple[jax.Array, jax.Array]:
    (gate, up), (dgate, dup) = (jnp.asarray(p) for p in primals), tangents
    a, slope = _activation_and_slope(gate.astype(jnp.float32), activation)
    u = up.astype(jnp.float32)
    y = (a * u).astype(up.dtype)
    return y, dup * a.astype(up.dtype) + dgate * (u * slope).astype(up.dtype)
