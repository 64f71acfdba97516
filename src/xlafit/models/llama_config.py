"""The sizes and options of :class:`xlafit.models.llama.LlamaForCausalLM` and the families
it covers (Llama, Qwen2, Qwen3, Qwen3-MoE, Mistral, Gemma 2, Gemma 3, Gemma 4's text models,
Qwen3.5 and its mixture of experts), with named presets (:mod:`xlafit.models.llama_presets`).

Example:
    >>> LlamaConfig.preset("llama-3.2-1b").num_kv_heads
    8
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any, Literal

import jax.numpy as jnp

from xlafit.errors import ConfigError
from xlafit.models.bert import REMAT_POLICIES
from xlafit.models.llama_presets import PRESETS

__all__ = [
    "DTYPES",
    "KEY_PROJ",
    "LAYER_INPUT",
    "OUT_PROJ",
    "PRESETS",
    "QUERY_PROJ",
    "REMAT",
    "VALUE_PROJ",
    "LlamaConfig",
]

# The names (jax.ad_checkpoint.checkpoint_name) of each decoder layer's input and of its
# attention's projections: MaxText's.
LAYER_INPUT = "decoder_layer_input"
QUERY_PROJ, KEY_PROJ, VALUE_PROJ, OUT_PROJ = "query_proj", "key_proj", "value_proj", "out_proj"
# A decoder layer's remat names: BERT's; "offload" (the layer's input kept in host memory);
# "offload_attention" (the input and the attention's q/k/v and output projections in host memory,
# MaxText's remat of its published v6e Llama 3.1 8B runs)
REMAT = (*REMAT_POLICIES, "offload", "offload_attention")

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """Sizes and options of a Llama; :meth:`preset` fills the sizes by name.

    ``num_kv_heads`` (default ``num_heads``) below ``num_heads`` is grouped-query attention;
    ``head_dim`` defaults to ``hidden_size // num_heads``; both are filled in on
    construction. ``dtype`` is the compute dtype, ``param_dtype`` the parameters' (float32
    unless memory forces bfloat16). ``attention`` picks the kernel: "splash" is the Pallas
    flash-attention kernel for TPUs (:mod:`xlafit.models.splash`: memory linear in the
    sequence, packed segments too), "cudnn" and "xla" the implementations of
    ``jax.nn.dot_product_attention`` as in :class:`~xlafit.models.bert.BertConfig`, "cudnn"
    with packed rows through cuDNN's packed layout (:mod:`xlafit.models.cudnn`; "auto"
    leaves packed rows to XLA); "auto" takes splash on TPUs where
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
    rope_type: Literal["default", "llama3", "linear", "proportional"] = "default"
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
    # The families' differences (Hugging Face's model_type: llama, qwen2, qwen3, qwen3_moe, mistral, gemma2,
    # gemma3_text, gemma4_text, qwen3_5_text, qwen3_5_moe_text).
    family: Literal[
        "llama", "qwen2", "qwen3", "qwen3_moe", "mistral", "gemma2", "gemma3_text", "gemma4_text", "qwen3_5_text",
        "qwen3_5_moe_text",
    ] = "llama"  # fmt: skip
    hidden_activation: Literal["silu", "gelu_tanh"] = "silu"  # the gated MLP's (Gemma: GeGLU)
    qk_norm: bool = False  # an RMSNorm over each head of q and k before the rotation (Qwen3, Gemma 3)
    sandwich_norms: bool = False  # Gemma 2/3: norms after attention and around the MLP as well as before
    attn_logit_softcap: float | None = None  # Gemma 2: scores = cap * tanh(scores / cap)
    final_logit_softcap: float | None = None  # Gemma 2: the same on the output logits
    query_pre_attn_scalar: float | None = None  # Gemma: scores scaled by its -1/2 power instead of head_dim's
    sliding_window: int | None = None  # a sliding layer's query sees the last this many keys (itself included)
    # per layer "sliding_attention", "full_attention" or "linear_attention" (a Gated DeltaNet layer,
    # xlafit.models.gated_deltanet); None: every layer sliding when sliding_window is set
    layer_types: tuple[str, ...] | None = None
    attn_output_gate: bool = False  # Qwen3.5: attention's output times sigmoid(a gate q_proj also computes)
    # The share of each head's dimensions the rotary embedding turns (transformers' partial_rotary_factor),
    # on every layer but the sliding layers with their own base (rope_local_theta): its first dimensions
    # (Qwen3.5: 0.25), or with rope_type="proportional" (Gemma 4's global layers) the first pairs of the
    # rotate_half halves, at frequencies spaced over the whole head (the other pairs keep their position).
    partial_rotary_factor: float = 1.0
    # Gated DeltaNet layers (Qwen3.5): heads and head sizes, the causal convolution's width, and
    # the chunk of the training form (xlafit.models.delta_rule; a power of two)
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_conv_kernel_dim: int = 4
    linear_chunk_size: int = 64
    rope_local_theta: float | None = None  # Gemma 3/4: sliding layers' own rotary base (no scaling)
    # Gemma 4: the global ("full_attention") layers' own head size and key/value heads (None: as the others').
    global_head_dim: int | None = None
    global_kv_heads: int | None = None
    value_norm: bool = False  # Gemma 4: an RMSNorm without weights over each value head
    attention_k_eq_v: bool = False  # Gemma 4: a global layer's values are its key projection (no v_proj)
    # Gemma 4: the last this many layers compute no keys and values: each attends over those of
    # the last earlier layer of its kind (and, generating, reads that layer's cache).
    num_kv_shared_layers: int = 0
    double_wide_mlp: bool = False  # Gemma 4: the key/value-sharing layers' MLP twice as wide
    # Gemma 4's per-layer inputs: a second embedding table [per_layer_vocab_size, num_layers *
    # per_layer_input_size] and a projection of the embeddings, one slice of each feeding each layer
    # through a gate after its MLP. 0: none.
    per_layer_input_size: int = 0
    per_layer_vocab_size: int | None = None
    layer_scalar: bool = False  # Gemma 4: each layer's output times a stored scalar (not trained)
    # Mixture of experts (xlafit.models.moe): num_experts > 0 makes the layers that
    # moe_layers names sparse blocks of num_experts gated MLPs of moe_intermediate_size, each
    # token sent to num_experts_per_tok of them (their weights renormalised with norm_topk_prob);
    # Gemma 4's run beside the layer's dense MLP (moe_beside_mlp)
    num_experts: int = 0
    num_experts_per_tok: int = 2
    moe_intermediate_size: int | None = None  # default intermediate_size
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1  # every this many layers is sparse (Qwen3-MoE's), unless in mlp_only_layers
    mlp_only_layers: tuple[int, ...] = ()  # layers that keep the dense MLP
    # A shared expert of this width in each sparse block (0: none): a gated MLP every token goes
    # through, its output times sigmoid(shared_expert_gate(x)) added to the routed experts' (Qwen3.5-MoE)
    shared_expert_intermediate_size: int = 0
    moe_impl: Literal["ragged", "dense"] = "ragged"  # grouped products, or every expert on every token
    router_aux_loss_coef: float = 0.0  # the load-balancing loss's weight in the training loss
    router_z_loss_coef: float = 0.0  # the router z-loss's (ST-MoE)
    dtype: Literal["float32", "bfloat16"] = "float32"
    param_dtype: Literal["float32", "bfloat16"] = "float32"
    attention: Literal["auto", "xla", "cudnn", "splash"] = "auto"
    # As BertConfig.remat ("full", or a jax.checkpoint_policies name), or "offload": each
    # layer's input saved in pinned host memory, the rest recomputed (layer_remat_policy).
    remat: str = "none"
    # One decoder layer compiled instead of num_layers (parameters stacked on a "layers"
    # axis, the decoder an nnx.scan): as BertConfig.scan_layers. A model that mixes kinds of
    # layer (sliding and global, Gated DeltaNet and attention, dense and mixture of experts)
    # scans its repeating block (scan_period layers: Gemma 3's five sliding and one global),
    # the layers after the last whole block unscanned.
    scan_layers: bool = False
    # Training's and evaluation's loss in blocks of positions (and of the vocabulary where a
    # block's row is large), never the whole [B, T, vocab] logits: "auto" where the whole
    # would be a large share of memory (xlafit.recipes.llm.logits_blocks), N positions a
    # block, or 0: the whole logits at once.
    logits_chunk: int | Literal["auto"] = "auto"

    def __post_init__(self) -> None:
        if self.logits_chunk != "auto" and (not isinstance(self.logits_chunk, int) or self.logits_chunk < 0):
            raise ValueError(
                f"logits_chunk={self.logits_chunk!r} must be auto, 0 (the whole logits) or a number of positions."
            )
        if self.remat not in REMAT:
            raise ValueError(f"remat={self.remat!r} is not one of {', '.join(REMAT)}.")
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
        if self.head_size % 2 or self.rope_type != "proportional" and self.rotary_dim % 2:
            raise ValueError(
                f"head_dim={self.head_dim} times partial_rotary_factor={self.partial_rotary_factor} must be even "
                "(rotary embeddings rotate pairs)."
            )
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ValueError(
                f"linear_num_value_heads={self.linear_num_value_heads} must be a multiple of linear_num_key_heads="
                f"{self.linear_num_key_heads} (each key head serves a group of value heads)."
            )
        if self.linear_chunk_size < 1 or self.linear_chunk_size & (self.linear_chunk_size - 1):
            raise ValueError(f"linear_chunk_size={self.linear_chunk_size} must be a power of two (16, 32, 64, ...).")
        if self.layer_types is not None:
            object.__setattr__(self, "layer_types", tuple(self.layer_types))
            if len(self.layer_types) != self.num_layers:
                raise ValueError(f"layer_types has {len(self.layer_types)} entries for {self.num_layers} layers.")
        object.__setattr__(self, "mlp_only_layers", tuple(self.mlp_only_layers))
        if self.num_experts and not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError(
                f"num_experts_per_tok={self.num_experts_per_tok} must be between 1 and num_experts={self.num_experts}."
            )
        if self.num_kv_shared_layers:
            self.kv_sources  # noqa: B018 (raises on a sharing layer with no earlier layer of its kind)
        if self.scan_layers and self.num_kv_shared_layers:
            raise ConfigError(
                "model.scan_layers=true needs repeating blocks of layers; this model's last layers share earlier "
                "layers' keys and values (num_kv_shared_layers): use model.scan_layers=false."
            )

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
    def rotary_dim(self) -> int:
        """The dimensions of a head the rotary embedding turns (the first ones; the rest pass),
        ``rope_type="proportional"`` aside (:func:`~xlafit.models.attention.rope_frequencies`)."""
        return int(self.head_size * self.partial_rotary_factor)

    @property
    def compute_dtype(self) -> Any:
        return DTYPES[self.dtype]

    @property
    def kinds(self) -> tuple[str, ...]:
        """Each layer's attention: "sliding_attention" (the last ``sliding_window`` keys),
        "full_attention" or "linear_attention" (Gated DeltaNet)."""
        if self.layer_types is not None:
            return self.layer_types
        kind = "sliding_attention" if self.sliding_window else "full_attention"
        return (kind,) * self.num_layers

    @property
    def scan_period(self) -> int:
        """The layers in the block that repeats (layer ``i`` is of the kind of layer ``i -
        period``, dense or sparse alike): 1 when every layer is alike, 6 for Gemma 3's and
        Gemma 4's five sliding and one global, 4 for Qwen3.5's three Gated DeltaNet layers and
        one attention layer.

        Example:
            >>> LlamaConfig.preset("gemma-3-1b").scan_period
            6
        """
        layers = tuple(zip(self.kinds, self.moe_layers, strict=True))
        return next(
            p for p in range(1, len(layers) + 1) if all(layers[i] == layers[i - p] for i in range(p, len(layers)))
        )

    def layer_head_dim(self, kind: str) -> int:
        """The head size of a layer of ``kind`` (Gemma 4's global layers have their own)."""
        return self.global_head_dim if kind == "full_attention" and self.global_head_dim else self.head_size

    def layer_kv_heads(self, kind: str) -> int:
        """The key/value heads of a layer of ``kind`` (Gemma 4's global layers have their own)."""
        return self.global_kv_heads if kind == "full_attention" and self.global_kv_heads else self.kv_heads

    def values_are_keys(self, kind: str) -> bool:
        """Whether a layer of ``kind`` takes its values from its key projection (Gemma 4's
        ``attention_k_eq_v``, on global layers)."""
        return self.attention_k_eq_v and kind == "full_attention"

    @property
    def kv_sources(self) -> tuple[int, ...]:
        """Per layer, the layer whose keys and values it attends over: itself, or for the last
        ``num_kv_shared_layers`` layers the last layer of the same kind before them (as
        transformers' ``Gemma4TextConfig.kv_sharing_modes``)."""
        first = self.num_layers - self.num_kv_shared_layers
        sources = list(range(self.num_layers))
        for i in range(first, self.num_layers):
            earlier = [j for j in range(first) if self.kinds[j] == self.kinds[i]]
            if not earlier:
                raise ValueError(
                    f"num_kv_shared_layers={self.num_kv_shared_layers}: layer {i} ({self.kinds[i]}) shares the keys "
                    "and values of an earlier layer of its kind, and there is none; lower num_kv_shared_layers."
                )
            sources[i] = earlier[-1]
        return tuple(sources)

    def shares_kv(self, index: int) -> bool:
        """Whether layer ``index`` reads another layer's keys and values (computes none)."""
        return index >= self.num_layers - self.num_kv_shared_layers

    def layer_intermediate_size(self, index: int) -> int:
        """Layer ``index``'s MLP width (Gemma 4's ``double_wide_mlp`` doubles the sharing layers')."""
        return self.intermediate_size * (2 if self.double_wide_mlp and self.shares_kv(index) else 1)

    @property
    def moe_layers(self) -> tuple[bool, ...]:
        """Whether each layer is a mixture of experts (Qwen3-MoE's rule: every
        ``decoder_sparse_step``-th layer not in ``mlp_only_layers``)."""
        return tuple(
            self.num_experts > 0 and i not in self.mlp_only_layers and (i + 1) % self.decoder_sparse_step == 0
            for i in range(self.num_layers)
        )

    @property
    def moe_beside_mlp(self) -> bool:
        """Whether a sparse layer keeps its dense MLP and runs the experts beside it, routed by
        :class:`~xlafit.models.moe.ScaledRouter` (Gemma 4's ``enable_moe_block``), rather
        than replacing the MLP by a :class:`~xlafit.models.moe.MoEBlock` (Qwen3-MoE)."""
        return self.family == "gemma4_text" and self.num_experts > 0

    @property
    def expert_size(self) -> int:
        """An expert's intermediate size."""
        return self.moe_intermediate_size or self.intermediate_size

    def train_flops_per_token(self, seq_len: int) -> float:
        """Model FLOPs to train on one token of a ``seq_len``-token sequence.

        PaLM's count (Chowdhery et al. 2022, appendix B; MaxText's too): ``6 * N`` for the
        matmul parameters ``N`` (the decoder's projections and the output layer, not the
        embedding lookup) plus ``12 * layers * heads * head_dim * seq_len`` for attention
        scores and their weighting, forward and backward, with no discount for the causal
        mask. Divide tokens/s times this by the peak FLOP/s for MFU. A Gated DeltaNet layer
        (Qwen3.5) counts its projections and its delta rule's products per token instead.

        Example:
            >>> round(LlamaConfig.preset("llama-3.1-8b").train_flops_per_token(4096) / 1e9, 1)
            51.5
        """
        h, p = self.hidden_size, self.per_layer_input_size
        gates = 2 if self.attn_output_gate else 1
        # A Gated DeltaNet layer: its projections (q, k, v, z, b, a in; out), and per token and
        # value head the delta rule's state products (read, predict, write: 3 Dk Dv) and the
        # in-chunk products (C (2 Dk + Dv)), 6 FLOPs each forward and backward as the matmuls.
        heads, dk, dv = self.linear_num_value_heads, self.linear_key_head_dim, self.linear_value_head_dim
        key_dim, value_dim = self.linear_num_key_heads * dk, heads * dv
        deltanet = h * (2 * key_dim + 2 * value_dim + 2 * heads) + value_dim * h
        rule = heads * (3 * dk * dv + self.linear_chunk_size * (2 * dk + dv))
        # A sparse layer's token runs its router and k of the experts (gate, up, down each), and
        # the shared expert and its gate where there is one. Gemma 4's sparse layer runs its dense MLP too.
        sparse = h * self.num_experts + 3 * h * self.expert_size * self.num_experts_per_tok
        if self.shared_expert_intermediate_size:
            sparse += 3 * h * self.shared_expert_intermediate_size + h
        matmul_params = h * self.vocab_size + h * self.num_layers * p  # output layer; per-layer inputs' projection
        rules, attended = 0.0, 0.0
        for i, (kind, moe) in enumerate(zip(self.kinds, self.moe_layers, strict=True)):
            dense = 3 * h * self.layer_intermediate_size(i)  # gate, up, down
            matmul_params += (sparse + dense * self.moe_beside_mlp) if moe else dense
            matmul_params += 2 * h * p  # the per-layer input's gate and projection
            if kind == "linear_attention":
                matmul_params, rules = matmul_params + deltanet, rules + rule
                continue
            d = self.layer_head_dim(kind)
            kv = 0 if self.shares_kv(i) else (1 if self.values_are_keys(kind) else 2) * self.layer_kv_heads(kind)
            matmul_params += h * d * (gates * self.num_heads + self.num_heads + kv)  # q (and its gate), o; k, v
            # A sliding layer's query sees at most sliding_window keys.
            seen = min(seq_len, self.sliding_window or seq_len) if kind == "sliding_attention" else seq_len
            attended += self.num_heads * d * seen
        return 6.0 * (matmul_params + rules) + 12.0 * attended
