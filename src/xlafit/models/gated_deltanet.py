"""Gated DeltaNet (Yang, Kautz & Hatamizadeh 2024): the linear-attention layer of Qwen3.5's
decoder ("linear_attention" in ``layer_types``), as transformers' ``Qwen3_5GatedDeltaNet``.

One projection gives the queries, keys and values (``in_proj_qkv``), which pass through a
short causal depthwise convolution (``conv1d``, ``linear_conv_kernel_dim`` taps) and SiLU;
``in_proj_b`` gives each value head's write strength ``beta = sigmoid(b)``, ``in_proj_a`` its
decay ``g = -exp(A_log) softplus(a + dt_bias)``; the gated delta rule
(:mod:`xlafit.models.delta_rule`, queries and keys L2-normalised) mixes the tokens; a gated
RMSNorm per value head (``norm(o) * silu(z)``, ``z`` from ``in_proj_z``) and ``out_proj``
give the layer's output. Parameter names are Hugging Face's, so weights map one to one
(:mod:`xlafit.hf.llama`).

Decoding keeps a :class:`LinearState` per layer instead of keys and values: the last
``linear_conv_kernel_dim - 1`` inputs of the convolution and the delta rule's state, a fixed
size whatever the context's length.

Example:
    >>> from xlafit.models.llama_config import LlamaConfig
    >>> cfg = LlamaConfig.preset("tiny", linear_num_key_heads=2, linear_num_value_heads=4,
    ...                          linear_key_head_dim=8, linear_value_head_dim=8, linear_chunk_size=16)
    >>> layer = GatedDeltaNet(cfg, nnx.Rngs(0))
    >>> layer(jnp.ones((2, 20, 64)), None).shape
    (2, 20, 64)
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from xlafit.models.delta_rule import chunk_gated_delta_rule, recurrent_gated_delta_rule
from xlafit.models.dense import dense
from xlafit.models.llama_config import DTYPES, LlamaConfig
from xlafit.parallel.sharding import constrain, logical

__all__ = ["GatedDeltaNet", "GatedRMSNorm", "LinearState", "causal_conv"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LinearState:
    """What a Gated DeltaNet layer carries from token to token while decoding: the
    convolution's last inputs ``conv [B, kernel - 1, channels]`` and the delta rule's state
    ``recurrent [B, value_heads, key_head_dim, value_head_dim]`` (float32)."""

    conv: jax.Array
    recurrent: jax.Array


def causal_conv(window: jax.Array, kernel: jax.Array, length: int, same: jax.Array | None = None) -> jax.Array:
    """Depthwise causal convolution: output ``t`` of ``length`` is ``sum_j kernel[j] *
    window[t + j]`` over the ``K`` taps, ``window [B, K - 1 + length, C]`` holding the ``K -
    1`` inputs before the first output's (zeros at a sequence's start, the cache's while
    decoding). ``kernel [K, 1, C]`` is flax's depthwise layout (PyTorch's ``[C, 1, K]``
    reversed). ``same [B, K, length]``: which taps belong to the output's own segment (the
    others count as zeros), for packed rows. Accumulated in float32."""
    taps = kernel.shape[0]
    out = jnp.zeros((window.shape[0], length, window.shape[2]), jnp.float32)
    for j in range(taps):
        tap = window[:, j : j + length].astype(jnp.float32) * kernel[j, 0].astype(jnp.float32)[None, None, :]
        out = out + (tap if same is None else jnp.where(same[:, j, :, None], tap, 0.0))
    return out


class GatedRMSNorm(nnx.Module):
    """RMSNorm over a value head, times ``silu(gate)``: transformers' ``Qwen3_5RMSNormGated``
    (the weight used as it is, initialised at 1; statistics and gate in float32)."""

    def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs) -> None:
        init = logical(nnx.initializers.ones_init(), "norm")
        self.scale = nnx.Param(init(rngs.params(), (cfg.linear_value_head_dim,), DTYPES[cfg.param_dtype]))
        self.eps = cfg.rms_norm_eps

    def __call__(self, x: jax.Array, gate: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        y = (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)).astype(x.dtype)
        y = self.scale[...].astype(x.dtype).reshape((1,) * (x.ndim - 1) + (-1,)) * y
        return (y * jax.nn.silu(gate.astype(jnp.float32))).astype(x.dtype)


class _DepthwiseConv(nnx.Module):
    """The convolution's weights alone (``kernel [K, 1, C]``); :func:`causal_conv` applies them."""

    def __init__(self, cfg: LlamaConfig, channels: int, rngs: nnx.Rngs) -> None:
        init = logical(nnx.initializers.normal(stddev=cfg.initializer_range), None, None, "heads")
        shape = (cfg.linear_conv_kernel_dim, 1, channels)
        self.kernel = nnx.Param(init(rngs.params(), shape, DTYPES[cfg.param_dtype]))


def _a_log_init(key: jax.Array, shape: tuple[int, ...], dtype: jax.typing.DTypeLike) -> jax.Array:
    """transformers' initial ``A_log``: the log of a uniform draw in [0.01, 16)."""
    return jnp.log(jax.random.uniform(key, shape, jnp.float32, 0.01, 16.0)).astype(dtype)


class GatedDeltaNet(nnx.Module):
    """A Gated DeltaNet token mixer: ``[B, T, hidden] -> [B, T, hidden]`` (see the module)."""

    def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs) -> None:
        self.cfg = cfg
        h, heads = cfg.hidden_size, cfg.linear_num_value_heads
        self.key_dim = cfg.linear_num_key_heads * cfg.linear_key_head_dim
        self.value_dim = heads * cfg.linear_value_head_dim
        channels = 2 * self.key_dim + self.value_dim
        self.in_proj_qkv = dense(cfg, h, channels, rngs, ("embed", "heads"), False)
        self.in_proj_z = dense(cfg, h, self.value_dim, rngs, ("embed", "heads"), False)
        self.in_proj_b = dense(cfg, h, heads, rngs, ("embed", None), False)
        self.in_proj_a = dense(cfg, h, heads, rngs, ("embed", None), False)
        self.conv1d = _DepthwiseConv(cfg, channels, rngs)
        param_dtype = DTYPES[cfg.param_dtype]
        self.dt_bias = nnx.Param(logical(nnx.initializers.ones_init(), "norm")(rngs.params(), (heads,), param_dtype))
        self.A_log = nnx.Param(logical(_a_log_init, "norm")(rngs.params(), (heads,), param_dtype))
        self.norm = GatedRMSNorm(cfg, rngs)
        self.out_proj = dense(cfg, self.value_dim, h, rngs, ("heads", "embed"), False)

    def _mix(
        self,
        x: jax.Array,
        conv: jax.Array,
        initial_state: jax.Array | None,
        segment_ids: jax.Array | None,
    ) -> tuple[jax.Array, jax.Array]:
        """The output of ``x [B, T, hidden]`` whose convolution output is ``conv [B, T,
        channels]`` (before SiLU), and the delta rule's final state."""
        cfg = self.cfg
        b, t, _ = x.shape
        mixed = jax.nn.silu(conv).astype(x.dtype)
        q, k, v = jnp.split(mixed, [self.key_dim, 2 * self.key_dim], axis=-1)
        q = q.reshape(b, t, cfg.linear_num_key_heads, cfg.linear_key_head_dim)
        k = k.reshape(b, t, cfg.linear_num_key_heads, cfg.linear_key_head_dim)
        v = v.reshape(b, t, cfg.linear_num_value_heads, cfg.linear_value_head_dim)
        beta = jax.nn.sigmoid(self.in_proj_b(x))
        a = self.in_proj_a(x).astype(jnp.float32) + self.dt_bias[...].astype(jnp.float32)[None, None]
        g = -jnp.exp(self.A_log[...].astype(jnp.float32))[None, None] * jax.nn.softplus(a)  # [B, T, heads], <= 0
        if t == 1 and initial_state is not None:  # a decoding step
            out, state = recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=initial_state, normalize_qk=True)
        else:
            out, state = chunk_gated_delta_rule(
                q, k, v, g, beta, chunk_size=cfg.linear_chunk_size, initial_state=initial_state,
                segment_ids=segment_ids, normalize_qk=True,
            )  # fmt: skip
        out = constrain(out, "batch", None, "heads", None)
        z = self.in_proj_z(x).reshape(b, t, cfg.linear_num_value_heads, cfg.linear_value_head_dim)
        return self.out_proj(self.norm(out, z).reshape(b, t, self.value_dim)), state

    def __call__(self, x: jax.Array, segment_ids: jax.Array | None) -> jax.Array:
        """The layer over whole sequences ``x [B, T, hidden]`` (training, evaluation);
        ``segment_ids [B, T]``: packed rows, each segment from an empty state."""
        taps = self.cfg.linear_conv_kernel_dim
        projected = self.in_proj_qkv(x)
        window = jnp.pad(projected, ((0, 0), (taps - 1, 0), (0, 0)))
        same = None
        if segment_ids is not None:  # tap j of output t reads token t - (taps - 1) + j
            padded = jnp.pad(segment_ids, ((0, 0), (taps - 1, 0)), constant_values=-1)
            t = x.shape[1]
            same = jnp.stack([padded[:, j : j + t] == segment_ids for j in range(taps)], axis=1)
        conv = causal_conv(window, self.conv1d.kernel[...], x.shape[1], same)
        return self._mix(x, conv, None, segment_ids)[0]

    def empty_state(self, batch: int, dtype: jax.typing.DTypeLike | None = None) -> LinearState:
        """The state before a sequence's first token (zeros)."""
        cfg = self.cfg
        channels = 2 * self.key_dim + self.value_dim
        conv = jnp.zeros((batch, cfg.linear_conv_kernel_dim - 1, channels), dtype or cfg.compute_dtype)
        shape = (batch, cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim)
        return LinearState(conv, jnp.zeros(shape, jnp.float32))

    def cached(self, x: jax.Array, state: LinearState, visible: jax.Array) -> tuple[jax.Array, LinearState]:
        """The layer over ``x [B, T, hidden]`` continuing from ``state``, and the state after
        it. Tokens that are not ``visible [B, T]`` (a left-padded prompt's padding) are zeros
        here, as in transformers: they write nothing and leave an empty state empty."""
        x = jnp.where(visible[..., None], x, jnp.zeros((), x.dtype))
        projected = self.in_proj_qkv(x)
        window = jnp.concatenate([state.conv.astype(projected.dtype), projected], axis=1)
        conv = causal_conv(window, self.conv1d.kernel[...], x.shape[1])
        out, recurrent = self._mix(x, conv, state.recurrent, None)
        keep = self.cfg.linear_conv_kernel_dim - 1
        return out, LinearState(window[:, window.shape[1] - keep :].astype(state.conv.dtype), recurrent)
