"""The llm recipe's preference objectives (``model.objective=dpo``, ``simpo`` or ``orpo``):
their settings, their data (pairs, :mod:`xlafit.data.preference`) and their loss
(:mod:`xlafit.train.preference`), wired to the llm recipe's model and tokenizer.

DPO's reference (``model.preference.reference``): ``auto`` is the base with the LoRA
adapters off (``lora.rank`` above 0: no second copy of the weights); ``precomputed`` runs
the model as it starts once over the pairs before training and keeps their log-probabilities
with the data (full fine-tuning, or a cheaper step with LoRA); full fine-tuning with ``auto``
is refused with both options named.

    xlafit train llm model.objective=dpo model.init_from_hf=chat-model/ lora.rank=16 \\
        --data-dir prefs.jsonl data.seq_len=512
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable
from typing import Any, Literal

import numpy as np
from flax import nnx

from xlafit.config import Config
from xlafit.data.preference import PreferencePairs, load_pairs, summary
from xlafit.errors import ConfigError
from xlafit.recipes.base import reading_shapes_only
from xlafit.train import preference
from xlafit.train.losses import TokenLogps, whole_token_logps
from xlafit.train.step import LossFn

__all__ = ["OBJECTIVES", "PreferenceConfig", "load", "loss_for", "objective_of", "validate"]

OBJECTIVES = ("next_token", *preference.LOSSES, "grpo")


@dataclasses.dataclass
class PreferenceConfig:
    """The preference objectives' settings (TRL's names and defaults)."""

    beta: float = 0.1  # DPO's KL strength; SimPO's reward scale (its paper: 2 to 10); ORPO's odds-ratio weight
    label_smoothing: float = 0.0  # the chance that a pair's preference is flipped (conservative DPO; SimPO), < 0.5
    gamma: float = 0.5  # SimPO's target margin (TRL's simpo_gamma)
    # DPO's reference model: auto (with LoRA the base with its adapters off, no copy) or precomputed
    # (its log-probabilities computed once before training: full fine-tuning, or a cheaper LoRA step)
    reference: Literal["auto", "precomputed"] = "auto"
    # DPO: the weight of the chosen completion's negative log-likelihood added to the loss (TRL's "sft" loss
    # beside "sigmoid"; RPO): keeps the chosen answers likely while the rejected ones fall; 0: DPO alone
    sft_weight: float = 0.0


def objective_of(cfg: Config) -> preference.Objective | None:
    """The run's preference objective, None for next-token training."""
    m = cfg.model
    if m.objective in ("next_token", "grpo"):
        return None
    p = m.preference
    reference: preference.Reference = "precomputed" if p.reference == "precomputed" else "base"
    return preference.Objective(m.objective, p.beta, p.label_smoothing, p.gamma, reference, p.sft_weight)


def validate(cfg: Config) -> None:
    """Refuses preference settings that cannot work, before any data is read: DPO on full
    fine-tuning with no reference, the demo of one objective with the other's data."""
    objective = objective_of(cfg)  # the settings' own ranges (Objective refuses them)
    d: Any = cfg.data  # the llm recipe's LlmDataConfig
    demo = d.demo if not d.data_dir else None
    if objective is None:
        if demo == "preference" or d.format == "preference":
            raise ConfigError(
                "preference pairs train a preference objective: set model.objective=dpo (or simpo, orpo), or give "
                "other data for next-token training."
            )
        return
    if d.format not in ("auto", "preference"):
        raise ConfigError(
            f"model.objective={objective.loss} trains on preference pairs; data.format={d.format} is another "
            "kind of data: set data.format=auto (or preference)."
        )
    if demo is not None and demo != "preference":
        raise ConfigError(
            f"model.objective={objective.loss} trains on preference pairs: give them as --data-dir (JSON lines or "
            'Parquet of {"prompt", "chosen", "rejected"}), or data.demo=preference for the arithmetic pairs.'
        )
    if objective.needs_reference and objective.reference == "base" and not cfg.lora.rank:
        raise ConfigError(
            "model.objective=dpo compares the model with a reference (the model before tuning); full fine-tuning "
            "(lora.rank=0) has no frozen base to serve as one without a second copy of the weights in memory. Set "
            "lora.rank=16 (the reference is the base with its adapters off: no copy), or "
            "model.preference.reference=precomputed (the reference's log-probabilities computed once before training), "
            "or a reference-free objective: model.objective=simpo or orpo."
        )


def load(
    cfg: Config,
    tok: Any,
    template: Any,
    markers: tuple[int | None, int | None],
    inputs: list[str],
    build_base: Callable[[Config, int], nnx.Module],
    token_logps: TokenLogps = whole_token_logps,
    evaluating: bool = False,
) -> tuple[PreferencePairs, PreferencePairs]:
    """(train, eval) pairs of ``inputs`` (``data.data_dir``, or the demo's), with the
    reference's log-probabilities where ``model.preference.reference=precomputed``
    (``build_base`` builds the model as the run starts, adapters aside; ``token_logps``
    computes its tokens'); ``markers``: the tokenizer's ``(bos, eos)``; ``evaluating``: the
    pairs are read to be evaluated alone (``xlafit eval``), and said so."""
    d: Any = cfg.data  # the llm recipe's LlmDataConfig
    say = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
    train, evaluation = load_pairs(
        inputs,
        tok,
        template,
        seq_len=d.seq_len,
        eval_fraction=d.eval_fraction,
        seed=d.seed,
        markers=markers,
        progress=say,
        eval_inputs=[d.eval_data_dir] if d.eval_data_dir else [],
    )
    say(summary(train, evaluation, d.eval_fraction, evaluating))
    objective = objective_of(cfg)
    if objective is not None and objective.needs_reference and objective.reference == "precomputed":
        pairs = len(train) + len(evaluation)
        if reading_shapes_only():  # a check compiles the step: their shape is all it reads
            say(f"the reference's log-probabilities: not computed for a check (a run computes them, {pairs} pairs)")
            for data in (train, evaluation):
                data.arrays["ref_logps"] = np.zeros((len(data), 2), np.float32)
            return train, evaluation
        base = build_base(cfg, train.vocab_size)
        say(f"the reference's log-probabilities: one pass of the starting model over {pairs} pairs")
        for data in (train, evaluation):
            if len(data):
                data.arrays["ref_logps"] = preference.reference_logps(base, data.arrays, token_logps=token_logps)
    return train, evaluation


def loss_for(cfg: Config, next_token: LossFn, token_logps: TokenLogps = whole_token_logps) -> LossFn:
    """The loss a run of ``cfg`` trains with: the preference objective's (its tokens'
    log-probabilities from ``token_logps``), else ``next_token``."""
    objective = objective_of(cfg)
    return next_token if objective is None else preference.loss_fn(objective, token_logps)


def reference_passes(cfg: Config) -> float:
    """Forward passes a step adds per pair beyond the policy's: the base's, for DPO with its
    reference in the step (1 forward = 1/3 of a training pass's FLOPs)."""
    objective = objective_of(cfg)
    in_step = objective is not None and objective.needs_reference and objective.reference == "base"
    return 1.0 if in_step else 0.0
