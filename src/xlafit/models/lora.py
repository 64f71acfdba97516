"""LoRA (Hu et al. 2021): low-rank adapters on the dense layers of any NNX model.

:func:`apply_lora` wraps chosen ``nnx.Linear`` layers (by attribute name: ``q_proj``,
``v_proj`` in a Llama, ``out`` or ``intermediate`` in BERT) in :class:`LoRA`, Flax's
``nnx.LoRA`` with PEFT's scaling: ``y = base(x) + (alpha / rank) * x @ A @ B``. ``A`` is
drawn as PEFT draws it, ``B`` starts at zero, so a new adapter leaves the model's outputs
unchanged. The adapters are ``nnx.LoRAParam`` variables and the base weights stay
``nnx.Param``; ``LoRAParam`` subclasses ``Param``, so select with the filters here:
:data:`ADAPTER` (what to train) and :data:`BASE` (what to freeze), e.g.
``nnx.Optimizer(model, tx, wrt=ADAPTER)`` and ``nnx.grad(..., argnums=nnx.DiffState(0,
ADAPTER))``. Stacked layers (``scan_layers``) get stacked adapters.

Example:
    >>> from xlafit.models.llama import LlamaConfig, LlamaForCausalLM
    >>> model = LlamaForCausalLM(LlamaConfig.preset("tiny", vocab_size=100), rngs=nnx.Rngs(0))
    >>> model = apply_lora(model, ("q_proj", "v_proj"), rank=4, alpha=8, rngs=nnx.Rngs(1))
    >>> sorted(nnx.state(model.layers[0].self_attn.q_proj, ADAPTER))
    ['lora_a', 'lora_b']
    >>> merged = merge_lora(model)  # plain nnx.Linear layers again, W + (alpha / rank) * A @ B
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from xlafit.errors import ConfigError
from xlafit.models.moe import EXPERT_WEIGHTS, ExpertAdapters, Experts
from xlafit.models.quantized import QuantizedExperts, QuantizedLinear, dequantize_linears, set_child
from xlafit.models.quantized_embed import dequantize_embeddings
from xlafit.parallel.sharding import logical_axes, to_host

ADAPTER = nnx.LoRAParam  # the adapters: what a LoRA fine-tune trains
BASE = nnx.All(nnx.Param, nnx.Not(nnx.LoRAParam))  # everything else it keeps frozen

# Set while a model runs as its base (adapters_off): read when a LoRA layer is traced.
_OFF: contextvars.ContextVar[bool] = contextvars.ContextVar("lora_adapters_off", default=False)

# PEFT's draw of A (torch's kaiming_uniform_ with a=sqrt(5)): uniform in +-1/sqrt(in_features).
_A_INIT = nnx.initializers.variance_scaling(1.0 / 3.0, "fan_in", "uniform")


def _stacked(init: Callable, lead: tuple[int, ...]) -> Callable:
    """``init`` drawn once per stacked layer: ``(*lead, *shape)``, each slice as ``init`` alone."""
    if not lead:
        return init

    def stacked(key: jax.Array, shape: Sequence[int], dtype: Any = jnp.float32) -> jax.Array:
        keys = jax.random.split(key, math.prod(lead))
        return jax.vmap(lambda k: init(k, shape, dtype))(keys).reshape(*lead, *shape)

    return stacked


class LoRA(nnx.LoRA):
    """``base(x) + (alpha / rank) * x @ lora_a @ lora_b`` around an ``nnx.Linear``.

    ``lora_a`` is ``[in, rank]``, ``lora_b`` ``[rank, out]`` (with the base kernel's leading
    ``layers`` axis when stacked), float32, computed in the base layer's dtype. Their logical
    axes are the kernel's in and out axes (the rank axis replicated), so they shard along
    with it.

    Args:
        base: the layer adapted (an ``nnx.Linear``, or a quantized base's
            :class:`~xlafit.models.quantized.QuantizedLinear`); it stays ``base_module``, its
            weights untouched.
        rank: the adapters' rank ``r``.
        alpha: PEFT's ``lora_alpha``; the update is scaled by ``alpha / rank``.
        rngs: ``params`` draws ``lora_a``.
    """

    def __init__(self, base: nnx.Linear | QuantizedLinear, *, rank: int, alpha: float, rngs: nnx.Rngs) -> None:
        kernel = base.kernel if isinstance(base, nnx.Linear) else base.qvalue
        lead = tuple(kernel.get_value().shape[:-2])  # (layers,) for a scanned model's stacked kernel
        names = logical_axes(kernel)

        def meta(axes: tuple[str | None, ...] | None) -> dict[str, Any]:
            return {} if names is None else {"out_sharding": axes, "eager_sharding": False}

        super().__init__(
            base.in_features,
            rank,
            base.out_features,
            base_module=base,
            dtype=base.dtype,
            a_initializer=_stacked(_A_INIT, lead),
            b_initializer=_stacked(nnx.initializers.zeros_init(), lead),
            rngs=rngs,
            a_metadata=meta(None if names is None else (*names[:-1], None)),
            b_metadata=meta(None if names is None else (*names[:-2], None, names[-1])),
        )
        self.rank, self.alpha = rank, alpha

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank

    def __call__(self, x: jax.Array, **kwargs: Any) -> jax.Array:
        """The base layer's output plus the scaled low-rank update (``x [..., in]``)."""
        base = self.base_module
        assert base is not None  # built with one
        if _OFF.get():
            return base(x, **kwargs)
        xl, a, b = self.promote_dtype((x, self.lora_a[...], self.lora_b[...]), dtype=self.dtype)
        return base(x, **kwargs) + (xl @ a @ b) * self.scaling


EXPERTS_TARGET = "experts"  # the lora.targets name of a mixture of experts' stacked weights
ALL_LINEAR = "all-linear"  # PEFT's shorthand: every projection of the decoder's layers
# What all-linear stands for, where the model has it: attention's projections (a Gated
# DeltaNet's too), an MLP's (a shared expert's too) and a mixture of experts' stacked weights.
# Never a router (Qwen's `gate`, Gemma 4's `router.proj`), a shared expert's or per-layer
# input's gate, nor the output layer, which PEFT's all-linear leaves out too.
ALL_LINEAR_NAMES = (
    *("q_proj", "k_proj", "v_proj", "o_proj", "in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"),
    *("gate_proj", "up_proj", "down_proj", EXPERTS_TARGET),
)


class ExpertLoRA(nnx.Module):
    """LoRA on a mixture of experts' stacked weights (:class:`~xlafit.models.moe.Experts`),
    as PEFT adapts transformers' fused experts (``target_parameters``
    ``mlp.experts.gate_up_proj`` and ``mlp.experts.down_proj``): each expert its own rank-``r``
    adapter on its fused gate-and-up projection and on its down projection
    (:class:`~xlafit.models.moe.ExpertAdapters`). The updates are computed as grouped products
    of rank ``r`` beside the experts' own, never as ``[E, hidden, f]`` weights.

    ``gate_up_a`` ``[E, hidden, r]``, ``gate_up_b`` ``[E, r, 2f]``, ``down_a`` ``[E, f, r]``,
    ``down_b`` ``[E, r, hidden]`` (with the stacked layers' leading axis when scanned): float32
    ``nnx.LoRAParam``, laid out along the experts' axes. ``A`` is drawn as PEFT draws it
    (uniform in +-1/sqrt(in_features)), ``B`` starts at zero.

    Args:
        base: the experts adapted; it stays ``base_module``, its weights untouched.
        rank: the adapters' rank ``r``.
        alpha: PEFT's ``lora_alpha``; the updates are scaled by ``alpha / rank``.
        rngs: ``params`` draws the ``A`` matrices.
    """

    def __init__(self, base: Experts | QuantizedExperts, *, rank: int, alpha: float, rngs: nnx.Rngs) -> None:
        shape = base.shape  # (*lead, E, hidden, f)
        lead, (e, h, f) = tuple(shape[:-3]), shape[-3:]
        stored = base.gate_proj.qvalue if isinstance(base, QuantizedExperts) else base.gate_proj
        names = logical_axes(stored)  # (*lead, experts, embed, mlp)
        outer = None if names is None else names[:-2]

        def param(init: Callable, dims: tuple[int, int], axes: tuple[str | None, str | None]) -> nnx.LoRAParam:
            value = _stacked(init, (*lead, e))(rngs.params(), dims, jnp.float32)
            if outer is None:
                return nnx.LoRAParam(value)
            return nnx.LoRAParam(value, out_sharding=(*outer, *axes), eager_sharding=False)

        zeros = nnx.initializers.zeros_init()
        self.base_module = base
        self.gate_up_a = param(_A_INIT, (h, rank), ("embed", None))
        self.gate_up_b = param(zeros, (rank, 2 * f), (None, "mlp"))
        self.down_a = param(_A_INIT, (f, rank), ("mlp", None))
        self.down_b = param(zeros, (rank, h), (None, "embed"))
        self.rank, self.alpha = rank, alpha

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank

    def adapters(self) -> ExpertAdapters:
        dtype = self.base_module.dtype
        a_gu, b_gu, a_d, b_d = (
            v[...].astype(dtype) for v in (self.gate_up_a, self.gate_up_b, self.down_a, self.down_b)
        )
        return ExpertAdapters(a_gu, b_gu, a_d, b_d, self.scaling)

    def __call__(self, tokens: jax.Array, weights: jax.Array, experts: jax.Array) -> jax.Array:
        """The experts' output with each expert's LoRA update (``tokens [N, hidden]``)."""
        if _OFF.get():
            return self.base_module(tokens, weights, experts)
        return self.base_module(tokens, weights, experts, self.adapters())

    def merged_weights(self) -> tuple[jax.Array, jax.Array, jax.Array]:
        """``(gate, up, down)``: the experts' stacked weights plus their updates, float32."""
        gate, up, down = self.base_module.weights(jnp.float32)  # a quantized base's dequantized
        f = gate.shape[-1]
        gate_up = jnp.matmul(self.gate_up_a[...], self.gate_up_b[...]) * self.scaling
        delta = jnp.matmul(self.down_a[...], self.down_b[...]) * self.scaling
        return gate + gate_up[..., :f], up + gate_up[..., f:], down + delta


@contextlib.contextmanager
def adapters_off() -> Iterator[None]:
    """Within it, every :class:`LoRA` layer computes its base layer alone, as PEFT's
    ``disable_adapter()`` does: the model is the frozen base, with no second copy of its
    weights. Read when a layer is traced, so a function traced inside it (under ``jax.jit``,
    ``nnx.scan``, ``jax.grad``) keeps the base's path; the reference model of preference
    tuning (:mod:`xlafit.train.preference`).

    Example:
        >>> layer = apply_lora(nnx.Sequential(nnx.Linear(2, 2, rngs=nnx.Rngs(0))), ("0",), rank=1, alpha=1,
        ...                    rngs=nnx.Rngs(1)).layers[0]
        >>> layer.lora_b[...] = jnp.ones((1, 2))
        >>> x = jnp.ones((1, 2))
        >>> with adapters_off():
        ...     off = layer(x)
        >>> bool(jnp.array_equal(off, layer.base_module(x))), bool(jnp.array_equal(layer(x), off))
        (True, False)
    """
    token = _OFF.set(True)
    try:
        yield
    finally:
        _OFF.reset(token)


def apply_lora(model: nnx.Module, targets: Sequence[str], *, rank: int, alpha: float, rngs: nnx.Rngs) -> nnx.Module:
    """Wraps every ``nnx.Linear`` named one of ``targets`` in a :class:`LoRA`, in place.

    Args:
        model: any NNX model; its layers are found by attribute name at any depth.
        targets: attribute names (PEFT's ``target_modules``), e.g. ``("q_proj", "v_proj")``;
            ``"experts"`` adapts a mixture of experts' stacked weights (:class:`ExpertLoRA`);
            ``"all-linear"`` the names of :data:`ALL_LINEAR_NAMES` that the model has.
        rank: the adapters' rank.
        alpha: PEFT's ``lora_alpha`` (the adapters' output is scaled by ``alpha / rank``).
        rngs: ``params`` for ``lora_a``.

    Returns:
        ``model``, whose logits are unchanged until the adapters train (``lora_b`` is 0).

    Raises:
        ConfigError: a target names no ``nnx.Linear`` (the message lists the names there
            are) or one of a mixture of experts' stacked weights (``experts`` names them all:
            :class:`ExpertLoRA`), or ``rank`` or ``alpha`` is not positive.

    Example:
        >>> mlp = nnx.Sequential(nnx.Linear(8, 32, rngs=nnx.Rngs(0)), jax.nn.relu, nnx.Linear(32, 8, rngs=nnx.Rngs(1)))
        >>> x = jnp.ones((2, 8))
        >>> before = mlp(x)
        >>> mlp = apply_lora(mlp, ("0",), rank=2, alpha=4, rngs=nnx.Rngs(2))  # Sequential's layers are named 0, 1, ...
        >>> type(mlp.layers[0]).__name__, bool(jnp.array_equal(mlp(x), before))
        ('LoRA', True)
    """
    if rank < 1:
        raise ConfigError(f"LoRA rank={rank} must be at least 1.")
    if alpha <= 0:
        raise ConfigError(f"LoRA alpha={alpha} must be positive: the adapters' update is scaled by alpha / rank.")
    linears = [(path, m) for path, m in nnx.iter_modules(model) if isinstance(m, nnx.Linear | QuantizedLinear) and path]
    names = sorted({str(path[-1]) for path, _ in linears})
    experts = [(path, m) for path, m in nnx.iter_modules(model) if isinstance(m, Experts | QuantizedExperts) and path]
    if ALL_LINEAR in targets:
        present = [n for n in ALL_LINEAR_NAMES if n in names or (n == EXPERTS_TARGET and experts)]
        if not present:
            raise ConfigError(
                f"lora.targets={ALL_LINEAR} names a decoder's attention and MLP projections, and the model has none "
                f"({', '.join(ALL_LINEAR_NAMES)}): name its layers instead, from {', '.join(names) or 'none'}."
            )
        targets = list(dict.fromkeys(n for t in targets for n in (present if t == ALL_LINEAR else [t])))
    unknown = [t for t in targets if t not in names and not (t == EXPERTS_TARGET and experts)]
    stacked = _expert_names(model)
    for target in unknown:
        if target in stacked:
            raise ConfigError(
                f"lora.targets names {target}, one of the experts' stacked weights: name them all as `experts` "
                "(LoRA on each expert's gate_up_proj and down_proj, PEFT's target_parameters), beside the attention "
                "(q_proj, k_proj, v_proj, o_proj) or a dense MLP's layers where the model has one."
            )
    if unknown:
        # An attribute that is None where a layer could be: Llama's lm_head with tied embeddings.
        tied = [t for t in unknown if any(getattr(m, t, False) is None for _, m in nnx.iter_modules(model))]
        why = (
            f" The model ties its output layer to its embedding (tie_word_embeddings), so {', '.join(tied)} is no "
            "nnx.Linear: drop it from the targets."
            if tied
            else ""
        )
        modules = {tuple(path): m for path, m in nnx.iter_modules(model)}
        routers = sorted({str(path[-1]) for path, _ in linears if _is_router(modules, tuple(path))})
        if routers:
            why += f" {' and '.join(f'`{r}`' for r in routers)} is the router of its mixture of experts."
        raise ConfigError(
            f"no nnx.Linear named {', '.join(unknown)} in the model (LoRA targets are attribute names); "
            f"its Linear layers are named: {', '.join(names) or 'none'}"
            f"{' (and `experts`, its mixture of experts)' if experts else ''}; {ALL_LINEAR} names its attention and "
            f"MLP projections.{why}"
        )
    if EXPERTS_TARGET in targets:
        for path, module in experts:
            set_child(model, path, ExpertLoRA(module, rank=rank, alpha=alpha, rngs=rngs))
    chosen = [(path, m) for path, m in linears if str(path[-1]) in targets]
    for path, linear in chosen:
        set_child(model, path, LoRA(linear, rank=rank, alpha=alpha, rngs=rngs))
    return model


def _is_router(modules: dict[tuple, Any], path: tuple) -> bool:
    """Whether the layer at ``path`` (``modules``: the model's by path) is a mixture of
    experts' router: Qwen's ``mlp.gate``, beside its ``experts``, or Gemma 4's ``router.proj``."""
    if len(path) < 2:
        return False
    beside_experts = isinstance(getattr(modules.get(path[:-1]), "experts", None), Experts | QuantizedExperts)
    return str(path[-2]) == "router" or (str(path[-1]) == "gate" and beside_experts)


def _expert_names(model: nnx.Module) -> set[str]:
    """The names a mixture of experts' stacked weights go by (ours and transformers' fused
    ``gate_up_proj``), where ``model`` has experts; else none."""
    experts = [(path, m) for path, m in nnx.iter_modules(model) if isinstance(m, Experts | QuantizedExperts) and path]
    if not experts:
        return set()
    return {"gate_up_proj", *(str(path[-1]) for path, _ in experts), *EXPERT_WEIGHTS}


def lora_modules(model: nnx.Module) -> list[tuple[tuple, LoRA]]:
    """``(path, layer)`` of every :class:`LoRA` in ``model``, in module order."""
    return [(path, m) for path, m in nnx.iter_modules(model) if isinstance(m, LoRA)]


def expert_lora_modules(model: nnx.Module) -> list[tuple[tuple, ExpertLoRA]]:
    """``(path, experts)`` of every :class:`ExpertLoRA` in ``model``, in module order."""
    return [(path, m) for path, m in nnx.iter_modules(model) if isinstance(m, ExpertLoRA)]


def has_adapters(model: nnx.Module) -> bool:
    """Whether ``model`` has LoRA adapters (on dense layers or on experts)."""
    return bool(lora_modules(model) or expert_lora_modules(model))


def adapters_add_nothing(model: nnx.Module) -> jax.Array:
    """A boolean array: whether every adapter of ``model`` is still zero (each ``lora_b``, an
    expert adapter's ``gate_up_b`` and ``down_b``), so that the model computes its base
    exactly, as before training; False where it has no adapters. Traceable: a train step
    reads it from the state it trains.

    Example:
        >>> model = apply_lora(nnx.Sequential(nnx.Linear(2, 2, rngs=nnx.Rngs(0))), ("0",), rank=1, alpha=1,
        ...                    rngs=nnx.Rngs(1))
        >>> bool(adapters_add_nothing(model))  # lora_b starts at 0
        True
    """
    factors = [layer.lora_b[...] for _, layer in lora_modules(model)]
    factors += [f[...] for _, e in expert_lora_modules(model) for f in (e.gate_up_b, e.down_b)]
    if not factors:
        return jnp.asarray(False)
    return jnp.all(jnp.stack([jnp.all(f == 0) for f in factors]))


def merge_lora(model: nnx.Module) -> nnx.Module:
    """Folds each adapter into its base layer (``W + (alpha / rank) * A @ B``) and puts the
    plain ``nnx.Linear`` back, in place: the result has the original parameter structure
    (it exports to Hugging Face like a model that never had adapters).

    A quantized base (:mod:`xlafit.models.quantized`) is merged as PEFT merges into a
    bitsandbytes base: ``W`` is the dequantized kernel, and every layer of the result is a
    plain bfloat16 ``nnx.Linear`` (the quantized layers without adapters dequantized too; a
    quantized embedding table and output layer, a bfloat16 ``nnx.Embed`` and ``nnx.Linear``).

    Example:
        >>> merge_lora(nnx.Linear(2, 2, rngs=nnx.Rngs(0))).kernel.shape  # nothing to merge
        (2, 2)
    """
    for path, layer in lora_modules(model):
        base = layer.base_module
        delta = jnp.matmul(layer.lora_a[...].astype(jnp.float32), layer.lora_b[...].astype(jnp.float32))
        if isinstance(base, QuantizedLinear):
            set_child(model, path, base.dequantized(jnp.bfloat16, layer.scaling * delta))
            continue
        assert isinstance(base, nnx.Linear)
        kernel = base.kernel[...]
        base.kernel[...] = (kernel.astype(jnp.float32) + layer.scaling * delta).astype(kernel.dtype)
        set_child(model, path, base)
    for path, wrapped in expert_lora_modules(model):
        merged = wrapped.merged_weights()
        experts = wrapped.base_module
        if isinstance(experts, QuantizedExperts):  # merged into bfloat16 weights, as a quantized base's layers
            experts = experts.dequantized(jnp.bfloat16)
        for variable, value in zip((experts.gate_proj, experts.up_proj, experts.down_proj), merged, strict=True):
            variable[...] = value.astype(variable[...].dtype)
        set_child(model, path, experts)
    return dequantize_embeddings(dequantize_linears(model, jnp.bfloat16), jnp.bfloat16)


def lora_state(model: nnx.Module) -> nnx.State:
    """The adapters alone (``nnx.LoRAParam``): what a LoRA checkpoint needs beyond the base."""
    return nnx.state(model, ADAPTER)


def _name(path: tuple) -> str:
    """A parameter's path without the wrappers LoRA adds: the same before and after."""
    return "/".join(str(p) for p in path if p != "base_module")


def base_fingerprint(model: nnx.Module, *, full: bool = False, samples: int = 256) -> str:
    """A sha256 of the base weights (not the adapters), to check an adapter meets its base.

    The hash covers every base parameter's name, shape and dtype and, by default,
    ``samples`` values spread evenly over each tensor (gathered on device: milliseconds and
    a few KB of transfer even for 8B parameters). Two different checkpoints of one
    architecture differ in practically every weight, so samples tell them apart;
    ``full=True`` hashes every byte instead (seconds per GB, on the host). The fingerprint
    is the same before and after :func:`apply_lora`, and differs between scanned and
    unrolled models (their parameters have other shapes).

    Example:
        >>> from xlafit.models.llama import LlamaConfig, LlamaForCausalLM
        >>> model = LlamaForCausalLM(LlamaConfig.preset("tiny", vocab_size=100), rngs=nnx.Rngs(0))
        >>> before = base_fingerprint(model)
        >>> before == base_fingerprint(apply_lora(model, ("q_proj",), rank=2, alpha=4, rngs=nnx.Rngs(1)))
        True
    """
    return state_fingerprint(nnx.state(model, BASE), full=full, samples=samples)


def state_fingerprint(state: nnx.State, *, full: bool = False, samples: int = 256) -> str:
    """:func:`base_fingerprint` of a state already split off (the frozen part of a train
    state): the same hash as ``base_fingerprint`` of the model it came from."""
    digest = hashlib.sha256()
    flat = sorted(((_name(path), var) for path, var in state.flat_state()), key=lambda p: p[0])
    for name, var in flat:
        value = var[...] if isinstance(var, nnx.Variable) else var
        digest.update(f"{name}:{tuple(value.shape)}:{value.dtype};".encode())
        if full or value.size <= samples:
            digest.update(to_host(value).tobytes())
            continue
        flat_index = np.linspace(0, value.size - 1, samples).round().astype(np.int64)
        index = np.unravel_index(flat_index, value.shape)  # a gather: no copy of the tensor
        digest.update(to_host(value[tuple(jnp.asarray(i) for i in index)]).tobytes())
    return digest.hexdigest()
