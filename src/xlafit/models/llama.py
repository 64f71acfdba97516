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

import math
import typing
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from xlafit.models import splash
from xlafit.models.attention import rope_frequencies
from xlafit.models.bert import remat_policy
from xlafit.models.decoder import KV, Buffer, KVCache, LlamaAttention, LlamaBlock, LlamaDecoderLayer, LlamaMLP, RMSNorm
from xlafit.models.dense import dense as _dense
from xlafit.models.gated_deltanet import LinearState
from xlafit.models.llama_config import (
    DTYPES,
    KEY_PROJ,
    LAYER_INPUT,
    OUT_PROJ,
    PRESETS,
    QUERY_PROJ,
    VALUE_PROJ,
    LlamaConfig,
)
from xlafit.models.lora import LoRA
from xlafit.models.moe import RouterStats
from xlafit.models.quantized_embed import QuantizedEmbed, QuantizedKernel
from xlafit.parallel.sharding import constrain, logical

__all__ = [
    "PRESETS",
    "Buffer",
    "KVCache",
    "LlamaAttention",
    "LlamaBlock",
    "LlamaConfig",
    "LlamaDecoderLayer",
    "LlamaForCausalLM",
    "LlamaMLP",
    "RMSNorm",
    "layer_remat_policy",
    "rope_frequencies",
]


def _stacked_layers(cfg: LlamaConfig, rngs: nnx.Rngs) -> LlamaDecoderLayer | LlamaBlock:
    """The scanned layers as one module whose variables have a leading ``layers`` axis (each
    drawn from its own split of the keys), for :func:`jax.lax.scan`: ``num_layers`` decoder
    layers when all are alike, else ``num_layers // scan_period`` blocks of ``scan_period``
    layers (:class:`LlamaBlock`)."""
    period = cfg.scan_period

    @nnx.split_rngs(splits=cfg.num_layers // period)
    @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
    def build(rngs: nnx.Rngs) -> LlamaDecoderLayer | LlamaBlock:
        if period == 1:
            return LlamaDecoderLayer(cfg, rngs, cfg.kinds[0], False, cfg.moe_layers[0])
        return LlamaBlock(cfg, rngs, cfg.kinds[:period], cfg.moe_layers[:period])

    return build(rngs)


def _block_layers(module: LlamaDecoderLayer | LlamaBlock) -> list[LlamaDecoderLayer]:
    """The decoder layers of one step of the scan: a layer, or a block's layers in order."""
    return list(module.layers) if isinstance(module, LlamaBlock) else [module]


def _run_layer(
    layer: LlamaDecoderLayer,
    x: jax.Array,
    positions: jax.Array,
    segment_ids: jax.Array | None,
    implementation: str,
    per_layer_input: jax.Array | None = None,
    shared: KV | None = None,
) -> tuple[jax.Array, KV | None, RouterStats | None]:
    # Named for remat="offload", whose policy keeps this one array of the layer for the
    # backward pass, in host memory (an identity otherwise).
    return layer(checkpoint_name(x, LAYER_INPUT), positions, segment_ids, implementation, per_layer_input, shared)


def _lookup(table: nnx.Embed | QuantizedEmbed, ids: jax.Array) -> jax.Array:
    """The rows of ``ids``: a quantized table dequantizes its tokens' rows alone."""
    if isinstance(table, QuantizedEmbed):
        return table.lookup(ids)
    # The gradient of a lookup is a scatter-add: on the parameter-dtype table (see BertEmbeddings).
    return jnp.take(table.embedding[...], ids, axis=0)


def layer_remat_policy(name: str) -> Any:
    """The ``jax.checkpoint`` policy of a decoder layer's ``remat`` name: ``"offload"``
    saves the layer's input in pinned host memory and recomputes the rest (MaxText's
    ``decoder_layer_input: offload``), ``"offload_attention"`` its attention's q/k/v and output
    projections there too (the products the backward pass then does not redo); the others as
    :func:`~xlafit.models.bert.remat_policy`.

    Example:
        >>> layer_remat_policy("full") is None
        True
    """
    offloaded = {"offload": [LAYER_INPUT], "offload_attention": [LAYER_INPUT, *ATTENTION_PROJECTIONS]}
    if name in offloaded:
        return jax.checkpoint_policies.save_and_offload_only_these_names(
            names_which_can_be_saved=[],
            names_which_can_be_offloaded=offloaded[name],
            offload_src="device",
            offload_dst="pinned_host",
        )
    return remat_policy(name)


# The attention's projections that "offload_attention" keeps in host memory
ATTENTION_PROJECTIONS = (QUERY_PROJ, KEY_PROJ, VALUE_PROJ, OUT_PROJ)


class LlamaForCausalLM(nnx.Module):
    """Llama decoder with its language-model head; Hugging Face's ``LlamaForCausalLM`` in NNX
    (and its families' causal LMs, :class:`LlamaConfig`'s ``family``).

    Args:
        cfg: sizes and options.
        rngs: ``params`` for initialisation (normal, std ``initializer_range``, as
            Hugging Face).
    """

    def __init__(self, cfg: LlamaConfig, *, rngs: nnx.Rngs) -> None:
        self.cfg = cfg
        init = nnx.initializers.normal(stddev=cfg.initializer_range)

        def embedding(rows: int, width: int) -> nnx.Embed:
            return nnx.Embed(
                rows,
                width,
                embedding_init=logical(init, "vocab", "embed"),
                dtype=cfg.compute_dtype,
                param_dtype=DTYPES[cfg.param_dtype],
                rngs=rngs,
            )

        self.embed_tokens = embedding(cfg.vocab_size, cfg.hidden_size)
        if cfg.per_layer_input_size:  # Gemma 4: every layer's slice side by side
            width = cfg.num_layers * cfg.per_layer_input_size
            self.embed_tokens_per_layer = embedding(cfg.per_layer_vocab_size or cfg.vocab_size, width)
            self.per_layer_model_projection = _dense(cfg, cfg.hidden_size, width, rngs, ("embed", "mlp"), False)
            self.per_layer_projection_norm = RMSNorm(cfg, rngs, cfg.per_layer_input_size)
        # With scan_layers, one layer (or block) whose variables are stacked (typed as the list
        # it replaces), and the layers after the last whole block in a list of their own.
        self.layers: nnx.List[LlamaDecoderLayer] = (
            typing.cast(Any, _stacked_layers(cfg, rngs))
            if cfg.scan_layers
            else nnx.List(
                [
                    LlamaDecoderLayer(cfg, rngs, kind, cfg.shares_kv(i), moe)
                    for i, (kind, moe) in enumerate(zip(cfg.kinds, cfg.moe_layers, strict=True))
                ]
            )
        )
        if cfg.scan_layers and cfg.scan_period > 1:
            after = list(zip(cfg.kinds, cfg.moe_layers, strict=True))[self._scanned() :]
            self.tail = nnx.List([LlamaDecoderLayer(cfg, rngs, kind, False, moe) for kind, moe in after])
        self.norm = RMSNorm(cfg, rngs)
        self.lm_head = (
            None
            if cfg.tie_embeddings
            else _dense(cfg, cfg.hidden_size, cfg.vocab_size, rngs, ("embed", "vocab"), False)
        )

    def _scanned(self) -> int:
        """How many layers the scan runs (whole blocks); the rest are the unscanned tail."""
        period = self.cfg.scan_period
        return self.cfg.num_layers // period * period

    def _tail(self) -> list[LlamaDecoderLayer]:
        return list(self.tail) if self.cfg.scan_layers and self.cfg.scan_period > 1 else []

    def layer_prefixes(self) -> list[tuple[tuple[str | int, ...], int | None]]:
        """Per decoder layer ``i`` (Hugging Face's ``layers.{i}``), the path of its module in
        this model and its row in stacked variables (None: not stacked): ``("layers", i)``
        unscanned; ``("layers",)``, row ``i`` for scanned alike layers; ``("layers", "layers",
        i % period)``, row ``i // period`` for a scanned block, ``("tail", k)`` after it.

        Example:
            >>> cfg = LlamaConfig.preset("tiny", layer_types=("sliding_attention", "full_attention") * 2 + (
            ...     "sliding_attention",), num_layers=5, sliding_window=4, scan_layers=True)
            >>> prefixes = LlamaForCausalLM(cfg, rngs=nnx.Rngs(0)).layer_prefixes()
            >>> prefixes[3], prefixes[4]
            ((('layers', 'layers', 1), 1), (('tail', 0), None))
        """
        cfg = self.cfg
        if not cfg.scan_layers:
            return [(("layers", i), None) for i in range(cfg.num_layers)]
        period, scanned = cfg.scan_period, self._scanned()
        if period == 1:
            return [(("layers",), i) for i in range(cfg.num_layers)]
        return [(("layers", "layers", i % period), i // period) for i in range(scanned)] + [
            (("tail", k), None) for k in range(cfg.num_layers - scanned)
        ]

    def layer_at(self, i: int) -> tuple[LlamaDecoderLayer, int | None]:
        """Decoder layer ``i``'s module and its row in stacked variables (None: not stacked)."""
        prefix, row = self.layer_prefixes()[i]
        module: Any = self
        for key in prefix:
            module = module[key] if isinstance(key, int) else getattr(module, key)
        return module, row

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
        head_sizes = sorted({cfg.layer_head_dim(kind) for kind in cfg.kinds})
        splash_refusal = next(filter(None, (splash.unsupported(seq_len, d) for d in head_sizes)), None)
        if attention == "splash" and (splash_refusal or not splash.on_tpu()):
            why = splash_refusal or "it runs on TPUs only"
            raise ValueError(f"attention='splash': {why}; use 'xla' or 'auto'.")
        if attention == "auto":
            if splash_refusal is None and splash.on_tpu():
                return "splash"
            return "cudnn" if fits and jax.default_backend() == "gpu" else "xla"
        return attention

    def _embed(self, input_ids: jax.Array) -> tuple[jax.Array, jax.Array | None]:
        """The embeddings ``[B, T, h]`` and Gemma 4's per-layer inputs ``[B, T, layers,
        per_layer_input_size]`` (None without them), as transformers' ``get_per_layer_inputs``
        and ``project_per_layer_inputs`` compute them."""
        cfg = self.cfg
        dtype = cfg.compute_dtype
        x = _lookup(self.embed_tokens, input_ids).astype(dtype)  # (B, T, h)
        if cfg.embedding_scale:
            x = x * jnp.asarray(math.sqrt(cfg.hidden_size), dtype)  # Gemma rounds the factor to dtype
        if not cfg.per_layer_input_size:
            return x, None
        b, t = input_ids.shape
        p = cfg.per_layer_input_size
        tokens = _lookup(self.embed_tokens_per_layer, input_ids).astype(dtype)
        tokens = (tokens * jnp.asarray(math.sqrt(p), dtype)).reshape(b, t, cfg.num_layers, p)
        projected = self.per_layer_model_projection(x) * jnp.asarray(cfg.hidden_size**-0.5, dtype)
        projected = self.per_layer_projection_norm(projected.reshape(b, t, cfg.num_layers, p))
        return x, (projected + tokens) * jnp.asarray(2**-0.5, dtype)

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
        cfg = self.cfg
        b, t = input_ids.shape
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32)[None, :], (b, t))
        implementation = self._implementation(segment_ids, t)
        x, per_layer = self._embed(input_ids)
        x = constrain(x, "batch", None, "activation_embed")
        run = _run_layer
        if cfg.remat != "none":
            run = nnx.remat(_run_layer, policy=layer_remat_policy(cfg.remat), static_argnums=(4,))
        total: RouterStats | None = RouterStats.zeros(cfg.num_experts) if any(cfg.moe_layers) else None

        def add(total: RouterStats | None, stats: RouterStats | None) -> RouterStats | None:
            return total if stats is None or total is None else total + stats

        if cfg.scan_layers:
            # A plain lax.scan over the layers' stacked state, each layer merged in the body:
            # nnx.scan would also return the state it scans (to carry a layer's mutations out),
            # and a frozen base's stacked weights (LoRA) then come out of the forward loop as a
            # second copy, written layer by layer (the TPU compiler copies the whole stack each
            # layer: a third of a v5e-1 step for a 1.7B model). These layers mutate nothing.
            graphdef, stacked = nnx.split(self.layers)
            period, scanned = cfg.scan_period, self._scanned()
            layer_inputs = None if per_layer is None else jnp.moveaxis(per_layer, 2, 0)  # (layers, B, T, p)

            def decoder(carry: Any, xs: Any) -> tuple[Any, None]:
                (x, total), (state, inputs) = carry, xs  # inputs: the block's per-layer inputs (period, B, T, p)
                module = typing.cast(LlamaDecoderLayer | LlamaBlock, nnx.merge(graphdef, state))
                for j, layer in enumerate(_block_layers(module)):
                    x, _, stats = run(
                        layer, x, positions, segment_ids, implementation, None if inputs is None else inputs[j]
                    )
                    total = add(total, stats)
                return (x, total), None

            blocks = (
                None if layer_inputs is None else layer_inputs[:scanned].reshape(-1, period, *layer_inputs.shape[1:])
            )
            (x, total), _ = jax.lax.scan(decoder, (x, total), (stacked, blocks))
            for k, layer in enumerate(self._tail()):
                layer_input = None if layer_inputs is None else layer_inputs[scanned + k]
                x, _, stats = run(layer, x, positions, segment_ids, implementation, layer_input)
                total = add(total, stats)
        else:
            sources = cfg.kv_sources
            read = set(sources[i] for i in range(cfg.num_layers) if cfg.shares_kv(i))
            kept: dict[int, KV | None] = {}  # the keys and values of the layers that others share
            for i, layer in enumerate(self.layers):
                layer_input = None if per_layer is None else per_layer[:, :, i]
                shared = kept[sources[i]] if cfg.shares_kv(i) else None
                x, kv, stats = run(layer, x, positions, segment_ids, implementation, layer_input, shared)
                total = add(total, stats)
                if i in read:
                    kept[i] = kv
        return self.norm(x), total

    def output_kernel(self) -> jax.Array | QuantizedKernel:
        """The output layer as one ``[hidden, vocab]`` matrix: :meth:`logits` is ``x @`` it
        (then cast to float32 and soft-capped), for a loss that computes the logits a block
        at a time (:func:`xlafit.train.losses.blockwise_cross_entropy`). A tied model's is the
        embedding's transpose; a LoRA-adapted ``lm_head``'s, its kernel plus the scaled update;
        a quantized table's (``lora.quantize_embeddings``), its codes, which the loss
        dequantizes a tile of the vocabulary at a time."""
        head = self.embed_tokens if self.lm_head is None else self.lm_head
        if isinstance(head, QuantizedEmbed):
            return head.kernel()
        if self.lm_head is None:
            return self.embed_tokens.embedding[...].T
        if isinstance(self.lm_head, LoRA):
            base = typing.cast(nnx.Linear, self.lm_head.base_module)
            update = self.lm_head.lora_a[...] @ self.lm_head.lora_b[...]
            return base.kernel[...] + (update * self.lm_head.scaling).astype(base.kernel[...].dtype)
        return self.lm_head.kernel[...]

    def logits(self, x: jax.Array) -> jax.Array:
        """Float32 logits ``[..., vocab]`` of final hidden states (:meth:`decode`'s)."""
        head = self.embed_tokens if self.lm_head is None else self.lm_head
        logits = (head.attend(x) if isinstance(head, nnx.Embed | QuantizedEmbed) else head(x)).astype(jnp.float32)
        if self.cfg.final_logit_softcap:  # Gemma 2
            cap = self.cfg.final_logit_softcap
            logits = jnp.tanh(logits / cap) * cap
        return logits

    def _cache_owners(self) -> list[int]:
        """The layers that keep a cache (a layer that shares another's keys and values has none)."""
        return [i for i in range(self.cfg.num_layers) if not self.cfg.shares_kv(i)]

    def empty_cache(self, batch: int, length: int, dtype: Any = None) -> Any:
        """What generation carries from step to step for ``batch`` sequences of at most
        ``length`` slots (zeros): per layer that keeps one, a :class:`KVCache` of its kind's
        head size and key/value heads, or a Gated DeltaNet layer's
        :class:`~xlafit.models.gated_deltanet.LinearState`; a tuple of them, in layer order.
        Scanned layers: ``(block, tail)``, ``block`` a tuple per position in the scanned block,
        stacked over the blocks, ``tail`` the unscanned layers' after it."""
        cfg = self.cfg
        dtype = dtype or cfg.compute_dtype

        def empty(layer: LlamaDecoderLayer, kind: str) -> KVCache | LinearState:
            if layer.linear:
                return layer.linear_attn.empty_state(batch, dtype)
            zeros = jnp.zeros((batch, length, cfg.layer_kv_heads(kind), cfg.layer_head_dim(kind)), dtype)
            return KVCache(zeros, zeros)

        if cfg.scan_layers:
            blocks, first = self._scanned() // cfg.scan_period, self._scanned()
            module = typing.cast(LlamaDecoderLayer | LlamaBlock, self.layers)
            block = tuple(
                jax.tree.map(lambda a: jnp.zeros((blocks, *a.shape), a.dtype), empty(layer, kind))
                for layer, kind in zip(_block_layers(module), cfg.kinds, strict=False)
            )
            return block, tuple(empty(layer, kind) for layer, kind in zip(self._tail(), cfg.kinds[first:], strict=True))
        return tuple(empty(self.layers[i], cfg.kinds[i]) for i in self._cache_owners())

    def cached(
        self, input_ids: jax.Array, positions: jax.Array, cache: Any, slot: jax.Array, visible: jax.Array
    ) -> tuple[jax.Array, Any]:
        """Next-token logits ``[B, T, vocab]`` of ``input_ids`` placed at cache ``slot``
        onwards (a prompt, then one token at a time), and the cache (:meth:`empty_cache`'s)
        with their keys and values: what :meth:`__call__` computes for the whole sequence,
        token by token. A layer that shares keys and values reads its source layer's cache
        (written by then in this call) and writes none."""
        hidden, cache = self.cached_hidden(input_ids, positions, cache, slot, visible)
        return self.logits(hidden), cache

    def cached_hidden(
        self, input_ids: jax.Array, positions: jax.Array, cache: Any, slot: jax.Array, visible: jax.Array
    ) -> tuple[jax.Array, Any]:
        """:meth:`cached` up to the output layer: the final hidden states ``[B, T, hidden]``
        (normed) whose :meth:`logits` it returns, and the cache."""
        cfg = self.cfg
        x, per_layer = self._embed(input_ids)
        if cfg.scan_layers:

            @nnx.scan(in_axes=(0, nnx.Carry, 0, 0), out_axes=(nnx.Carry, 0))
            def decoder(module: LlamaDecoderLayer | LlamaBlock, x: jax.Array, caches: Any, inputs: Any) -> Any:
                written = []
                for j, layer in enumerate(_block_layers(module)):
                    x, c = layer.cached(x, positions, caches[j], slot, visible, None if inputs is None else inputs[j])
                    written.append(c)
                return x, tuple(written)

            period, scanned = cfg.scan_period, self._scanned()
            layer_inputs = None if per_layer is None else jnp.moveaxis(per_layer, 2, 0)
            blocks = (
                None if layer_inputs is None else layer_inputs[:scanned].reshape(-1, period, *layer_inputs.shape[1:])
            )
            block, tail = cache
            x, block = decoder(typing.cast(LlamaDecoderLayer | LlamaBlock, self.layers), x, block, blocks)
            tail = list(tail)
            for k, layer in enumerate(self._tail()):
                layer_input = None if layer_inputs is None else layer_inputs[scanned + k]
                x, tail[k] = layer.cached(x, positions, tail[k], slot, visible, layer_input)
            cache = (block, tuple(tail))
        else:
            owners = self._cache_owners()
            entry = [owners.index(source) for source in cfg.kv_sources]  # layer -> its (source's) cache entry
            caches = list(cache)
            for i, layer in enumerate(self.layers):
                layer_input = None if per_layer is None else per_layer[:, :, i]
                x, written = layer.cached(x, positions, caches[entry[i]], slot, visible, layer_input)
                if not cfg.shares_kv(i):
                    caches[entry[i]] = written
            cache = tuple(caches)
        return self.norm(x), cache

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
