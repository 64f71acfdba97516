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
from xlafit.hf.config_json import config_from_hf, hf_config
from xlafit.hf.files import open_safetensors, read_json, read_tensor
from xlafit.hf.llama_tensors import EXPERT_NAMES, PerExpert, fuse_experts, layer_tensors
from xlafit.models.llama import LlamaConfig, LlamaForCausalLM
from xlafit.parallel.sharding import logical_axes

INDEX = "model.safetensors.index.json"


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
