"""The named sizes of :class:`~xlafit.models.llama_config.LlamaConfig`: released models'
``config.json`` values, and tiny ones for tests.

Example:
    >>> PRESETS["llama-3.2-1b"]["num_kv_heads"]
    8
"""

from __future__ import annotations

from typing import Any

__all__ = ["PRESETS"]


def _kinds(layers: int, period: int) -> tuple[str, ...]:
    """Sliding layers with a global one every ``period`` (Gemma's pattern)."""
    return tuple("full_attention" if (i + 1) % period == 0 else "sliding_attention" for i in range(layers))


# What every Gemma 4 text model shares (transformers' gemma4_text as xlafit.hf.gemma4 reads it).
_GEMMA4: dict[str, Any] = {
    "family": "gemma4_text",
    "head_dim": 256,
    "global_head_dim": 512,
    "vocab_size": 262144,
    "hidden_activation": "gelu_tanh",
    "qk_norm": True,
    "value_norm": True,
    "sandwich_norms": True,
    "layer_scalar": True,
    "embedding_scale": True,
    "query_pre_attn_scalar": 1.0,
    "final_logit_softcap": 30.0,
    "rope_theta": 1000000.0,
    "rope_type": "proportional",
    "rope_factor": 1.0,
    "partial_rotary_factor": 0.25,
    "rope_local_theta": 10000.0,
    "rms_norm_eps": 1e-6,
    "tie_embeddings": True,
}


# Released sizes (the config.json of meta-llama/Llama-3.2-1B, Llama-3.1-8B and Llama-3.1-70B,
# google/gemma-3-1b-it, gemma-3-4b-it, gemma-3-12b-pt and gemma-3-27b-pt's text model, the text_config of
# google/gemma-4-E2B, E4B, 26B-A4B and 31B, Qwen/Qwen3-1.7B, Qwen3-14B, Qwen3-32B and
# Qwen3-30B-A3B), and tiny ones for tests (dense, and a mixture of experts).
# vocab_size of "tiny" and "tiny-moe" is a placeholder: set it to the tokenizer's.
def _gemma3(layers: int, hidden: int, heads: int, kv_heads: int, intermediate: int, **more: Any) -> dict[str, Any]:
    """What Gemma 3's text models share, as the 4B, 12B and 27B have it (``more`` gives the 1B's
    and 27B's differences): five sliding-window layers of 1,024 to each global one (its rotation
    scaled linearly by 8), heads of 256, the 262,208-token vocabulary tied to the output layer, a
    context of 131,072."""
    return {
        "family": "gemma3_text",
        "num_layers": layers,
        "hidden_size": hidden,
        "num_heads": heads,
        "num_kv_heads": kv_heads,
        "head_dim": 256,
        "intermediate_size": intermediate,
        "vocab_size": 262208,
        "hidden_activation": "gelu_tanh",
        "qk_norm": True,
        "sandwich_norms": True,
        "embedding_scale": True,
        "norm_offset": True,
        "query_pre_attn_scalar": 256,
        "sliding_window": 1024,
        "layer_types": tuple("full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(layers)),
        "rope_theta": 1000000.0,
        "rope_type": "linear",
        "rope_factor": 8.0,
        "rope_local_theta": 10000.0,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 131072,
        "tie_embeddings": True,
        **more,
    }


def _qwen3_5(layers: int, hidden: int, heads: int, kv_heads: int, value_heads: int) -> dict[str, Any]:
    """What Qwen3.5's text models share: three Gated DeltaNet layers to each attention layer
    (its output gated, rotation on a quarter of a head of 256), 16 key heads of 128 in the
    DeltaNet layers, the 248,320-token vocabulary, an untied output layer."""
    return {
        "family": "qwen3_5_text",
        "num_layers": layers,
        "hidden_size": hidden,
        "num_heads": heads,
        "num_kv_heads": kv_heads,
        "head_dim": 256,
        "layer_types": tuple("full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)),
        "attn_output_gate": True,
        "qk_norm": True,
        "norm_offset": True,
        "partial_rotary_factor": 0.25,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": value_heads,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "linear_conv_kernel_dim": 4,
        "vocab_size": 248320,
        "rope_theta": 10000000.0,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 262144,
        "tie_embeddings": False,
    }


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
    "gemma-3-1b": _gemma3(  # google/gemma-3-1b-it's config.json
        26, 1152, 4, 1, 6912, vocab_size=262144, sliding_window=512, rope_type="default", max_position_embeddings=32768
    ),
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
    # Qwen/Qwen3.5-35B-A3B's text_config: transformers' Qwen3_5MoeTextConfig defaults (its "35B-A3B
    # style") with the release's rotary base and context; every field equal to what xlafit reads
    # from the release's config.json (as MaxText's checkpoint conversion copies it)
    "qwen3.5-35b-a3b": {
        **_qwen3_5(layers=40, hidden=2048, heads=16, kv_heads=2, value_heads=32),
        "family": "qwen3_5_moe_text",
        "moe_intermediate_size": 512,
        "shared_expert_intermediate_size": 512,
        "num_experts": 256,
        "num_experts_per_tok": 8,
        "norm_topk_prob": True,
        "router_aux_loss_coef": 0.001,
    },
    # Qwen/Qwen3.5-9B's and Qwen/Qwen3.5-27B's text_config (the released config.json, as public
    # repositories that load the checkpoints copy it; the 9B's is transformers' Qwen3_5TextConfig
    # defaults)
    "qwen3.5-9b": {
        **_qwen3_5(layers=32, hidden=4096, heads=16, kv_heads=4, value_heads=32),
        "intermediate_size": 12288,
    },
    "qwen3.5-27b": {
        **_qwen3_5(layers=64, hidden=5120, heads=24, kv_heads=4, value_heads=48),
        "intermediate_size": 17408,
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
    # the text_config of google/gemma-3-4b-it (the multimodal checkpoint's text model), -12b-pt, -27b-pt
    "gemma-3-4b": _gemma3(34, 2560, 8, 4, 10240),
    "gemma-3-12b": _gemma3(48, 3840, 16, 8, 15360),
    "gemma-3-27b": _gemma3(62, 5376, 32, 16, 21504, head_dim=128, query_pre_attn_scalar=168),
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
    # google/gemma-4-*'s text_config (tests/test_gemma4.py reads each released config.json
    # into these fields): E2B and E4B with per-layer inputs and key/value sharing across
    # their last layers; 26B-A4B a mixture of 128 experts beside each layer's dense MLP;
    # 26B-A4B and 31B with values equal to keys on their global layers
    "gemma-4-e2b": {
        **_GEMMA4,
        "num_layers": 35,
        "hidden_size": 1536,
        "num_heads": 8,
        "num_kv_heads": 1,
        "intermediate_size": 6144,
        "sliding_window": 512,
        "layer_types": _kinds(35, 5),
        "num_kv_shared_layers": 20,
        "double_wide_mlp": True,
        "per_layer_input_size": 256,
        "per_layer_vocab_size": 262144,
        "max_position_embeddings": 131072,
    },
    "gemma-4-e4b": {
        **_GEMMA4,
        "num_layers": 42,
        "hidden_size": 2560,
        "num_heads": 8,
        "num_kv_heads": 2,
        "intermediate_size": 10240,
        "sliding_window": 512,
        "layer_types": _kinds(42, 6),
        "num_kv_shared_layers": 18,
        "per_layer_input_size": 256,
        "per_layer_vocab_size": 262144,
        "max_position_embeddings": 131072,
    },
    "gemma-4-26b-a4b": {
        **_GEMMA4,
        "num_layers": 30,
        "hidden_size": 2816,
        "num_heads": 16,
        "num_kv_heads": 8,
        "intermediate_size": 2112,
        "sliding_window": 1024,
        "layer_types": _kinds(30, 6),
        "attention_k_eq_v": True,
        "global_kv_heads": 2,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": 704,
        "norm_topk_prob": True,
        "max_position_embeddings": 262144,
    },
    "gemma-4-31b": {
        **_GEMMA4,
        "num_layers": 60,
        "hidden_size": 5376,
        "num_heads": 32,
        "num_kv_heads": 16,
        "intermediate_size": 21504,
        "sliding_window": 1024,
        "layer_types": _kinds(60, 6),
        "attention_k_eq_v": True,
        "global_kv_heads": 4,
        "max_position_embeddings": 262144,
    },
}
