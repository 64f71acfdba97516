"""The parts of a decoder layer the families compose: RMSNorm, attention (grouped-query,
sliding windows, soft-caps, q/k norms, Qwen3.5's gated output, Gemma 4's shared keys and
values), the gated MLP (:mod:`xlafit.models.dense`) or a mixture of experts
(:mod:`xlafit.models.moe`), Gemma 4's per-layer input gate, and the key/value cache
generation fills.

:class:`LlamaDecoderLayer` is one layer of :class:`xlafit.models.llama.LlamaForCausalLM`;
what differs between families is in :class:`~xlafit.models.llama_config.LlamaConfig` and the
layer's kind (``"sliding_attention"``, ``"full_attention"`` or ``"linear_attention"``: a
Gated DeltaNet, :mod:`xlafit.models.gated_deltanet`), whether it is a mixture of experts and
whether it shares another layer's keys and values. Parameter names follow Hugging Face's.

Example:
    >>> from xlafit.models.llama_config import LlamaConfig
    >>> layer = LlamaDecoderLayer(LlamaConfig.preset("tiny"), nnx.Rngs(0))
    >>> x = jnp.ones((1, 4, 64))
    >>> out, (keys, values), stats = layer(x, jnp.arange(4)[None], None, "xla")
    >>> out.shape, keys.shape, stats
    ((1, 4, 64), (1, 4, 2, 16), None)
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from xlafit.models import splash
from xlafit.models.activations import gated, rms
from xlafit.models.attention import apply_rope, attention, causal_mask, default_scale, rope_frequencies
from xlafit.models.cudnn import packed_flash_attention
from xlafit.models.dense import LlamaMLP
from xlafit.models.dense import dense as _dense
from xlafit.models.gated_deltanet import GatedDeltaNet, LinearState
from xlafit.models.llama_config import DTYPES, KEY_PROJ, OUT_PROJ, QUERY_PROJ, VALUE_PROJ, LlamaConfig
from xlafit.models.moe import Experts, MoEBlock, RouterStats, ScaledRouter, router_stats
from xlafit.parallel.sharding import constrain, logical

__all__ = ["Buffer", "KVCache", "LlamaAttention", "LlamaBlock", "LlamaDecoderLayer", "LlamaMLP", "RMSNorm"]

# A layer's own keys and values [B, T, kv_heads, head_dim], or those it reads from another layer.
KV = tuple[jax.Array, jax.Array]


class Buffer(nnx.Variable):
    """A value read with the weights that training leaves as it is (PyTorch's buffer, such as
    Gemma 4's ``layer_scalar``): in the model's state and checkpoints, never in the optimizer's."""


class RMSNorm(nnx.Module):
    """Root-mean-square norm (Zhang & Sennrich 2019) over the last ``size`` features
    (default the hidden size; a head's for q/k norms): statistics in float32, as Hugging
    Face's ``LlamaRMSNorm``; the weight is ``1 + w`` with ``offset`` (Gemma 2/3, initialised
    at 0; Qwen3.5), and Gemma and Qwen3.5 multiply by it in float32 before the cast back."""

    def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs, size: int | None = None) -> None:
        init = nnx.initializers.zeros_init() if cfg.norm_offset else nnx.initializers.ones_init()
        shape = (size or cfg.hidden_size,)
        self.scale = nnx.Param(logical(init, "norm")(rngs.params(), shape, DTYPES[cfg.param_dtype]))
        self.eps, self.offset = cfg.rms_norm_eps, cfg.norm_offset
        self.float32_product = cfg.norm_offset or cfg.family.startswith("gemma")

    def __call__(self, x: jax.Array) -> jax.Array:
        y = rms(x, self.eps)
        scale = self.scale[...].astype(jnp.float32).reshape((1,) * (x.ndim - 1) + (-1,))
        if self.offset:
            scale = 1.0 + scale
        if self.float32_product:
            return (y * scale).astype(x.dtype)
        return y.astype(x.dtype) * scale.astype(x.dtype)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    """The keys and values generation has computed for one layer: ``[B, S, kv_heads,
    head_dim]`` (``[blocks, B, S, ...]`` for a position of a scanned block). The whole model's
    cache is :meth:`~xlafit.models.llama.LlamaForCausalLM.empty_cache`'s."""

    keys: Any
    values: Any


class LlamaAttention(nnx.Module):
    """Grouped-query attention of one layer of ``kind``; with ``shares_kv`` it projects
    queries only and attends over the keys and values another layer computed (Gemma 4); with
    ``attn_output_gate`` (Qwen3.5) ``q_proj`` also gives each head's gate, and the output is
    the attention's times ``sigmoid(gate)``."""

    def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs, kind: str = "full_attention", shares_kv: bool = False) -> None:
        self.cfg = cfg
        self.head_dim, self.kv_heads = cfg.layer_head_dim(kind), cfg.layer_kv_heads(kind)
        h, q_dim, kv_dim = cfg.hidden_size, cfg.num_heads * self.head_dim, self.kv_heads * self.head_dim
        # Megatron: q, k, v column-parallel by head, o row-parallel. "kv_heads" is its own
        # name so a run with more tensor devices than key/value heads can replicate k and v.
        gates = 2 if cfg.attn_output_gate else 1  # Qwen3.5: each head's queries, then its gate
        self.q_proj = _dense(cfg, h, gates * q_dim, rngs, ("embed", "heads"), cfg.attention_bias)
        self.shares_kv, self.values_are_keys = shares_kv, cfg.values_are_keys(kind)
        if not shares_kv:
            self.k_proj = _dense(cfg, h, kv_dim, rngs, ("embed", "kv_heads"), cfg.attention_bias)
            if not self.values_are_keys:
                self.v_proj = _dense(cfg, h, kv_dim, rngs, ("embed", "kv_heads"), cfg.attention_bias)
        self.o_proj = _dense(cfg, q_dim, h, rngs, ("heads", "embed"), False)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg, rngs, self.head_dim)
            if not shares_kv:
                self.k_norm = RMSNorm(cfg, rngs, self.head_dim)
        # A sliding layer sees the last sliding_window keys (a static property of the layer).
        self.window = cfg.sliding_window if kind == "sliding_attention" else None
        self.local_rope = kind == "sliding_attention" and cfg.rope_local_theta is not None

    def _frequencies(self) -> Any:
        # Computed from the config at trace time: a constant of the compiled program, not
        # state (an array attribute would be a leaf of nnx.state and of checkpoints).
        return rope_frequencies(self.cfg, self.local_rope, self.head_dim)

    def _query(self, x: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array | None]:
        """Rotated queries ``[B, T, heads, head_dim]``, and the output gate (``attn_output_gate``) or None."""
        b, t, _ = x.shape
        q = checkpoint_name(self.q_proj(x), QUERY_PROJ).reshape(b, t, self.cfg.num_heads, -1)
        gate = q[..., self.head_dim :].reshape(b, t, -1) if self.cfg.attn_output_gate else None
        q = q[..., : self.head_dim]
        if self.cfg.qk_norm:
            q = self.q_norm(q)
        return apply_rope(q, positions, self._frequencies()), gate

    def _output(self, context: jax.Array, gate: jax.Array | None) -> jax.Array:
        b, t = context.shape[:2]
        context = context.reshape(b, t, self.cfg.num_heads * self.head_dim)
        return checkpoint_name(self.o_proj(context if gate is None else context * jax.nn.sigmoid(gate)), OUT_PROJ)

    def keys_values(self, x: jax.Array, positions: jax.Array) -> KV:
        """This layer's keys (rotated) and values ``[B, T, kv_heads, head_dim]`` of ``x``."""
        b, t, _ = x.shape
        k = checkpoint_name(self.k_proj(x), KEY_PROJ).reshape(b, t, self.kv_heads, self.head_dim)
        if self.values_are_keys:
            v = k
        else:
            v = checkpoint_name(self.v_proj(x), VALUE_PROJ).reshape(b, t, self.kv_heads, self.head_dim)
        if self.cfg.qk_norm:
            k = self.k_norm(k)
        if self.cfg.value_norm:  # Gemma 4: no weights
            v = rms(v, self.cfg.rms_norm_eps).astype(v.dtype)
        return apply_rope(k, positions, self._frequencies()), v

    @property
    def plain(self) -> bool:
        """Llama's attention: causal, whole context, 1/sqrt(head_dim), no soft-cap."""
        cfg = self.cfg
        return self.window is None and not cfg.attn_logit_softcap and not cfg.query_pre_attn_scalar

    def __call__(
        self,
        x: jax.Array,
        positions: jax.Array,
        segment_ids: jax.Array | None,
        implementation: str,
        shared: KV | None = None,
    ) -> tuple[jax.Array, KV]:
        """The attention's output ``[B, T, h]`` and the keys and values it attended over
        (its own, or ``shared``: another layer's, for a layer that shares them)."""
        t = x.shape[1]
        cfg = self.cfg
        q, gate = self._query(x, positions)
        if self.shares_kv:
            assert shared is not None, "a layer that shares keys and values needs its source layer's"
            k, v = shared
        else:
            k, v = self.keys_values(x, positions)
        q = constrain(q, "batch", None, "heads", None)
        k = constrain(k, "batch", None, "kv_heads", None)
        v = constrain(v, "batch", None, "kv_heads", None)
        scale = default_scale(cfg, self.head_dim)
        # Grouped-query attention: every path takes num_kv_heads dividing num_heads as is (no repeat).
        if implementation == "splash":
            context = splash.splash_attention(
                q, k, v, segment_ids, window=self.window, scale=scale, softcap=cfg.attn_logit_softcap
            )
        elif implementation == "cudnn" and segment_ids is not None:  # packed rows: plain, bf16 (checked)
            context = packed_flash_attention(q, k, v, segment_ids, scale)
        elif self.plain:  # (B, 1, T, T): a query sees keys of its own segment; is_causal adds "and earlier"
            mask = None if segment_ids is None else segment_ids[:, None, :, None] == segment_ids[:, None, None, :]
            context = jax.nn.dot_product_attention(
                q, k, v, mask=mask, is_causal=True, implementation=typing.cast(Any, implementation)
            )
        else:
            mask = jnp.asarray(causal_mask(t))[None, None]
            if segment_ids is not None:
                mask = mask & (segment_ids[:, None, :, None] == segment_ids[:, None, None, :])
            if self.window:  # within a packed segment, by its own positions
                mask = mask & (positions[:, None, :, None] - positions[:, None, None, :] < self.window)
            context = attention(q, k, v, mask, scale, cfg.attn_logit_softcap)
        return self._output(context, gate), (k, v)

    def cached(
        self, x: jax.Array, positions: jax.Array, cache: KVCache, slot: jax.Array, visible: jax.Array
    ) -> tuple[jax.Array, KVCache]:
        """Attention of ``x [B, T, h]`` written into the key/value cache at ``slot`` (the
        same slot for every row), over the cache's keys up to each query's own slot that are
        ``visible [B, S]`` (a left-padded prompt's padding is not). A layer that shares keys
        and values is given its source layer's cache, already written, and returns it as is."""
        t = x.shape[1]
        cfg = self.cfg
        q, gate = self._query(x, positions)
        keys, values = cache.keys, cache.values
        if not self.shares_kv:
            k, v = self.keys_values(x, positions)
            keys = jax.lax.dynamic_update_slice(keys, k.astype(keys.dtype), (0, slot, 0, 0))
            values = jax.lax.dynamic_update_slice(values, v.astype(values.dtype), (0, slot, 0, 0))
        s = keys.shape[1]
        distance = (slot + jnp.arange(t))[:, None] - jnp.arange(s)[None, :]  # (T, S): query slot - key slot
        seen = (distance >= 0) & ((distance < self.window) if self.window else True)
        mask = visible[:, None, None, :] & seen[None, None]  # (B, 1, T, S)
        context = attention(
            q,
            keys.astype(q.dtype),
            values.astype(q.dtype),
            mask,
            default_scale(cfg, self.head_dim),
            cfg.attn_logit_softcap,
        )
        return self._output(context, gate), KVCache(keys, values)


class LlamaDecoderLayer(nnx.Module):
    """Pre-norm attention and MLP with residuals; Gemma's ``sandwich_norms`` also normalise
    each branch's output (``post_attention_layernorm`` is then on the attention's output, and
    ``pre_feedforward_layernorm`` / ``post_feedforward_layernorm`` around the MLP). A
    ``"linear_attention"`` layer (Qwen3.5) has a Gated DeltaNet (``linear_attn``) instead of
    attention; with ``moe`` the MLP is a mixture of experts
    (:class:`~xlafit.models.moe.MoEBlock`), or for Gemma 4 (``moe_beside_mlp``) the MLP stays
    and experts (``router``, ``experts``) run beside it. Gemma 4 then adds its per-layer
    input through a gate (``per_layer_input_gate``, ``per_layer_projection``,
    ``post_per_layer_input_norm``) and scales the output by its ``layer_scalar``."""

    def __init__(
        self,
        cfg: LlamaConfig,
        rngs: nnx.Rngs,
        kind: str = "full_attention",
        shares_kv: bool = False,
        moe: bool = False,
    ) -> None:
        self.input_layernorm = RMSNorm(cfg, rngs)
        self.linear = kind == "linear_attention"
        if self.linear:
            self.linear_attn = GatedDeltaNet(cfg, rngs)
        else:
            self.self_attn = LlamaAttention(cfg, rngs, kind, shares_kv)
        self.post_attention_layernorm = RMSNorm(cfg, rngs)
        if cfg.sandwich_norms:
            self.pre_feedforward_layernorm = RMSNorm(cfg, rngs)
            self.post_feedforward_layernorm = RMSNorm(cfg, rngs)
        width = cfg.intermediate_size * (2 if cfg.double_wide_mlp and shares_kv else 1)
        self.beside = moe and cfg.moe_beside_mlp
        self.mlp: LlamaMLP | MoEBlock = MoEBlock(cfg, rngs) if moe and not self.beside else LlamaMLP(cfg, rngs, width)
        if self.beside:  # Gemma 4: the experts beside the MLP, each branch normed
            self.router = ScaledRouter(cfg, rngs)
            self.experts = Experts.init(cfg, rngs)
            self.post_feedforward_layernorm_1 = RMSNorm(cfg, rngs)
            self.post_feedforward_layernorm_2 = RMSNorm(cfg, rngs)
            self.pre_feedforward_layernorm_2 = RMSNorm(cfg, rngs)
        self.sandwich = cfg.sandwich_norms
        self.per_layer_inputs = cfg.per_layer_input_size > 0
        if self.per_layer_inputs:
            h, p = cfg.hidden_size, cfg.per_layer_input_size
            self.per_layer_input_gate = _dense(cfg, h, p, rngs, ("embed", "mlp"), False)
            self.per_layer_projection = _dense(cfg, p, h, rngs, ("mlp", "embed"), False)
            self.post_per_layer_input_norm = RMSNorm(cfg, rngs)
        if cfg.layer_scalar:
            self.layer_scalar = Buffer(jnp.ones((1,), DTYPES[cfg.param_dtype]))
        self.activation = cfg.hidden_activation

    def _mlp(self, x: jax.Array, mask: jax.Array | None = None) -> tuple[jax.Array, RouterStats | None]:
        """The feed-forward branch with its residual, and a sparse block's router statistics
        (over the tokens of ``mask [B, T]``, default all)."""
        h = self.pre_feedforward_layernorm(x) if self.sandwich else self.post_attention_layernorm(x)
        y, stats = self.mlp(h, mask) if isinstance(self.mlp, MoEBlock) else (self.mlp(h), None)
        if self.beside:
            y, stats = self._beside(x, y, mask)
        return x + (self.post_feedforward_layernorm(y) if self.sandwich else y), stats

    def _beside(self, x: jax.Array, y: jax.Array, mask: jax.Array | None) -> tuple[jax.Array, RouterStats]:
        """Gemma 4's sparse layer: the dense MLP's output ``y`` normed, plus the experts' of
        ``x [B, T, h]`` (the attention's residual, routed as it is and normed again for the
        experts) normed, as transformers' ``Gemma4TextDecoderLayer`` adds them."""
        b, t, h = x.shape
        tokens = x.reshape(b * t, h)
        logits, weights, experts, probs = self.router(tokens)
        routed = self.experts(self.pre_feedforward_layernorm_2(tokens), weights, experts).astype(x.dtype)
        routed = constrain(routed.reshape(b, t, h), "batch", None, None)
        y = self.post_feedforward_layernorm_1(y) + self.post_feedforward_layernorm_2(routed)
        return y, router_stats(logits, probs, experts, mask)

    def _residual(self, x: jax.Array, attended: jax.Array) -> jax.Array:
        return x + (self.post_attention_layernorm(attended) if self.sandwich else attended)

    def _after_mlp(self, x: jax.Array, per_layer_input: jax.Array | None) -> jax.Array:
        """Gemma 4: the per-layer input ``[B, T, per_layer_input_size]`` through its gate, and the scalar."""
        if self.per_layer_inputs:
            assert per_layer_input is not None, "a layer with per-layer inputs needs its slice of them"
            g = gated(self.per_layer_input_gate(x), per_layer_input.astype(x.dtype), self.activation)
            x = x + self.post_per_layer_input_norm(self.per_layer_projection(g))
        if hasattr(self, "layer_scalar"):
            x = x * self.layer_scalar[...].astype(x.dtype)[0]  # a [1] buffer, as stored
        return x

    def __call__(
        self,
        x: jax.Array,
        positions: jax.Array,
        segment_ids: jax.Array | None,
        implementation: str,
        per_layer_input: jax.Array | None = None,
        shared: KV | None = None,
    ) -> tuple[jax.Array, KV | None, RouterStats | None]:
        """The layer's output ``[B, T, h]``, the keys and values its attention used (None for
        a Gated DeltaNet layer) and, for a mixture of experts, its router's statistics over
        the real tokens (segment 0, padding, left out)."""
        normed = self.input_layernorm(x)
        kv: KV | None = None
        if self.linear:
            attended = self.linear_attn(normed, segment_ids)
        else:
            attended, kv = self.self_attn(normed, positions, segment_ids, implementation, shared)
        x, stats = self._mlp(self._residual(x, attended), None if segment_ids is None else segment_ids > 0)
        x = self._after_mlp(x, per_layer_input)
        return constrain(x, "batch", None, "activation_embed"), kv, stats

    def cached(
        self,
        x: jax.Array,
        positions: jax.Array,
        cache: KVCache | LinearState,
        slot: jax.Array,
        visible: jax.Array,
        per_layer_input: jax.Array | None = None,
    ) -> tuple[jax.Array, KVCache | LinearState]:
        """As :meth:`LlamaAttention.cached`; a Gated DeltaNet layer's cache is its :class:`LinearState`."""
        normed = self.input_layernorm(x)
        if self.linear:
            assert isinstance(cache, LinearState)
            attended, cache = self.linear_attn.cached(
                normed, cache, jax.lax.dynamic_slice_in_dim(visible, slot, x.shape[1], 1)
            )
        else:
            assert isinstance(cache, KVCache)
            attended, cache = self.self_attn.cached(normed, positions, cache, slot, visible)
        return self._after_mlp(self._mlp(self._residual(x, attended))[0], per_layer_input), cache


class LlamaBlock(nnx.Module):
    """Consecutive decoder layers of ``kinds`` (each a mixture of experts where ``moe``
    says): the block a scanned model with a pattern of layers stacks (Gemma 3's five sliding
    layers and a global one, Qwen3.5's three Gated DeltaNet layers and an attention layer)."""

    def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs, kinds: tuple[str, ...], moe: tuple[bool, ...]) -> None:
        self.layers = nnx.List([LlamaDecoderLayer(cfg, rngs, k, False, m) for k, m in zip(kinds, moe, strict=True)])
