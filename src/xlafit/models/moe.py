"""Mixture-of-experts feed-forward blocks: a top-k router and experts as stacked weights.

A token's hidden state goes to the ``k`` experts whose router probabilities are largest
(Shazeer et al. 2017; Switch Transformer, Fedus et al. 2021), each expert a gated MLP
(SwiGLU), and their outputs are summed with the router's weights. Routing is dropless and
capacity-free: every token reaches all ``k`` of its experts, however unbalanced the batch.

The experts' weights are stacked, ``gate_proj``/``up_proj`` ``[E, hidden, f]`` and
``down_proj`` ``[E, f, hidden]``, and computed one of two ways (``moe_impl``):

- ``"ragged"``: the ``tokens x k`` assignments sorted by expert, then one grouped matrix
  product per projection (``jax.lax.ragged_dot``: each expert multiplies only its own rows;
  MaxText's ``layers/moe.py`` and the megablox kernel do the same on TPUs). The FLOPs are
  the routed tokens'. XLA:CPU has no grouped kernel (JAX lowers ``ragged_dot`` there to a
  dense product over every group, ``E`` times the work), so on CPUs the same product is
  computed in tiles of rows of one expert each (:func:`tiled_ragged_dot`).
- ``"dense"``: every expert computes every token and the router's weights (zero for the
  experts not chosen) combine them: ``E / k`` times the FLOPs, the reference.

The router of Qwen3-MoE (``qwen3_moe``) and Qwen3.5-MoE (``qwen3_5_moe_text``): float32
softmax over the experts, the top ``k`` probabilities, renormalised to sum to 1 with
``norm_topk_prob`` (always, in Qwen3.5-MoE) (:class:`MoEBlock`, the whole feed-forward
block). Qwen3.5-MoE's blocks also have a shared expert (Qwen2-MoE's, DeepSeekMoE's "shared
expert isolation", Dai et al. 2024): a gated MLP that every token goes through, its output
times ``sigmoid(shared_expert_gate(x))`` added to the routed experts'. Gemma 4's
(:class:`ScaledRouter`) routes a normalised and scaled input and scales each chosen expert's
weight; its decoder layer runs the experts beside a dense MLP
(:class:`~xlafit.models.decoder.LlamaDecoderLayer`). What training adds to the
loss: the load-balancing loss of Switch Transformer (:func:`load_balancing_loss`, equal to
transformers' ``load_balancing_loss_func``) and the router z-loss of ST-MoE (Zoph et al.
2022, :func:`router_z_loss`); the statistics both need are summed over the layers
(:class:`RouterStats`).

Example:
    >>> stats = RouterStats.zeros(4)
    >>> stats.counts.shape
    (4,)
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from xlafit.models.activations import gated, rms
from xlafit.models.dense import LlamaMLP, dense
from xlafit.models.llama_config import DTYPES, LlamaConfig
from xlafit.parallel.sharding import constrain, logical

__all__ = [
    "EXPERT_WEIGHTS",
    "ExpertAdapters",
    "Experts",
    "MoEBlock",
    "RouterStats",
    "ScaledRouter",
    "dense_experts",
    "load_balancing_loss",
    "ragged_experts",
    "route",
    "router_stats",
    "router_z_loss",
    "tiled_ragged_dot",
]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RouterStats:
    """What the auxiliary losses and the routing metrics need, summed over the MoE layers
    (and the real tokens: padding weighs 0).

    Attributes:
        counts: ``[E]`` routed assignments per expert (each token counts once for each of
            its ``k`` experts).
        probs: ``[E]`` the router's softmax probabilities, summed over tokens.
        rows: tokens routed (summed over layers).
        z: ``logsumexp(router logits) ** 2``, summed over tokens.
        layers: MoE layers summed.
    """

    counts: jax.Array
    probs: jax.Array
    rows: jax.Array
    z: jax.Array
    layers: jax.Array

    @classmethod
    def zeros(cls, experts: int) -> RouterStats:
        zero = jnp.zeros((), jnp.float32)
        return cls(jnp.zeros((experts,), jnp.float32), jnp.zeros((experts,), jnp.float32), zero, zero, zero)

    def __add__(self, other: RouterStats) -> RouterStats:
        return jax.tree.map(jnp.add, self, other)

    def expert_load(self) -> jax.Array:
        """``[E]`` tokens routed to each expert per MoE layer (they sum to ``k x tokens``)."""
        return self.counts / jnp.maximum(self.layers, 1.0)


def load_balancing_loss(stats: RouterStats) -> jax.Array:
    """Switch Transformer's auxiliary loss (Fedus et al. 2021, eqs. 4-6) over all layers'
    tokens: ``E * sum_e f_e * P_e``, ``f_e`` the share of assignments to expert ``e`` (they sum
    to ``k``) and ``P_e`` its mean router probability; 1 per routed slot when balanced.
    transformers' ``load_balancing_loss_func`` (the layers' tokens pooled, padding masked).

    Example:
        >>> uniform = RouterStats(jnp.full(4, 2.0), jnp.full(4, 1.0), jnp.array(4.0), jnp.array(0.0), jnp.array(1.0))
        >>> float(load_balancing_loss(uniform))  # 4 tokens, k=2, E=4, perfectly balanced
        2.0
    """
    rows = jnp.maximum(stats.rows, 1.0)
    return stats.counts.shape[0] * jnp.sum((stats.counts / rows) * (stats.probs / rows))


def router_z_loss(stats: RouterStats) -> jax.Array:
    """ST-MoE's router z-loss (Zoph et al. 2022, eq. 5): the mean over tokens of the squared
    log-sum-exp of the router logits, which keeps the logits small (bfloat16 round-off)."""
    return stats.z / jnp.maximum(stats.rows, 1.0)


def route(
    logits: jax.Array, k: int, norm_topk_prob: bool, expert_scale: jax.Array | None = None
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Top-k routing of ``logits [N, E]``: ``(weights [N, k], experts [N, k] int32, probs [N, E])``.

    Softmax in float32 over the experts, the ``k`` largest probabilities (ties to the lower
    index, as ``torch.topk``), renormalised to sum to 1 with ``norm_topk_prob``, then each
    times its expert's ``expert_scale [E]`` where given (Gemma 4's ``per_expert_scale``); the
    weights in the logits' dtype (Qwen3-MoE's ``Qwen3MoeTopKRouter``, Gemma 4's
    ``Gemma4TextRouter``).

    Example:
        >>> w, e, _ = route(jnp.log(jnp.array([[0.1, 0.6, 0.3]])), 2, norm_topk_prob=True)
        >>> e.tolist(), [round(float(v), 3) for v in w[0]]
        ([[1, 2]], [0.667, 0.333])
    """
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    weights, experts = jax.lax.top_k(probs, k)
    if norm_topk_prob:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    if expert_scale is not None:
        weights = weights * expert_scale.astype(jnp.float32)[experts]
    return weights.astype(logits.dtype), experts.astype(jnp.int32), probs


def router_stats(logits: jax.Array, probs: jax.Array, experts: jax.Array, mask: jax.Array | None) -> RouterStats:
    """One layer's :class:`RouterStats` of its router's ``logits [N, E]``, ``probs [N, E]``
    and chosen ``experts [N, k]``, over the tokens ``mask [N]`` keeps (default all)."""
    n, k = experts.shape
    real = jnp.ones((n,), jnp.float32) if mask is None else mask.reshape(-1).astype(jnp.float32)
    assigned = jnp.zeros((probs.shape[-1],), jnp.float32).at[experts.reshape(-1)].add(jnp.repeat(real, k))
    lse = jax.nn.logsumexp(logits.astype(jnp.float32), axis=-1)
    return RouterStats(
        counts=assigned,
        probs=jnp.sum(probs * real[:, None], axis=0),
        rows=jnp.sum(real),
        z=jnp.sum(lse * lse * real),
        layers=jnp.ones((), jnp.float32),
    )


def _tile_rows(rows: int, experts: int) -> int:
    """Rows of one tile of :func:`tiled_ragged_dot`: about half an expert's fair share (a
    power of two, 8 to 128), so that padding each group to whole tiles adds little."""
    share = max(1, rows // (2 * experts))
    return int(min(128, max(8, 2 ** int(math.log2(share)))))


def tiled_ragged_dot(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """``jax.lax.ragged_dot(lhs [M, d], rhs [E, d, f], group_sizes [E])`` computed in tiles:
    each group's rows padded to whole tiles of ``tm`` rows, each tile multiplied by its
    group's matrix (one batched product over ``M / tm + E`` tiles, each tile's matrix
    gathered). The FLOPs are about ``(M + E * tm) * d * f``, where JAX's own CPU lowering of
    ``ragged_dot`` computes ``E * M * d * f``. Rows past ``sum(group_sizes)`` give zeros.

    Example:
        >>> lhs, rhs = jnp.ones((5, 2)), jnp.stack([jnp.eye(2), 2 * jnp.eye(2)])
        >>> tiled_ragged_dot(lhs, rhs, jnp.array([2, 3]))[:, 0].tolist()
        [1.0, 1.0, 2.0, 2.0, 2.0]
    """
    m, d = lhs.shape
    e, _, f = rhs.shape
    tm = _tile_rows(m, e)
    tiles = -(-m // tm) + e  # each group wastes less than one tile: a static bound
    sizes = group_sizes.astype(jnp.int32)
    starts = jnp.cumsum(sizes) - sizes  # each group's first row in lhs
    group_tiles = -(-sizes // tm)
    padded_starts = (jnp.cumsum(group_tiles) - group_tiles) * tm  # each group's first row, tiles padded
    # The group of each padded row, and the lhs row it takes (or none: padding).
    slot = jnp.arange(tiles * tm, dtype=jnp.int32)
    tile_group = jnp.clip(jnp.searchsorted(jnp.cumsum(group_tiles), jnp.arange(tiles), side="right"), 0, e - 1)
    group = tile_group[slot // tm]
    rank = slot - padded_starts[group]
    valid = rank < sizes[group]
    source = jnp.clip(starts[group] + rank, 0, m - 1)
    x = jnp.where(valid[:, None], lhs[source], jnp.zeros((), lhs.dtype)).reshape(tiles, tm, d)
    out = jnp.einsum("tmd,tdf->tmf", x, rhs[tile_group], preferred_element_type=lhs.dtype).reshape(tiles * tm, f)
    # Back to lhs's rows: row i of group g sits at padded_starts[g] + (i - starts[g]).
    row = jnp.arange(m, dtype=jnp.int32)
    row_group = jnp.clip(jnp.searchsorted(jnp.cumsum(sizes), row, side="right"), 0, e - 1)
    inside = row < jnp.sum(sizes)
    picked = out[jnp.clip(padded_starts[row_group] + row - starts[row_group], 0, tiles * tm - 1)]
    return jnp.where(inside[:, None], picked, jnp.zeros((), out.dtype))


@dataclasses.dataclass(frozen=True)
class ExpertAdapters:
    """LoRA adapters of stacked experts, in PEFT's form for transformers' fused experts
    (``target_parameters`` ``mlp.experts.gate_up_proj`` and ``mlp.experts.down_proj``): one
    adapter on the fused gate and up projection, one on the down projection, each expert its
    own ``A`` and ``B``. The gate and up halves of the fused update share ``A``.

    Attributes:
        gate_up_a: ``[E, hidden, r]``; ``gate_up_b`` ``[E, r, 2f]`` (the gate's ``f``
            columns first, as transformers' ``chunk(2)`` splits them).
        down_a: ``[E, f, r]``; ``down_b`` ``[E, r, hidden]``.
        scaling: ``alpha / r``.
    """

    gate_up_a: jax.Array
    gate_up_b: jax.Array
    down_a: jax.Array
    down_b: jax.Array
    scaling: float


def grouped_dot(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """The grouped product of rows sorted by group: ``jax.lax.ragged_dot`` on TPUs and GPUs
    (a grouped kernel), :func:`tiled_ragged_dot` on CPUs (see the module's docstring)."""
    if jax.default_backend() == "cpu":
        return tiled_ragged_dot(lhs, rhs, group_sizes)
    return jax.lax.ragged_dot(lhs, rhs, group_sizes)


def ragged_experts(
    x: jax.Array,
    weights: jax.Array,
    experts: jax.Array,
    gate: jax.Array,
    up: jax.Array,
    down: jax.Array,
    activation: str,
    adapters: ExpertAdapters | None = None,
) -> jax.Array:
    """``sum_j weights[:, j] * expert_{experts[:, j]}(x)`` for ``x [N, d]`` with grouped
    products: the ``N x k`` assignments sorted by expert, each projection one
    :func:`grouped_dot` over them, the outputs put back in token order and combined.

    Args:
        x: ``[N, d]`` tokens.
        weights: ``[N, k]`` the router's weights.
        experts: ``[N, k]`` the chosen experts.
        gate: ``[E, d, f]`` stacked gate projections; ``up`` the same, ``down`` ``[E, f, d]``.
        activation: the gated MLP's (``silu``: SwiGLU).
        adapters: LoRA on the experts, computed as grouped products of rank ``r`` (never
            the ``[E, d, f]`` update).
    """
    n, k = experts.shape
    e, f = gate.shape[0], gate.shape[-1]
    flat = experts.reshape(-1)  # (N * k,)
    order = jnp.argsort(flat, stable=True)  # assignments grouped by expert, tokens in order within
    sizes = jnp.bincount(flat, length=e).astype(jnp.int32)
    rows = x[order // k]  # (N * k, d): a gather, no copy of x per expert
    g, u = grouped_dot(rows, gate, sizes), grouped_dot(rows, up, sizes)
    if adapters is not None:
        gate_up = grouped_dot(grouped_dot(rows, adapters.gate_up_a, sizes), adapters.gate_up_b, sizes)
        g, u = g + adapters.scaling * gate_up[:, :f], u + adapters.scaling * gate_up[:, f:]
    hidden = gated(g, u, activation).astype(x.dtype)
    out = grouped_dot(hidden, down, sizes)  # (N * k, d) in expert order
    if adapters is not None:
        out = out + adapters.scaling * grouped_dot(grouped_dot(hidden, adapters.down_a, sizes), adapters.down_b, sizes)
    unsorted = out[jnp.argsort(order)].reshape(n, k, -1)  # back to (token, slot)
    return jnp.einsum("nkd,nk->nd", unsorted, weights.astype(unsorted.dtype))


def dense_experts(
    x: jax.Array,
    weights: jax.Array,
    experts: jax.Array,
    gate: jax.Array,
    up: jax.Array,
    down: jax.Array,
    activation: str,
    adapters: ExpertAdapters | None = None,
) -> jax.Array:
    """:func:`ragged_experts`'s result with every expert computing every token (the
    weights of the experts not chosen are 0): ``E / k`` times the FLOPs, no sort."""
    e, f = gate.shape[0], gate.shape[-1]
    combine = jnp.einsum("nk,nke->ne", weights, jax.nn.one_hot(experts, e, dtype=weights.dtype))  # (N, E)
    g, u = jnp.einsum("nd,edf->enf", x, gate), jnp.einsum("nd,edf->enf", x, up)
    if adapters is not None:
        low = jnp.einsum("nd,edr->enr", x, adapters.gate_up_a)
        gate_up = jnp.einsum("enr,erf->enf", low, adapters.gate_up_b)
        g, u = g + adapters.scaling * gate_up[..., :f], u + adapters.scaling * gate_up[..., f:]
    hidden = gated(g, u, activation).astype(x.dtype)
    out = jnp.einsum("enf,efd->end", hidden, down)
    if adapters is not None:
        low = jnp.einsum("enf,efr->enr", hidden, adapters.down_a)
        out = out + adapters.scaling * jnp.einsum("enr,erd->end", low, adapters.down_b)
    return jnp.einsum("end,ne->nd", out, combine.astype(out.dtype))


class MoEBlock(nnx.Module):
    """A sparse MoE feed-forward block in Hugging Face's naming: ``gate`` the router (an
    ``nnx.Linear`` ``[hidden, E]``, no bias) and ``experts`` the stacked expert weights
    (``mlp.experts.gate_proj`` ``[E, hidden, f]``, ...), computed as ``cfg.moe_impl`` says;
    with ``shared_expert_intermediate_size`` also ``shared_expert`` (a
    :class:`~xlafit.models.dense.LlamaMLP`) and ``shared_expert_gate`` (``[hidden, 1]``).

    Args:
        cfg: ``num_experts``, ``num_experts_per_tok``, ``moe_intermediate_size``,
            ``norm_topk_prob``, ``moe_impl``, ``shared_expert_intermediate_size``.
        rngs: ``params`` for initialisation (normal, std ``initializer_range``).
    """

    def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs) -> None:
        self.gate = _router_projection(cfg, rngs)
        self.experts = Experts.init(cfg, rngs)
        self.shared = cfg.shared_expert_intermediate_size > 0
        if self.shared:
            self.shared_expert = LlamaMLP(cfg, rngs, cfg.shared_expert_intermediate_size)
            self.shared_expert_gate = dense(cfg, cfg.hidden_size, 1, rngs, ("embed", None), False)
        self.k, self.norm_topk_prob = cfg.num_experts_per_tok, cfg.norm_topk_prob

    def __call__(self, x: jax.Array, mask: jax.Array | None = None) -> tuple[jax.Array, RouterStats]:
        """``(y [B, T, hidden], the router's statistics)`` of ``x [B, T, hidden]``; ``mask``
        ``[B, T]`` (1 for real tokens) weighs the statistics, not the outputs."""
        b, t, h = x.shape
        tokens = x.reshape(b * t, h)
        logits = self.gate(tokens)  # (N, E), in the compute dtype as transformers' F.linear
        weights, experts, probs = route(logits, self.k, self.norm_topk_prob)
        y = self.experts(tokens, weights, experts).astype(x.dtype).reshape(b, t, h)
        if self.shared:  # every token's, weighed by its own gate (B, T, 1)
            y = y + (jax.nn.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)).astype(y.dtype)
        return constrain(y, "batch", None, None), router_stats(logits, probs, experts, mask)


def _router_projection(cfg: LlamaConfig, rngs: nnx.Rngs) -> nnx.Linear:
    """The router's ``[hidden, E]`` projection (no bias), its expert axis replicated."""
    return nnx.Linear(
        cfg.hidden_size, cfg.num_experts, use_bias=False,
        kernel_init=logical(nnx.initializers.normal(stddev=cfg.initializer_range), "embed", None),
        dtype=cfg.compute_dtype, param_dtype=DTYPES[cfg.param_dtype], rngs=rngs,
    )  # fmt: skip


EXPERT_WEIGHTS = ("gate_proj", "up_proj", "down_proj")  # an Experts module's stacked weights


class Experts(nnx.Module):
    """The stacked expert weights: ``gate_proj``, ``up_proj`` ``[E, hidden, f]`` and
    ``down_proj`` ``[E, f, hidden]`` (each expert's ``[in, out]``, PyTorch's transposed; a
    leading layers axis when scanned), computed as ``impl`` says (:func:`ragged_experts` or
    :func:`dense_experts`). :meth:`init` draws a config's; the constructor takes the weights.

    Args:
        gate_proj: ``nnx.Param`` ``[..., E, hidden, f]``; ``up_proj`` the same; ``down_proj``
            ``[..., E, f, hidden]``.
        impl: ``ragged`` or ``dense`` (``LlamaConfig.moe_impl``).
        activation: the gated MLP's (``silu``: SwiGLU).
        dtype: the compute dtype.
    """

    def __init__(
        self, gate_proj: nnx.Param, up_proj: nnx.Param, down_proj: nnx.Param, *, impl: str, activation: str, dtype: Any
    ) -> None:
        self.gate_proj, self.up_proj, self.down_proj = gate_proj, up_proj, down_proj
        self.impl, self.activation, self.dtype = impl, activation, dtype

    @classmethod
    def init(cls, cfg: LlamaConfig, rngs: nnx.Rngs) -> Experts:
        """``cfg``'s experts, drawn (normal, std ``initializer_range``), laid out along ``experts``."""
        init = nnx.initializers.normal(stddev=cfg.initializer_range)
        h, e, f = cfg.hidden_size, cfg.num_experts, cfg.expert_size
        dtype = DTYPES[cfg.param_dtype]
        return cls(
            nnx.Param(logical(init, "experts", "embed", "mlp")(rngs.params(), (e, h, f), dtype)),
            nnx.Param(logical(init, "experts", "embed", "mlp")(rngs.params(), (e, h, f), dtype)),
            nnx.Param(logical(init, "experts", "mlp", "embed")(rngs.params(), (e, f, h), dtype)),
            impl=cfg.moe_impl,
            activation=cfg.hidden_activation,
            dtype=cfg.compute_dtype,
        )

    @property
    def shape(self) -> tuple[int, ...]:
        """``gate_proj``'s: ``(..., E, hidden, f)``."""
        return tuple(self.gate_proj.get_value().shape)

    def weights(self, dtype: Any) -> tuple[jax.Array, jax.Array, jax.Array]:
        """``(gate, up, down)`` as ``dtype``."""
        return tuple(w[...].astype(dtype) for w in (self.gate_proj, self.up_proj, self.down_proj))  # type: ignore[return-value]

    def __call__(
        self, tokens: jax.Array, weights: jax.Array, experts: jax.Array, adapters: ExpertAdapters | None = None
    ) -> jax.Array:
        """``sum_j weights[:, j] * expert_{experts[:, j]}(tokens)`` of ``tokens [N, hidden]``
        (with ``adapters``: each expert's weights plus its LoRA update)."""
        gate, up, down = self.weights(self.dtype)
        run = ragged_experts if self.impl == "ragged" else dense_experts
        return run(tokens, weights, experts, gate, up, down, self.activation, adapters)


class ScaledRouter(nnx.Module):
    """Gemma 4's router (transformers' ``Gemma4TextRouter``): its input RMS-normalised
    (no weights), times a learned ``scale [hidden]`` and ``hidden ** -0.5``, projected by
    ``proj`` to the experts' logits; the top ``k`` probabilities renormalised, each times
    its expert's learned ``per_expert_scale [E]`` (:func:`route`).

    Args:
        cfg: ``hidden_size``, ``num_experts``, ``num_experts_per_tok``, ``rms_norm_eps``.
        rngs: ``params`` for ``proj`` (the scales start at 1, as transformers').
    """

    def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs) -> None:
        dtype = DTYPES[cfg.param_dtype]
        ones = nnx.initializers.ones_init()
        self.proj = _router_projection(cfg, rngs)
        self.scale = nnx.Param(logical(ones, "norm")(rngs.params(), (cfg.hidden_size,), dtype))
        self.per_expert_scale = nnx.Param(logical(ones, None)(rngs.params(), (cfg.num_experts,), dtype))
        self.k, self.eps, self.dtype = cfg.num_experts_per_tok, cfg.rms_norm_eps, cfg.compute_dtype

    def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
        """``(logits [N, E], weights [N, k], experts [N, k], probs [N, E])`` of ``x [N, hidden]``."""
        h = x.shape[-1]
        normed = rms(x, self.eps).astype(self.dtype) * self.scale[...].astype(self.dtype)[None, :]
        logits = self.proj(normed * jnp.asarray(h**-0.5, self.dtype))
        weights, experts, probs = route(logits, self.k, True, self.per_expert_scale[...])
        return logits, weights, experts, probs
