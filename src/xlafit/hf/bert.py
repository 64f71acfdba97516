"""Weights between :class:`~xlafit.models.bert.BertForMaskedLM` and Hugging Face's.

The Hugging Face side is the files ``transformers.BertForMaskedLM.save_pretrained`` writes
and ``from_pretrained`` reads: ``config.json`` and ``model.safetensors`` (PyTorch layout:
``Linear`` weights are ``[out, in]``, ours ``[in, out]``). Nothing here imports PyTorch or
transformers; ``safetensors.numpy`` reads and writes the tensors.

Example:
    >>> save_hf(model, "exported/", tokenizer_dir="runs/bert/tokenizer")  # doctest: +SKIP
    >>> model = from_hf("exported/")                                      # doctest: +SKIP
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
from flax import nnx

from xlafit.errors import HFFormatError
from xlafit.hf.files import load_safetensors, read_json
from xlafit.models.bert import BertConfig, BertForMaskedLM

# Our config field -> Hugging Face's BertConfig key.
_CONFIG_KEYS = {
    "vocab_size": "vocab_size",
    "num_layers": "num_hidden_layers",
    "hidden_size": "hidden_size",
    "num_heads": "num_attention_heads",
    "intermediate_size": "intermediate_size",
    "max_position_embeddings": "max_position_embeddings",
    "type_vocab_size": "type_vocab_size",
    "hidden_dropout": "hidden_dropout_prob",
    "attention_dropout": "attention_probs_dropout_prob",
    "layer_norm_eps": "layer_norm_eps",
    "initializer_range": "initializer_range",
    "pad_token_id": "pad_token_id",
}


def hf_config(cfg: BertConfig) -> dict:
    """The ``config.json`` of a Hugging Face ``BertForMaskedLM`` with ``cfg``'s sizes."""
    out = {hf: getattr(cfg, ours) for ours, hf in _CONFIG_KEYS.items()}
    out.update(
        {
            "architectures": ["BertForMaskedLM"],
            "model_type": "bert",
            "hidden_act": "gelu",
            "position_embedding_type": "absolute",
            "tie_word_embeddings": True,
            "torch_dtype": "float32",
        }
    )
    return out


def config_from_hf(hf: dict, **overrides: Any) -> BertConfig:
    """A :class:`BertConfig` from a Hugging Face ``config.json`` dict."""
    if hf.get("model_type", "bert") != "bert":
        raise HFFormatError(f"config.json describes a {hf.get('model_type')!r} model, not BERT.")
    if hf.get("hidden_act", "gelu") != "gelu":
        raise HFFormatError(f"hidden_act={hf['hidden_act']!r} is not supported: xlafit's BERT uses the exact 'gelu'.")
    if hf.get("position_embedding_type", "absolute") != "absolute":
        raise HFFormatError("only absolute position embeddings are supported.")
    missing = [hf_key for hf_key in ("vocab_size", "hidden_size", "num_hidden_layers") if hf_key not in hf]
    if missing:
        raise HFFormatError(f"config.json lacks {', '.join(missing)}.")
    fields = {ours: hf[hf_key] for ours, hf_key in _CONFIG_KEYS.items() if hf_key in hf}
    return BertConfig(**{**fields, **overrides})


def _present(param: nnx.Param | None, name: str) -> nnx.Param:
    """``param``, which nnx types as optional (``use_bias``, ``use_scale``); this BERT always has it."""
    if param is None:
        raise ValueError(f"{name} is missing: xlafit's BERT builds every dense layer and LayerNorm with it.")
    return param


def _pairs(model: BertForMaskedLM) -> Iterator[tuple[str, nnx.Param, bool]]:
    if model.cfg.scan_layers:
        raise HFFormatError(
            "a model with scan_layers=true keeps its layers stacked; the Hugging Face format needs them one by one: "
            "build the model with model.scan_layers=false (its checkpoints do not carry over) to export or import."
        )
    """``(Hugging Face name, our parameter, transposed)`` for every tensor but Q/K/V."""

    def linear(prefix: str, layer: nnx.Linear) -> Iterator[tuple[str, nnx.Param, bool]]:
        yield f"{prefix}.weight", layer.kernel, True
        yield f"{prefix}.bias", _present(layer.bias, f"{prefix}.bias"), False

    def norm(prefix: str, layer: nnx.LayerNorm) -> Iterator[tuple[str, nnx.Param, bool]]:
        yield f"{prefix}.weight", _present(layer.scale, f"{prefix}.weight"), False
        yield f"{prefix}.bias", _present(layer.bias, f"{prefix}.bias"), False

    e = model.embeddings
    yield "bert.embeddings.word_embeddings.weight", e.word.embedding, False
    yield "bert.embeddings.position_embeddings.weight", e.position.embedding, False
    yield "bert.embeddings.token_type_embeddings.weight", e.token_type.embedding, False
    yield from norm("bert.embeddings.LayerNorm", e.norm)
    for i, layer in enumerate(model.layers):
        p = f"bert.encoder.layer.{i}"
        yield from linear(f"{p}.attention.output.dense", layer.attention.out)
        yield from norm(f"{p}.attention.output.LayerNorm", layer.attention.norm)
        yield from linear(f"{p}.intermediate.dense", layer.intermediate)
        yield from linear(f"{p}.output.dense", layer.output)
        yield from norm(f"{p}.output.LayerNorm", layer.norm)
    yield from linear("cls.predictions.transform.dense", model.head_dense)
    yield from norm("cls.predictions.transform.LayerNorm", model.head_norm)
    yield "cls.predictions.bias", model.head_bias, False


def to_hf_state(model: BertForMaskedLM) -> dict[str, np.ndarray]:
    """Hugging Face ``BertForMaskedLM`` tensors (float32 NumPy, PyTorch layout)."""
    state = {}
    for name, param, transposed in _pairs(model):
        value = np.asarray(param[...], np.float32)
        state[name] = value.T if transposed else value
    for i, layer in enumerate(model.layers):
        qkv_bias = _present(layer.attention.qkv.bias, f"the query/key/value bias of layer {i}")
        kernel, bias = np.asarray(layer.attention.qkv.kernel[...]), np.asarray(qkv_bias[...])  # (3, in, out), (3, out)
        for j, name in enumerate(("query", "key", "value")):
            state[f"bert.encoder.layer.{i}.attention.self.{name}.weight"] = kernel[j].T.copy()
            state[f"bert.encoder.layer.{i}.attention.self.{name}.bias"] = bias[j].copy()
    return {k: np.ascontiguousarray(v) for k, v in state.items()}


def from_hf_state(model: BertForMaskedLM, state: dict[str, np.ndarray]) -> None:
    """Loads Hugging Face tensors into ``model`` in place, checking every name and shape."""
    state = {k.removeprefix("model."): v for k, v in state.items()}
    if not any(k.startswith("bert.") for k in state):  # a bare BertModel checkpoint
        state = {f"bert.{k}": v for k, v in state.items() if not k.startswith("cls.")} | {
            k: v for k, v in state.items() if k.startswith("cls.")
        }

    def take(name: str, shape: tuple[int, ...]) -> np.ndarray:
        if name not in state:
            raise HFFormatError(f"the checkpoint has no tensor {name!r}; is it a BertForMaskedLM?")
        value = np.asarray(state[name], np.float32)
        if value.shape != shape:
            raise HFFormatError(f"{name} has shape {value.shape}, expected {shape} from config.json.")
        return value

    for name, param, transposed in _pairs(model):
        shape = tuple(param[...].shape)
        value = take(name, shape[::-1] if transposed else shape)
        param[...] = value.T if transposed else value
    h = model.cfg.hidden_size
    for i, layer in enumerate(model.layers):
        p = f"bert.encoder.layer.{i}.attention.self"
        q, k, v = (take(f"{p}.{n}.weight", (h, h)).T for n in ("query", "key", "value"))
        qkv = layer.attention.qkv
        qkv.kernel[...] = np.stack([q, k, v])
        qkv_bias = _present(qkv.bias, f"the query/key/value bias of layer {i}")
        qkv_bias[...] = np.stack([take(f"{p}.{n}.bias", (h,)) for n in ("query", "key", "value")])
    decoder = state.get("cls.predictions.decoder.weight")
    if decoder is not None and not np.array_equal(
        np.asarray(decoder, np.float32), model.embeddings.word.embedding[...]
    ):
        raise HFFormatError(
            "cls.predictions.decoder.weight differs from the word embeddings (tie_word_embeddings=false); "
            "xlafit's MLM head is tied to the word embeddings, so this checkpoint cannot be imported as is."
        )


def save_hf(model: BertForMaskedLM, directory: str | Path, tokenizer_dir: str | Path | None = None) -> Path:
    """Writes ``config.json``, ``model.safetensors`` and the tokenizer's files to ``directory``.

    The result loads with ``transformers.BertForMaskedLM.from_pretrained(directory)`` and,
    with a tokenizer, ``AutoTokenizer.from_pretrained(directory)``.
    """
    from safetensors.numpy import save_file

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(hf_config(model.cfg), indent=2) + "\n")
    save_file(to_hf_state(model), str(out / "model.safetensors"), metadata={"format": "pt"})
    if tokenizer_dir is not None:
        for f in Path(tokenizer_dir).iterdir():
            if f.is_file():
                shutil.copy2(f, out / f.name)
    return out


def from_hf(directory: str | Path, rngs: nnx.Rngs | None = None, **overrides: Any) -> BertForMaskedLM:
    """A :class:`BertForMaskedLM` with the weights of a Hugging Face checkpoint directory.

    Like ``transformers``' ``from_pretrained``, the model is in eval mode (dropout off).
    """
    d = Path(directory).expanduser()
    if not (d / "config.json").exists():
        raise HFFormatError(f"{d} has no config.json; give a directory written by save_pretrained or xlafit export hf.")
    cfg = config_from_hf(read_json(d / "config.json"), **overrides)
    weights = d / "model.safetensors"
    if not weights.exists():
        raise HFFormatError(
            f"{d} has no model.safetensors (only safetensors is read; convert a pytorch_model.bin with "
            "transformers: BertForMaskedLM.from_pretrained(d).save_pretrained(d, safe_serialization=True))."
        )
    model = BertForMaskedLM(cfg, rngs=rngs or nnx.Rngs(0))
    from_hf_state(model, load_safetensors(weights))
    return model
