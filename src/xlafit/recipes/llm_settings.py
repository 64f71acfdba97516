"""The llm recipe's model settings (``model.*``: :class:`LlmModelConfig`, a mixture of
experts' :class:`MoeOptions`), and the warnings for settings a run is given and does not read
(an objective's section on another objective, data settings GRPO ignores, router loss weights
on a model without experts): each is named as ignored, never dropped without a word.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Literal

from xlafit.config import Config
from xlafit.errors import ConfigError
from xlafit.models.llama import LlamaConfig
from xlafit.models.llama_config import REMAT
from xlafit.overrides import load_yaml
from xlafit.recipes import llm_grpo, llm_preference
from xlafit.recipes.llm_data import LlmDataConfig, data_config

log = logging.getLogger("xlafit")


@dataclasses.dataclass
class MoeOptions:
    """A mixture of experts' settings (models whose config has experts: Qwen3-MoE, Gemma 4 26B-A4B)."""

    # ragged: each expert multiplies only the tokens routed to it (grouped products:
    # jax.lax.ragged_dot on TPUs and GPUs, tiles of one expert on CPUs); dense: every expert
    # computes every token (num_experts / k times the FLOPs), the reference
    impl: Literal["ragged", "dense"] = "ragged"
    # the load-balancing loss's weight in the loss; null: the checkpoint's router_aux_loss_coef
    # (Qwen3-MoE's 0.001; Gemma 4's has none: 0) or the preset's
    router_aux_loss_coef: float | None = None
    router_z_loss_coef: float = 0.0  # ST-MoE's router z-loss weight (0: off)


@dataclasses.dataclass
class LlmModelConfig:
    # Llama's sizes by name (tiny: 2 layers of 64 for tests and the demo, tiny-moe: tiny with
    # 8 experts; the others the released models' shapes, models/llama_config.py: PRESETS), or
    # custom: the sizes below
    preset: Literal[
        "tiny", "tiny-moe", "llama-3.2-1b", "llama-3.1-8b", "llama-3.1-70b", "gemma-3-1b", "gemma-3-4b", "gemma-3-12b",
        "gemma-3-27b", "gemma-4-e2b", "gemma-4-e4b", "gemma-4-26b-a4b", "gemma-4-31b", "qwen3-1.7b", "qwen3-14b",
        "qwen3-32b", "qwen3-30b-a3b", "qwen3.5-9b", "qwen3.5-27b", "qwen3.5-35b-a3b", "custom",
    ] = "tiny"  # fmt: skip
    num_layers: int | None = None  # null: the preset's
    hidden_size: int | None = None  # null: the preset's
    num_heads: int | None = None  # query heads; null: the preset's
    num_kv_heads: int | None = None  # key/value heads (fewer: grouped-query attention); null: the preset's
    intermediate_size: int | None = None  # the SwiGLU MLP's width; null: the preset's
    max_position_embeddings: int | None = None  # the longest sequence; null: the preset's
    head_dim: int | None = None  # per attention head; null: the preset's (custom: hidden_size / num_heads)
    vocab_size: int | None = None  # null: the preset's (tiny and custom: the tokenizer's)
    compute_dtype: Literal["float32", "bfloat16"] = "float32"  # bfloat16: mixed precision (parameters stay float32)
    # the attention kernel: auto takes splash (flash, TPUs; seq_len a multiple of 128) or
    # cudnn (flash, GPUs; unpacked bf16) where it applies, else xla; cudnn: packed rows too (bf16)
    attention: Literal["auto", "xla", "cudnn", "splash"] = "auto"
    # a Hugging Face Llama (or Qwen2) directory to start from (config.json + safetensors):
    # its sizes replace the preset's, and its tokenizer.json is the default data.tokenizer
    init_from_hf: str | None = None
    revision: str | None = None  # a hub id's branch, tag or commit (model.init_from_hf, data.tokenizer)
    # Recompute activations in the backward pass, per decoder layer: none, full, a
    # jax.checkpoint_policies name (dots_saveable, ...), offload: each layer's input kept in
    # the host's memory, the rest recomputed, or offload_attention: its attention's q/k/v and
    # output projections there too (models/llama_config.py: REMAT)
    remat: str = "none"
    scan_layers: bool = False  # nnx.scan over the decoder layers: one layer compiled instead of num_layers
    # the loss (training's and evaluation's) in blocks of this many positions, and of the
    # vocabulary where a block's row is large: holds [batch, chunk, tile] float32 logits instead
    # of [batch, seq_len, vocab], for a third more output-layer FLOPs. auto: in blocks where the
    # whole logits and their gradient would take more than 1/8 of a device's memory (logits_blocks);
    # 0: the whole logits at once
    logits_chunk: int | Literal["auto"] = "auto"
    # next_token (pretraining, SFT), a preference objective on pairs of completions (dpo, simpo, orpo), or
    # grpo: reinforcement learning with reward functions on completions the model samples from prompts
    objective: Literal["next_token", "dpo", "simpo", "orpo", "grpo"] = "next_token"
    # the preference objectives' settings: beta, label_smoothing, gamma, reference (docs/guides/preference.md)
    preference: llm_preference.PreferenceConfig = dataclasses.field(default_factory=llm_preference.PreferenceConfig)
    # GRPO's settings: rewards, num_generations, max_completion_length, beta, epsilon, loss_type, ...
    grpo: llm_grpo.GrpoConfig = dataclasses.field(default_factory=llm_grpo.GrpoConfig)
    moe: MoeOptions = dataclasses.field(default_factory=MoeOptions)  # a mixture of experts' settings

    def __post_init__(self) -> None:
        if self.remat not in REMAT:  # the model's own check comes late for a model.init_from_hf run
            raise ConfigError(f"model.remat={self.remat}: give one of {', '.join(REMAT)}.")
        if isinstance(self.logits_chunk, int) and self.logits_chunk < 0:
            raise ConfigError(
                f"model.logits_chunk={self.logits_chunk} must be auto, 0 (the whole logits at once) or a number of "
                "positions."
            )


# the data settings GRPO does not read: a completion's length is model.grpo.max_completion_length,
# and the rewards, not a held-out loss, measure the run
_GRPO_UNREAD_DATA = ("seq_len", "eval_fraction", "eval_global_batch", "loss_on", "text_column")


def warn_unused_settings(cfg: Config) -> None:
    """Warns of settings of an objective the run does not train (``model.grpo.*`` on a
    next-token run), and of data settings a GRPO run does not read: given, and ignored."""
    m = cfg.model
    if m.objective == "grpo":
        d, default_data = data_config(cfg), LlmDataConfig(**load_yaml(Path(__file__).with_name("llm.yaml"))["data"])
        unread = [f"data.{k}={getattr(d, k)}" for k in _GRPO_UNREAD_DATA if getattr(d, k) != getattr(default_data, k)]
        if unread:
            log.warning(
                "warning: %s set, but model.objective=grpo does not read %s (a completion's length is "
                "model.grpo.max_completion_length; the rewards measure the run, no evaluation is held out): ignored",
                ", ".join(unread),
                "it" if len(unread) == 1 else "them",
            )
    _warn_router_losses_unused(m)
    _warn_preference_settings_unread(cfg)
    sections = (
        ("grpo", m.grpo, llm_grpo.GrpoConfig(), m.objective == "grpo"),
        ("preference", m.preference, llm_preference.PreferenceConfig(), m.objective in ("dpo", "simpo", "orpo")),
    )
    for name, given, default, used in sections:
        changed = [
            f"model.{name}.{f.name}={getattr(given, f.name)}"
            for f in dataclasses.fields(given)
            if getattr(given, f.name) != getattr(default, f.name)
        ]
        if changed and not used:
            log.warning(
                "warning: %s set, but model.objective=%s does not use model.%s: ignored",
                ", ".join(changed),
                m.objective,
                name,
            )


# The preference settings each objective reads (the others are given, and ignored)
_PREFERENCE_READS = {
    "dpo": ("beta", "label_smoothing", "reference", "sft_weight"),
    "simpo": ("beta", "label_smoothing", "gamma"),
    "orpo": ("beta",),
}


def _warn_preference_settings_unread(cfg: Config) -> None:
    """Warns of ``model.preference.*`` settings the run's preference objective does not read
    (``gamma`` on DPO, ``sft_weight`` on SimPO, ``label_smoothing`` on ORPO), and of
    ``data.loss_on=all`` (the objectives compare the completions' tokens alone)."""
    m = cfg.model
    reads = _PREFERENCE_READS.get(m.objective)
    if reads is None:
        return
    if data_config(cfg).loss_on != "assistant":
        log.warning(
            "warning: data.loss_on=%s set, but model.objective=%s compares the completions' tokens alone (ORPO's "
            "SFT term too): ignored",
            data_config(cfg).loss_on,
            m.objective,
        )
    if data_config(cfg).text_column != "text":
        log.warning(
            "warning: data.text_column=%s set, but model.objective=%s reads each record's prompt, chosen and "
            "rejected fields: ignored",
            data_config(cfg).text_column,
            m.objective,
        )
    default = llm_preference.PreferenceConfig()
    unread = [
        f"model.preference.{f.name}={getattr(m.preference, f.name)}"
        for f in dataclasses.fields(m.preference)
        if f.name not in reads and getattr(m.preference, f.name) != getattr(default, f.name)
    ]
    if unread:
        log.warning(
            "warning: %s set, but model.objective=%s does not read %s (it reads model.preference.%s): ignored",
            ", ".join(unread),
            m.objective,
            "it" if len(unread) == 1 else "them",
            ", ".join(reads),
        )


def _router_weights_given(moe: MoeOptions) -> list[str]:
    """The router loss weights a config gives (``model.moe.router_aux_loss_coef=0.5``)."""
    # null: the checkpoint's aux weight, not given; the z-loss's default 0: off, not given
    weights = (
        ("router_aux_loss_coef", moe.router_aux_loss_coef),
        ("router_z_loss_coef", moe.router_z_loss_coef or None),
    )
    return [f"model.moe.{k}={v}" for k, v in weights if v is not None]


def _warn_router_losses_unused(m: LlmModelConfig) -> None:
    """Warns of a mixture of experts' router loss weights given to an objective that trains
    without them (the preference objectives, GRPO: their losses are of the completions' log-
    probabilities alone, where TRL's trainers add the load-balancing term)."""
    given = _router_weights_given(m.moe)
    if given and m.objective != "next_token":
        log.warning(
            "warning: %s set, but model.objective=%s trains without the router's losses (only next-token runs "
            "add them; TRL's trainers add the load-balancing one to every objective): ignored",
            ", ".join(given),
            m.objective,
        )


def warn_expert_settings_on_dense(cfg: Config, llama: LlamaConfig, name: str) -> None:
    """Warns of a mixture of experts' settings given for a model without experts (``name``)."""
    if llama.num_experts:
        return
    moe = cfg.model.moe
    given = _router_weights_given(moe) + ([] if moe.impl == "ragged" else [f"model.moe.impl={moe.impl}"])
    if given:
        log.warning("warning: %s set, but %s has no experts: ignored", ", ".join(given), name)
    if cfg.mesh.expert != 1:
        log.warning(
            "warning: mesh.expert=%s set, but %s has no experts to split: that axis only splits the batch, as "
            "mesh.data does",
            cfg.mesh.expert,
            name,
        )
