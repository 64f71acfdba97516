"""LoRA adapters of a :class:`~xlafit.models.llama.LlamaForCausalLM` as PEFT writes them.

A PEFT LoRA adapter is a directory with ``adapter_config.json`` (``r``, ``lora_alpha``,
``target_modules``, ...) and ``adapter_model.safetensors`` whose tensors are named
``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`` (``[r, in]``) and
``...lora_B.weight`` (``[out, r]``): ours transposed. PEFT scales the update by
``lora_alpha / r``, as :class:`~xlafit.models.lora.LoRA` does, so the tensors carry over
unchanged. ``peft.PeftModel.from_pretrained(llama, directory)`` loads what
:func:`save_peft_adapter` writes. The base model's :func:`~xlafit.models.lora.base_fingerprint`
goes into the safetensors metadata (``xlafit_base_fingerprint``; PEFT ignores it) and
:func:`load_peft_adapter` checks it when present. Nothing here imports PEFT or PyTorch.

Example:
    >>> save_peft_adapter(model, "adapter/", base_model_name_or_path="meta-llama/Llama-3.2-1B")  # doctest: +SKIP
    >>> model = load_peft_adapter(from_hf("Llama-3.2-1B/"), "adapter/")                            # doctest: +SKIP
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import numpy as np
from flax import nnx

from xlafit.errors import HFFormatError
from xlafit.hf.files import open_safetensors, read_json
from xlafit.models.llama import LlamaForCausalLM
from xlafit.models.lora import (
    BASE,
    EXPERTS_TARGET,
    ExpertLoRA,
    LoRA,
    apply_lora,
    base_fingerprint,
    expert_lora_modules,
    has_adapters,
    lora_modules,
)
from xlafit.models.quantized import is_quantized, quantize_base, quantized_layers
from xlafit.models.quantized_embed import quantize_embeddings, quantized_tables

CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
FINGERPRINT_KEY = "xlafit_base_fingerprint"
# An adapter trained on a quantized base: "nf4:64" (its type and block), "nf4:64:embeddings" with
# its embedding tables quantized too; the fingerprint is that base's.
QUANTIZED_KEY = "xlafit_base_quantized"
# An adapter trained on a base cast to bfloat16 (lora.base_dtype=bfloat16): the fingerprint is that base's.
BASE_DTYPE_KEY = "xlafit_base_dtype"


# PEFT's target_parameters of transformers' fused experts. PEFT wraps the experts module once
# per parameter, in the module's order of its parameters (gate_up_proj, then down_proj), so the
# gate-and-up adapter is inside the down one: ``...experts.base_layer.lora_A.weight`` and
# ``...experts.lora_A.weight``, whatever order the config lists them in.
EXPERT_PARAMETERS = ("gate_up_proj", "down_proj")


# Where a multimodal model's text model is in transformers (Gemma 3's and 4's, Qwen3.5's
# ...ForConditionalGeneration): its modules' names, and so a PEFT adapter's for it.
TEXT_MODEL = "model.language_model."


def _hf_modules(model: LlamaForCausalLM, multimodal: bool = False) -> Iterator[tuple[str, LoRA, int | None]]:
    """``(PEFT module name, our layer, row of its stacked adapters or None)`` per adapted layer."""
    yield from _hf_names(model, lora_modules(model), multimodal)


def _hf_experts(model: LlamaForCausalLM, multimodal: bool = False) -> Iterator[tuple[str, ExpertLoRA, int | None]]:
    """``(PEFT module name of the experts, our adapters, row or None)`` per adapted experts."""
    yield from _hf_names(model, expert_lora_modules(model), multimodal)


def _hf_names(model: LlamaForCausalLM, modules: list, multimodal: bool) -> Iterator[tuple[str, Any, int | None]]:
    prefixes = model.layer_prefixes()  # layer i's module path, and its row when stacked (scan_layers)
    text = TEXT_MODEL if multimodal else "model."
    for path, layer in modules:
        parts = tuple(path)
        prefix = "base_model.model." + ("" if parts[0] == "lm_head" else text)
        found = [(i, row, len(p)) for i, (p, row) in enumerate(prefixes) if parts[: len(p)] == p]
        for i, row, n in found:  # a stacked layer: one PEFT module per layer it holds
            yield prefix + ".".join(["layers", str(i), *map(str, parts[n:])]), layer, row
        if not found:
            yield prefix + ".".join(map(str, parts)), layer, None


def _rank_and_alpha(model: LlamaForCausalLM) -> tuple[int, float]:
    kinds = {(layer.rank, layer.alpha) for _, layer in lora_modules(model)}
    kinds |= {(experts.rank, experts.alpha) for _, experts in expert_lora_modules(model)}
    if not kinds:
        raise HFFormatError("the model has no LoRA adapters; add them with xlafit.models.lora.apply_lora.")
    if len(kinds) > 1:
        raise HFFormatError(f"the adapters have several (rank, alpha) pairs {sorted(kinds)}; export needs one.")
    return kinds.pop()


def save_peft_adapter(
    model: LlamaForCausalLM,
    directory: str | Path,
    *,
    base_model_name_or_path: str | None = None,
    multimodal: bool = False,
) -> Path:
    """Writes ``model``'s LoRA adapters as a PEFT adapter directory (float32).

    Args:
        model: a Llama with adapters from :func:`~xlafit.models.lora.apply_lora` (one rank
            and alpha for all).
        directory: created if missing.
        base_model_name_or_path: what PEFT records as the base (a hub id or a path).
        multimodal: the base is a multimodal checkpoint that ``AutoModelForCausalLM`` loads
            whole (Gemma 3 4B-27B, Gemma 4: :func:`xlafit.hf.config_json.causal_lm_class`; it loads
            Qwen3.5's text model alone, whose names are the text model's): the adapter names
            its modules as transformers does there (``model.language_model.layers...``), and its
            ``target_modules`` is a pattern that matches the text model's alone (a list of
            names would adapt the vision tower's layers of the same names too, and PEFT
            would load none of these tensors into the text model).

    Returns:
        ``directory``, loadable with ``peft.PeftModel.from_pretrained(base, directory)``.

    Example:
        >>> save_peft_adapter(model, "adapter/", base_model_name_or_path="exported/")  # doctest: +SKIP
    """
    from safetensors.numpy import save_file

    rank, alpha = _rank_and_alpha(model)
    tensors: dict[str, np.ndarray] = {}
    targets: set[str] = set()
    routers: set[str] = set()  # a router transformers makes a module of its own: PEFT adapts its weight
    router = ROUTER_MODULES.get(model.cfg.family)
    for name, layer, row in _hf_modules(model, multimodal):
        a, b = np.asarray(layer.lora_a[...], np.float32), np.asarray(layer.lora_b[...], np.float32)
        a, b = (a, b) if row is None else (a[row], b[row])
        tensors[f"{name}.lora_A.weight"] = np.ascontiguousarray(a.T)  # [r, in]
        tensors[f"{name}.lora_B.weight"] = np.ascontiguousarray(b.T)  # [out, r]
        if name.rsplit(".", 1)[-1] == router and ".layers." in name:
            routers.add(name.split(".layers.", 1)[-1].split(".", 1)[-1] + ".weight")  # "mlp.gate.weight"
        else:
            targets.add(name.rsplit(".", 1)[-1])
    tails: set[str] = set()
    on_host: dict[int, list[np.ndarray]] = {}  # each module's adapters copied once, not once per stacked layer
    for name, experts, row in _hf_experts(model, multimodal):
        arrays = on_host.setdefault(id(experts), _expert_arrays(experts))
        for param, tensors_ab in zip(EXPERT_PARAMETERS, _expert_tensors(arrays, row), strict=True):
            tensors.update(
                {f"{_expert_module(name, param)}.lora_{ab}.weight": t for ab, t in zip("AB", tensors_ab, strict=True)}
            )
        tails.add(name.split(".layers.", 1)[-1].split(".", 1)[-1])  # "mlp.experts" after "layers.<i>."
    parameters = [f"{tail}.{param}" for tail in sorted(tails) for param in EXPERT_PARAMETERS] + sorted(routers)
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name_or_path,
        "r": rank,
        "lora_alpha": alpha,
        "lora_dropout": 0.0,
        "target_modules": _text_model_pattern(targets) if multimodal else sorted(targets),
        **({"target_parameters": parameters} if parameters else {}),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "modules_to_save": None,
        "init_lora_weights": True,
        "inference_mode": True,
    }
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    (out / CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    metadata = {"format": "pt", FINGERPRINT_KEY: base_fingerprint(model)}
    quantized = [layer for _, layer in quantized_layers(model)]
    if quantized:  # PEFT applies it to the unquantized base; xlafit checks that base quantized alike
        tables = ":embeddings" if quantized_tables(model) else ""
        metadata[QUANTIZED_KEY] = f"{quantized[0].qtype}:{quantized[0].block}{tables}"
    elif _base_dtypes(model) == {"bfloat16"}:
        metadata[BASE_DTYPE_KEY] = "bfloat16"
    save_file(tensors, str(out / WEIGHTS), metadata=metadata)
    return out


# The routers that transformers makes a module of their own (Qwen3MoeTopKRouter,
# Qwen3_5MoeTopKRouter: not an nn.Linear, which PEFT refuses as a target module): their adapter
# goes in target_parameters (PEFT's ParamWrapper: lora_A [r, in], lora_B [out, r], as a Linear's).
# Gemma 4's router projection (router.proj) is an nn.Linear.
ROUTER_MODULES = {"qwen3_moe": "gate", "qwen3_5_moe_text": "gate"}
# The module names PEFT takes for a model type's experts whatever layer holds them (its
# conversion of transformers 4's MoE layouts, peft.utils.transformers_weight_conversion): a
# dense layer's MLP adapted under those names does not load as it trained.
PEFT_EXPERT_NAMES = {"qwen3_moe": ("gate_proj", "up_proj", "down_proj")}


def peft_misreads(model: LlamaForCausalLM) -> list[str]:
    """The adapted modules of ``model`` that PEFT (through at least 0.21) reads as its experts'
    (:data:`PEFT_EXPERT_NAMES`): a Qwen3-MoE checkpoint's dense layers' MLP (``mlp_only_layers``).
    Empty where PEFT loads the adapter as it trained."""
    names = PEFT_EXPERT_NAMES.get(model.cfg.family, ())
    adapted = {name.removeprefix("base_model.model.") for name, _, _ in _hf_modules(model)}
    return sorted(name for name in adapted if name.rsplit(".", 1)[-1] in names)


def _text_model_pattern(targets: set[str]) -> str:
    """PEFT's ``target_modules`` as a regular expression (PEFT matches it whole) for the
    text model of a multimodal one: its layers' ``targets``, and its output layer."""
    inner = sorted(targets - {"lm_head"})
    pattern = rf".*\.language_model\..*\.({'|'.join(inner)})" if inner else ""
    return "|".join(p for p in (pattern, "lm_head" if "lm_head" in targets else "") if p)


def _expert_module(name: str, param: str) -> str:
    """The PEFT module whose ``lora_A``/``lora_B`` adapt the experts' ``param``: the experts'
    module under one ``base_layer`` for each of their parameters wrapped after it."""
    return ".".join([name, *["base_layer"] * (len(EXPERT_PARAMETERS) - 1 - EXPERT_PARAMETERS.index(param))])


def _expert_arrays(experts: ExpertLoRA) -> list[np.ndarray]:
    """The experts' adapters on the host, float32: gate-and-up's A and B, then down's."""
    return [
        np.asarray(v[...], np.float32) for v in (experts.gate_up_a, experts.gate_up_b, experts.down_a, experts.down_b)
    ]


def _expert_tensors(arrays: list[np.ndarray], row: int | None) -> list[tuple[np.ndarray, np.ndarray]]:
    """PEFT's ``(lora_A [r * E, in], lora_B [out, r * E])`` of the fused gate-and-up and the
    down projection (of stacked layer ``row``): PEFT reads ``lora_A`` as ``[E, r, in]`` and
    ``lora_B`` as ``[out, r, E]``."""
    out = []
    for a, b in (arrays[0:2], arrays[2:4]):
        a, b = (a, b) if row is None else (a[row], b[row])  # a [E, in, r], b [E, r, out]
        e, n_in, r = a.shape
        out.append(
            (
                np.ascontiguousarray(a.transpose(0, 2, 1).reshape(e * r, n_in)),
                np.ascontiguousarray(b.transpose(2, 1, 0).reshape(b.shape[-1], r * e)),
            )
        )
    return out


def _base_dtypes(model: nnx.Module) -> set[str]:
    return {str(x.dtype) for x in jax.tree.leaves(nnx.state(model, BASE))}


def _fingerprint_as_trained(model: LlamaForCausalLM, quantized: str | None, dtype: str | None = None) -> str:
    """``model``'s base fingerprint as the adapter's base was: quantized as recorded (a copy;
    the model stays as it is) when the adapter trained on a quantized base and ``model`` is not;
    cast to ``dtype`` (bfloat16) when it trained on a base in that precision."""
    if dtype is not None and quantized is None and _base_dtypes(model) != {dtype}:
        base: nnx.Module = nnx.clone(model)
        nnx.update(base, jax.tree.map(lambda x: x.astype(dtype), nnx.state(base, BASE)))
        return base_fingerprint(base)
    if quantized is None or is_quantized(model):
        return base_fingerprint(model)
    qtype, block, *tables = quantized.split(":")
    base = nnx.clone(model)
    if tables == ["embeddings"]:
        base = quantize_embeddings(base, qtype, int(block))
    return base_fingerprint(quantize_base(base, qtype, int(block)))


def adapter_base(d: str | Path) -> str | None:
    """The base model a PEFT adapter directory ``d`` names (its ``base_model_name_or_path``),
    or None where ``d`` is no adapter (no ``adapter_config.json``)."""
    path = Path(d).expanduser()
    if not (path / CONFIG).is_file():
        return None
    return str(read_json(path / CONFIG).get("base_model_name_or_path") or "")


def not_a_model_but_an_adapter(d: str | Path, base: str) -> str:
    """Why a PEFT adapter directory ``d`` on ``base`` is not a model to start training from,
    and what to give instead."""
    on = f" on {base}" if base else ""
    merged = f" (xlafit export hf writes it in {Path(d).parent})" if (Path(d).parent / "config.json").is_file() else ""
    return (
        f"{d} is a PEFT adapter{on} ({CONFIG}), not a model: start from the model with the adapter merged into it"
        f"{merged}, or PEFT's merge_and_unload() then save_pretrained(); a LoRA run then trains a new adapter on it"
    )


def _read_config(d: Path) -> dict:
    if not (d / CONFIG).exists() or not (d / WEIGHTS).exists():
        raise HFFormatError(f"{d} is not a PEFT adapter: it needs {CONFIG} and {WEIGHTS}.")
    config = read_json(d / CONFIG)
    unsupported = {
        "peft_type": config.get("peft_type") != "LORA",
        "use_rslora": bool(config.get("use_rslora")),
        "rank_pattern": bool(config.get("rank_pattern")),
        "alpha_pattern": bool(config.get("alpha_pattern")),
        "bias": config.get("bias", "none") != "none",
        "fan_in_fan_out": bool(config.get("fan_in_fan_out")),
        "modules_to_save": bool(config.get("modules_to_save")),
        "target_modules": not isinstance(config.get("target_modules"), list | str),
        "target_parameters": not _readable_parameters(config.get("target_parameters") or []),
    }
    bad = [f"{k}={config.get(k)!r}" for k, v in unsupported.items() if v]
    if bad:
        raise HFFormatError(
            f"{d / CONFIG}: {', '.join(bad)} is not supported; xlafit reads plain LoRA adapters "
            "(one r and lora_alpha, target_modules, no biases or extra modules; on a mixture of experts, "
            "target_parameters naming both experts.gate_up_proj and experts.down_proj, and a router's weight)."
        )
    return config


def _readable_parameters(parameters: list[str]) -> bool:
    """Whether PEFT's ``target_parameters`` are what :func:`save_peft_adapter` writes: the
    experts' two stacked weights (both or neither) and any router's ``gate.weight``."""
    experts = sorted(p.rsplit(".", 1)[-1] for p in parameters if _module_of(p) == EXPERTS_TARGET)
    others = [p for p in parameters if _module_of(p) != EXPERTS_TARGET]
    routers = set(ROUTER_MODULES.values())
    return experts in ([], sorted(EXPERT_PARAMETERS)) and all(
        p.endswith(".weight") and _module_of(p) in routers for p in others
    )


def _module_of(parameter: str) -> str:
    """The name of the module that holds one of PEFT's ``target_parameters``: ``gate`` of
    ``mlp.gate.weight``, ``experts`` of ``experts.down_proj``."""
    parts = parameter.rsplit(".", 2)
    return parts[-2] if len(parts) > 1 else ""


def load_peft_adapter(
    model: LlamaForCausalLM, directory: str | Path, *, rngs: nnx.Rngs | None = None, check_base: bool = True
) -> LlamaForCausalLM:
    """Loads a PEFT LoRA adapter into ``model``, in place, adding the adapters if it has none.

    Args:
        model: the base model (or one with adapters of the same targets and rank).
        directory: a PEFT adapter directory (:func:`save_peft_adapter` or PEFT's
            ``save_pretrained``).
        rngs: for :func:`~xlafit.models.lora.apply_lora` (the draws are overwritten).
        check_base: refuse an adapter whose recorded base fingerprint differs from
            ``model``'s (adapters PEFT wrote record none and are not checked); an adapter
            trained on a quantized base is checked against ``model`` quantized alike.

    Raises:
        HFFormatError: an unsupported adapter config, a missing tensor or one of another
            shape (named), or another base model.

    Example:
        >>> model = load_peft_adapter(from_hf("base/"), "adapter/")  # doctest: +SKIP
    """
    d = Path(directory).expanduser()
    config = _read_config(d)
    with open_safetensors(d / WEIGHTS) as f:
        metadata = f.metadata() or {}
        recorded = metadata.get(FINGERPRINT_KEY)
        # A multimodal model's adapter names its text model's modules under model.language_model.
        tensors = {
            name.replace("base_model.model." + TEXT_MODEL, "base_model.model.model.", 1): f.get_tensor(name)
            for name in f.keys()  # noqa: SIM118 (safe_open is no dict)
        }
    if check_base and recorded is not None:
        ours = _fingerprint_as_trained(model, metadata.get(QUANTIZED_KEY), metadata.get(BASE_DTYPE_KEY))
        if recorded != ours:
            raise HFFormatError(
                f"{d} was trained on another base model (fingerprint {recorded[:12]}..., this model's "
                f"{ours[:12]}...); load the base it was made for, or pass check_base=False."
            )
    if not has_adapters(model):
        parameters = config.get("target_parameters") or []
        stacked = [EXPERTS_TARGET] if any(_module_of(p) == EXPERTS_TARGET for p in parameters) else []
        routers = sorted({_module_of(p) for p in parameters} - {EXPERTS_TARGET})  # "mlp.gate.weight": gate
        targets = [*_targets(config, tensors), *routers, *stacked]
        apply_lora(model, targets, rank=config["r"], alpha=config["lora_alpha"], rngs=rngs or nnx.Rngs(0))
    rows: dict[int, tuple[LoRA, list[np.ndarray], list[np.ndarray]]] = {}
    modules = list(_hf_modules(model))
    experts = list(_hf_experts(model))
    expected = {f"{name}.lora_{ab}.weight" for name, _, _ in modules for ab in "AB"}
    expected |= {
        f"{_expert_module(n, p)}.lora_{ab}.weight" for n, _, _ in experts for p in EXPERT_PARAMETERS for ab in "AB"
    }
    unused = sorted(set(tensors) - expected)
    if unused:
        raise HFFormatError(f"the adapter has tensors for layers this model does not adapt: {', '.join(unused[:3])}.")
    for name, layer, row in modules:
        a = _take(tensors, f"{name}.lora_A.weight", (layer.rank, layer.in_features)).T
        b = _take(tensors, f"{name}.lora_B.weight", (layer.out_features, layer.rank)).T
        if row is None:
            layer.lora_a[...], layer.lora_b[...] = a, b
        else:
            entry = rows.setdefault(id(layer), (layer, [], []))
            entry[1].append(a)
            entry[2].append(b)
    for layer, a_rows, b_rows in rows.values():  # scanned: the layers' adapters stacked
        layer.lora_a[...], layer.lora_b[...] = np.stack(a_rows), np.stack(b_rows)
    _load_experts(tensors, experts)
    return model


def _targets(config: dict, tensors: dict[str, np.ndarray]) -> list[str]:
    """The adapted layers' names: ``target_modules``, or where it is a pattern (PEFT's
    regular expression), the layers the tensors name."""
    if isinstance(config["target_modules"], list):
        return config["target_modules"]
    found = {name.split(".lora_", 1)[0].rsplit(".", 1)[-1] for name in tensors}
    return sorted(found - {"experts", "base_layer"})


def _load_experts(tensors: dict[str, np.ndarray], experts: list[tuple[str, ExpertLoRA, int | None]]) -> None:
    """The experts' adapters from PEFT's ``lora_A [r * E, in]`` / ``lora_B [out, r * E]``."""
    stacked: dict[int, tuple[ExpertLoRA, list[list[np.ndarray]]]] = {}
    for name, layer, row in experts:
        values = []
        for param, (a_var, b_var) in zip(
            EXPERT_PARAMETERS, ((layer.gate_up_a, layer.gate_up_b), (layer.down_a, layer.down_b)), strict=True
        ):
            e, n_in, r = a_var.get_value().shape[-3:]
            n_out = b_var.get_value().shape[-1]
            module = _expert_module(name, param)
            a = _take(tensors, f"{module}.lora_A.weight", (r * e, n_in)).reshape(e, r, n_in).transpose(0, 2, 1)
            b = _take(tensors, f"{module}.lora_B.weight", (n_out, r * e)).reshape(n_out, r, e).transpose(2, 1, 0)
            values += [a, b]
        if row is None:
            for var, value in zip((layer.gate_up_a, layer.gate_up_b, layer.down_a, layer.down_b), values, strict=True):
                var[...] = value
        else:
            lists = stacked.setdefault(id(layer), (layer, [[], [], [], []]))[1]
            for layer_rows, value in zip(lists, values, strict=True):
                layer_rows.append(value)
    for layer, lists in stacked.values():  # scanned: the layers' adapters stacked
        for var, layer_rows in zip((layer.gate_up_a, layer.gate_up_b, layer.down_a, layer.down_b), lists, strict=True):
            var[...] = np.stack(layer_rows)


def _take(tensors: dict[str, np.ndarray], name: str, shape: tuple[int, int]) -> np.ndarray:
    if name not in tensors:
        raise HFFormatError(f"the adapter has no tensor {name!r} (expected shape {shape}).")
    value = np.asarray(tensors[name], np.float32)
    if value.shape != shape:
        raise HFFormatError(f"{name} has shape {value.shape}, expected {shape} (r from adapter_config.json).")
    return value
