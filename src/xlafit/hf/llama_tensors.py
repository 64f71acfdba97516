"""The tensors of one decoder layer in Hugging Face's checkpoints, per family and kind of
layer, for :mod:`xlafit.hf.llama`: each as its name after ``model.layers.{i}.``, the path of
our parameter in a :class:`~xlafit.models.decoder.LlamaDecoderLayer`, and whether PyTorch's
``[out, in]`` is our ``[in, out]`` transposed; and transformers' fused expert weights seen as
the per-expert tensors that ``save_pretrained`` writes (Gemma 4's as the two halves of its
fused ``experts.gate_up_proj``, fused again to be written).

Example:
    >>> from xlafit.models.llama_config import LlamaConfig
    >>> [name for name, _, _ in layer_tensors(LlamaConfig.preset("tiny"), 0)][:3]
    ['input_layernorm.weight', 'self_attn.q_proj.weight', 'self_attn.k_proj.weight']
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np

from xlafit.models.llama_config import LlamaConfig
from xlafit.models.moe import EXPERT_WEIGHTS

__all__ = ["EXPERT_NAMES", "PerExpert", "Tensor", "fuse_experts", "layer_tensors"]

log = logging.getLogger("xlafit")

# (Hugging Face name after "model.layers.{i}.", attribute path in a decoder layer, transposed)
Tensor = tuple[str, tuple[str, ...], bool]
# A sparse layer's experts, each written as mlp.experts.{e}.{name}.weight (our stacked [E, in, out]).
EXPERT_NAMES = EXPERT_WEIGHTS
# A Gated DeltaNet layer's (Qwen3.5) in place of self_attn's; conv1d's [C, 1, K] is our [K, 1, C] reversed.
_LINEAR_TENSORS: list[Tensor] = [
    *[
        (f"linear_attn.{p}.weight", ("linear_attn", p, "kernel"), True)
        for p in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "conv1d", "out_proj")
    ],
    *[(f"linear_attn.{p}", ("linear_attn", p), False) for p in ("dt_bias", "A_log")],
    ("linear_attn.norm.weight", ("linear_attn", "norm", "scale"), False),
]


# Gemma 4's router and experts beside the MLP, and their norms. The experts are whole stacks
# ([E, out, in] in the checkpoint: our [E, in, out] with its last two axes swapped); the file's
# experts.gate_up_proj is seen as its two halves, experts.gate_proj and experts.up_proj
# (PerExpert reads them, fuse_experts writes them back as one).
_EXPERTS_BESIDE: list[Tensor] = [
    ("router.proj.weight", ("router", "proj", "kernel"), True),
    ("router.scale", ("router", "scale"), False),
    ("router.per_expert_scale", ("router", "per_expert_scale"), False),
    *[(f"experts.{p}", ("experts", p), True) for p in EXPERT_NAMES],
    *[
        (f"{n}.weight", (n, "scale"), False)
        for n in ("pre_feedforward_layernorm_2", "post_feedforward_layernorm_1", "post_feedforward_layernorm_2")
    ],
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
    beside = cfg.moe_layers[i] and cfg.moe_beside_mlp
    if cfg.moe_layers[i] and not beside:
        out.append(("mlp.gate.weight", ("mlp", "gate", "kernel"), True))
        if cfg.shared_expert_intermediate_size:  # Qwen3.5-MoE: the shared expert and its gate [1, hidden]
            out += [
                (f"mlp.shared_expert.{p}.weight", ("mlp", "shared_expert", p, "kernel"), True)
                for p in ("gate_proj", "up_proj", "down_proj")
            ]
            out.append(("mlp.shared_expert_gate.weight", ("mlp", "shared_expert_gate", "kernel"), True))
    else:
        out += [(f"mlp.{p}.weight", ("mlp", p, "kernel"), True) for p in ("gate_proj", "up_proj", "down_proj")]
    if beside:
        out += _EXPERTS_BESIDE
    if cfg.per_layer_input_size:
        out += [(f"{p}.weight", (p, "kernel"), True) for p in ("per_layer_input_gate", "per_layer_projection")]
        out.append(("post_per_layer_input_norm.weight", ("post_per_layer_input_norm", "scale"), False))
    if cfg.layer_scalar:
        out.append(("layer_scalar", ("layer_scalar",), False))
    return out


_HALVES = {"gate_proj": slice(0, 1), "up_proj": slice(1, 2)}


def fuse_experts(tensors: dict[str, Any]) -> dict[str, Any]:
    """Gemma 4's experts as its checkpoints hold them: each layer's ``experts.gate_proj`` and
    ``experts.up_proj`` (``(shape [E, f, hidden], a function giving the value)``) as one
    ``experts.gate_up_proj`` ``[E, 2f, hidden]``; every other tensor as it is, in order.

    Example:
        >>> halves = {f"experts.{p}": ((1, 2, 3), lambda: np.zeros((1, 2, 3))) for p in ("gate_proj", "up_proj")}
        >>> [(name, shape) for name, (shape, _) in fuse_experts(halves).items()]
        [('experts.gate_up_proj', (1, 4, 3))]
    """
    out: dict[str, Any] = {}
    for name, (shape, value) in tensors.items():
        head = name.removesuffix("gate_proj").removesuffix("up_proj")
        if not head.endswith("experts."):
            out[name] = (shape, value)
            continue
        if head + "gate_up_proj" in out:  # the up projection, fused with its gate already
            continue
        (gate_shape, gate), (up_shape, up) = tensors[head + "gate_proj"], tensors[head + "up_proj"]

        def fused(gate: Any = gate, up: Any = up) -> np.ndarray:
            return np.concatenate([gate(), up()], axis=-2)

        out[head + "gate_up_proj"] = ((*gate_shape[:-2], gate_shape[-2] + up_shape[-2], gate_shape[-1]), fused)
    return out


class PerExpert(Mapping[str, Any]):
    """A checkpoint's tensors with transformers' fused expert weights (``mlp.experts.gate_up_proj``
    ``[E, 2f, hidden]``, ``mlp.experts.down_proj`` ``[E, hidden, f]``) also seen as the
    per-expert tensors of the layout that ``save_pretrained`` writes (``mlp.experts.{e}.gate_proj.weight``
    ``[f, hidden]``, ...). The last fused tensor read is kept: each is read once for its experts.
    ``read``: the names of ``state``'s tensors read so far (a fused one for any of its experts)."""

    def __init__(self, state: Mapping[str, Any]) -> None:
        self.state = state
        self.read: set[str] = set()
        self._kept: tuple[str, np.ndarray] | None = None

    def _fused(self, name: str) -> tuple[str, int | None, slice | None] | None:
        """``(fused tensor's name, expert (None: all), half of its rows)`` for a per-expert
        name the state lacks, or a half of Gemma 4's ``experts.gate_up_proj``."""
        if name in self.state:
            return None
        for proj in ("gate_proj", "up_proj"):  # Gemma 4: the whole stack's half
            if name.endswith(f".experts.{proj}"):
                return name.removesuffix(proj) + "gate_up_proj", None, _HALVES[proj]
        head, sep, tail = name.partition(".mlp.experts.")
        parts = tail.split(".")
        if not sep or len(parts) != 3 or not parts[0].isdigit():
            return None
        e, proj = int(parts[0]), parts[1]
        if proj == "down_proj":
            return f"{head}.mlp.experts.down_proj", e, None
        return f"{head}.mlp.experts.gate_up_proj", e, _HALVES[proj]

    def __getitem__(self, name: str) -> Any:
        fused = self._fused(name)
        if fused is None or fused[0] not in self.state:
            value = self.state[name]
            self.read.add(name)
            return value
        key, e, half = fused
        self.read.add(key)
        if self._kept is None or self._kept[0] != key:
            self._kept = (key, np.asarray(self.state[key]))
        value = self._kept[1] if e is None else self._kept[1][e]
        if half is None:
            return value
        f = value.shape[-2] // 2  # gate_up_proj: the gate's rows, then the up projection's
        return value[..., half.start * f : half.stop * f, :]

    def __contains__(self, name: object) -> bool:
        fused = self._fused(name) if isinstance(name, str) else None
        return name in self.state or (fused is not None and fused[0] in self.state)

    def __iter__(self) -> Iterator[str]:
        return iter(self.state)

    def __len__(self) -> int:
        return len(self.state)

    def warn_unread(self, text_model: str, tied: bool) -> None:
        """Names in a warning the tensors of the checkpoint not read so far (transformers'
        UNEXPECTED keys: its config.json may not be the one its weights were saved with), but
        those no text model reads: a multimodal checkpoint's other towers (outside
        ``text_model``, the prefix of its text model's tensors), rotary tables kept as buffers,
        Qwen3.5's multi-token prediction head (``mtp.``) and a ``tied`` model's output layer."""

        def unexpected(key: str) -> bool:
            if key.endswith("lm_head.weight"):  # beside a multimodal text model's prefix
                return not tied
            return key.startswith(text_model) and not key.endswith(".inv_freq") and not key.startswith("mtp.")

        unread = [key for key in self.state if key not in self.read and unexpected(key)]
        if unread:
            log.warning(
                "warning: the checkpoint has %d tensor%s the model does not read (%s), left out: its config.json may "
                "not be the one its weights were saved with (a bias with attention_bias=false, another family's "
                "names); check that both come from the same model.",
                len(unread),
                "" if len(unread) == 1 else "s",
                ", ".join(unread[:3]) + (", ..." if len(unread) > 3 else ""),
            )
