"""``config.json`` of the Llama families' Hugging Face models and :class:`~xlafit.models.llama.LlamaConfig`,
both ways: the keys and conventions of Llama, Qwen2, Qwen3, Qwen3-MoE, Mistral, Gemma 2, Gemma 3,
Gemma 4, Qwen3.5 and Qwen3.5-MoE (the family is ``model_type``), and the text model of their
multimodal checkpoints. The weights are :mod:`xlafit.hf.llama`'s.

Example:
    >>> config_from_hf(hf_config(LlamaConfig.preset("llama-3.2-1b"))) == LlamaConfig.preset("llama-3.2-1b")
    True
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from xlafit.errors import HFFormatError
from xlafit.hf import gemma4, qwen3_5
from xlafit.hf.files import read_json
from xlafit.models.llama import LlamaConfig

# Our config field -> Hugging Face's LlamaConfig / Qwen2Config key.
_CONFIG_KEYS = {
    "vocab_size": "vocab_size",
    "hidden_size": "hidden_size",
    "intermediate_size": "intermediate_size",
    "num_layers": "num_hidden_layers",
    "num_heads": "num_attention_heads",
    "num_kv_heads": "num_key_value_heads",
    "head_dim": "head_dim",
    "rms_norm_eps": "rms_norm_eps",
    "max_position_embeddings": "max_position_embeddings",
    "tie_embeddings": "tie_word_embeddings",
    "initializer_range": "initializer_range",
}
# Our field -> key of Hugging Face's "llama3" rope_scaling / rope_parameters.
_LLAMA3_KEYS = {
    "rope_factor": "factor",
    "rope_low_freq_factor": "low_freq_factor",
    "rope_high_freq_factor": "high_freq_factor",
    "rope_original_max_position_embeddings": "original_max_position_embeddings",
}


# The families: Hugging Face's model_type -> its model class.
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mistral": "MistralForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "gemma4_text": "Gemma4ForCausalLM",
    "qwen3_5_text": "Qwen3_5ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM",
}
_GEMMA = ("gemma2", "gemma3_text")  # Gemma 4's config.json has its own keys (xlafit.hf.gemma4)


def _family(cfg: LlamaConfig) -> str:
    return "qwen2" if cfg.family == "llama" and cfg.attention_bias else cfg.family


def hf_config(cfg: LlamaConfig) -> dict:
    """The ``config.json`` of the Hugging Face model of ``cfg``'s family (:data:`ARCHITECTURES`)
    with its sizes.

    Rotary settings are written as Meta's own files have them (``rope_theta`` and
    ``rope_scaling``), which transformers 4 and 5 both read.

    Example:
        >>> scaling = hf_config(LlamaConfig.preset("llama-3.2-1b"))["rope_scaling"]
        >>> scaling["factor"]
        32.0
    """
    family = _family(cfg)
    if family == "gemma4_text":
        return gemma4.hf_config(cfg, {hf: getattr(cfg, ours) for ours, hf in _CONFIG_KEYS.items()})
    if family not in _GEMMA and cfg.embedding_scale or family not in (*_GEMMA, *qwen3_5.FAMILIES) and cfg.norm_offset:
        raise HFFormatError(f"embedding_scale and norm_offset (Gemma's conventions) have no {family} config.json.")
    out: dict[str, Any] = {hf: getattr(cfg, ours) for ours, hf in _CONFIG_KEYS.items()}
    if family == "qwen3_5_moe_text":  # every layer sparse: transformers' config class has no intermediate_size
        del out["intermediate_size"]
    act = "gelu_pytorch_tanh" if cfg.hidden_activation == "gelu_tanh" else "silu"
    out.update(
        {
            "architectures": [ARCHITECTURES[family]],
            "model_type": family,
            "hidden_act": act,
            "rope_theta": cfg.rope_theta,
            "rope_scaling": None,
            "torch_dtype": "float32",
        }
    )
    if family in ("llama", "qwen3", "mistral"):
        out.update({"attention_bias": cfg.attention_bias, "mlp_bias": False})
    if family == "qwen3_moe":
        out.update(
            {
                "attention_bias": False,
                "num_experts": cfg.num_experts,
                "num_experts_per_tok": cfg.num_experts_per_tok,
                "moe_intermediate_size": cfg.expert_size,
                "norm_topk_prob": cfg.norm_topk_prob,
                "decoder_sparse_step": cfg.decoder_sparse_step,
                "mlp_only_layers": list(cfg.mlp_only_layers),
                "router_aux_loss_coef": cfg.router_aux_loss_coef,
                "use_sliding_window": False,
            }
        )
    if family in ("mistral", *_GEMMA):
        out["sliding_window"] = cfg.sliding_window
    if family in _GEMMA:
        out.update(
            {
                "hidden_activation": act,
                "query_pre_attn_scalar": cfg.query_pre_attn_scalar or cfg.head_size,
                "attn_logit_softcapping": cfg.attn_logit_softcap,
                "final_logit_softcapping": cfg.final_logit_softcap,
                "layer_types": list(cfg.kinds),
            }
        )
    if family == "gemma3_text":
        out["rope_local_base_freq"] = cfg.rope_local_theta or cfg.rope_theta
    if family in qwen3_5.FAMILIES:
        out.update(qwen3_5.hf_config(cfg))
    if cfg.rope_type == "llama3":
        out["rope_scaling"] = {"rope_type": "llama3", **{hf: getattr(cfg, ours) for ours, hf in _LLAMA3_KEYS.items()}}
    elif cfg.rope_type == "linear":
        out["rope_scaling"] = {"rope_type": "linear", "factor": cfg.rope_factor}
    return out


def _rope_fields(hf: dict) -> dict[str, Any]:
    """Our rotary fields from ``rope_parameters`` (transformers 5; per layer kind for Gemma 3)
    or ``rope_theta`` + ``rope_scaling`` (transformers 4, Meta's files)."""
    rope = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
    local = rope.get("sliding_attention") if isinstance(rope.get("sliding_attention"), dict) else None
    rope = rope.get("full_attention", rope) if isinstance(rope.get("full_attention"), dict) else rope
    kind = rope.get("rope_type", rope.get("type", "default"))
    fields: dict[str, Any] = {"rope_theta": float(rope.get("rope_theta", hf.get("rope_theta", 10000.0)))}
    if local is not None and "rope_theta" in local:
        fields["rope_local_theta"] = float(local["rope_theta"])
    if kind == "llama3":
        fields["rope_type"] = "llama3"
        fields.update({ours: rope[hf_key] for ours, hf_key in _LLAMA3_KEYS.items() if hf_key in rope})
    elif kind == "linear":
        fields.update(rope_type="linear", rope_factor=float(rope["factor"]))
    elif kind != "default":
        raise HFFormatError(f"rope type {kind!r} is not supported: xlafit has 'default', 'llama3' and 'linear'.")
    return fields


def _family_fields(kind: str, hf: dict) -> dict[str, Any]:
    """The fields a family's config.json sets beyond Llama's."""
    act = hf.get("hidden_activation") or hf.get("hidden_act", "silu")
    if act not in ("silu", "gelu_pytorch_tanh", "gelu_tanh"):
        raise HFFormatError(f"hidden_act={act!r} is not supported: xlafit has 'silu' and 'gelu_pytorch_tanh'.")
    fields: dict[str, Any] = {"family": kind, "hidden_activation": "silu" if act == "silu" else "gelu_tanh"}
    if kind in ("llama", "qwen3", "mistral") and hf.get("mlp_bias"):
        raise HFFormatError("mlp_bias models (a bias on the MLP) are not supported.")
    if kind == "llama" and hf.get("attention_bias"):
        raise HFFormatError("attention_bias Llamas (a bias on o_proj too) are not supported.")
    if kind in ("qwen2", "qwen3", "qwen3_moe") and hf.get("use_sliding_window"):
        raise HFFormatError("use_sliding_window=true is not supported for Qwen: xlafit attends to the whole context.")
    fields["attention_bias"] = kind == "qwen2" or (kind == "qwen3" and bool(hf.get("attention_bias")))
    fields["qk_norm"] = kind in ("qwen3", "qwen3_moe", "gemma3_text")
    if kind == "qwen3_moe":
        fields.update(_moe_fields(hf))
    if kind == "mistral":
        fields["sliding_window"] = hf.get("sliding_window")
    if kind in _GEMMA:
        pattern = 2 if kind == "gemma2" else int(hf.get("sliding_window_pattern", 6))
        layers = int(hf["num_hidden_layers"])
        types = hf.get("layer_types") or [
            "sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)
        ]
        fields.update(
            embedding_scale=True,
            norm_offset=True,
            sandwich_norms=True,
            attn_logit_softcap=hf.get("attn_logit_softcapping"),
            final_logit_softcap=hf.get("final_logit_softcapping"),
            query_pre_attn_scalar=hf.get("query_pre_attn_scalar"),
            sliding_window=hf.get("sliding_window"),
            layer_types=tuple(types),
            tie_embeddings=hf.get("tie_word_embeddings", True),
        )
        if kind == "gemma3_text" and "rope_local_base_freq" in hf:
            fields["rope_local_theta"] = float(hf["rope_local_base_freq"])
    if kind in qwen3_5.FAMILIES:
        fields.update(qwen3_5.config_fields(kind, hf))
    return fields


def _moe_fields(hf: dict) -> dict[str, Any]:
    """Qwen3-MoE's mixture-of-experts fields (transformers 5 writes ``num_experts`` as
    ``num_local_experts``). Its attention has biases on o_proj too when ``attention_bias``."""
    if hf.get("attention_bias"):
        raise HFFormatError("attention_bias=true Qwen3-MoE models (a bias on o_proj too) are not supported.")
    experts = hf.get("num_experts", hf.get("num_local_experts"))
    if not experts:
        raise HFFormatError("config.json of a qwen3_moe model lacks num_experts.")
    return {
        "num_experts": int(experts),
        "num_experts_per_tok": int(hf.get("num_experts_per_tok", 8)),
        "moe_intermediate_size": hf.get("moe_intermediate_size"),
        "norm_topk_prob": bool(hf.get("norm_topk_prob", False)),
        "decoder_sparse_step": int(hf.get("decoder_sparse_step", 1)),
        "mlp_only_layers": tuple(int(i) for i in hf.get("mlp_only_layers") or ()),
        "router_aux_loss_coef": float(hf.get("router_aux_loss_coef", 0.001)),
    }


# The multimodal checkpoints whose text model xlafit reads: model_type -> the text model's.
MULTIMODAL = {
    "qwen3_5": "qwen3_5_text",
    "qwen3_5_moe": "qwen3_5_moe_text",
    "gemma3": "gemma3_text",
    "gemma4": "gemma4_text",
}
# transformers' Gemma3TextConfig defaults: Gemma 3 4B, 12B and 27B's config.json give their
# text_config's differences from them only (the 4B's: its sizes, rotary scaling and window).
GEMMA3_TEXT_DEFAULTS: dict[str, Any] = {
    "vocab_size": 262208,
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "num_hidden_layers": 26,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1_000_000.0,
    "rope_local_base_freq": 10_000.0,
    "query_pre_attn_scalar": 256,
    "sliding_window": 4096,
    "sliding_window_pattern": 6,
    "tie_word_embeddings": True,
}


def text_config(hf: dict) -> dict:
    """The text model's ``config.json`` keys of a multimodal checkpoint (Qwen3.5's and Gemma
    3's and 4's: ``text_config``, over the checkpoint's ``tie_word_embeddings``; Gemma 3's
    missing keys are transformers' defaults), else ``hf`` as it is. Their weights keep the
    text model under ``model.language_model.`` or, as Gemma 3's files have it,
    ``language_model.model.`` (:func:`from_hf_state`)."""
    kind = hf.get("model_type")
    if kind not in MULTIMODAL or not isinstance(hf.get("text_config"), dict):
        return hf
    defaults = GEMMA3_TEXT_DEFAULTS if kind == "gemma3" else {}
    text = {**defaults, "tie_word_embeddings": hf.get("tie_word_embeddings", False), **hf["text_config"]}
    return {**text, "model_type": MULTIMODAL[kind]}


def is_multimodal(directory: str | Path) -> bool:
    """Whether ``directory`` holds a multimodal checkpoint whose text model xlafit reads
    (:data:`MULTIMODAL`): transformers names that text model's modules ``model.language_model.``."""
    return read_json(Path(directory) / "config.json").get("model_type") in MULTIMODAL


# The multimodal checkpoints that transformers' AutoModelForCausalLM loads whole (their
# ...ForConditionalGeneration, the text model's modules under model.language_model.); for the
# others of MULTIMODAL (Qwen3.5's) it loads the text model alone (Qwen3_5ForCausalLM: model.layers).
WHOLE_FOR_CAUSAL_LM = ("gemma3", "gemma4")


def causal_lm_class(directory: str | Path) -> tuple[str, bool]:
    """The class ``AutoModelForCausalLM`` loads for the checkpoint in ``directory``, and whether
    it is the whole multimodal model (:data:`WHOLE_FOR_CAUSAL_LM`) rather than a text model.

    Example:
        >>> causal_lm_class("Qwen3.5-35B-A3B/")  # doctest: +SKIP
        ('Qwen3_5MoeForCausalLM', False)
    """
    kind = str(read_json(Path(directory) / "config.json").get("model_type") or "")
    if kind in WHOLE_FOR_CAUSAL_LM:
        return f"{kind.capitalize()}ForConditionalGeneration", True
    return ARCHITECTURES.get(MULTIMODAL.get(kind, kind), "LlamaForCausalLM"), False


def config_from_hf(hf: dict, **overrides: Any) -> LlamaConfig:
    """A :class:`LlamaConfig` from a Hugging Face ``config.json`` dict of a Llama, Qwen2,
    Qwen3, Qwen3-MoE, Mistral, Gemma 2, Gemma 3 or Gemma 4 (text), Qwen3.5 or Qwen3.5-MoE model.

    Example:
        >>> config_from_hf({"model_type": "llama", "vocab_size": 100, "hidden_size": 64,
        ...                 "num_hidden_layers": 2, "num_attention_heads": 4}).head_dim
        16
    """
    hf = text_config(hf)  # a multimodal Qwen3.5, Gemma 3 or Gemma 4 checkpoint: its text model
    kind = hf.get("model_type", "llama")
    if kind not in ARCHITECTURES:
        raise HFFormatError(f"config.json describes a {kind!r} model; xlafit reads {', '.join(ARCHITECTURES)}.")
    missing = [k for k in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads") if k not in hf]
    if missing:
        raise HFFormatError(f"config.json lacks {', '.join(missing)}.")
    fields = {ours: hf[key] for ours, key in _CONFIG_KEYS.items() if hf.get(key) is not None}
    if kind == "gemma4_text":
        fields.update(gemma4.config_fields(hf))
    else:
        fields.update(_rope_fields(hf))
        fields.update(_family_fields(kind, hf))
    return LlamaConfig(**{**fields, **overrides})
