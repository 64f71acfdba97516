"""The llm recipe's reinforcement learning with rewards (``model.objective=grpo``): its
settings (``model.grpo.*``, TRL's ``GRPOConfig`` names and defaults), its data (prompts,
:mod:`xlafit.data.prompts`), its rollout (:mod:`xlafit.train.rollout`) and loss
(:mod:`xlafit.train.grpo`), wired to the llm recipe's model and tokenizer.

``data.global_batch`` counts completions: ``num_generations`` of each prompt. A train-step
call is one generation batch trained ``num_iterations`` times (``trainer.steps_per_call`` is
set to it), so checkpoints fall between generation batches and a resume generates nothing
twice.

    xlafit train llm model.objective=grpo model.init_from_hf=chat-model/ lora.rank=16 \\
        --data-dir prompts.jsonl model.grpo.rewards=rewards.py:exact_answer data.global_batch=64
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable
from typing import Any, Literal

import numpy as np

from xlafit.config import Config
from xlafit.data.prompts import PromptSet, load_prompts
from xlafit.errors import ConfigError
from xlafit.train import grpo
from xlafit.train.losses import TokenLogps, whole_token_logps
from xlafit.train.rewards import load_rewards, parse_spec
from xlafit.train.rollout import Rollout
from xlafit.train.step import LossFn

__all__ = ["GrpoConfig", "load", "loss_for", "objective_of", "rollout_for", "settle", "validate"]


@dataclasses.dataclass
class GrpoConfig:
    """GRPO's settings (TRL's names and defaults; docs/guides/preference.md)."""

    rewards: str | None = None  # the reward functions: FILE.py:fn_a,fn_b (TRL's signature)
    reward_weights: float | str | None = None  # one weight per function, comma-separated (null: 1 each)
    num_generations: int = 8  # G: the completions of each prompt (data.global_batch counts completions)
    max_completion_length: int = 256  # the tokens of a completion at most
    temperature: float = 1.0  # the sampler's; the log-probabilities are the model's at it too
    top_p: float = 1.0  # nucleus sampling's mass (1: every token)
    top_k: int = 0  # 0: every token
    beta: float = 0.0  # the KL term's weight; > 0 needs a reference: the base with the LoRA adapters off
    epsilon: float = 0.2  # the ratio's clip: [1 - epsilon, 1 + epsilon_high]
    epsilon_high: float | None = None  # null: epsilon (DAPO's clip-higher: 0.28)
    loss_type: Literal["grpo", "dr_grpo", "dapo"] = "dapo"  # the loss's normalisation
    scale_rewards: Literal["group", "batch", "none"] = "group"  # the advantages' divisor: the group's std, ...
    num_iterations: int = 1  # optimisation steps per generation batch (old log-probs kept from generation)


def objective_of(cfg: Config) -> grpo.GrpoObjective | None:
    """The run's GRPO objective, None for another objective."""
    if cfg.model.objective != "grpo":
        return None
    g = cfg.model.grpo
    return grpo.GrpoObjective(
        g.loss_type, g.beta, g.epsilon, g.epsilon_high, g.scale_rewards, g.num_generations,
        g.max_completion_length, g.temperature,
    )  # fmt: skip


def weights_of(g: GrpoConfig) -> np.ndarray | None:
    """``model.grpo.reward_weights`` as numbers (None: 1 each)."""
    if g.reward_weights is None:
        return None
    try:
        return np.array([float(w) for w in str(g.reward_weights).split(",")], np.float32)
    except ValueError:
        raise ConfigError(
            f"model.grpo.reward_weights={g.reward_weights!r}: give numbers separated by commas, one per function "
            "(model.grpo.reward_weights=1,0.5)."
        ) from None


def validate(cfg: Config) -> None:
    """Refuses GRPO settings that cannot work, before any data is read: no reward functions,
    a reference without LoRA, data of another kind, steps per call that split a generation batch."""
    objective = objective_of(cfg)  # the settings' own ranges (GrpoObjective refuses them)
    d: Any = cfg.data
    demo = d.demo if not d.data_dir else None
    if objective is None:
        if d.format == "prompt" or demo == "grpo":
            raise ConfigError("prompt records train model.objective=grpo; set it, or give other data.")
        return
    g = cfg.model.grpo
    if not g.rewards:
        raise ConfigError(
            "model.objective=grpo learns from rewards: name the reward functions, as "
            "model.grpo.rewards=rewards.py:exact_answer (a Python file and its functions)."
        )
    load_rewards(g.rewards)  # a missing file, one that is not Python, a function it lacks: refused now
    weights = weights_of(g)
    if weights is not None and len(weights) != len(parse_spec(g.rewards)[1]):
        functions = len(parse_spec(g.rewards)[1])
        raise ConfigError(
            f"model.grpo.reward_weights has {len(weights)} weight{'s' if len(weights) != 1 else ''} for the "
            f"{functions} function{'s' if functions != 1 else ''} of model.grpo.rewards; give one weight per function "
            "(or none: 1 each)."
        )
    if g.num_iterations < 1 or not 0 < g.top_p <= 1 or g.top_k < 0:
        raise ConfigError(
            f"model.grpo.num_iterations={g.num_iterations}, top_p={g.top_p:g}, top_k={g.top_k}: give 1 or more "
            "iterations, 0 < top_p <= 1 and top_k >= 0 (0: every token)."
        )
    if objective.beta and not cfg.lora.rank:
        raise ConfigError(
            f"model.grpo.beta={objective.beta:g} compares the policy with a reference (the model before tuning); "
            "full fine-tuning (lora.rank=0) has no frozen base to serve as one without a second copy of the weights. "
            "Set lora.rank=16 (the reference is the base with its adapters off), or model.grpo.beta=0 (TRL's "
            "default)."
        )
    if d.format not in ("auto", "prompt"):
        raise ConfigError(
            f"model.objective=grpo trains on prompts; data.format={d.format} is another kind of data: set "
            "data.format=auto (or prompt)."
        )
    if d.global_batch and d.global_batch % g.num_generations:  # else when the batch is known (PromptSet)
        PromptSet([], [], {}, None, (), g.num_generations).prompts_per_step(d.global_batch)  # type: ignore[arg-type]
    if demo is not None and demo != "grpo":
        raise ConfigError(
            'model.objective=grpo needs prompts: give --data-dir (JSON lines or Parquet of {"prompt": ...} with the '
            "columns the rewards read), or data.demo=grpo for the chat demo's questions."
        )
    steps = cfg.trainer.steps_per_call
    if steps not in (1, g.num_iterations):
        raise ConfigError(
            f"trainer.steps_per_call={steps}: a GRPO call is one generation batch trained "
            f"model.grpo.num_iterations={g.num_iterations} times; drop trainer.steps_per_call (it is set to "
            "num_iterations)."
        )
    if cfg.trainer.stop_at_step and cfg.trainer.stop_at_step % g.num_iterations:
        raise ConfigError(
            f"trainer.stop_at_step={cfg.trainer.stop_at_step} stops inside a generation batch of "
            f"model.grpo.num_iterations={g.num_iterations} steps; give a multiple of it."
        )


def settle(cfg: Config) -> Config:
    """``cfg`` with ``trainer.steps_per_call`` = ``num_iterations`` (a call is a generation batch)."""
    if cfg.model.objective != "grpo":
        return cfg
    return dataclasses.replace(
        cfg, trainer=dataclasses.replace(cfg.trainer, steps_per_call=cfg.model.grpo.num_iterations)
    )


def load(cfg: Config, tok: Any, template: Any, markers: tuple[int | None, int | None], stops: tuple[int, ...],
         inputs: list[str], context: int | None = None) -> PromptSet:  # fmt: skip
    """The prompts of ``inputs`` (``data.data_dir``), encoded for generation; one longer than
    ``context`` (the model's positions) less ``max_completion_length`` is refused as it is read."""
    g = cfg.model.grpo
    say = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
    room = (context, g.max_completion_length) if context else None
    prompts = load_prompts(
        inputs, tok, template, stops, group=g.num_generations, iterations=g.num_iterations, bos=markers[0],
        progress=say, room=room,
    )  # fmt: skip
    columns = ", ".join(prompts.columns) or "none"
    say(
        f"data: {len(prompts.prompts)} prompts (up to {prompts.prompt_length} tokens; columns for the rewards: "
        f"{columns}), {g.num_generations} completions of up to {g.max_completion_length} tokens each"
    )
    return prompts


def loss_for(cfg: Config, other: Callable[[Config], LossFn], token_logps: TokenLogps = whole_token_logps) -> LossFn:
    """GRPO's loss for a GRPO run (its tokens' log-probabilities from ``token_logps``), else
    ``other``'s for the config."""
    objective = objective_of(cfg)
    return other(cfg) if objective is None else grpo.loss_fn(objective, token_logps)


def rollout_for(cfg: Config, train: Any, token_logps: TokenLogps = whole_token_logps) -> Rollout | None:
    """The run's rollout (its reward functions loaded; the log-probabilities of its rows from
    ``token_logps``, the loss's), None for another objective."""
    objective = objective_of(cfg)
    if objective is None:
        return None
    g = cfg.model.grpo
    assert g.rewards is not None  # validate
    rewards = load_rewards(g.rewards)
    return Rollout(
        train, objective, rewards, weights_of(g), g.num_iterations, g.top_p, g.top_k, cfg.data.seed, token_logps,
        epochs=cfg.trainer.epochs,
    )  # fmt: skip
