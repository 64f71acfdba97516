"""A Hugging Face checkpoint read into a quantized base (QLoRA), one tensor at a time.

:func:`from_hf_quantized` builds the model as shapes only (``nnx.eval_shape``: no weight in
memory), then reads the safetensors files tensor by tensor: each dense layer's kernel is
quantized as it arrives (:func:`xlafit.models.quantized.quantize_kernel`, on the CPU, a
slice of rows at a time), as is each expert's of a mixture of experts, and only their codes
and scales are kept; the embeddings, norms and output layer are kept in bfloat16 (with
``embeddings``, the embedding tables and an untied output layer quantized as they arrive too:
:func:`xlafit.models.quantized_embed.quantize_table`). The host holds about one tensor of the
file plus the quantized model at any time, never the whole model in full precision (a
notebook VM's memory is shared with everything else it holds).

Example:
    >>> model = from_hf_quantized("meta-llama/Llama-3.2-1B", "nf4")  # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np
from flax import nnx

from xlafit.hf import llama as llama_hf
from xlafit.models.llama import LlamaForCausalLM
from xlafit.models.moe import EXPERT_WEIGHTS, Experts
from xlafit.models.quantized import (
    BLOCK,
    UNQUANTIZED,
    QuantizedExperts,
    QuantizedLinear,
    check_qtype,
    check_tilings,
    quantizable,
    quantize_kernel,
    set_child,
)
from xlafit.models.quantized_embed import QuantizedEmbed, check_tables, quantize_table, table_param, tables
from xlafit.parallel.sharding import logical_axes


def tiled_shapes(model: nnx.Module, skip: Sequence[str] = UNQUANTIZED) -> list[tuple[str, tuple[int, ...]]]:
    """``(name, shape)`` of every kernel a quantized base quantizes in blocks along its input
    features (``shape[-2]``): the dense layers (all but ``skip``) and the experts' weights;
    ``model`` may be shapes only (``nnx.eval_shape``)."""
    shapes = [
        (".".join(map(str, path)), tuple(layer.kernel.get_value().shape)) for path, layer in quantizable(model, skip)
    ]
    for path, module in nnx.iter_modules(model):
        if isinstance(module, Experts) and path:
            shapes += [
                (".".join(map(str, (*path, w))), tuple(getattr(module, w).get_value().shape)) for w in EXPERT_WEIGHTS
            ]
    return shapes


def from_hf_quantized(
    directory: str | Path,
    qtype: str,
    block: int = BLOCK,
    *,
    skip: tuple[str, ...] = UNQUANTIZED,
    embeddings: bool = False,
    **overrides: Any,
) -> LlamaForCausalLM:
    """A :class:`LlamaForCausalLM` of a Hugging Face checkpoint with its dense layers and experts
    quantized (``nf4``, ``int4``, ``int8`` in blocks of ``block``: :class:`QuantizedLinear`)
    and every other parameter in bfloat16; ``skip`` names layers left in bfloat16 (the
    output layer); ``embeddings`` quantizes the embedding tables and an untied output layer
    too (:class:`~xlafit.models.quantized_embed.QuantizedEmbed`, ``lora.quantize_embeddings``).
    ``overrides`` as :func:`xlafit.hf.llama.from_hf`'s.

    Raises:
        ConfigError: an unknown ``qtype``, or a layer whose input features ``block`` does not divide.
        HFFormatError: a tensor is missing or has another shape than ``config.json`` gives.
    """
    check_qtype(qtype)
    d, cfg = llama_hf.read_config(directory, **{**overrides, "param_dtype": "bfloat16"})
    # Shapes only: every value is read from the files (no draw is used).
    model = nnx.eval_shape(lambda: LlamaForCausalLM(cfg, rngs=nnx.Rngs(0)))
    layers = quantizable(model, skip)
    check_tilings(tiled_shapes(model, skip), block, qtype)  # every shape refused before a tensor is read
    experts = [(path, m) for path, m in nnx.iter_modules(model) if isinstance(m, Experts) and path]
    embedded = tables(model) if embeddings else []
    if embeddings:
        check_tables(model, qtype, block)
    # each table's parameter and whether it arrives as a kernel [H, V] (the output layer)
    table_params = {id(param): linear for param, linear in (table_param(m) for _, m in embedded)}
    expert_kernels = {id(getattr(m, weight)) for _, m in experts for weight in EXPERT_WEIGHTS}
    kernels = {id(layer.kernel) for _, layer in layers} | expert_kernels
    rows: dict[int, list[tuple[Any, Any]]] = {}  # a scanned model's layers: quantized rows, stacked at the end
    stacked: dict[int, tuple[nnx.Variable, list[np.ndarray]]] = {}

    def put(param: nnx.Variable, row: tuple[int, ...] | None, value: np.ndarray) -> None:
        if id(param) in table_params:  # [V, H] (the output layer's kernel transposed back: a view)
            rows[id(param)] = [quantize_table(value.T if table_params[id(param)] else value, qtype, block)]
            return
        if id(param) in expert_kernels and np.ndim(value) > 2:  # a layer's experts in one tensor (Gemma 4's)
            for e in range(value.shape[0]):  # each expert's kernel [in, out], as _experts_of stacks them
                rows.setdefault(id(param), []).append(quantize_kernel(value[e], qtype, block))
            return
        if id(param) in kernels:
            quantized = quantize_kernel(value, qtype, block)
            if row is None:
                rows[id(param)] = [quantized]
            else:
                rows.setdefault(id(param), []).append(quantized)
            return
        value = np.asarray(value).astype(param.get_value().dtype, copy=False)
        if row is None:
            param.set_value(value)
        else:
            stacked.setdefault(id(param), (param, []))[1].append(value)

    llama_hf.from_hf_state(model, llama_hf.lazy_tensors(d), put)
    for param, values in stacked.values():  # in row-major order of (layer, expert)
        param.set_value(np.stack(values).reshape(param.get_value().shape))
    for path, layer in layers:
        parts = rows.pop(id(layer.kernel))
        qvalue, scale = (
            parts[0] if len(parts) == 1 else (jnp.stack([q for q, _ in parts]), jnp.stack([s for _, s in parts]))
        )
        bias = None if layer.bias is None else layer.bias.get_value()
        quantized = QuantizedLinear(
            qvalue,
            scale,
            bias,
            qtype=qtype,
            dtype=layer.dtype,
            axes=logical_axes(layer.kernel),
            bias_axes=None if layer.bias is None else logical_axes(layer.bias),
        )
        set_child(model, path, quantized)
    for path, module in experts:  # each expert's kernel quantized as read, in (layer, expert) order
        set_child(model, path, _experts_of(module, rows, qtype))
    for path, m in embedded:
        [(qvalue, scale)] = rows.pop(id(table_param(m)[0]))
        set_child(model, path, QuantizedEmbed.from_values(m, qvalue, scale, qtype=qtype))
    return model


def _experts_of(module: Experts, rows: dict[int, list[tuple[Any, Any]]], qtype: str) -> QuantizedExperts:
    """``module``'s :class:`QuantizedExperts` of each expert's codes and scales in ``rows``
    (keyed by the parameter's id, in (layer, expert) order), taken out of ``rows``."""
    stored: list[QuantizedLinear] = []
    for weight in EXPERT_WEIGHTS:
        param = getattr(module, weight)
        pieces = rows.pop(id(param))
        lead = param.get_value().shape[:-2]
        qvalue = jnp.stack([q for q, _ in pieces]).reshape(*lead, *pieces[0][0].shape)
        scale = jnp.stack([s for _, s in pieces]).reshape(*lead, *pieces[0][1].shape)
        stored.append(QuantizedLinear(qvalue, scale, None, qtype=qtype, dtype=module.dtype, axes=logical_axes(param)))
    return QuantizedExperts(*stored, impl=module.impl, activation=module.activation, dtype=module.dtype)
