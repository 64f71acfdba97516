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
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from xlafit.models import splash
from xlafit.models.bert import REMAT_POLICIES, remat_policy
from xlafit.parallel.sharding import constrain, logical

# Meta's released sizes (the config.json of meta-llama/Llama-3.2-1B and Llama-3.1-8B), and a
# tiny one for tests. vocab_size of "tiny" is a placeholder: set it to the tokenizer's.
PRESETS: dict[str, dict[str, Any]] = {
    "tiny": {
        "num_layers": 2,
        "hidden_size": 64,
        "num_heads": 4,
        "num_kv_heads": 2,
        "intermediate_size": 128,
        "vocab_size": 512,
        "max_position_embeddings": 512,
    },
    "llama-3.2-1b": {
        "num_layers": 16,
        "hidden_size": 2048,
        "num_heads": 32,
        "num_kv_heads": 8,
        "head_dim": 64,
        "intermediate_size": 8192,
        "vocab_size": 128256,
        "rope_theta": 500000.0,
        "rope_type": "llama3",
        "rope_factor": 32.0,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 131072,
        "tie_embeddings": True,
    },
    "llama-3.1-8b": {
        "num_layers": 32,
        "hidden_size": 4096,
        "num_heads": 32,
        "num_kv_heads": 8,
        "intermediate_size": 14336,
        "vocab_size": 128256,
        "rope_theta": 500000.0,
        "rope_type": "llama3",
        "rope_factor": 8.0,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 131072,
        "tie_embeddings": False,
    },
}

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """Sizes and options of a Llama; :meth:`preset` fills the sizes by name.

    ``num_kv_heads`` (default ``num_heads``) below ``num_heads`` is grouped-query attention;
    ``head_dim`` defaults to ``hidden_size // num_heads``; both are filled in on
    construction. ``dtype`` is the compute dtype, ``param_dtype`` the parameters' (float32
    unless memory forces bfloat16). ``attention`` picks the kernel: "splash" is the Pallas
    flash-attention kernel for TPUs (:mod:`xlafit.models.splash`: memory linear in the
    sequence, packed segments too), "cudnn" and "xla" the implementations of
    ``jax.nn.dot_product_attention`` as in :class:`~xlafit.models.bert.BertConfig` (cuDNN
    takes no segment ids: packed batches run on XLA); "auto" takes splash on TPUs where
    the shapes allow it (a sequence that is a multiple of 128), cuDNN on GPUs where it
    applies, else XLA. ``rope_type="llama3"`` is Llama 3.1's
    frequency scaling (``rope_factor``, ``rope_low_freq_factor``, ``rope_high_freq_factor``,
    ``rope_original_max_position_embeddings``). ``embedding_scale`` (embeddings times
    ``sqrt(hidden_size)``) and ``norm_offset`` (RMSNorm weights used as ``1 + w``) are
    Gemma's conventions.
    """

    vocab_size: int = 32000
    hidden_size: int = 4096
    intermediate_size: int = 11008
    num_layers: int = 32
    num_heads: int = 32
    num_kv_heads: int | None = None
    head_dim: int | None = None
    rope_theta: float = 10000.0
    rope_type: Literal["default", "llama3"] = "default"
    rope_factor: float = 8.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_position_embeddings: int = 8192
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 2048
    tie_embeddings: bool = False
    attention_bias: bool = False  # Qwen2: biases on q, k and v (not on o)
    initializer_range: float = 0.02
    embedding_scale: bool = False
    norm_offset: bool = False
    dtype: Literal["float32", "bfloat16"] = "float32"
    param_dtype: Literal["float32", "bfloat16"] = "float32"
    attention: Literal["auto", "xla", "cudnn", "splash"] = "auto"
    remat: str = "none"  # as BertConfig.remat: "full", or a jax.checkpoint_policies name
    # One decoder layer compiled instead of num_layers (parameters stacked on a "layers"
    # axis, the decoder an nnx.scan): as BertConfig.scan_layers.
    scan_layers: bool = False

    def __post_init__(self) -> None:
        if self.remat not in REMAT_POLICIES:
            raise ValueError(f"remat={self.remat!r} is not one of {', '.join(REMAT_POLICIES)}.")
        if self.num_kv_heads is None:
            object.__setattr__(self, "num_kv_heads", self.num_heads)
        if self.head_dim is None:
            if self.hidden_size % self.num_heads:
                raise ValueError(
                    f"hidden_size={self.hidden_size} is not a multiple of num_heads={self.num_heads}; "
                    "give head_dim explicitly."
                )
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
        if self.num_heads % self.kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads} "
                "(each key/value head serves a group of query heads)."
            )
        if self.head_size % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even (rotary embeddings rotate pairs).")

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> LlamaConfig:
        """A named size (tiny, llama-3.2-1b, llama-3.1-8b) with ``overrides`` applied.

        Example:
            >>> LlamaConfig.preset("llama-3.2-1b").num_kv_heads
            8
        """
        if name not in PRESETS:
            raise ValueError(f"unknown Llama preset {name!r}; choose one of {', '.join(PRESETS)} or 'custom'.")
        return cls(**{**PRESETS[name], **overrides})

    @property
    def kv_heads(self) -> int:
        return typing.cast(int, self.num_kv_heads)

    @property
    def head_size(self) -> int:
        return typing.cast(int, self.head_dim)

    @property
    def compute_dtype(self) -> Any:
        return _DTYPES[self.dtype]

    def train_flops_per_token(self, seq_len: int) -> float:
        """Model FLOPs to train on one token of a ``seq_len``-token sequence.

        PaLM's count (Chowdhery et al. 2022, appendix B; MaxText's too): ``6 * N`` for the
        matmul parameters ``N`` (the decoder's projections and the output layer, not the
        embedding lookup) plus ``12 * layers * heads * head_dim * seq_len`` for attention
        scores and their weighting, forward and backward, with no discount for the causal
        mask. Divide tokens/s times this by the peak FLOP/s for MFU.

        Example:
            >>> round(LlamaConfig.preset("llama-3.1-8b").train_flops_per_token(4096) / 1e9, 1)
            51.5
        """
        h, d, layers = self.hidden_size, self.head_size, self.num_layers
        attention = h * d * (2 * self.num_heads + 2 * self.kv_heads)  # q, o; k, v
        per_layer = attention + 3 * h * self.intermediate_size  # gate, up, down
        matmul_params = layers * per_layer + h * self.vocab_size
        return 6.0 * matmul_params + 12.0 * layers * self.num_heads * d * seq_len


def rope_frequencies(cfg: LlamaConfig) -> np.ndarray:
    """The rotary inverse frequencies ``[head_dim / 2]`` (float32), Llama 3 scaling applied.

    Computed as Hugging Face does (``_compute_default_rope_parameters``,
    ``_compute_llama3_parameters``), in float32, so the angles agree bit for bit.
    """
    d = cfg.head_size
    inv_freq = (1.0 / (cfg.rope_theta ** (np.arange(0, d, 2).astype(np.float32) / d))).astype(np.float32)
    if cfg.rope_type == "default":
        return inv_freq
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
    """Rotates ``x [B, T, heads, head_dim]`` by the angles of ``positions [B, T]``.

    The angles are float32 (bf16 positions past 256 would round), cos and sin are cast to
    ``x``'s dtype before the products, as in Hugging Face.
    """
    freqs = positions.astype(jnp.float32)[:, :, None] * jnp.asarray(inv_freq)[None, None, :]  # (B, T, d/2)
    angles = jnp.concatenate([freqs, freqs], axis=-1)[:, :, None, :]  # (B, T, 1, d)
    cos, sin = jnp.cos(angles).astype(x.dtype), jnp.sin(angles).astype(x.dtype)
    return x * cos + rotate_half(x) * sin


def _dense(cfg: LlamaConfig, din: int, dout: int, rngs: nnx.Rngs, axes: tuple[str, str], bias: bool) -> nnx.Linear:
    """A bias-free (unless ``bias``) dense layer whose kernel has the logical axes ``axes``."""
    init = nnx.initializers.normal(stddev=cfg.initializer_range)
    return nnx.Linear(
        din,
        dout,
        use_bias=bias,
        kernel_init=logical(init, *axes),
        bias_init=logical(nnx.initializers.zeros_init(), axes[1]),
        dtype=cfg.compute_dtype,
        param_dtype=_DTYPES[cfg.param_dtype],
        rngs=rngs,
    )


class RMSNorm(nnx.Module):
    """Root-mean-square norm (Zhang & Sennrich 2019): statistics in float32, as Hugging Face's
    ``LlamaRMSNorm``; the weight is ``1 + w`` with ``offset`` (Gemma, initialised at 0)."""

    def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs) -> None:
        init = nnx.initializers.zeros_init() if cfg.norm_offset else nnx.initializers.ones_init()
        self.scale = nnx.Param(logical(init, "norm")(rngs.params(), (cfg.hidden_size,), _DTYPES[cfg.param_dtype]))
        self.eps, self.offset = cfg.rms_norm_eps, cfg.norm_offset

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        scale = self.scale[...].astype(jnp.float32)
        if self.offset:  # Gemma multiplies in float32, then casts
            return (y * (1.0 + scale)[None, None]).astype(x.dtype)
        return y.astype(x.dtype) * scale.astype(x.dtype)[None, None]


class LlamaAttention(nnx.Module):
    def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs) -> None:
        self.cfg = cfg
        h, q_dim, kv_dim = cfg.hidden_size, cfg.num_heads * cfg.head_size, cfg.kv_heads * cfg.head_size
        # Megatron: q, k, v column-parallel by head, o row-parallel. "kv_heads" is its own
        # name so a run with more tensor devices than key/value heads can replicate k and v.
        self.q_proj = _dense(cfg, h, q_dim, rngs, ("embed", "heads"), cfg.attention_bias)
        self.k_proj = _dense(cfg, h, kv_dim, rngs, ("embed", "kv_heads"), cfg.attention_bias)
        self.v_proj = _dense(cfg, h, kv_dim, rngs, ("embed", "kv_heads"), cfg.attention_bias)
        self.o_proj = _dense(cfg, q_dim, h, rngs, ("heads", "embed"), False)

    def __call__(self, x: jax.Array, positions: jax.Array, mask: jax.Array | None, implementation: str) -> jax.Array:
        b, t, _ = x.shape
        cfg = self.cfg
        q = self.q_proj(x).reshape(b, t, cfg.num_heads, cfg.head_size)
        k = self.k_proj(x).reshape(b, t, cfg.kv_heads, cfg.head_size)
        v = self.v_proj(x).reshape(b, t, cfg.kv_heads, cfg.head_size)
        # Computed from the config at trace time: a constant of the compiled program, not
        # state (an array attribute would be a leaf of nnx.state and of checkpoints).
        inv_freq = rope_frequencies(cfg)
        q = constrain(apply_rope(q, positions, inv_freq), "batch", None, "heads", None)
        k = constrain(apply_rope(k, positions, inv_freq), "batch", None, "kv_heads", None)
        v = constrain(v, "batch", None, "kv_heads", None)
        # Grouped-query attention: both take num_kv_heads dividing num_heads as is (no repeat).
        if implementation == "splash":  # ``mask`` is the segment ids [B, T] (or None)
            context = splash.splash_attention(q, k, v, mask)
        else:
            context = jax.nn.dot_product_attention(
                q, k, v, mask=mask, is_causal=True, implementation=typing.cast(Any, implementation)
            )  # (B, T, heads, head_dim)
        return self.o_proj(context.reshape(b, t, cfg.num_heads * cfg.head_size))

    def cached(
        self, x: jax.Array, positions: jax.Array, cache: KVCache, slot: jax.Array, visible: jax.Array
    ) -> tuple[jax.Array, KVCache]:
        """Attention of ``x [B, T, h]`` written into the key/value cache at ``slot`` (the
        same slot for every row), over the cache's keys up to each query's own slot that are
        ``visible [B, S]`` (a left-padded prompt's padding is not)."""
        b, t, _ = x.shape
        cfg = self.cfg
        q = self.q_proj(x).reshape(b, t, cfg.num_heads, cfg.head_size)
        k = self.k_proj(x).reshape(b, t, cfg.kv_heads, cfg.head_size)
        v = self.v_proj(x).reshape(b, t, cfg.kv_heads, cfg.head_size)
        inv_freq = rope_frequencies(cfg)
        q, k = apply_rope(q, positions, inv_freq), apply_rope(k, positions, inv_freq)
        keys = jax.lax.dynamic_update_slice(cache.keys, k.astype(cache.keys.dtype), (0, slot, 0, 0))
        values = jax.lax.dynamic_update_slice(cache.values, v.astype(cache.values.dtype), (0, slot, 0, 0))
        s = keys.shape[1]
        causal = jnp.arange(s)[None, :] <= (slot + jnp.arange(t))[:, None]  # (T, S)
        mask = visible[:, None, None, :] & causal[None, None]  # (B, 1, T, S)
        context = jax.nn.dot_product_attention(q, keys.astype(q.dtype), values.astype(q.dtype), mask=mask)
        return self.o_proj(context.reshape(b, t, cfg.num_heads * cfg.head_size)), KVCache(keys, values)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    """The keys and values generation has computed: ``[B, S, kv_heads, head_dim]`` per
    layer, or ``[layers, B, S, kv_heads, head_dim]`` for the whole model."""

    keys: jax.Array
    values: jax.Array


class LlamaMLP(nnx.Module):
    """SwiGLU (Shazeer 2020): ``down(silu(gate(x)) * up(x))``; Megatron's column/row split."""

    def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs) -> None:
        h, i = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = _dense(cfg, h, i, rngs, ("embed", "mlp"), False)
        self.up_proj = _dense(cfg, h, i, rngs, ("embed", "mlp"), False)
        self.down_proj = _dense(cfg, i, h, rngs, ("mlp", "embed"), False)

    def __call__(self, x: jax.Array) -> jax.Array:
        y = constrain(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x), "batch", None, "mlp")  # (B, T, i)
        return self.down_proj(y)


class LlamaDecoderLayer(nnx.Module):
    def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs) -> None:
        self.input_layernorm = RMSNorm(cfg, rngs)
        self.self_attn = LlamaAttention(cfg, rngs)
        self.post_attention_layernorm = RMSNorm(cfg, rngs)
        self.mlp = LlamaMLP(cfg, rngs)

    def __call__(self, x: jax.Array, positions: jax.Array, mask: jax.Array | None, implementation: str) -> jax.Array:
        x = x + self.self_attn(self.input_layernorm(x), positions, mask, implementation)
        x = x + self.mlp(self.post_attention_layernorm(x))
        return constrain(x, "batch", None, None)

    def cached(
        self, x: jax.Array, positions: jax.Array, cache: KVCache, slot: jax.Array, visible: jax.Array
    ) -> tuple[jax.Array, KVCache]:
        attended, cache = self.self_attn.cached(self.input_layernorm(x), positions, cache, slot, visible)
        x = x + attended
        return x + self.mlp(self.post_attention_layernorm(x)), cache


def _stacked_layers(cfg: LlamaConfig, rngs: nnx.Rngs) -> LlamaDecoderLayer:
    """``num_layers`` decoder layers as one module whose variables have a leading ``layers``
    axis (each layer drawn from its own split of the keys), for :func:`nnx.scan`."""

    @nnx.split_rngs(splits=cfg.num_layers)
    @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
    def build(rngs: nnx.Rngs) -> LlamaDecoderLayer:
        return LlamaDecoderLayer(cfg, rngs)

    return build(rngs)


def _run_layer(
    layer: LlamaDecoderLayer, x: jax.Array, positions: jax.Array, mask: jax.Array | None, implementation: str
) -> jax.Array:
    return layer(x, positions, mask, implementation)


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
            param_dtype=_DTYPES[cfg.param_dtype],
            rngs=rngs,
        )
        # With scan_layers, one layer whose variables are stacked (typed as the list it replaces).
        self.layers: nnx.List[LlamaDecoderLayer] = (
            typing.cast(Any, _stacked_layers(cfg, rngs))
            if cfg.scan_layers
            else nnx.List([LlamaDecoderLayer(cfg, rngs) for _ in range(cfg.num_layers)])
        )
        self.norm = RMSNorm(cfg, rngs)
        self.lm_head = (
            None
            if cfg.tie_embeddings
            else _dense(cfg, cfg.hidden_size, cfg.vocab_size, rngs, ("embed", "vocab"), False)
        )

    def _implementation(self, segment_ids: jax.Array | None, seq_len: int) -> str:
        """The attention kernel (see :class:`LlamaConfig`): splash on TPUs where the shapes
        allow; cuDNN flash attention takes no segment mask and only 16-bit inputs, so "auto"
        uses it for unpacked bf16 on GPUs."""
        attention = self.cfg.attention
        fits = segment_ids is None and self.cfg.dtype == "bfloat16"
        if attention == "cudnn" and not fits:
            raise ValueError("attention='cudnn' needs dtype='bfloat16' and no segment_ids; use 'xla' or 'auto'.")
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
        b, t = input_ids.shape
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32)[None, :], (b, t))
        implementation = self._implementation(segment_ids, t)
        # (B, 1, T, T): a query sees keys of its own segment (is_causal adds "and earlier");
        # splash attention takes the segment ids themselves.
        mask = segment_ids
        if segment_ids is not None and implementation != "splash":
            mask = segment_ids[:, None, :, None] == segment_ids[:, None, None, :]
        dtype = self.cfg.compute_dtype
        # The gradient of a lookup is a scatter-add: on the parameter-dtype table (see BertEmbeddings).
        x = jnp.take(self.embed_tokens.embedding[...], input_ids, axis=0).astype(dtype)  # (B, T, h)
        if self.cfg.embedding_scale:
            x = x * jnp.asarray(math.sqrt(self.cfg.hidden_size), dtype)  # Gemma rounds the factor to dtype
        x = constrain(x, "batch", None, None)
        run = _run_layer
        if self.cfg.remat != "none":
            run = nnx.remat(_run_layer, policy=remat_policy(self.cfg.remat), static_argnums=(4,))
        if self.cfg.scan_layers:

            @nnx.scan(in_axes=(0, nnx.Carry), out_axes=nnx.Carry)
            def decoder(layer: LlamaDecoderLayer, x: jax.Array) -> jax.Array:
                return run(layer, x, positions, mask, implementation)

            x = decoder(typing.cast(LlamaDecoderLayer, self.layers), x)
        else:
            for layer in self.layers:
                x = run(layer, x, positions, mask, implementation)
        return self.norm(x)

    def empty_cache(self, batch: int, length: int, dtype: Any = None) -> KVCache:
        """A key/value cache of ``length`` slots for ``batch`` sequences (zeros)."""
        cfg = self.cfg
        shape = (cfg.num_layers, batch, length, cfg.kv_heads, cfg.head_size)
        zeros = jnp.zeros(shape, dtype or cfg.compute_dtype)
        return KVCache(zeros, zeros)

    def cached(
        self, input_ids: jax.Array, positions: jax.Array, cache: KVCache, slot: jax.Array, visible: jax.Array
    ) -> tuple[jax.Array, KVCache]:
        """Next-token logits ``[B, T, vocab]`` of ``input_ids`` placed at cache ``slot``
        onwards (a prompt, then one token at a time), and the cache with their keys and
        values: what :meth:`__call__` computes for the whole sequence, token by token."""
        dtype = self.cfg.compute_dtype
        x = jnp.take(self.embed_tokens.embedding[...], input_ids, axis=0).astype(dtype)
        if self.cfg.embedding_scale:
            x = x * jnp.asarray(math.sqrt(self.cfg.hidden_size), dtype)
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
        x = self.norm(x)
        logits = self.embed_tokens.attend(x) if self.lm_head is None else self.lm_head(x)
        return logits.astype(jnp.float32), cache

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
        x = self.decode(input_ids, segment_ids, positions)
        logits = self.embed_tokens.attend(x) if self.lm_head is None else self.lm_head(x)
        return constrain(logits.astype(jnp.float32), "batch", None, "vocab")
