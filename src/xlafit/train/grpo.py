"""GRPO's objective: group-relative advantages and the clipped policy loss, as TRL's
``GRPOTrainer`` computes them (tested against TRL's own code).

A generation batch holds ``G`` completions of each prompt, adjacent (rows ``g G`` to
``g G + G - 1`` answer prompt ``g``). Each completion's reward is the weighted sum of the
reward functions' values (:func:`advantages`); its advantage is that reward less its group's
mean, divided by the group's standard deviation (``scale_rewards=group``), the batch's
(``batch``) or by nothing (``none``; Dr. GRPO's advice), as TRL's ``scale_rewards``.

The loss per completion token ``t`` (Shao et al. 2024; TRL's ``_compute_loss``)::

    r_t = π(t) / π_old(t)                         (1 on the first step of a generation batch)
    ℓ_t = -min(r_t A, clip(r_t, 1 - ε_low, 1 + ε_high) A) + β KL_t
    KL_t = exp(ref_t - log π(t)) - (ref_t - log π(t)) - 1     (k3; only with β > 0)

summed over a completion's tokens and normalised by the loss variant (TRL's ``loss_type``):
``grpo`` divides each completion's sum by its length, then averages the completions;
``dr_grpo`` divides the batch's sum by ``B x max_completion_length`` (Liu et al. 2025);
``dapo`` by the batch's completion tokens (Yu et al. 2025). Each variant is a per-row weight
computed when the batch is made (:func:`row_weights`), so the trainer's mean over rows is the
variant's loss, also under gradient accumulation.

A batch holds the completions as rows of ``input_ids``, ``segment_ids``, ``positions``,
``loss_mask`` ``[B, T]`` (the prompt, then its completion; ``loss_mask`` marks the
completion's tokens), ``advantages`` and ``weights`` ``[B]``; ``old_logps`` ``[B, T - 1]``
where a generation batch trains more than one step (``num_iterations``), ``ref_logps``
``[B, T - 1]`` where ``β > 0``; columns named ``log/NAME`` ``[B]`` are logged as ``NAME``
(the rollout's statistics: rewards, completion lengths, tokens/s).

Example:
    >>> adv, _ = advantages(np.array([[1.0], [0.0], [1.0], [1.0]]), np.array([1.0]), group=2)
    >>> tuple(round(float(a), 3) for a in adv)
    (0.707, -0.707, 0.0, 0.0)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np

from xlafit.data.clm import next_token_targets
from xlafit.errors import ConfigError
from xlafit.models.lora import adapters_add_nothing
from xlafit.train.losses import TokenLogps, token_logps_of, whole_token_logps

__all__ = ["LOSS_TYPES", "GrpoObjective", "advantages", "loss_fn", "row_weights", "token_logps"]

LOSS_TYPES = ("grpo", "dr_grpo", "dapo")
ScaleRewards = Literal["group", "batch", "none"]
ROW_KEYS = ("input_ids", "segment_ids", "positions", "loss_mask")
LOGGED = "log/"  # a batch column logged under the rest of its name


@dataclasses.dataclass(frozen=True)
class GrpoObjective:
    """GRPO's settings (TRL's names and defaults).

    Attributes:
        loss_type: ``grpo``, ``dr_grpo`` or ``dapo`` (the normalisation; module docstring).
        beta: the KL term's weight; 0 needs no reference model (TRL's default).
        epsilon: the ratio's lower clip ``1 - ε`` (and upper, unless ``epsilon_high``).
        epsilon_high: the upper clip ``1 + ε_high`` (DAPO's clip-higher: 0.28); None: ``epsilon``.
        scale_rewards: ``group``, ``batch`` or ``none`` (module docstring).
        num_generations: ``G``, the completions of each prompt.
        max_completion_length: the tokens of a completion at most (``dr_grpo``'s divisor).
        temperature: the sampling temperature; the log-probabilities are the model's at it too.
    """

    loss_type: str = "dapo"
    beta: float = 0.0
    epsilon: float = 0.2
    epsilon_high: float | None = None
    scale_rewards: ScaleRewards = "group"
    num_generations: int = 8
    max_completion_length: int = 256
    temperature: float = 1.0

    def __post_init__(self) -> None:
        if self.loss_type not in LOSS_TYPES:
            raise ConfigError(f"model.grpo.loss_type={self.loss_type!r}: one of {', '.join(LOSS_TYPES)}.")
        if self.scale_rewards not in ("group", "batch", "none"):
            raise ConfigError(f"model.grpo.scale_rewards={self.scale_rewards!r}: one of group, batch, none.")
        if self.beta < 0:
            raise ConfigError(f"model.grpo.beta={self.beta:g} must be 0 (no reference) or more.")
        if not 0 <= self.epsilon < 1 or (self.epsilon_high is not None and self.epsilon_high < 0):
            raise ConfigError(
                f"model.grpo.epsilon={self.epsilon:g} must be in [0, 1) and epsilon_high 0 or more (TRL: 0.2, 0.28 "
                "for DAPO's clip-higher)."
            )
        if self.num_generations < 2:
            raise ConfigError(
                f"model.grpo.num_generations={self.num_generations}: a group needs 2 completions or more (its "
                "advantages are relative to its mean)."
            )
        if self.max_completion_length < 1:
            raise ConfigError(
                f"model.grpo.max_completion_length={self.max_completion_length}: give 1 token or more (a "
                "completion's length at most)."
            )
        if self.temperature <= 0:
            raise ConfigError(
                f"model.grpo.temperature={self.temperature:g}: give a temperature above 0 (GRPO samples its "
                "completions; TRL's default is 1.0)."
            )

    @property
    def clip(self) -> tuple[float, float]:
        """``(1 - ε_low, 1 + ε_high)``."""
        high = self.epsilon if self.epsilon_high is None else self.epsilon_high
        return 1.0 - self.epsilon, 1.0 + high


def advantages(
    rewards: np.ndarray, weights: np.ndarray, group: int, scale: ScaleRewards = "group"
) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """``(advantages [N], stats)`` of ``rewards [N, F]`` (each reward function's value per
    completion, ``N`` a multiple of ``group``, a group's completions adjacent) weighted by
    ``weights [F]``; ``stats``: ``reward`` ``[N]`` and ``zero_std`` ``[N]`` (1 where the
    completion's group, or batch, has rewards all equal: TRL's ``frac_reward_zero_std``).
    Float32 throughout, as TRL's tensors; standard deviations unbiased (``torch.std``)."""
    rewards = np.asarray(rewards, np.float32)
    total = (rewards * np.asarray(weights, np.float32)[None, :]).sum(axis=1, dtype=np.float32)
    grouped = total.reshape(-1, group)
    mean = np.repeat(grouped.mean(axis=1, dtype=np.float32), group)
    if scale == "batch":
        std = np.full_like(total, total.std(ddof=1, dtype=np.float32))
    else:
        std = np.repeat(grouped.std(axis=1, ddof=1, dtype=np.float32), group)
    adv = total - mean
    if scale != "none":
        adv = adv / (std + np.float32(1e-4))
    zero = np.isclose(std, 0.0, rtol=1e-5, atol=1e-8).astype(np.float32)  # torch.isclose's tolerances
    return adv.astype(np.float32), {"reward": total, "zero_std": zero}


def row_weights(lengths: np.ndarray, loss_type: str, max_completion_length: int, batch_tokens: int) -> np.ndarray:
    """Each completion's weight ``[B]``: its summed token losses times this, averaged over the
    rows, is the loss variant's value. ``lengths``: the completions' tokens; ``batch_tokens``:
    those of the whole global batch (``dapo``'s divisor, TRL's ``num_items_in_batch``)."""
    lengths = np.asarray(lengths, np.float32)
    if loss_type == "grpo":
        return (1.0 / np.maximum(lengths, 1.0)).astype(np.float32)
    if loss_type == "dr_grpo":
        return np.full_like(lengths, 1.0 / max_completion_length)
    return np.full_like(lengths, len(lengths) / max(batch_tokens, 1))  # dapo: B x sum / B over all tokens


def token_logps(logits: jax.Array, rows: dict[str, jax.Array], temperature: float) -> tuple[jax.Array, jax.Array]:
    """``(logps, mask)`` ``[R, T - 1]``: each completion token's log-probability under
    ``logits [R, T, V] / temperature`` (predicted from the tokens before it, as TRL scales
    them), and the mask of completion tokens."""
    targets, mask = next_token_targets(rows["input_ids"], rows["segment_ids"], rows["loss_mask"])
    return token_logps_of(logits[:, :-1], targets, temperature), mask


def policy_loss(
    logps: jax.Array,
    old_logps: jax.Array,
    ref_logps: jax.Array | None,
    mask: jax.Array,
    advantage: jax.Array,
    weights: jax.Array,
    objective: GrpoObjective,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """``(losses [B], metrics)`` from per-token log-probabilities ``[B, C]`` (the policy's,
    at generation, the reference's or None where ``β = 0``), the completion ``mask [B, C]``,
    ``advantage [B]`` and the rows' ``weights [B]`` (:func:`row_weights`). Metrics, by TRL's
    names: ``kl`` (with ``β > 0``), ``clip_ratio/low_mean``, ``clip_ratio/high_mean``,
    ``clip_ratio/region_mean``, each a mean over the batch's completion tokens."""
    low, high = objective.clip
    a = advantage[:, None]
    ratio = jnp.exp(logps - old_logps)
    clipped = jnp.clip(ratio, low, high)
    per_token = -jnp.minimum(ratio * a, clipped * a)
    tokens = jnp.maximum(mask.sum(), 1.0)

    def token_mean(x: jax.Array) -> jax.Array:
        return jax.lax.stop_gradient((x * mask).sum() / tokens)

    metrics: dict[str, jax.Array] = {}
    if objective.beta:
        assert ref_logps is not None
        kl = jnp.exp(ref_logps - logps) - (ref_logps - logps) - 1.0
        per_token = per_token + objective.beta * kl
        metrics["kl"] = token_mean(kl)
    is_low = ((ratio < low) & (a < 0)).astype(jnp.float32)
    is_high = ((ratio > high) & (a > 0)).astype(jnp.float32)
    metrics |= {
        "clip_ratio/low_mean": token_mean(is_low),
        "clip_ratio/high_mean": token_mean(is_high),
        "clip_ratio/region_mean": token_mean(jnp.maximum(is_low, is_high)),
    }
    return (per_token * mask).sum(-1) * weights, metrics


def loss_fn(
    objective: GrpoObjective, token_logps: TokenLogps = whole_token_logps
) -> Callable[[Any, dict[str, jax.Array]], tuple[jax.Array, dict[str, jax.Array]]]:
    """The ``loss_fn(model, batch) -> (losses [B], metrics)`` of GRPO for
    :class:`xlafit.Trainer`: ``model(input_ids, segment_ids, positions)`` gives float32
    logits, of which ``token_logps`` takes each token's log-probability (by default from the
    whole logits; the llm recipe's computes them in blocks); ``batch`` as the module
    docstring says. The metrics of :func:`policy_loss`,
    and each ``log/NAME`` column as ``NAME``.

    Example:
        >>> grpo_loss = loss_fn(GrpoObjective("dapo", num_generations=8))
        >>> trainer = xlafit.Trainer(model, grpo_loss, optax.adamw(1e-6), rollout=...)  # doctest: +SKIP
    """

    def completions_loss(model: Any, batch: dict[str, jax.Array]) -> tuple[jax.Array, dict[str, jax.Array]]:
        rows = {k: batch[k] for k in ROW_KEYS}
        logps = token_logps(model, rows, objective.temperature)  # (B, T - 1)
        _, mask = next_token_targets(rows["input_ids"], rows["segment_ids"], rows["loss_mask"])
        # One optimisation step per generation batch: the policy at generation is this one (ratio 1).
        old = batch["old_logps"] if "old_logps" in batch else jax.lax.stop_gradient(logps)
        ref = batch.get("ref_logps") if objective.beta else None
        if ref is not None:
            # While the adapters add nothing the policy is its reference: its own log-probabilities,
            # the KL exactly 0 with a gradient of 0 (the reference's pass, another program, rounds
            # apart from this one on a multi-device mesh, and Adam would step on that rounding).
            ref = jnp.where(adapters_add_nothing(model), jax.lax.stop_gradient(logps), ref)
        losses, metrics = policy_loss(logps, old, ref, mask, batch["advantages"], batch["weights"], objective)
        metrics |= {k[len(LOGGED) :]: v for k, v in batch.items() if k.startswith(LOGGED)}
        return losses, metrics

    return completions_loss
