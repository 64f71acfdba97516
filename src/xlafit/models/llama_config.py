"""The sizes and options of :class:`xlafit.models.llama.LlamaForCausalLM` and the families
it covers (Llama, Qwen2, Qwen3, Mistral, Gemma 2, Gemma 3, Qwen3.5), with named presets.

Example:
    >>> LlamaConfig.preset("llama-3.2-1b").num_kv_heads
    8
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any, Literal

import jax.numpy as jnp

from xlafit.models.bert import REMAT_POLICIES

__all__ = ["DTYPES", "LAYER_INPUT", "PRESETS", "REMAT", "LlamaConfig"]

# The name (jax.ad_checkpoint.checkpoint_name) of each decoder layer's input: MaxText's.
LAYER_INPUT = "decoder_layer_input"
# A decoder layer's remat names: BERT's, and "offload" (the layer's input kept in host memory).
REMAT = (*REMAT_POLICIES, "offload")

# Released sizes (the config.json of meta-llama/Llama-3.2-1B, Llama-3.1-8B and Llama-3.1-70B,
# google/gemma-3-1b-it, gemma-3-12b-pt and gemma-3-27b-pt's text model, Qwen/Qwen3-1.7B, Qwen3-14B,
# Qwen3-32B and Qwen3-30B-A3B), and tiny ones for tests (dense, and a mixture of experts).
# vocab_size of "tiny" and "tiny-moe" is a placeholder: set it to the tokenizer's.
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
    "gemma-3-1b": {  # google/gemma-3-1b-it's config.json
        "family": "gemma3_text",
        "num_layers": 26,
        "hidden_size": 1152,
        "num_heads": 4,
        "num_kv_heads": 1,
        "head_dim": 256,
        "intermediate_size": 6912,
        "vocab_size": 262144,
        "hidden_activation": "gelu_tanh",
        "qk_norm": True,
        "sandwich_norms": True,
        "embedding_scale": True,
        "norm_offset": True,
        "query_pre_attn_scalar": 256,
        "sliding_window": 512,
        "layer_types": tuple("full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(26)),
        "rope_theta": 1000000.0,
        "rope_local_theta": 10000.0,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 32768,
        "tie_embeddings": True,
    },
    "qwen3-1.7b": {  # Qwen/Qwen3-1.7B's config.json
        "family": "qwen3",
        "num_layers": 28,
        "hidden_size": 2048,
        "num_heads": 16,
        "num_kv_heads": 8,
        "head_dim": 128,
        "intermediate_size": 6144,
        "vocab_size": 151936,
        "qk_norm": True,
        "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 40960,
        "tie_embeddings": True,
    },
    "tiny-moe": {  # tiny with Qwen3-MoE's sparse blocks: 8 experts, 2 a token
        "family": "qwen3_moe",
        "num_layers": 2,
        "hidden_size": 64,
        "num_heads": 4,
        "num_kv_heads": 2,
        "intermediate_size": 128,
        "moe_intermediate_size": 32,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "norm_topk_prob": True,
        "router_aux_loss_coef": 0.001,
        "qk_norm": True,
        "vocab_size": 512,
        "max_position_embeddings": 512,
    },
    "qwen3-30b-a3b": {  # Qwen/Qwen3-30B-A3B's config.json
        "family": "qwen3_moe",
        "num_layers": 48,
        "hidden_size": 2048,
        "num_heads": 32,
        "num_kv_heads": 4,
        "head_dim": 128,
        "intermediate_size": 6144,
        "moe_intermediate_size": 768,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "norm_topk_prob": True,
        "router_aux_loss_coef": 0.001,
        "qk_norm": True,
        "vocab_size": 151936,
        "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 40960,
        "tie_embeddings": False,
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
    "gemma-3-12b": {
        "family": "gemma3_text",
        "num_layers": 48,
        "hidden_size": 3840,
        "num_heads": 16,
        "num_kv_heads": 8,
        "head_dim": 256,
        "intermediate_size": 15360,
        "vocab_size": 262208,
        "hidden_activation": "gelu_tanh",
        "qk_norm": True,
        "sandwich_norms": True,
        "embedding_scale": True,
        "norm_offset": True,
        "query_pre_attn_scalar": 256,
        "sliding_window": 1024,
        "layer_types": tuple("full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(48)),
        "rope_theta": 1000000.0,
        "rope_type": "linear",
        "rope_factor": 8.0,
        "rope_local_theta": 10000.0,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 131072,
        "tie_embeddings": True,
    },  # google/gemma-3-12b-pt's text_config
    "gemma-3-27b": {
        "family": "gemma3_text",
        "num_layers": 62,
        "hidden_size": 5376,
        "num_heads": 32,
        "num_kv_heads": 16,
        "head_dim": 128,
        "intermediate_size": 21504,
        "vocab_size": 262208,
        "hidden_activation": "gelu_tanh",
        "qk_norm": True,
        "sandwich_norms": True,
        "embedding_scale": True,
        "norm_offset": True,
        "query_pre_attn_scalar": 168,
        "sliding_window": 1024,
        "layer_types": tuple("full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(62)),
        "rope_theta": 1000000.0,
        "rope_type": "linear",
        "rope_factor": 8.0,
        "rope_local_theta": 10000.0,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 131072,
        "tie_embeddings": True,
    },  # google/gemma-3-27b-pt's text_config
    "qwen3-14b": {
        "family": "qwen3",
        "num_layers": 40,
        "hidden_size": 5120,
        "num_heads": 40,
        "num_kv_heads": 8,
        "head_dim": 128,
        "intermediate_size": 17408,
        "vocab_size": 151936,
        "qk_norm": True,
        "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 40960,
        "tie_embeddings": False,
    },  # Qwen/Qwen3-14B's config.json
    "qwen3-32b": {
        "family": "qwen3",
        "num_layers": 64,
        "hidden_size": 5120,
        "num_heads": 64,
        "num_kv_heads": 8,
        "head_dim": 128,
        "intermediate_size": 25600,
        "vocab_size": 151936,
        "qk_norm": True,
        "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 40960,
        "tie_embeddings": False,
    },  # Qwen/Qwen3-32B's config.json
    "llama-3.1-70b": {  # meta-llama/Llama-3.1-70B's config.json
        "num_layers": 80,
        "hidden_size": 8192,
        "num_heads": 64,
        "num_kv_heads": 8,
        "intermediate_size": 28672,
        "vocab_size": 128256,
        "rope_theta": 500000.0,
        "rope_type": "llama3",
        "rope_factor": 8.0,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 131072,
        "tie_embeddings": False,
    },
}

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
    rope_type: Literal["default", "llama3", "linear"] = "default"
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
    # gemma3_text, qwen3_5_text).
    family: Literal["llama", "qwen2", "qwen3", "qwen3_moe", "mistral", "gemma2", "gemma3_text", "qwen3_5_text"] = (
        "llama"
    )
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
    partial_rotary_factor: float = 1.0  # the share of each head's dimensions rotated (Qwen3.5: 0.25)
    # Gated DeltaNet layers (Qwen3.5): heads and head sizes, the causal convolution's width, and
    # the chunk of the training form (xlafit.models.delta_rule; a power of two)
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_conv_kernel_dim: int = 4
    linear_chunk_size: int = 64
    rope_local_theta: float | None = None  # Gemma 3: sliding layers' own rotary base (no scaling)
    # Mixture of experts (xlafit.models.moe): num_experts > 0 makes the layers that
    # moe_layers names sparse blocks of num_experts gated MLPs of moe_intermediate_size, each
    # token sent to num_experts_per_tok of them (their weights renormalised with norm_topk_prob)
    num_experts: int = 0
    num_experts_per_tok: int = 2
    moe_intermediate_size: int | None = None  # default intermediate_size
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1  # every this many layers is sparse (Qwen3-MoE's), unless in mlp_only_layers
    mlp_only_layers: tuple[int, ...] = ()  # layers that keep the dense MLP
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
    # axis, the decoder an nnx.scan): as BertConfig.scan_layers.
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
        if self.head_size % 2 or self.rotary_dim % 2:
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
        if self.scan_layers and len(set(self.moe_layers)) > 1:
            raise ValueError(
                "scan_layers=True needs identical layers; this model mixes dense and mixture-of-experts layers "
                "(decoder_sparse_step, mlp_only_layers): use scan_layers=False."
            )
        if self.scan_layers and len(set(self.kinds)) > 1:
            raise ValueError(
                f"scan_layers=True needs identical layers; this model mixes {' and '.join(sorted(set(self.kinds)))} "
                "layers (Gemma's and Qwen3.5's patterns): use scan_layers=False."
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
        """The dimensions of a head the rotary embedding turns (the first ones; the rest pass)."""
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
    def moe_layers(self) -> tuple[bool, ...]:
        """Whether each layer is a mixture of experts (Qwen3-MoE's rule: every
        ``decoder_sparse_step``-th layer not in ``mlp_only_layers``)."""
        return tuple(
            self.num_experts > 0 and i not in self.mlp_only_layers and (i + 1) % self.decoder_sparse_step == 0
            for i in range(self.num_layers)
        )

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
        h, d = self.hidden_size, self.head_size
        gates = 2 if self.attn_output_gate else 1
        attention = h * d * ((1 + gates) * self.num_heads + 2 * self.kv_heads)  # q (and its gate), o; k, v
        kinds = self.kinds
        linear = kinds.count("linear_attention")
        # A Gated DeltaNet layer: its projections (q, k, v, z, b, a in; out), and per token and
        # value head the delta rule's state products (read, predict, write: 3 Dk Dv) and the
        # in-chunk products (C (2 Dk + Dv)), 6 FLOPs each forward and backward as the matmuls.
        heads, dk, dv = self.linear_num_value_heads, self.linear_key_head_dim, self.linear_value_head_dim
        key_dim, value_dim = self.linear_num_key_heads * dk, heads * dv
        deltanet = h * (2 * key_dim + 2 * value_dim + 2 * heads) + value_dim * h
        rule = heads * (3 * dk * dv + self.linear_chunk_size * (2 * dk + dv))
        # A sparse layer's token runs its router and k of the experts (gate, up, down each).
        sparse = h * self.num_experts + 3 * h * self.expert_size * self.num_experts_per_tok
        mlps = sum(sparse if moe else 3 * h * self.intermediate_size for moe in self.moe_layers)
        matmul_params = (len(kinds) - linear) * attention + linear * deltanet + mlps + h * self.vocab_size
        # A sliding layer's query sees at most sliding_window keys.
        seen = sum(
            min(seq_len, self.sliding_window or seq_len) if kind == "sliding_attention" else seq_len
            for kind in kinds
            if kind != "linear_attention"
        )
        return 6.0 * (matmul_params + linear * rule) + 12.0 * self.num_heads * d * seen
