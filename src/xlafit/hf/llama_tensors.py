"""The tensors of one decoder layer in Hugging Face's checkpoints, per family and kind of
layer, for :mod:`xlafit.hf.llama`: each as its name after ``model.layers.{i}.``, the path of
our parameter in a :class:`~xlafit.models.decoder.LlamaDecoderLayer`, and whether PyTorch's
``[out, in]`` is our ``[in, out]`` transposed; and transformers' fused expert weights seen as
the per-expert tensors that ``save_pretrained`` writes.

Example:
    >>> from xlafit.models.llama_config import LlamaConfig
    >>> [name for name, _, _ in layer_tensors(LlamaConfig.preset("tiny"), 0)][:3]
    ['input_layernorm.weight', 'self_attn.q_proj.weight', 'self_attn.k_proj.weight']
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np

from xlafit.models.llama_config import LlamaConfig

__all__ = ["EXPERT_NAMES", "PerExpert", "Tensor", "layer_tensors"]

# (Hugging Face name after "model.layers.{i}.", attribute path in a decoder layer, transposed)
Tensor = tuple[str, tuple[str, ...], bool]
# A sparse layer's experts, each written as mlp.experts.{e}.{name}.weight (our stacked [E, in, out]).
EXPERT_NAMES = ("gate_proj", "up_proj", "down_proj")
# A Gated DeltaNet layer's (Qwen3.5) in place of self_attn's; conv1d's [C, 1, K] is our [K, 1, C] reversed.
_LINEAR_TENSORS: list[Tensor] = [
    *[
        (f"linear_attn.{p}.weight", ("linear_attn", p, "kernel"), True)
        for p in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "conv1d", "out_proj")
    ],
    *[(f"linear_attn.{p}", ("linear_attn", p), False) for p in ("dt_bias", "A_log")],
    ("linear_attn.norm.weight", ("linear_attn", "norm", "scale"), False),
]


def _attention_tensors(cfg: LlamaConfig, i: int) -> list[Tensor]:
    """Layer ``i``'s attention (Gemma 4: a layer sharing keys and values has no k or v; a
    global layer whose values are its keys has no v)."""
    kind = cfg.kinds[i]
    projections = ["q_proj"]
    if not cfg.shares_kv(i):
        projections += ["k_proj"] if cfg.values_are_keys(kind) else ["k_proj", "v_proj"]
    out: list[Tensor] = [(f"self_attn.{p}.weight", ("self_attn", p, "kernel"), True) for p in (*projections, "o_proj")]
    if cfg.attention_bias:
        out += [(f"self_attn.{p}.bias", ("self_attn", p, "bias"), False) for p in projections]
    if cfg.qk_norm:
        norms = ["q_norm"] if cfg.shares_kv(i) else ["q_norm", "k_norm"]
        out += [(f"self_attn.{n}.weight", ("self_attn", n, "scale"), False) for n in norms]
    return out


def layer_tensors(cfg: LlamaConfig, i: int) -> list[Tensor]:
    """Layer ``i``'s tensors but a sparse layer's experts (:data:`EXPERT_NAMES`): Llama's,
    and those its family and kind add, replace or leave out (a Gated DeltaNet in place of
    attention; a mixture of experts' router, and its shared expert, in place of the MLP;
    Gemma's sandwich norms, Gemma 4's per-layer input gate and layer scalar)."""
    linear = cfg.kinds[i] == "linear_attention"
    out: list[Tensor] = [("input_layernorm.weight", ("input_layernorm", "scale"), False)]
    out += _LINEAR_TENSORS if linear else _attention_tensors(cfg, i)
    out.append(("post_attention_layernorm.weight", ("post_attention_layernorm", "scale"), False))
    if cfg.sandwich_norms:
        out += [
            (f"{n}.weight", (n, "scale"), False) for n in ("pre_feedforward_layernorm", "post_feedforward_layernorm")
        ]
    if cfg.moe_layers[i]:
        out.append(("mlp.gate.weight", ("mlp", "gate", "kernel"), True))
        if cfg.shared_expert_intermediate_size:  # Qwen3.5-MoE: the shared expert and its gate [1, hidden]
            out += [
                (f"mlp.shared_expert.{p}.weight", ("mlp", "shared_expert", p, "kernel"), True)
                for p in ("gate_proj", "up_proj", "down_proj")
            ]
            out.append(("mlp.shared_expert_gate.weight", ("mlp", "shared_expert_gate", "kernel"), True))
    else:
        out += [(f"mlp.{p}.weight", ("mlp", p, "kernel"), True) for p in ("gate_proj", "up_proj", "down_proj")]
    if cfg.per_layer_input_size:
        out += [(f"{p}.weight", (p, "kernel"), True) for p in ("per_layer_input_gate", "per_layer_projection")]
        out.append(("post_per_layer_input_norm.weight", ("post_per_layer_input_norm", "scale"), False))
    if cfg.layer_scalar:
        out.append(("layer_scalar", ("layer_scalar",), False))
    return out


class PerExpert(Mapping[str, Any]):
    """A checkpoint's tensors with transformers' fused expert weights (``mlp.experts.gate_up_proj``
    ``[E, 2f, hidden]``, ``mlp.experts.down_proj`` ``[E, hidden, f]``) also seen as the
    per-expert tensors of the layout that ``save_pretrained`` writes (``mlp.experts.{e}.gate_proj.weight``
    ``[f, hidden]``, ...). The last fused tensor read is kept: each is read once for its experts."""

    def __init__(self, state: Mapping[str, Any]) -> None:
        self.state = state
        self._kept: tuple[str, np.ndarray] | None = None

    def _fused(self, name: str) -> tuple[str, int, slice | None] | None:
        """``(fused tensor's name, expert, rows of it)`` for a per-expert name the state lacks."""
        head, sep, tail = name.partition(".mlp.experts.")
        parts = tail.split(".")
        if not sep or len(parts) != 3 or not parts[0].isdigit() or name in self.state:
            return None
        e, proj = int(parts[0]), parts[1]
        if proj == "down_proj":
            return f"{head}.mlp.experts.down_proj", e, None
        return f"{head}.mlp.experts.gate_up_proj", e, slice(0, 1) if proj == "gate_proj" else slice(1, 2)

    def __getitem__(self, name: str) -> Any:
        fused = self._fused(name)
        if fused is None or fused[0] not in self.state:
            return self.state[name]
        key, e, half = fused
        if self._kept is None or self._kept[0] != key:
            self._kept = (key, np.asarray(self.state[key]))
        value = self._kept[1][e]
        if half is None:
            return value
        f = value.shape[0] // 2  # gate_up_proj: the gate's rows, then the up projection's
        return value[half.start * f : half.stop * f]

    def __contains__(self, name: object) -> bool:
        fused = self._fused(name) if isinstance(name, str) else None
        return name in self.state or (fused is not None and fused[0] in self.state)

    def __iter__(self) -> Iterator[str]:
        return iter(self.state)

    def __len__(self) -> int:
        return len(self.state)
