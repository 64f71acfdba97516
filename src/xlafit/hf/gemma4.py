"""Gemma 4's text models (``gemma4_text``) in Hugging Face's ``config.json`` and back.

Gemma 4 keeps the keys of Gemma 3 that still apply and adds its own: rotary parameters per
layer kind (``rope_parameters``: a plain rotation on the sliding layers, a "proportional"
one on part of each global head), the global layers' head size and key/value heads
(``per_layer_config`` by layer index as transformers writes it, or ``global_head_dim`` and
``num_global_key_value_heads``), per-layer inputs (``hidden_size_per_layer_input``,
``vocab_size_per_layer_input``), ``attention_k_eq_v``, ``num_kv_shared_layers`` and
``use_double_wide_mlp``; the mixture of experts (``enable_moe_block``: ``num_experts``
experts of ``moe_intermediate_size``, ``top_k_experts`` a token, beside every layer's dense
MLP). Missing keys take ``transformers.Gemma4TextConfig``'s defaults.

Example:
    >>> fields = config_fields({"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4})
    >>> fields["layer_types"], fields["global_head_dim"], fields["rope_type"]
    (('sliding_attention', 'full_attention'), 512, 'proportional')
"""

from __future__ import annotations

from typing import Any

from xlafit.errors import HFFormatError
from xlafit.models.llama_config import LlamaConfig

# transformers' Gemma4TextConfig defaults for the keys a config.json may leave out.
_DEFAULT_ROPE = {
    "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
    "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0},
}
_PATTERN = 6  # five sliding layers, then a global one


def _layer_types(hf: dict) -> tuple[str, ...]:
    layers = int(hf["num_hidden_layers"])
    types = list(hf.get("layer_types") or [
        "sliding_attention" if (i + 1) % _PATTERN else "full_attention" for i in range(layers)
    ])  # fmt: skip
    types[-1] = "full_attention"  # transformers makes the last layer global whatever the file says
    return tuple(types)


def _rope(hf: dict) -> dict[str, Any]:
    rope: dict[str, Any] = hf.get("rope_parameters") or _DEFAULT_ROPE
    local: dict[str, Any] = rope.get("sliding_attention") or {}
    full: dict[str, Any] = rope.get("full_attention") or {}
    if local.get("rope_type", "default") != "default" or "partial_rotary_factor" in local:
        raise HFFormatError(
            f"rope_parameters.sliding_attention={local}: xlafit rotates Gemma 4's sliding layers by a plain rotation "
            "(rope_type default) only."
        )
    kind = full.get("rope_type", "default")
    if kind not in ("default", "proportional"):
        raise HFFormatError(
            f"rope_parameters.full_attention has rope_type {kind!r}: xlafit reads Gemma 4's 'proportional' and "
            "'default'."
        )
    return {
        "rope_theta": float(full.get("rope_theta", 10_000.0)),
        "rope_local_theta": float(local.get("rope_theta", 10_000.0)),
        "rope_type": kind,
        "partial_rotary_factor": float(full.get("partial_rotary_factor", 1.0)),
        "rope_factor": float(full.get("factor", 1.0)),
    }


def _global_attention(hf: dict, types: tuple[str, ...]) -> dict[str, Any]:
    """The global layers' head size and key/value heads, from ``per_layer_config`` (one set
    for every global layer) or from ``global_head_dim`` / ``num_global_key_value_heads``."""
    per_layer = hf.get("per_layer_config")
    if per_layer is None:
        kv = hf.get("num_global_key_value_heads") if hf.get("attention_k_eq_v", False) else None
        return {"global_head_dim": int(hf.get("global_head_dim", 512)), "global_kv_heads": kv}
    overrides = {int(i): dict(v) for i, v in per_layer.items()}
    stray = sorted(
        i for i in overrides if types[i] != "full_attention" or set(overrides[i]) - {"head_dim", "num_key_value_heads"}
    )
    distinct = {tuple(sorted(v.items())) for v in overrides.values()}
    if stray or len(distinct) > 1:
        raise HFFormatError(
            f"per_layer_config={per_layer}: xlafit reads Gemma 4's one head_dim and num_key_value_heads for every "
            "global (full_attention) layer."
        )
    one = overrides[min(overrides)] if overrides else {}
    return {"global_head_dim": one.get("head_dim"), "global_kv_heads": one.get("num_key_value_heads")}


def config_fields(hf: dict) -> dict[str, Any]:
    """:class:`LlamaConfig` fields from a ``gemma4_text`` ``config.json`` (beyond the sizes
    every family shares).

    Raises:
        HFFormatError: bidirectional attention over text (``"all"``), biases, a mixture of experts without its sizes,
            or rotary or per-layer settings that xlafit does not compute.
    """
    refused = {
        # "vision" makes only an image's tokens see each other (the multimodal model's); text
        # stays causal, as transformers' Gemma4TextModel computes it. "all" is an encoder's.
        "use_bidirectional_attention": hf.get("use_bidirectional_attention") not in (None, "vision"),
        "attention_bias": bool(hf.get("attention_bias")),
    }
    bad = [f"{key}={hf.get(key)!r}" for key, value in refused.items() if value]
    if bad:
        raise HFFormatError(
            f"config.json has {', '.join(bad)}: xlafit reads Gemma 4's causal text models (causal attention, no "
            "biases)."
        )
    act = hf.get("hidden_activation", "gelu_pytorch_tanh")
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise HFFormatError(f"hidden_activation={act!r} is not supported for Gemma 4: xlafit has 'gelu_pytorch_tanh'.")
    types = _layer_types(hf)
    per_layer = int(hf.get("hidden_size_per_layer_input", 256) or 0)
    return {
        "family": "gemma4_text",
        "head_dim": int(hf.get("head_dim", 256)),
        "hidden_activation": "gelu_tanh",
        "qk_norm": True,
        "value_norm": True,
        "embedding_scale": True,
        "sandwich_norms": True,
        "layer_scalar": True,
        "query_pre_attn_scalar": 1.0,  # queries and keys are normed: scores are not scaled
        "final_logit_softcap": hf.get("final_logit_softcapping"),
        "sliding_window": int(hf.get("sliding_window", 512)),
        "layer_types": types,
        "tie_embeddings": hf.get("tie_word_embeddings", True),
        "attention_k_eq_v": bool(hf.get("attention_k_eq_v", False)),
        "num_kv_shared_layers": int(hf.get("num_kv_shared_layers", 0)),
        "double_wide_mlp": bool(hf.get("use_double_wide_mlp", False)),
        "per_layer_input_size": per_layer,
        "per_layer_vocab_size": int(hf.get("vocab_size_per_layer_input", 262_144)) if per_layer else None,
        **_rope(hf),
        **_global_attention(hf, types),
        **_experts(hf),
    }


def _experts(hf: dict) -> dict[str, Any]:
    """The mixture of experts' fields (``enable_moe_block``): every layer sparse, the top-k
    weights renormalised (transformers' ``Gemma4TextRouter`` always does), no auxiliary loss
    (transformers adds none to Gemma 4's)."""
    if not hf.get("enable_moe_block"):
        return {}
    missing = [key for key in ("num_experts", "top_k_experts", "moe_intermediate_size") if not hf.get(key)]
    if missing:
        raise HFFormatError(
            f"config.json has enable_moe_block=true and lacks {', '.join(missing)}: a Gemma 4 mixture of experts needs "
            "its number of experts, experts per token and expert size."
        )
    return {
        "num_experts": int(hf["num_experts"]),
        "num_experts_per_tok": int(hf["top_k_experts"]),
        "moe_intermediate_size": int(hf["moe_intermediate_size"]),
        "norm_topk_prob": True,
    }


def hf_config(cfg: LlamaConfig, sizes: dict[str, Any]) -> dict[str, Any]:
    """The ``config.json`` of ``Gemma4ForCausalLM`` for ``cfg`` (``sizes``: the keys every
    family shares, already named as Hugging Face names them)."""
    full: dict[str, Any] = {"rope_type": cfg.rope_type, "rope_theta": cfg.rope_theta}
    if cfg.rope_type == "proportional" or cfg.partial_rotary_factor != 1.0:
        full["partial_rotary_factor"] = cfg.partial_rotary_factor
    if cfg.rope_type == "proportional" and cfg.rope_factor != 1.0:
        full["factor"] = cfg.rope_factor
    elif cfg.rope_type not in ("default", "proportional"):
        raise HFFormatError(f"rope_type={cfg.rope_type!r} has no Gemma 4 config.json (default or proportional).")
    overrides: dict[str, Any] = {"head_dim": cfg.layer_head_dim("full_attention")}
    if cfg.global_kv_heads:
        overrides["num_key_value_heads"] = cfg.global_kv_heads
    return {
        **sizes,
        "architectures": ["Gemma4ForCausalLM"],
        "model_type": "gemma4_text",
        "hidden_activation": "gelu_pytorch_tanh",
        "final_logit_softcapping": cfg.final_logit_softcap,
        "sliding_window": cfg.sliding_window,
        "layer_types": list(cfg.kinds),
        "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": cfg.rope_local_theta or cfg.rope_theta},
            "full_attention": full,
        },
        "per_layer_config": {str(i): overrides for i, kind in enumerate(cfg.kinds) if kind == "full_attention"},
        "attention_k_eq_v": cfg.attention_k_eq_v,
        "num_kv_shared_layers": cfg.num_kv_shared_layers,
        "use_double_wide_mlp": cfg.double_wide_mlp,
        "hidden_size_per_layer_input": cfg.per_layer_input_size,
        "vocab_size_per_layer_input": cfg.per_layer_vocab_size or cfg.vocab_size,
        "torch_dtype": "float32",
        **_hf_experts(cfg),
    }


def _hf_experts(cfg: LlamaConfig) -> dict[str, Any]:
    """``config.json``'s mixture-of-experts keys (``enable_moe_block`` false for a dense model).

    Raises:
        HFFormatError: experts that Gemma 4's layer cannot hold (some layers dense, or top-k
            weights not renormalised).
    """
    if not cfg.num_experts:
        return {"enable_moe_block": False}
    if not all(cfg.moe_layers) or not cfg.norm_topk_prob:
        raise HFFormatError(
            f"the model's experts (mlp_only_layers={list(cfg.mlp_only_layers)}, decoder_sparse_step="
            f"{cfg.decoder_sparse_step}, norm_topk_prob={cfg.norm_topk_prob}) have no Gemma 4 config.json: it has "
            "experts in every layer, their top-k weights renormalised."
        )
    return {
        "enable_moe_block": True,
        "num_experts": cfg.num_experts,
        "top_k_experts": cfg.num_experts_per_tok,
        "moe_intermediate_size": cfg.expert_size,
    }
