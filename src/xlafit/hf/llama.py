"""Weights between :class:`~xlafit.models.llama.LlamaForCausalLM` and Hugging Face's.

The Hugging Face side is the files ``save_pretrained`` writes and ``from_pretrained`` reads
for ``LlamaForCausalLM``, ``Qwen2ForCausalLM``, ``Qwen3ForCausalLM``, ``Qwen3MoeForCausalLM``,
``MistralForCausalLM``, ``Gemma2ForCausalLM``, ``Gemma3ForCausalLM``, ``Gemma4ForCausalLM``,
``Qwen3_5ForCausalLM`` and ``Qwen3_5MoeForCausalLM`` (the family is the config's ``model_type``;
Qwen3.5's multimodal checkpoints give their text model, :mod:`xlafit.hf.qwen3_5`):
``config.json`` and ``model.safetensors``, or shards ``model-0000i-of-0000n.safetensors``
listed in ``model.safetensors.index.json``. PyTorch's ``Linear`` weights are ``[out, in]``,
ours ``[in, out]``. Nothing here imports PyTorch or transformers. Scanned models
(``scan_layers``) convert too: layer ``i`` is row ``i`` of each stacked parameter, or of a
scanned block's (:meth:`~xlafit.models.llama.LlamaForCausalLM.layer_prefixes`). A mixture
of experts' stacked expert weights are written one tensor per expert
(``mlp.experts.{e}.gate_proj.weight``), as transformers' ``save_pretrained`` writes them, and
read from that layout or from transformers' fused one (``mlp.experts.gate_up_proj``
``[E, 2f, hidden]``, ``mlp.experts.down_proj`` ``[E, hidden, f]``). Gemma 4's experts
(``experts.gate_up_proj``, ``experts.down_proj``) are read and written fused, as its
checkpoints hold them. The per-layer tables are :mod:`xlafit.hf.llama_tensors`'.

Example:
    >>> save_hf(model, "exported/", max_shard_bytes=2**30)  # doctest: +SKIP
    >>> model = from_hf("exported/")                        # doctest: +SKIP
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, Literal

import ml_dtypes
import numpy as np
from flax import nnx

from xlafit.errors import HFFormatError
from xlafit.hf import gemma4, qwen3_5
from xlafit.hf.files import open_safetensors, read_json, read_tensor
from xlafit.hf.llama_tensors import EXPERT_NAMES, PerExpert, fuse_experts, layer_tensors
from xlafit.models.llama import LlamaConfig, LlamaForCausalLM
from xlafit.parallel.sharding import logical_axes

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
INDEX = "model.safetensors.index.json"


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


def _param(module: Any, path: tuple[str, ...]) -> nnx.Variable:
    for name in path:
        module = getattr(module, name)
    return module


# One tensor: (Hugging Face name, our parameter, its index in a stacked parameter (the layer's
# row when scanned, then an expert's) or None, transposed)
Entry = tuple[str, nnx.Variable, tuple[int, ...] | None, bool]


def entries(model: LlamaForCausalLM) -> Iterator[Entry]:
    """Every Hugging Face tensor of ``model`` and where it lives in ours."""
    cfg = model.cfg
    if nnx.state(model, nnx.LoRAParam):
        raise HFFormatError(
            "the model has LoRA adapters: merge them first (xlafit.models.lora.merge_lora) or save the adapter "
            "alone (xlafit.hf.peft.save_peft_adapter)."
        )
    yield "model.embed_tokens.weight", model.embed_tokens.embedding, None, False
    if cfg.per_layer_input_size:
        yield "model.embed_tokens_per_layer.weight", model.embed_tokens_per_layer.embedding, None, False
        yield "model.per_layer_model_projection.weight", model.per_layer_model_projection.kernel, None, True
        yield "model.per_layer_projection_norm.weight", model.per_layer_projection_norm.scale, None, False
    for i in range(cfg.num_layers):
        layer, stacked = model.layer_at(i)
        row: tuple[int, ...] = () if stacked is None else (stacked,)
        for suffix, path, transposed in layer_tensors(cfg, i):
            yield f"model.layers.{i}.{suffix}", _param(layer, path), row or None, transposed
        if cfg.moe_layers[i] and not cfg.moe_beside_mlp:  # Gemma 4's whole stacks are in layer_tensors
            for e in range(cfg.num_experts):
                for p in EXPERT_NAMES:
                    param = _param(layer, ("mlp", "experts", p))
                    yield f"model.layers.{i}.mlp.experts.{e}.{p}.weight", param, (*row, e), True
    yield "model.norm.weight", model.norm.scale, None, False
    if model.lm_head is not None:
        yield "lm_head.weight", model.lm_head.kernel, None, True


def _torch_axes(param: nnx.Variable, row: tuple[int, ...] | None) -> tuple[int, ...]:
    """The permutation between our layout of a transposed tensor (``param``'s, at ``row``) and
    PyTorch's, each way: its axes reversed (a Linear's ``[in, out]`` and ``[out, in]``; a Gated
    DeltaNet's conv1d, our ``[K, 1, C]`` and ``[C, 1, K]``), past a stack of experts' leading
    axis (Gemma 4's ``[E, in, out]`` and ``[E, out, in]``)."""
    n = len(param.get_value().shape) - len(row or ())
    keep = 1 if n == 3 and (logical_axes(param) or ())[-3:][:1] == ("experts",) else 0
    return (*range(keep), *reversed(range(keep, n)))


def _hf_shape(param: nnx.Variable, row: tuple[int, ...] | None, transposed: bool) -> tuple[int, ...]:
    shape = tuple(param.get_value().shape)[len(row or ()) :]
    return tuple(shape[a] for a in _torch_axes(param, row)) if transposed else shape


def _hf_value(param: nnx.Variable, row: tuple[int, ...] | None, transposed: bool, dtype: Any) -> np.ndarray:
    value = np.asarray(param[...] if row is None else param[...][row]).astype(dtype)
    return np.ascontiguousarray(value.transpose(_torch_axes(param, row)) if transposed else value)


# A tensor to write: its Hugging Face shape, and a function giving its value (read when written).
Written = tuple[tuple[int, ...], Callable[[], np.ndarray]]


def _hf_tensors(model: LlamaForCausalLM, dtype: Any) -> dict[str, Written]:
    """Every Hugging Face tensor of ``model`` by name, as its checkpoints hold them (Gemma 4's
    expert projections fused: :func:`~xlafit.hf.llama_tensors.fuse_experts`)."""
    tensors = {
        name: (_hf_shape(param, row, t), functools.partial(_hf_value, param, row, t, dtype))
        for name, param, row, t in entries(model)
    }
    return fuse_experts(tensors)


def to_hf_state(model: LlamaForCausalLM, dtype: Literal["float32", "bfloat16"] = "float32") -> dict[str, np.ndarray]:
    """Hugging Face ``LlamaForCausalLM`` tensors (NumPy, PyTorch layout), all in host memory.

    Example:
        >>> from xlafit.models.llama import LlamaConfig, LlamaForCausalLM
        >>> model = LlamaForCausalLM(LlamaConfig.preset("tiny", vocab_size=100), rngs=nnx.Rngs(0))
        >>> to_hf_state(model)["model.layers.0.self_attn.k_proj.weight"].shape
        (32, 64)
    """
    return {name: value() for name, (_, value) in _hf_tensors(model, _np_dtype(dtype)).items()}


def _np_dtype(dtype: str) -> Any:
    return ml_dtypes.bfloat16 if dtype == "bfloat16" else np.float32


# Where a tensor read (in our layout) goes: (our parameter, its index when stacked, the value).
Put = Callable[[nnx.Variable, tuple[int, ...] | None, np.ndarray], None]


def from_hf_state(model: LlamaForCausalLM, state: Mapping[str, Any], put: Put | None = None) -> None:
    """Loads Hugging Face tensors into ``model`` in place, checking every name and shape.

    ``state`` may be any mapping (:func:`from_hf` passes one that reads each tensor from
    its file when asked). A tied model ignores a ``lm_head.weight``; a bare ``LlamaModel``
    checkpoint (names without ``model.``) loads too. ``put``: where each tensor goes instead
    of its parameter, one at a time (a quantizing reader, :mod:`xlafit.hf.quantized`), in our
    ``[in, out]`` layout and the file's dtype.

    A tensor the model does not read is named in a warning (transformers' UNEXPECTED keys:
    its config.json may not be the one its weights were saved with), but those no text model
    reads: a multimodal checkpoint's other towers, rotary ``inv_freq`` buffers, Qwen3.5's
    multi-token prediction head (``mtp.``) and a tied model's ``lm_head.weight``.

    Raises:
        HFFormatError: a tensor is missing or has another shape than ``model``'s config gives.
    """
    state = PerExpert(state)
    prefixed = any(k.startswith("model.") for k in state)
    # Qwen3.5's and Gemma 4's multimodal checkpoints keep the text model under
    # model.language_model., Gemma 3's under language_model.model. (and its tied output layer).
    language_model = any(k.startswith("model.language_model.") for k in state)
    legacy = any(k.startswith("language_model.model.") for k in state)

    def take(name: str, shape: tuple[int, ...]) -> np.ndarray:
        key = name if prefixed or name == "lm_head.weight" else name.removeprefix("model.")
        if language_model and key.startswith("model."):
            key = "model.language_model." + key.removeprefix("model.")
        elif legacy:
            key = "language_model." + name
        if key not in state:
            raise HFFormatError(
                f"the checkpoint has no tensor {key!r} (shape {shape}), which its config.json calls for: the weights "
                "and config.json disagree (a truncated copy, another family's checkpoint, or another model's "
                "config.json); check that both come from the same model and that every shard is there."
            )
        value = np.asarray(state[key])
        if value.shape != shape:
            raise HFFormatError(f"{key} has shape {value.shape}, expected {shape} from config.json.")
        return value

    stacked: dict[int, tuple[nnx.Variable, list[np.ndarray]]] = {}  # scanned layers: rows, stacked at the end
    for name, param, row, transposed in entries(model):
        value = take(name, _hf_shape(param, row, transposed))
        if put is not None:
            put(param, row, value.transpose(_torch_axes(param, row)) if transposed else value)
            continue
        value = (value.transpose(_torch_axes(param, row)) if transposed else value).astype(param[...].dtype)
        if row is None:
            param[...] = value
        else:
            stacked.setdefault(id(param), (param, []))[1].append(value)
    for param, rows in stacked.values():  # in row-major order of (layer, expert)
        param[...] = np.stack(rows).reshape(param[...].shape)
    text_model = "model.language_model." if language_model else "language_model." if legacy else ""
    state.warn_unread(text_model, tied=model.lm_head is None)


def _shards(names: list[str], sizes: list[int], max_shard_bytes: int | None) -> list[list[str]]:
    """Consecutive tensors in files of at most ``max_shard_bytes`` (a larger tensor alone)."""
    shards: list[list[str]] = [[]]
    used = 0
    for name, size in zip(names, sizes, strict=True):
        if max_shard_bytes is not None and shards[-1] and used + size > max_shard_bytes:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += size
    return shards


def save_hf(
    model: LlamaForCausalLM,
    directory: str | Path,
    *,
    max_shard_bytes: int | None = 5 * 2**30,
    dtype: Literal["float32", "bfloat16"] = "float32",
    token_ids: Mapping[str, int | list[int] | None] | None = None,
) -> Path:
    """Writes ``config.json`` and the weights (safetensors) to ``directory``.

    ``token_ids``: the tokenizer's ``bos_token_id``, ``eos_token_id`` (a list where several
    tokens end an answer) and ``pad_token_id`` for ``config.json`` (None values left out);
    without them ``transformers`` falls back to its config class's defaults, which name other
    tokens.

    One ``model.safetensors`` when the tensors fit in ``max_shard_bytes`` (None: no limit),
    else ``model-0000i-of-0000n.safetensors`` files and ``model.safetensors.index.json``, as
    ``save_pretrained(max_shard_size=...)``. One file's tensors are in host memory at a time.
    The result loads with ``transformers.AutoModelForCausalLM.from_pretrained(directory)``.

    Example:
        >>> save_hf(model, "exported/", max_shard_bytes=2 * 2**30, dtype="bfloat16")  # doctest: +SKIP
    """
    from safetensors.numpy import save_file

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    ids = {key: value for key, value in (token_ids or {}).items() if value is not None}
    config = {**hf_config(model.cfg), **ids, "torch_dtype": dtype}
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    np_dtype = _np_dtype(dtype)
    tensors = _hf_tensors(model, np_dtype)
    itemsize = np.dtype(np_dtype).itemsize
    sizes = [int(np.prod(shape)) * itemsize for shape, _ in tensors.values()]
    shards = _shards(list(tensors), sizes, max_shard_bytes)
    files = (
        ["model.safetensors"]
        if len(shards) == 1
        else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    )
    for file, names in zip(files, shards, strict=True):
        values = {name: tensors[name][1]() for name in names}
        save_file(values, str(out / file), metadata={"format": "pt"})
    if len(shards) > 1:
        index = {
            "metadata": {"total_size": sum(sizes)},
            "weight_map": {name: file for file, names in zip(files, shards, strict=True) for name in names},
        }
        (out / INDEX).write_text(json.dumps(index, indent=2) + "\n")
    return out


class _LazyTensors(Mapping[str, np.ndarray]):
    """The tensors of safetensors files by name, each read from its file when asked."""

    def __init__(self, files: dict[str, Path], reader: Callable[[Path, str], np.ndarray]) -> None:
        self.files, self.reader = files, reader

    def __getitem__(self, name: str) -> np.ndarray:
        return self.reader(self.files[name], name)

    def __contains__(self, name: object) -> bool:  # Mapping's own would read the tensor
        return name in self.files

    def __iter__(self) -> Iterator[str]:
        return iter(self.files)

    def __len__(self) -> int:
        return len(self.files)


def tensor_files(d: Path) -> dict[str, Path]:
    """Tensor name -> file, from ``model.safetensors`` or the shards' index."""
    if (d / INDEX).exists():
        weight_map = read_json(d / INDEX).get("weight_map", {})
        missing = sorted({f for f in weight_map.values() if not (d / f).exists()})
        if missing:
            raise HFFormatError(f"{d / INDEX} lists {', '.join(missing)}, which {d} lacks; copy every shard.")
        return {name: d / file for name, file in weight_map.items()}
    if (d / "model.safetensors").exists():
        with open_safetensors(d / "model.safetensors") as f:
            return {name: d / "model.safetensors" for name in f.keys()}  # noqa: SIM118 (safe_open is no dict)
    raise HFFormatError(
        f"{d} has neither model.safetensors nor {INDEX} (only safetensors is read; convert a pytorch_model.bin "
        "with transformers: AutoModelForCausalLM.from_pretrained(d).save_pretrained(d))."
    )


def from_hf(directory: str | Path, rngs: nnx.Rngs | None = None, **overrides: Any) -> LlamaForCausalLM:
    """A :class:`LlamaForCausalLM` with the weights of a Hugging Face checkpoint directory.

    Reads one ``model.safetensors`` or the shards of ``model.safetensors.index.json``, one
    tensor at a time; ``overrides`` set config fields that are not sizes (``dtype``,
    ``remat``, ``scan_layers``, ``attention``, ...).

    Example:
        >>> model = from_hf("meta-llama/Llama-3.2-1B", dtype="bfloat16", scan_layers=True)  # doctest: +SKIP
    """
    d, cfg = read_config(directory, **overrides)
    model = LlamaForCausalLM(cfg, rngs=rngs or nnx.Rngs(0))
    from_hf_state(model, lazy_tensors(d))
    return model


def read_config(directory: str | Path, **overrides: Any) -> tuple[Path, LlamaConfig]:
    """A checkpoint directory and its :class:`LlamaConfig` (``overrides`` set fields that are not sizes)."""
    d = Path(directory).expanduser()
    if not (d / "config.json").exists():
        raise HFFormatError(f"{d} has no config.json; give a directory written by save_pretrained or save_hf.")
    return d, config_from_hf(read_json(d / "config.json"), **overrides)


def lazy_tensors(d: Path) -> Mapping[str, np.ndarray]:
    """The tensors of checkpoint directory ``d`` by name, each read from its file when asked."""
    return _LazyTensors(tensor_files(d), read_tensor)
