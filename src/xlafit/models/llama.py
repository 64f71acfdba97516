"""Llama (Touvron et al. 2023; Llama 3: Grattafiori et al. 2024) causal LM, in Flax NNX.

The same computation as Hugging Face's ``LlamaForCausalLM`` (pre-RMSNorm decoder, rotary
position embeddings in the ``rotate_half`` convention, SwiGLU MLP, grouped-query attention)
and, with ``attention_bias=True``, ``Qwen2ForCausalLM`` (biases on q, k and v). Parameter
names follow Hugging Face's (``layers[i].self_attn.q_proj``), so weights move both ways
(:mod:`xlafit.hf.llama`) and LoRA targets have the names PEFT uses. Logits agree with
``transformers`` to float rounding (tested to 1e-4).

Example:
    >>> from flax import nnx
    >>> cfg = LlamaConfig.preset("tiny", vocab_size=1000)
    >>> model = LlamaForCausalLM(cfg, rngs=nnx.Rngs(0))
    >>> model(jnp.ones((2, 16), jnp.int32)).shape
    (2, 16, 1000)
"""

from __future__ import annotations

import dataclasses
import math
import typing
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from xlafit.models import splash
from xlafit.models.activations import gated
from xlafit.models.attention import apply_rope, attention, causal_mask, default_scale, rope_frequencies
from xlafit.models.bert import remat_policy
from xlafit.models.cudnn import packed_flash_attention
from xlafit.models.dense import dense as _dense
from xlafit.models.gated_deltanet import GatedDeltaNet
from xlafit.models.llama_config import DTYPES, LAYER_INPUT, PRESETS, LlamaConfig
from xlafit.models.lora import LoRA
from xlafit.models.moe import MoEBlock, RouterStats
from xlafit.parallel.sharding import constrain, logical

__all__ = ["PRESETS", "KVCache", "LlamaConfig", "LlamaForCausalLM", "layer_remat_policy", "rope_frequencies"]


class RMSNorm(nnx.Module):
    """Root-mean-square norm (Zhang & Sennrich 2019) over the last ``size`` features
    (default the hidden size; a head's for q/k norms): statistics in float32, as Hugging
    Face's ``LlamaRMSNorm``; the weight is ``1 + w`` with ``offset`` (Gemma, initialised at 0)."""

    def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs, size: int | None = None) -> None:
        init = nnx.initializers.zeros_init() if cfg.norm_offset else nnx.initializers.ones_init()
        shape = (size or cfg.hidden_size,)
        self.scale = nnx.Param(logical(init, "norm")(rngs.params(), shape, DTYPES[cfg.param_dtype]))
        self.eps, self.offset = cfg.rms_norm_eps, cfg.norm_offset

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        scale = self.scale[...].astype(jnp.float32).reshape((1,) * (x.ndim - 1) + (-1,))
        if self.offset:  # Gemma multiplies in float32, then casts
            return (y * (1.0 + scale)).astype(x.dtype)
        return y.astype(x.dtype) * scale.astype(x.dtype)


class LlamaAttention(nnx.Module):
    def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs, kind: str = "full_attention") -> None:
        self.cfg = cfg
        h, q_dim, kv_dim = cfg.hidden_size, cfg.num_heads * cfg.head_size, cfg.kv_heads * cfg.head_size
        # Megatron: q, k, v column-parallel by head, o row-parallel. "kv_heads" is its own
        # name so a run with more tensor devices than key/value heads can replicate k and v.
        # Qwen3.5's gated output: q_proj gives each head's queries, then its gate
        gates = 2 if cfg.attn_output_gate else 1
        self.q_proj = _dense(cfg, h, gates * q_dim, rngs, ("embed", "heads"), cfg.attention_bias)
        self.k_proj = _dense(cfg, h, kv_dim, rngs, ("embed", "kv_heads"), cfg.attention_bias)
        self.v_proj = _dense(cfg, h, kv_dim, rngs, ("embed", "kv_heads"), cfg.attention_bias)
        self.o_proj = _dense(cfg, q_dim, h, rngs, ("heads", "embed"), False)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg, rngs, cfg.head_size)
            self.k_norm = RMSNorm(cfg, rngs, cfg.head_size)
        # A sliding layer sees the last sliding_window keys (a static property of the layer).
        self.window = cfg.sliding_window if kind == "sliding_attention" else None
        self.local_rope = kind == "sliding_attention" and cfg.rope_local_theta is not None

    def _project(self, x: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array | None]:
        """Rotated queries and keys, values, and the output gate (``attn_output_gate``) or None."""
        b, t, _ = x.shape
        cfg = self.cfg
        q = self.q_proj(x).reshape(b, t, cfg.num_heads, -1)
        gate = q[..., cfg.head_size :].reshape(b, t, -1) if cfg.attn_output_gate else None
        q = q[..., : cfg.head_size]
        k = self.k_proj(x).reshape(b, t, cfg.kv_heads, cfg.head_size)
        v = self.v_proj(x).reshape(b, t, cfg.kv_heads, cfg.head_size)
        if cfg.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        # Computed from the config at trace time: a constant of the compiled program, not
        # state (an array attribute would be a leaf of nnx.state and of checkpoints).
        inv_freq = rope_frequencies(cfg, self.local_rope)
        return apply_rope(q, positions, inv_freq), apply_rope(k, positions, inv_freq), v, gate

    def _output(self, context: jax.Array, gate: jax.Array | None) -> jax.Array:
        b, t = context.shape[:2]
        context = context.reshape(b, t, self.cfg.num_heads * self.cfg.head_size)
        return self.o_proj(context if gate is None else context * jax.nn.sigmoid(gate))

    @property
    def plain(self) -> bool:
        """Llama's attention: causal, whole context, 1/sqrt(head_dim), no soft-cap."""
        cfg = self.cfg
        return self.window is None and not cfg.attn_logit_softcap and not cfg.query_pre_attn_scalar

    def __call__(
        self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array | None, implementation: str
    ) -> jax.Array:
        b, t, _ = x.shape
        cfg = self.cfg
        q, k, v, gate = self._project(x, positions)
        q = constrain(q, "batch", None, "heads", None)
        k = constrain(k, "batch", None, "kv_heads", None)
        v = constrain(v, "batch", None, "kv_heads", None)
        # Grouped-query attention: every path takes num_kv_heads dividing num_heads as is (no repeat).
        if implementation == "splash":
            context = splash.splash_attention(
                q, k, v, segment_ids, window=self.window, scale=default_scale(cfg), softcap=cfg.attn_logit_softcap
            )
        elif implementation == "cudnn" and segment_ids is not None:  # packed rows: plain, bf16 (checked)
            context = packed_flash_attention(q, k, v, segment_ids, default_scale(cfg))
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
            context = attention(q, k, v, mask, default_scale(cfg), cfg.attn_logit_softcap)
        return self._output(context, gate)

    def cached(
        self, x: jax.Array, positions: jax.Array, cache: KVCache, slot: jax.Array, visible: jax.Array
    ) -> tuple[jax.Array, KVCache]:
        """Attention of ``x [B, T, h]`` written into the key/value cache at ``slot`` (the
        same slot for every row), over the cache's keys up to each query's own slot that are
        ``visible [B, S]`` (a left-padded prompt's padding is not)."""
        b, t, _ = x.shape
        cfg = self.cfg
        q, k, v, gate = self._project(x, positions)
        keys = jax.lax.dynamic_update_slice(cache.keys, k.astype(cache.keys.dtype), (0, slot, 0, 0))
        values = jax.lax.dynamic_update_slice(cache.values, v.astype(cache.values.dtype), (0, slot, 0, 0))
        s = keys.shape[1]
        distance = (slot + jnp.arange(t))[:, None] - jnp.arange(s)[None, :]  # (T, S): query slot - key slot
        seen = (distance >= 0) & ((distance < self.window) if self.window else True)
        mask = visible[:, None, None, :] & seen[None, None]  # (B, 1, T, S)
        context = attention(
            q, keys.astype(q.dtype), values.astype(q.dtype), mask, default_scale(cfg), cfg.attn_logit_softcap
        )
        return self._output(context, gate), KVCache(keys, values)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    """The keys and values generation has computed: ``[B, S, kv_heads, head_dim]`` per
    layer, or ``[layers, B, S, kv_heads, head_dim]`` for the whole model."""

    keys: jax.Array
    values: jax.Array


class LlamaMLP(nnx.Module):
    """A gated MLP: ``down(act(gate(x)) * up(x))`` with SiLU (SwiGLU, Shazeer 2020) or tanh
    GELU (GeGLU, Gemma); Megatron's column/row split."""

    def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs) -> None:
        h, i = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = _dense(cfg, h, i, rngs, ("embed", "mlp"), False)
        self.up_proj = _dense(cfg, h, i, rngs, ("embed", "mlp"), False)
        self.down_proj = _dense(cfg, i, h, rngs, ("mlp", "embed"), False)
        self.gelu = cfg.hidden_activation == "gelu_tanh"

    def __call__(self, x: jax.Array) -> jax.Array:
        gated_product = gated(self.gate_proj(x), self.up_proj(x), "gelu_tanh" if self.gelu else "silu")
        y = constrain(gated_product, "batch", None, "mlp")  # (B, T, i)
        return self.down_proj(y)


class LlamaDecoderLayer(nnx.Module):
    """Pre-norm attention and MLP with residuals; Gemma's ``sandwich_norms`` also normalise
    each branch's output (``post_attention_layernorm`` is then on the attention's output, and
    ``pre_feedforward_layernorm`` / ``post_feedforward_layernorm`` around the MLP). With
    ``moe`` the MLP is a mixture of experts (:class:`~xlafit.models.moe.MoEBlock`)."""

    def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs, kind: str = "full_attention", moe: bool = False) -> None:
        self.input_layernorm = RMSNorm(cfg, rngs)
        self.linear = kind == "linear_attention"  # Qwen3.5: a Gated DeltaNet instead of attention
        if self.linear:
            self.linear_attn = GatedDeltaNet(cfg, rngs)
        else:
            self.self_attn = LlamaAttention(cfg, rngs, kind)
        self.post_attention_layernorm = RMSNorm(cfg, rngs)
        if cfg.sandwich_norms:
            self.pre_feedforward_layernorm = RMSNorm(cfg, rngs)
            self.post_feedforward_layernorm = RMSNorm(cfg, rngs)
        self.mlp: LlamaMLP | MoEBlock = MoEBlock(cfg, rngs) if moe else LlamaMLP(cfg, rngs)
        self.sandwich = cfg.sandwich_norms

    def _mlp(self, x: jax.Array, mask: jax.Array | None = None) -> tuple[jax.Array, RouterStats | None]:
        """The feed-forward branch with its residual, and a sparse block's router statistics."""
        h = self.pre_feedforward_layernorm(x) if self.sandwich else self.post_attention_layernorm(x)
        y, stats = self.mlp(h, mask) if isinstance(self.mlp, MoEBlock) else (self.mlp(h), None)
        return x + (self.post_feedforward_layernorm(y) if self.sandwich else y), stats

    def _residual(self, x: jax.Array, attended: jax.Array) -> jax.Array:
        return x + (self.post_attention_layernorm(attended) if self.sandwich else attended)

    def __call__(
        self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array | None, implementation: str
    ) -> jax.Array:
        return self.routed(x, positions, segment_ids, implementation)[0]

    def routed(
        self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array | None, implementation: str
    ) -> tuple[jax.Array, RouterStats | None]:
        """The layer's output and, for a mixture of experts, its router's statistics over
        the real tokens (segment 0, padding, left out)."""
        normed = self.input_layernorm(x)
        if self.linear:
            attended = self.linear_attn(normed, segment_ids)
        else:
            attended = self.self_attn(normed, positions, segment_ids, implementation)
        x, stats = self._mlp(self._residual(x, attended), None if segment_ids is None else segment_ids > 0)
        return constrain(x, "batch", None, None), stats

    def cached(
        self, x: jax.Array, positions: jax.Array, cache: Any, slot: jax.Array, visible: jax.Array
    ) -> tuple[jax.Array, Any]:
        """As :meth:`LlamaAttention.cached`; a Gated DeltaNet layer's cache is its :class:`LinearState`."""
        normed = self.input_layernorm(x)
        if self.linear:
            attended, cache = self.linear_attn.cached(
                normed, cache, jax.lax.dynamic_slice_in_dim(visible, slot, x.shape[1], 1)
            )
        else:
            attended, cache = self.self_attn.cached(normed, positions, cache, slot, visible)
        return self._mlp(self._residual(x, attended))[0], cache


def _stacked_layers(cfg: LlamaConfig, rngs: nnx.Rngs) -> LlamaDecoderLayer:
    """``num_layers`` decoder layers as one module whose variables have a leading ``layers``
    axis (each layer drawn from its own split of the keys), for :func:`nnx.scan`."""

    @nnx.split_rngs(splits=cfg.num_layers)
    @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
    def build(rngs: nnx.Rngs) -> LlamaDecoderLayer:
        return LlamaDecoderLayer(cfg, rngs, cfg.kinds[0], cfg.moe_layers[0])  # every layer alike (LlamaConfig checks)

    return build(rngs)


def _run_layer(
    layer: LlamaDecoderLayer, x: jax.Array, positions: jax.Array, segment_ids: jax.Array | None, implementation: str
) -> tuple[jax.Array, RouterStats | None]:
    # Named for remat="offload", whose policy keeps this one array of the layer for the
    # backward pass, in host memory (an identity otherwise).
    return layer.routed(checkpoint_name(x, LAYER_INPUT), positions, segment_ids, implementation)


def layer_remat_policy(name: str) -> Any:
    """The ``jax.checkpoint`` policy of a decoder layer's ``remat`` name: ``"offload"``
    saves the layer's input in pinned host memory and recomputes the rest (MaxText's
    ``decoder_layer_input: offload``); the others as :func:`~xlafit.models.bert.remat_policy`.

    Example:
        >>> layer_remat_policy("full") is None
        True
    """
    if name == "offload":
        return jax.checkpoint_policies.save_and_offload_only_these_names(
            names_which_can_be_saved=[],
            names_which_can_be_offloaded=[LAYER_INPUT],
            offload_src="device",
            offload_dst="pinned_host",
        )
    return remat_policy(name)


class LlamaForCausalLM(nnx.Module):
    """Llama decoder with its language-model head; Hugging Face's ``LlamaForCausalLM`` in NNX.

    Args:
        cfg: sizes and options.
        rngs: ``params`` for initialisation (normal, std ``initializer_range``, as
            Hugging Face).
    """

    def __init__(self, cfg: LlamaConfig, *, rngs: nnx.Rngs) -> None:
        self.cfg = cfg
        init = nnx.initializers.normal(stddev=cfg.initializer_range)
        self.embed_tokens = nnx.Embed(
            cfg.vocab_size,
            cfg.hidden_size,
            embedding_init=logical(init, "vocab", "embed"),
            dtype=cfg.compute_dtype,
            param_dtype=DTYPES[cfg.param_dtype],
            rngs=rngs,
        )
        # With scan_layers, one layer whose variables are stacked (typed as the list it replaces).
        self.layers: nnx.List[LlamaDecoderLayer] = (
            typing.cast(Any, _stacked_layers(cfg, rngs))
            if cfg.scan_layers
            else nnx.List(
                [LlamaDecoderLayer(cfg, rngs, kind, moe) for kind, moe in zip(cfg.kinds, cfg.moe_layers, strict=True)]
            )
        )
        self.norm = RMSNorm(cfg, rngs)
        self.lm_head = (
            None
            if cfg.tie_embeddings
            else _dense(cfg, cfg.hidden_size, cfg.vocab_size, rngs, ("embed", "vocab"), False)
        )

    def _implementation(self, segment_ids: jax.Array | None, seq_len: int) -> str:
        """The attention kernel (see :class:`LlamaConfig`): splash on TPUs where the shapes
        allow; cuDNN flash attention takes only 16-bit inputs, so "auto" uses it for unpacked
        bf16 on GPUs, and "cudnn" also for packed rows (:mod:`xlafit.models.cudnn`)."""
        cfg = self.cfg
        attention = cfg.attention
        plain = not (cfg.sliding_window or cfg.attn_logit_softcap or cfg.query_pre_attn_scalar)
        fits = segment_ids is None and cfg.dtype == "bfloat16" and plain
        if attention == "cudnn" and not plain:
            raise ValueError("attention='cudnn' takes no sliding window or soft-cap; use 'xla' or 'auto'.")
        if attention == "cudnn" and cfg.dtype != "bfloat16":
            raise ValueError("attention='cudnn' needs dtype='bfloat16'; use 'xla' or 'auto'.")
        if attention == "cudnn" and jax.default_backend() != "gpu":
            raise ValueError(
                f"attention='cudnn' runs on NVIDIA GPUs (cuDNN); this is {jax.default_backend()}: use 'xla' or 'auto'."
            )
        splash_refusal = splash.unsupported(seq_len, self.cfg.head_size)
        if attention == "splash" and (splash_refusal or not splash.on_tpu()):
            why = splash_refusal or "it runs on TPUs only"
            raise ValueError(f"attention='splash': {why}; use 'xla' or 'auto'.")
        if attention == "auto":
            if splash_refusal is None and splash.on_tpu():
                return "splash"
            return "cudnn" if fits and jax.default_backend() == "gpu" else "xla"
        return attention

    def decode(
        self, input_ids: jax.Array, segment_ids: jax.Array | None = None, positions: jax.Array | None = None
    ) -> jax.Array:
        """The final hidden states ``[B, T, hidden]`` (after the last RMSNorm)."""
        return self.decode_routed(input_ids, segment_ids, positions)[0]

    def decode_routed(
        self, input_ids: jax.Array, segment_ids: jax.Array | None = None, positions: jax.Array | None = None
    ) -> tuple[jax.Array, RouterStats | None]:
        """:meth:`decode`'s hidden states and, for a mixture of experts, the router
        statistics summed over its sparse layers (None for a dense model): what the
        auxiliary losses and the routing metrics are computed from."""
        b, t = input_ids.shape
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32)[None, :], (b, t))
        implementation = self._implementation(segment_ids, t)
        dtype = self.cfg.compute_dtype
        # The gradient of a lookup is a scatter-add: on the parameter-dtype table (see BertEmbeddings).
        x = jnp.take(self.embed_tokens.embedding[...], input_ids, axis=0).astype(dtype)  # (B, T, h)
        if self.cfg.embedding_scale:
            x = x * jnp.asarray(math.sqrt(self.cfg.hidden_size), dtype)  # Gemma rounds the factor to dtype
        x = constrain(x, "batch", None, None)
        run = _run_layer
        if self.cfg.remat != "none":
            run = nnx.remat(_run_layer, policy=layer_remat_policy(self.cfg.remat), static_argnums=(4,))
        if self.cfg.scan_layers:
            # A plain lax.scan over the layers' stacked state, each layer merged in the body:
            # nnx.scan would also return the state it scans (to carry a layer's mutations out),
            # and a frozen base's stacked weights (LoRA) then come out of the forward loop as a
            # second copy, written layer by layer (the TPU compiler copies the whole stack each
            # layer: a third of a v5e-1 step for a 1.7B model). These layers mutate nothing.
            graphdef, stacked = nnx.split(self.layers)

            def decoder(carry: Any, state: Any) -> tuple[Any, None]:
                layer = typing.cast(LlamaDecoderLayer, nnx.merge(graphdef, state))
                x, stats = run(layer, carry[0], positions, segment_ids, implementation)
                return (x, None if stats is None else carry[1] + stats), None

            start = RouterStats.zeros(self.cfg.num_experts) if self.cfg.moe_layers[0] else None
            (x, total), _ = jax.lax.scan(decoder, (x, start), stacked)
        else:
            total = None
            for layer in self.layers:
                x, stats = run(layer, x, positions, segment_ids, implementation)
                if stats is not None:
                    total = stats if total is None else total + stats
        return self.norm(x), total

    def output_kernel(self) -> jax.Array:
        """The output layer as one ``[hidden, vocab]`` matrix: :meth:`logits` is ``x @`` it
        (then cast to float32 and soft-capped), for a loss that computes the logits a block
        at a time (:func:`xlafit.train.losses.blockwise_cross_entropy`). A tied model's is the
        embedding's transpose; a LoRA-adapted ``lm_head``'s, its kernel plus the scaled update."""
        if self.lm_head is None:
            return self.embed_tokens.embedding[...].T
        if isinstance(self.lm_head, LoRA):
            base = typing.cast(nnx.Linear, self.lm_head.base_module)
            update = self.lm_head.lora_a[...] @ self.lm_head.lora_b[...]
            return base.kernel[...] + (update * self.lm_head.scaling).astype(base.kernel[...].dtype)
        return self.lm_head.kernel[...]

    def logits(self, x: jax.Array) -> jax.Array:
        """Float32 logits ``[..., vocab]`` of final hidden states (:meth:`decode`'s)."""
        logits = (self.embed_tokens.attend(x) if self.lm_head is None else self.lm_head(x)).astype(jnp.float32)
        if self.cfg.final_logit_softcap:  # Gemma 2
            cap = self.cfg.final_logit_softcap
            logits = jnp.tanh(logits / cap) * cap
        return logits

    def empty_cache(self, batch: int, length: int, dtype: Any = None) -> Any:
        """A key/value cache of ``length`` slots for ``batch`` sequences (zeros); a model with
        Gated DeltaNet layers (Qwen3.5) has one cache per layer in a tuple, a linear layer's
        its :class:`~xlafit.models.gated_deltanet.LinearState`."""
        cfg = self.cfg
        shape = (cfg.num_layers, batch, length, cfg.kv_heads, cfg.head_size)
        if "linear_attention" in cfg.kinds:
            zeros = jnp.zeros(shape[1:], dtype or cfg.compute_dtype)
            return tuple(
                layer.linear_attn.empty_state(batch, dtype) if layer.linear else KVCache(zeros, zeros)
                for layer in self.layers
            )
        zeros = jnp.zeros(shape, dtype or cfg.compute_dtype)
        return KVCache(zeros, zeros)

    def cached(
        self, input_ids: jax.Array, positions: jax.Array, cache: Any, slot: jax.Array, visible: jax.Array
    ) -> tuple[jax.Array, Any]:
        """Next-token logits ``[B, T, vocab]`` of ``input_ids`` placed at cache ``slot``
        onwards (a prompt, then one token at a time), and the cache with their keys and
        values: what :meth:`__call__` computes for the whole sequence, token by token."""
        dtype = self.cfg.compute_dtype
        x = jnp.take(self.embed_tokens.embedding[...], input_ids, axis=0).astype(dtype)
        if self.cfg.embedding_scale:
            x = x * jnp.asarray(math.sqrt(self.cfg.hidden_size), dtype)
        if isinstance(cache, tuple):  # one cache per layer (Gated DeltaNet layers: LinearState)
            caches = []
            for layer, layer_cache in zip(self.layers, cache, strict=True):
                x, layer_cache = layer.cached(x, positions, layer_cache, slot, visible)
                caches.append(layer_cache)
            return self.logits(self.norm(x)), tuple(caches)
        if self.cfg.scan_layers:

            @nnx.scan(in_axes=(0, nnx.Carry, 0, 0), out_axes=(nnx.Carry, 0, 0))
            def decoder(layer: LlamaDecoderLayer, x: jax.Array, keys: jax.Array, values: jax.Array) -> Any:
                x, layer_cache = layer.cached(x, positions, KVCache(keys, values), slot, visible)
                return x, layer_cache.keys, layer_cache.values

            x, keys, values = decoder(typing.cast(LlamaDecoderLayer, self.layers), x, cache.keys, cache.values)
            cache = KVCache(keys, values)
        else:
            keys, values = [], []
            for i, layer in enumerate(self.layers):
                x, layer_cache = layer.cached(x, positions, KVCache(cache.keys[i], cache.values[i]), slot, visible)
                keys.append(layer_cache.keys)
                values.append(layer_cache.values)
            cache = KVCache(jnp.stack(keys), jnp.stack(values))
        return self.logits(self.norm(x)), cache

    def __call__(
        self, input_ids: jax.Array, segment_ids: jax.Array | None = None, positions: jax.Array | None = None
    ) -> jax.Array:
        """Next-token logits ``[B, T, vocab]`` (float32).

        Args:
            input_ids: token ids ``[B, T]`` (int). Right padding needs no mask: causal
                attention keeps it out of the real tokens' logits.
            segment_ids: packed sequences ``[B, T]`` (1, 1, 2, 2, 2, 0 for padding): each
                token attends only within its segment.
            positions: ``[B, T]`` rotary positions, restarting at 0 in every segment of a
                packed row; default ``0..T-1``.
        """
        return constrain(self.logits(self.decode(input_ids, segment_ids, positions)), "batch", None, "vocab")
