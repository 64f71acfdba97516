"""Qwen3.5's text models in Hugging Face's ``config.json`` and back: the dense one
(``qwen3_5_text``, ``Qwen3_5ForCausalLM``) and the mixture of experts (``qwen3_5_moe_text``,
``Qwen3_5MoeForCausalLM``: Qwen3.5 35B-A3B).

Both have Gated DeltaNet layers with every ``full_attention_interval``-th (4) a
full-attention layer whose output is gated, q/k norms, RMSNorm weights used as ``1 + w`` and
a rotary share of each head (``partial_rotary_factor``). The mixture of experts makes every
layer a sparse block: a router whose top ``num_experts_per_tok`` weights are always
renormalised, ``num_experts`` experts of ``moe_intermediate_size``, and a shared expert of
``shared_expert_intermediate_size`` behind a sigmoid gate (its config has no
``intermediate_size``, ``norm_topk_prob``, ``decoder_sparse_step`` nor ``mlp_only_layers``).
Missing keys take transformers' ``Qwen3_5MoeTextConfig`` defaults. The multimodal checkpoints
(``qwen3_5``, ``qwen3_5_moe``) give their ``text_config`` (:func:`xlafit.hf.config_json.text_config`).

Example:
    >>> fields = config_fields("qwen3_5_moe_text", {"num_hidden_layers": 4, "num_experts": 8})
    >>> fields["layer_types"][3], fields["num_experts"], fields["norm_topk_prob"]
    ('full_attention', 8, True)
"""

from __future__ import annotations

from typing import Any

from xlafit.errors import HFFormatError
from xlafit.models.llama_config import LlamaConfig

__all__ = ["FAMILIES", "config_fields", "hf_config"]

FAMILIES = ("qwen3_5_text", "qwen3_5_moe_text")
# The Gated DeltaNet sizes: the same names in our config and Hugging Face's.
LINEAR_KEYS = (
    "linear_num_key_heads",
    "linear_num_value_heads",
    "linear_key_head_dim",
    "linear_value_head_dim",
    "linear_conv_kernel_dim",
)
# The mixture of experts' keys (our field -> Hugging Face's) and transformers' defaults for them.
_MOE_KEYS = {
    "num_experts": ("num_experts", 256),
    "num_experts_per_tok": ("num_experts_per_tok", 8),
    "moe_intermediate_size": ("moe_intermediate_size", 512),
    "shared_expert_intermediate_size": ("shared_expert_intermediate_size", 512),
    "router_aux_loss_coef": ("router_aux_loss_coef", 0.001),
}


def config_fields(kind: str, hf: dict) -> dict[str, Any]:
    """Our fields of a ``qwen3_5_text`` or ``qwen3_5_moe_text`` ``config.json`` beyond the
    sizes every family shares."""
    layers = int(hf["num_hidden_layers"])
    interval = int(hf.get("full_attention_interval", 4))
    types = hf.get("layer_types") or [
        "full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(layers)
    ]
    unknown = sorted(set(types) - {"full_attention", "linear_attention"})
    if unknown:
        raise HFFormatError(f"layer_types has {', '.join(unknown)}; Qwen3.5 has full_attention and linear_attention.")
    if hf.get("attention_bias"):
        raise HFFormatError("attention_bias=true Qwen3.5 models (a bias on o_proj too) are not supported.")
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    partial = rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 0.25))
    fields: dict[str, Any] = {key: int(hf[key]) for key in LINEAR_KEYS if key in hf}
    fields.update(
        layer_types=tuple(types),
        attn_output_gate=True,
        qk_norm=True,
        norm_offset=True,
        attention_bias=False,
        partial_rotary_factor=float(partial),
    )
    if kind == "qwen3_5_moe_text":
        fields.update({ours: type(default)(hf.get(key, default)) for ours, (key, default) in _MOE_KEYS.items()})
        fields["norm_topk_prob"] = True  # Qwen3_5MoeTopKRouter renormalises whatever the file says
    return fields


def hf_config(cfg: LlamaConfig) -> dict[str, Any]:
    """The ``config.json`` keys of ``cfg``'s Qwen3.5 family beyond those every family shares.

    Raises:
        HFFormatError: biases on attention (Qwen3.5's would be on o_proj too), or a mixture of
            experts Qwen3.5-MoE cannot describe (a dense layer, top-k weights not renormalised,
            no shared expert).
    """
    if cfg.attention_bias:
        raise HFFormatError(
            "attention_bias (q, k and v biases) has no Qwen3.5 config.json: its attention_bias puts one on o_proj too."
        )
    out: dict[str, Any] = {key: getattr(cfg, key) for key in LINEAR_KEYS}
    out.update(attention_bias=False, layer_types=list(cfg.kinds))
    out["rope_parameters"] = {
        "rope_type": "default", "rope_theta": cfg.rope_theta, "partial_rotary_factor": cfg.partial_rotary_factor
    }  # fmt: skip
    if cfg.family == "qwen3_5_moe_text":
        if not all(cfg.moe_layers) or not cfg.norm_topk_prob or not cfg.shared_expert_intermediate_size:
            raise HFFormatError(
                "Qwen3.5-MoE's config.json describes every layer sparse, the top-k weights renormalised and a shared "
                "expert: set num_experts, norm_topk_prob=true and shared_expert_intermediate_size, and no "
                "mlp_only_layers or decoder_sparse_step."
            )
        out.update({key: getattr(cfg, ours) for ours, (key, _) in _MOE_KEYS.items()})
        out["moe_intermediate_size"] = cfg.expert_size  # the field's None: intermediate_size
    return out
