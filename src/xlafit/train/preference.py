"""Preference tuning's objectives: DPO, SimPO and ORPO on pairs of a chosen and a rejected
completion of one prompt, as TRL computes them (the same losses and logged rewards, tested
against TRL's own code).

A batch holds pairs (:mod:`xlafit.data.preference`): ``input_ids``, ``segment_ids``,
``positions`` and ``loss_mask`` ``[B, 2, T]``, row 0 of a pair the chosen completion and row
1 the rejected one, each after the same prompt; ``loss_mask`` marks the completion's tokens.
The model reads the ``2B`` rows in one pass; a completion's log-probability is the sum of
its tokens' (:func:`completion_logps`).

- **DPO** (Rafailov et al. 2023, TRL's ``loss_type="sigmoid"``): ``-log σ(β Δ)`` where
  ``Δ`` is how much more the policy than the reference prefers the chosen completion;
  ``label_smoothing`` ``ε`` gives conservative DPO, ``-(1-ε) log σ(β Δ) - ε log σ(-β Δ)``.
  Rewards: ``β (log π - log π_ref)`` per completion. ``sft_weight`` adds that times the
  chosen completion's mean negative log-likelihood (TRL's ``loss_type=["sigmoid", "sft"]``
  with ``loss_weights=[1, sft_weight]``; RPO, Pang et al. 2024), which keeps DPO from
  lowering the chosen completion's likelihood along with the rejected one's.
- **SimPO** (Meng et al. 2024, TRL's ``CPOTrainer`` with ``loss_type="simpo"``): no
  reference; the log-probabilities are averaged over each completion's tokens, and the
  chosen one must win by a margin ``γ``: ``-log σ(β (avg_c - avg_r) - γ)``. Rewards:
  ``β avg``.
- **ORPO** (Hong et al. 2024, TRL's ``ORPOTrainer``): no reference; the chosen completion's
  mean negative log-likelihood (the SFT term) minus ``β log σ(log odds_c - log odds_r)``,
  odds ``p / (1 - p)`` of the length-averaged probabilities. Rewards: ``β avg``.

The reference of DPO is the model before tuning. With LoRA it costs no second copy: the
same model with its adapters off (:func:`xlafit.models.lora.adapters_off`), as TRL with
PEFT does; otherwise its log-probabilities are computed once before training
(:func:`reference_logps`) and the batch carries them as ``ref_logps`` ``[B, 2]``.

Example:
    >>> chosen, rejected = jnp.array([-3.0]), jnp.array([-5.0])
    >>> losses, c, r = dpo(chosen, rejected, jnp.array([-4.0]), jnp.array([-4.0]), beta=0.1)
    >>> round(float(losses[0]), 4), round(float(c[0]), 2), round(float(r[0]), 2)
    (0.5981, 0.1, -0.1)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from xlafit.data.clm import next_token_targets
from xlafit.errors import ConfigError
from xlafit.models.lora import adapters_add_nothing, adapters_off, has_adapters
from xlafit.train.losses import TokenLogps, token_logps_of, whole_token_logps

__all__ = [
    "LOSSES",
    "Objective",
    "completion_logps",
    "dpo",
    "loss_fn",
    "orpo",
    "reference_logps",
    "simpo",
]

LOSSES = ("dpo", "simpo", "orpo")
PAIR_KEYS = ("input_ids", "segment_ids", "positions", "loss_mask")  # [B, 2, T] each
Reference = Literal["base", "precomputed"]


@dataclasses.dataclass(frozen=True)
class Objective:
    """A preference objective and its settings (TRL's names and defaults).

    Attributes:
        loss: ``dpo``, ``simpo`` or ``orpo``.
        beta: DPO's KL strength ``β``; SimPO's reward scale; ORPO's weight of the odds-ratio
            term (TRL's ``beta``, 0.1 in each of its trainers).
        label_smoothing: the probability that a pair's preference is flipped (conservative
            DPO; SimPO too), in ``[0, 0.5)``.
        gamma: SimPO's target margin (TRL's ``simpo_gamma``).
        reference: DPO's reference: ``base`` (the model with its LoRA adapters off) or
            ``precomputed`` (``ref_logps`` in the batch).
        sft_weight: DPO: the weight of the chosen completion's mean negative log-likelihood
            added to the loss (0: DPO alone).
    """

    loss: str = "dpo"
    beta: float = 0.1
    label_smoothing: float = 0.0
    gamma: float = 0.5
    reference: Reference = "base"
    sft_weight: float = 0.0

    def __post_init__(self) -> None:
        if self.loss not in LOSSES:
            raise ConfigError(f"preference loss {self.loss!r}: one of {', '.join(LOSSES)}.")
        if self.beta <= 0:
            raise ConfigError(f"model.preference.beta={self.beta:g} must be positive (TRL's default is 0.1).")
        if self.sft_weight < 0:
            raise ConfigError(f"model.preference.sft_weight={self.sft_weight:g} must be 0 (DPO alone) or more.")
        if not 0 <= self.label_smoothing < 0.5:
            raise ConfigError(
                f"model.preference.label_smoothing={self.label_smoothing:g} must be in [0, 0.5): the probability that "
                "a pair's preference is flipped."
            )

    @property
    def needs_reference(self) -> bool:
        return self.loss == "dpo"


def completion_logps(logits: jax.Array, rows: dict[str, jax.Array]) -> tuple[jax.Array, jax.Array]:
    """``(sums, counts)`` ``[R]``: each row's log-probability of its completion (the sum over
    the tokens ``loss_mask`` marks, each predicted from the ones before), and their number.

    Args:
        logits: ``[R, T, V]`` float32.
        rows: ``input_ids``, ``segment_ids``, ``loss_mask`` ``[R, T]``.
    """
    targets, _ = next_token_targets(rows["input_ids"], rows["segment_ids"])
    return _completion_sums(token_logps_of(logits[:, :-1], targets), rows)


def _completion_sums(token_logps: jax.Array, rows: dict[str, jax.Array]) -> tuple[jax.Array, jax.Array]:
    """:func:`completion_logps` from the tokens' log-probabilities ``[R, T - 1]``."""
    _, weights = next_token_targets(rows["input_ids"], rows["segment_ids"], rows["loss_mask"])
    return (token_logps * weights).sum(-1), weights.sum(-1)


def _smoothed(logits: jax.Array, label_smoothing: float) -> jax.Array:
    """``-(1 - ε) log σ(x) - ε log σ(-x)``: the preference's logistic loss, its label flipped
    with probability ``ε``."""
    return -jax.nn.log_sigmoid(logits) * (1 - label_smoothing) - jax.nn.log_sigmoid(-logits) * label_smoothing


def dpo(
    chosen: jax.Array,
    rejected: jax.Array,
    ref_chosen: jax.Array,
    ref_rejected: jax.Array,
    *,
    beta: float,
    label_smoothing: float = 0.0,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``(losses, chosen rewards, rejected rewards)`` ``[B]`` of DPO (sigmoid; conservative
    with ``label_smoothing``) from summed completion log-probabilities ``[B]``."""
    chosen_ratio, rejected_ratio = chosen - ref_chosen, rejected - ref_rejected
    losses = _smoothed(beta * (chosen_ratio - rejected_ratio), label_smoothing)
    return losses, beta * jax.lax.stop_gradient(chosen_ratio), beta * jax.lax.stop_gradient(rejected_ratio)


def simpo(
    chosen_avg: jax.Array, rejected_avg: jax.Array, *, beta: float, gamma: float, label_smoothing: float = 0.0
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``(losses, chosen rewards, rejected rewards)`` ``[B]`` of SimPO from the completions'
    mean log-probabilities per token."""
    losses = _smoothed(beta * (chosen_avg - rejected_avg) - gamma, label_smoothing)
    return losses, beta * jax.lax.stop_gradient(chosen_avg), beta * jax.lax.stop_gradient(rejected_avg)


def _log1mexp(x: jax.Array) -> jax.Array:
    """``log(1 - exp(x))`` for ``x < 0``, without cancellation on either side of ``-log 2``."""
    return jnp.where(x < -np.log(2.0), jnp.log1p(-jnp.exp(x)), jnp.log(-jnp.expm1(x)))


def orpo(
    chosen_avg: jax.Array, rejected_avg: jax.Array, *, beta: float
) -> tuple[jax.Array, jax.Array, jax.Array, dict[str, jax.Array]]:
    """``(losses, chosen rewards, rejected rewards, extras)`` ``[B]`` of ORPO from the
    completions' mean log-probabilities per token: the chosen completion's mean negative
    log-likelihood minus ``β log σ(log odds ratio)``; ``extras``: TRL's ``nll_loss``,
    ``log_odds_ratio`` and ``log_odds_chosen``."""
    log_odds = (chosen_avg - rejected_avg) - (_log1mexp(chosen_avg) - _log1mexp(rejected_avg))
    ratio = jax.nn.log_sigmoid(log_odds)
    nll = -chosen_avg
    extras = {"nll_loss": nll, "log_odds_ratio": ratio, "log_odds_chosen": log_odds}
    rewards = beta * jax.lax.stop_gradient(chosen_avg), beta * jax.lax.stop_gradient(rejected_avg)
    return nll - beta * ratio, *rewards, jax.tree.map(jax.lax.stop_gradient, extras)


def _rows(batch: dict[str, jax.Array]) -> dict[str, jax.Array]:
    """A batch of pairs ``[B, 2, T]`` as ``2B`` rows: chosen, rejected, chosen, ..."""
    return {k: batch[k].reshape(-1, batch[k].shape[-1]) for k in PAIR_KEYS}


def _pair_logps(
    model: Any, rows: dict[str, jax.Array], token_logps: TokenLogps = whole_token_logps
) -> tuple[jax.Array, jax.Array]:
    """``(sums, counts)`` ``[B, 2]`` of the model's completion log-probabilities, its tokens'
    from ``token_logps``."""
    sums, counts = _completion_sums(token_logps(model, rows, 1.0), rows)
    return sums.reshape(-1, 2), counts.reshape(-1, 2)


def _base_logps(model: Any, rows: dict[str, jax.Array], token_logps: TokenLogps = whole_token_logps) -> jax.Array:
    """The reference's summed completion log-probabilities ``[B, 2]``: the model with its LoRA
    adapters off, no gradient through it."""
    if not has_adapters(model):
        raise ConfigError(
            "DPO's reference is the model before tuning: with LoRA the base with its adapters off (no copy), but this "
            "model has no adapters, so it would compare the model with itself. Set lora.rank=16 (or another rank), or "
            "model.preference.reference=precomputed (the reference's log-probabilities computed once before training)."
        )
    with adapters_off():
        sums, _ = _pair_logps(model, rows, token_logps)
    return jax.lax.stop_gradient(sums)


def loss_fn(
    objective: Objective, token_logps: TokenLogps = whole_token_logps
) -> Callable[[Any, dict[str, jax.Array]], tuple[jax.Array, dict[str, jax.Array]]]:
    """The ``loss_fn(model, batch) -> (losses [B], metrics)`` of ``objective`` for
    :class:`xlafit.Trainer`: ``model(input_ids, segment_ids, positions)`` gives float32
    logits (a :class:`~xlafit.models.llama.LlamaForCausalLM`), of which ``token_logps`` takes
    each token's log-probability (by default from the whole logits; the llm recipe's computes
    them in blocks); ``batch`` holds pairs (see the module docstring). Metrics, per pair, by
    TRL's names: ``rewards/chosen``, ``rewards/rejected``, ``rewards/accuracies``,
    ``rewards/margins``, ``logps/chosen``, ``logps/rejected`` (ORPO also ``nll_loss``,
    ``log_odds_ratio``, ``log_odds_chosen``).

    Example:
        >>> train_step_loss = loss_fn(Objective("simpo", beta=2.0, gamma=0.5))
        >>> trainer = xlafit.Trainer(model, train_step_loss, optax.adamw(1e-5))  # doctest: +SKIP
    """

    def pairs_loss(model: Any, batch: dict[str, jax.Array]) -> tuple[jax.Array, dict[str, jax.Array]]:
        rows = _rows(batch)
        ref = None
        if objective.needs_reference:  # before the policy's pass: its logits need not live alongside
            ref = batch["ref_logps"] if objective.reference == "precomputed" else _base_logps(model, rows, token_logps)
        sums, counts = _pair_logps(model, rows, token_logps)
        if ref is not None and objective.reference == "precomputed" and has_adapters(model):
            # While the adapters add nothing the policy is its reference: its own sums, the rewards
            # exactly 0 (the pass before training, other batches in another program, rounds apart).
            ref = jnp.where(adapters_add_nothing(model), jax.lax.stop_gradient(sums), ref)
        extras: dict[str, jax.Array] = {}
        if objective.loss == "dpo":
            assert ref is not None
            losses, chosen, rejected = dpo(
                sums[:, 0],
                sums[:, 1],
                ref[:, 0],
                ref[:, 1],
                beta=objective.beta,
                label_smoothing=objective.label_smoothing,
            )
            if objective.sft_weight:
                nll = -sums[:, 0] / jnp.maximum(counts[:, 0], 1.0)
                losses = losses + objective.sft_weight * nll
                extras = {"nll_loss": jax.lax.stop_gradient(nll)}
            logged = sums
        else:
            avg = sums / jnp.maximum(counts, 1.0)
            if objective.loss == "simpo":
                losses, chosen, rejected = simpo(
                    avg[:, 0],
                    avg[:, 1],
                    beta=objective.beta,
                    gamma=objective.gamma,
                    label_smoothing=objective.label_smoothing,
                )
            else:
                losses, chosen, rejected, extras = orpo(avg[:, 0], avg[:, 1], beta=objective.beta)
            logged = avg
        logged = jax.lax.stop_gradient(logged)
        metrics = {
            "rewards/chosen": chosen,
            "rewards/rejected": rejected,
            "rewards/accuracies": (chosen > rejected).astype(jnp.float32),
            "rewards/margins": chosen - rejected,
            "logps/chosen": logged[:, 0],
            "logps/rejected": logged[:, 1],
            **extras,
        }
        return losses, metrics

    return pairs_loss


def reference_logps(
    model: Any, arrays: dict[str, np.ndarray], batch_pairs: int = 16, token_logps: TokenLogps = whole_token_logps
) -> np.ndarray:
    """The summed completion log-probabilities ``[N, 2]`` of ``model`` (the reference: the
    model before tuning) for every pair of ``arrays`` (``[N, 2, T]`` each), a batch of
    ``batch_pairs`` pairs at a time: one forward pass over the data, before training, so that
    full fine-tuning needs no second copy of the weights while it trains; the tokens'
    log-probabilities from ``token_logps`` (:func:`loss_fn`'s)."""

    @nnx.jit
    def logps(model: Any, batch: dict[str, jax.Array]) -> jax.Array:
        return _pair_logps(model, _rows(batch), token_logps)[0]

    n = len(arrays["input_ids"])
    out = np.zeros((n, 2), np.float32)
    for start in range(0, n, batch_pairs):
        index = np.arange(start, start + batch_pairs) % max(n, 1)  # the last batch filled up: one shape
        chunk = {k: jnp.asarray(arrays[k][index]) for k in PAIR_KEYS}
        values = np.asarray(logps(model, chunk))
        end = min(start + batch_pairs, n)
        out[start:end] = values[: end - start]
    return out
