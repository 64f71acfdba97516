"""``xlafit check RECIPE``: a recipe's model, loss and a batch of its data, checked here or
compiled for TPU slices with the run's own settings, and the settings each answer is for."""

from __future__ import annotations

import shlex
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from flax import nnx

from xlafit.check.program import FitLever, ModelLever, Program
from xlafit.check.report import Report
from xlafit.check.step import check_step, check_tpu, example_layout, positive
from xlafit.data.dataset import as_dataset, num_shapes
from xlafit.models.lora import ADAPTER
from xlafit.overrides import merge_overrides
from xlafit.parallel.cluster import start_backends
from xlafit.parallel.sharding import parse_rules
from xlafit.platform.hardware import parse_targets
from xlafit.predict.rates import parameter_count
from xlafit.recipes import get_recipe, load_config
from xlafit.recipes.base import shapes_only
from xlafit.recipes.llm_settings import LlmModelConfig
from xlafit.run import with_lora
from xlafit.train.losses import whole_logits_bytes
from xlafit.train.optim import make_optimizer
from xlafit.train.rollout import Rollout

__all__ = [
    "SHAPING",
    "assumed_settings",
    "auto_logits_whole",
    "check_command",
    "check_recipe",
    "fit_levers_of",
    "memory_levers",
    "recipe_program",
    "residual_split",
]


def recipe_program(
    name: str,
    overrides: Sequence[str] = (),
    preset: str | Path | None = None,
    per_device_batch: int | None = None,
    global_batch: int | None = None,
    data: tuple[Any, Any] | None = None,
) -> tuple[Program, Any, int | None]:
    """What ``check --tpu`` compiles for a recipe: ``(program, config, train examples)``.

    The model is built abstractly (``nnx.eval_shape``) from the recipe's config with
    ``overrides`` (``preset``: a YAML file instead of the recipe's own), with the run's own
    optimizer, batch sizes and loop settings, and with ``lora.rank`` set its adapters, the
    only trainable variables (the base frozen, as a run trains it); a given
    ``per_device_batch`` or ``global_batch`` replaces the config's. Where the config alone
    decides the data's shapes (``Recipe.shapes``: an llm preset on the demo corpus), no data
    is read, and the train examples are None (unknown). A run whose model makes its batches
    (GRPO) compiles its train step on the rows the rollout makes, and the rollout's own
    programs beside it (:attr:`Program.rollout`). ``data``: the recipe's ``(train, eval)``
    data as read already (:attr:`Program.with_overrides` reads it once, for settings that leave
    the data alone). All of it reads for shapes (:func:`~xlafit.recipes.base.shapes_only`): a
    checkpoint's ``config.json``, not its weights, and no value-only work (a DPO run's
    reference pass).
    """
    with shapes_only():
        return _recipe_program(name, overrides, preset, per_device_batch, global_batch, data)


def _recipe_program(
    name: str,
    overrides: Sequence[str],
    preset: str | Path | None,
    per_device_batch: int | None,
    global_batch: int | None,
    data: tuple[Any, Any] | None,
) -> tuple[Program, Any, int | None]:
    cfg = load_config(name, list(overrides), preset=preset)
    recipe = get_recipe(name)
    recipe.validate(cfg)
    placeholder = recipe.shapes(cfg)
    if placeholder is not None:
        train_data, eval_data = placeholder, None
    else:
        train_data, eval_data = data if data is not None else recipe.load_data(cfg)
    train = as_dataset(train_data)
    cfg = recipe.from_data(cfg, train)
    per_device = per_device_batch or (None if cfg.data.global_batch else cfg.data.per_device_batch)
    global_batch = global_batch or cfg.data.global_batch
    reference = global_batch or (per_device or 1) * 8
    optimizer = make_optimizer(cfg.optimizer, reference, total_steps=cfg.optimizer.decay_steps or 1000).tx
    work = recipe.throughput(cfg, train)
    # A run whose batches its model makes (GRPO's rollout) trains on the rows the rollout makes,
    # compiles the rollout's programs beside its step, and evaluates nothing.
    made = recipe.rollout(cfg, train)
    rollout = made if isinstance(made, Rollout) else None
    example = rollout.example() if rollout is not None else example_layout(train.take(np.arange(1)))
    # No eval step where the data holds no evaluation split (shapes alone: the run's data may)
    evaluates = rollout is None and (placeholder is not None or _holds_examples(eval_data))

    def again(more: tuple[str, ...]) -> Program:
        """This run with ``more`` settings, on the data read above where they leave it alone."""
        read = None if placeholder is not None or any(m.startswith("data.") for m in more) else (train_data, eval_data)
        return recipe_program(name, [*overrides, *more], preset, per_device_batch, global_batch, read)[0]

    model = nnx.eval_shape(lambda: with_lora(recipe.build_model(cfg, train), cfg.lora, cfg.trainer.seed))
    vocab = getattr(getattr(model, "cfg", None), "vocab_size", None)  # a language model's output layer
    logits_whole = auto_logits_whole(cfg, vocab) if isinstance(cfg.model, LlmModelConfig) and vocab else None
    program = Program(
        model,
        recipe.loss(cfg),
        optimizer,
        cfg.trainer,
        example,
        per_device_batch=per_device,
        global_batch=None if per_device else global_batch,
        eval_global_batch=(cfg.data.eval_global_batch or "train") if evaluates else None,
        flops_per_example=work.get("flops_per_example"),
        tokens_per_example=work.get("tokens_per_example"),
        family=name,
        mesh=cfg.mesh.sizes,
        rules=parse_rules(cfg.mesh.rules),
        model_levers=memory_levers(
            cfg.model, residual_split(cfg), _llm_full_fine_tune(cfg), getattr(cfg, "lora", None), logits_whole
        ),
        trainable=ADAPTER if cfg.lora.rank else nnx.Param,
        fit_levers=fit_levers_of(cfg, logits_whole),
        with_overrides=again,
        rollout=rollout.programs if rollout is not None else None,
        decode_loop=rollout.decode_loop if rollout is not None else None,
    )
    return program, cfg, None if placeholder is not None else len(train)


def _holds_examples(data: Any) -> bool:
    """Whether a recipe's evaluation data holds an example (a stream of unknown length: yes)."""
    if data is None:
        return False
    try:
        return len(as_dataset(data)) > 0
    except TypeError:
        return True


def check_recipe(
    name: str,
    overrides: list[str] | None = None,
    tpu: str | None = None,
    max_batch: bool | int = False,
    preset: str | Path | None = None,
    **options: Any,
) -> Report:
    """Checks a recipe's model, loss and a batch of its data (and, for bert, the lengths
    of its tokenized corpus against the padding plans).

    With ``tpu``, compiles the recipe's train and eval steps for those TPU slices, with the
    run's own optimizer, batch sizes (``data.per_device_batch`` or ``data.global_batch``
    over each target's cores) and loop settings (:func:`recipe_program`); the model is built
    abstractly. ``preset``: a YAML file in place of the recipe's own (a ``plan.yaml``).
    """
    positive("--per-device-batch", options.get("per_device_batch"))
    positive("--global-batch", options.get("global_batch"))
    start_backends()  # quietly, as for a file
    if tpu:  # the recipes feed fixed shapes (bert packs its sequences): rule 3 has nothing to say
        parse_targets(tpu)  # an unknown name fails before the model is built
        program, cfg, _ = recipe_program(
            name, overrides or [], preset, options.get("per_device_batch"), options.get("global_batch")
        )
        report = check_tpu(name, program, tpu, max_batch=max_batch)
        report.assumed = assumed_settings(cfg, program, overrides or [])
        # A per-core batch compiled over a config's global one: the command clears the global one.
        cleared = ["data.global_batch=null"] if program.per_device_batch and cfg.data.global_batch else []
        report.command = check_command(name, tpu, [*(overrides or []), *cleared], report.assumed, preset)
        return report
    cfg = load_config(name, overrides or [], preset=preset)
    recipe = get_recipe(name)
    recipe.validate(cfg)
    train = as_dataset(recipe.load_data(cfg)[0])
    cfg = recipe.from_data(cfg, train)
    lengths = recipe.sequence_lengths(cfg)
    rows = options.get("per_device_batch") or 8  # the example batch run here: small
    batch = train.take(np.arange(min(rows, len(train))))
    if not options.get("per_device_batch") and not options.get("global_batch"):
        # Memory and FLOPs at the run's own batch, as --tpu compiles it, not the example's rows.
        if cfg.data.global_batch:
            options = {**options, "global_batch": cfg.data.global_batch}
        elif cfg.data.per_device_batch:
            options = {**options, "per_device_batch": cfg.data.per_device_batch}
    lora = getattr(cfg, "lora", None)
    _say_a_large_build(recipe, cfg, train)
    model = recipe.build_model(cfg, train)
    if lora is not None:  # the adapters the run trains (a preference objective's reference is the base without them)
        model = with_lora(model, lora, cfg.trainer.seed)
    made = recipe.rollout(cfg, train)
    if isinstance(made, Rollout):  # GRPO: the rows its rollout makes with the model (whole groups)
        whole = -(-rows // made.prompts.group) * made.prompts.group
        batch = made.generation_batch(model, 0, train.take(np.arange(min(whole, len(train))))["prompt_index"])
    # A recipe's rows have one shape (packed or padded) unless its dataset plans buckets.
    trainable = ADAPTER if lora is not None and lora.rank else nnx.Param
    return check_step(
        name,
        model,
        recipe.loss(cfg),
        batch,
        lengths=lengths,
        one_shape=num_shapes(train) == 1,
        trainable=trainable,
        users_loss=False,  # the recipe's own loss: the user cannot return other values from it
        **options,
    )


# A model this large takes a while to build on the host (random weights, a quantized base
# quantized tensor by tensor) before its step runs: the check says so first.
LARGE_BUILD = 10**9


def _say_a_large_build(recipe: Any, cfg: Any, train: Any) -> None:
    """A line on stderr before a model of :data:`LARGE_BUILD` parameters or more is built from
    random weights (a checkpoint's reading says its own progress)."""
    if getattr(cfg.model, "init_from_hf", None):
        return
    count = parameter_count(nnx.eval_shape(lambda: recipe.build_model(cfg, train)))
    if count >= LARGE_BUILD:
        base = getattr(getattr(cfg, "lora", None), "base_dtype", None)
        quantized = f", its base quantized to {base}" if base in ("nf4", "int4", "int8") else ""
        print(
            f"building the {count / 1e9:.1f}B-parameter model in this host's memory{quantized}, to run a step of it "
            "here (minutes for a model this size; `check --tpu` compiles without building it) ...",
            file=sys.stderr,
            flush=True,
        )


# The settings that shape a recipe's compiled step, printed with every answer (when present).
SHAPING = (
    "model.preset", "model.objective", "data.seq_len", "data.image_size", "lora.rank", "lora.base_dtype",
    "lora.quantize_embeddings", "model.compute_dtype", "model.remat", "model.scan_layers", "model.attention",
    "mesh.data", "mesh.fsdp", "mesh.tensor", "mesh.expert", "trainer.steps_per_call", "trainer.accumulate_steps",
)  # fmt: skip
# Settings whose default shapes nothing worth naming: left out unless given or changed.
_QUIET_DEFAULTS = {"model.objective": "next_token", "lora.quantize_embeddings": False}


def assumed_settings(cfg: Any, program: Program, overrides: Sequence[str]) -> list[str]:
    """The settings an answer is for, as overrides to copy: the batch the program compiles
    and each of :data:`SHAPING` the config has, the recipe's defaults included (a run that
    meant 2,048 tokens sees that the answer is for the default's 128)."""
    given = {o.split("=", 1)[0].strip() for o in overrides}
    batch = (
        f"data.per_device_batch={program.per_device_batch}"
        if program.per_device_batch
        else f"data.global_batch={program.global_batch}"
    )
    out = [batch]
    for key in SHAPING:
        section, _, field = key.partition(".")
        holder = getattr(cfg, section, None)
        if holder is None or not hasattr(holder, field):
            continue
        value = getattr(holder, field)
        if value is None or key not in given and key.startswith(("mesh.", "trainer.")) and value in (1, -1):
            continue  # an unset preset, a mesh axis or loop setting at its default: nothing assumed
        if key.startswith("lora.") and not getattr(cfg.lora, "rank", 0):
            continue  # no adapters
        if key in _QUIET_DEFAULTS and key not in given and value == _QUIET_DEFAULTS[key]:
            continue
        if key == "data.seq_len" and getattr(cfg.model, "objective", None) == "grpo":
            continue  # a GRPO row is a prompt and its completion (model.grpo.max_completion_length)
        if key == "model.preset" and getattr(cfg.model, "init_from_hf", None):
            key, value = "model.init_from_hf", cfg.model.init_from_hf  # the checkpoint's sizes, not the preset's
        out.append(f"{key}={str(value).lower() if isinstance(value, bool) else value}")
    # The model's own sizes given over its preset (a released shape the presets lack): the answer is
    # for them, not for the preset's.
    named = {a.split("=", 1)[0] for a in out}
    sizes = [(o.split("=", 1)[0].strip(), o.strip()) for o in overrides]
    out += [override for key, override in sizes if key in MODEL_SIZES and key not in named]
    return out


# The model's sizes an override may give over its preset (:func:`assumed_settings` names them).
MODEL_SIZES = (
    "model.num_layers", "model.hidden_size", "model.num_heads", "model.num_kv_heads", "model.head_dim",
    "model.intermediate_size", "model.vocab_size", "model.max_position_embeddings",
)  # fmt: skip


def check_command(
    name: str, tpu: str, overrides: Sequence[str], assumed: Sequence[str], preset: str | Path | None = None
) -> str:
    """The command that checks the same run again: every override given and every setting
    assumed, each key once (the assumed value, which the config resolved, wins)."""
    config = ["--config", str(preset)] if preset else []
    return shlex.join(["xlafit", "check", name, "--tpu", tpu, *config, *merge_overrides(overrides, assumed)])


def _llm_full_fine_tune(cfg: Any) -> bool:
    """Whether ``cfg`` fine-tunes an llm whole (no LoRA)."""
    return isinstance(cfg.model, LlmModelConfig) and not cfg.lora.rank


def memory_levers(
    model: Any,
    split: str | None = None,
    full: bool = False,
    lora: Any = None,
    logits_whole: Callable[[int, float], bool] | None = None,
) -> tuple[ModelLever, ...]:
    """The memory levers a recipe's model settings offer, for a run that does not fit;
    ``split``: the setting that splits its residual stream over a tensor group
    (:func:`residual_split`), where it has one; ``full``: an llm full fine-tune, which LoRA
    on a frozen base would make smaller; ``lora``: a LoRA run's settings, whose unquantized
    base a 4-bit one would make smaller; ``logits_whole``: where ``model.logits_chunk=auto``
    keeps the logits whole (:func:`auto_logits_whole`), the only runs chunks of 1,024 change."""
    found: list[ModelLever] = []
    rank, base = (lora.rank, lora.base_dtype) if lora is not None else (0, None)
    if rank and base in ("float32", "bfloat16"):
        found.append(ModelLever("state", "a 4-bit frozen base: lora.base_dtype=nf4 (the adapters train as they are)"))
    if full:
        found.append(
            ModelLever(
                "state",
                "LoRA on a frozen base: lora.rank=16 (the optimizer state of the adapters alone; with "
                "lora.base_dtype=nf4, a 4-bit base)",
            )
        )
    if getattr(model, "remat", None) == "none":
        found.append(
            ModelLever("activations", "rematerialisation: model.remat=full or dots_saveable (activations recomputed)")
        )
    if getattr(model, "compute_dtype", None) == "float32":
        found.append(ModelLever("activations", "bf16 compute: model.compute_dtype=bfloat16 (parameters stay float32)"))
    chunks = getattr(model, "logits_chunk", None)
    if chunks in (0, "auto"):  # auto keeps logits under 1/8 of memory whole
        text = "the loss's logits a chunk at a time: model.logits_chunk=1024 (recomputed)"
        found.append(ModelLever("activations", text, logits_whole if chunks == "auto" else None))
    if split is not None:
        found.append(
            ModelLever(
                "activations",
                f"the residual stream between layers split over the tensor group: {split} (what remat keeps of it)",
            )
        )
    return tuple(found)


def fit_levers_of(cfg: Any, logits_whole: Callable[[int, float], bool] | None = None) -> tuple[FitLever, ...]:
    """The levers ``check --tpu`` compiles for a recipe's run that does not fit, the ones its
    settings leave room for, most likely to help first: a 4-bit (NF4) frozen base (LoRA runs
    only: a quantized base cannot be trained), the loss's logits in chunks, under tensor
    parallelism the residual stream split over the tensor group (:func:`residual_split`), each
    decoder layer's input in host memory (the llm recipe's ``model.remat=offload``), full remat, and
    for an llm full fine-tune the optimizer state in host memory (``trainer.optimizer_offload``).
    ``logits_whole``: as :func:`memory_levers`'s (the logits' chunks are compiled only where
    ``auto`` keeps them whole).

    Example:
        >>> [lv.overrides for lv in fit_levers_of(load_config("llm", ["lora.rank=8"]))]
        [('lora.base_dtype=nf4',), ('model.logits_chunk=1024',), ('model.remat=offload',), ('model.remat=full',)]
    """
    found = []
    lora = getattr(cfg, "lora", None)
    if lora is not None and lora.rank and lora.base_dtype in ("float32", "bfloat16"):
        found.append(FitLever("a 4-bit (NF4) frozen base", ("lora.base_dtype=nf4",), "state"))
    model = cfg.model
    chunks = getattr(model, "logits_chunk", None)
    if chunks in (0, "auto"):  # auto keeps logits under 1/8 of memory whole
        helps = logits_whole if chunks == "auto" else None
        found.append(FitLever("the logits in chunks", ("model.logits_chunk=1024",), helps=helps))
    split = residual_split(cfg)
    if split is not None:
        found.append(FitLever("the residual stream split over the tensor group", (split,)))
    remat = getattr(model, "remat", None)
    if isinstance(model, LlmModelConfig) and remat != "offload":
        found.append(FitLever("layer inputs in host memory", ("model.remat=offload",)))
    if remat is not None and remat not in ("full", "offload"):
        found.append(FitLever("full remat", ("model.remat=full",)))
    trainer = getattr(cfg, "trainer", None)
    full = lora is None or not lora.rank  # LoRA's optimizer state is the adapters' own: small
    if isinstance(model, LlmModelConfig) and full and trainer is not None and not trainer.optimizer_offload:
        found.append(FitLever("optimizer state in host memory", ("trainer.optimizer_offload=true",), "state"))
    return tuple(found)


def auto_logits_whole(cfg: Any, vocab: int) -> Callable[[int, float], bool]:
    """Whether ``model.logits_chunk=auto`` keeps an llm run's logits whole at a per-core batch
    on a device of a memory: :func:`~xlafit.recipes.llm.logits_blocks`'s rule (the float32
    logits and their gradient of one device's rows within 1/8 of its memory; the vocabulary
    split over the tensor axis where the rules split it there)."""
    sizes, rules = dict(zip(("data", "fsdp", "tensor"), cfg.mesh.sizes, strict=False)), parse_rules(cfg.mesh.rules)
    tensor = sizes.get(rules.get("vocab") or "", 1)
    per_device = vocab // tensor if tensor > 1 and vocab % tensor == 0 else vocab
    seq_len = cfg.data.seq_len

    def whole(per_core_batch: int, memory: float) -> bool:
        return whole_logits_bytes(per_core_batch, seq_len, per_device) <= memory / 8

    return whole


def residual_split(cfg: Any) -> str | None:
    """The ``mesh.rules`` setting that splits an llm run's residual stream over its tensor
    group (MaxText's ``activation_embed``), keeping the run's own rules; None where it has no
    tensor group, already splits it, or its model has no such stream.

    Between decoder layers the stream is whole on every device of a tensor group by default:
    what remat keeps of it (each layer's input) is ``mesh.tensor`` times a split one, for a
    reduce-scatter and an all-gather a layer in place of an all-reduce.

    Example:
        >>> residual_split(load_config("llm", ["mesh.tensor=4", "mesh.rules=vocab=null"]))
        'mesh.rules=vocab=null,activation_embed=tensor'
        >>> residual_split(load_config("llm", [])) is None  # no tensor group
        True
    """
    mesh = getattr(cfg, "mesh", None)
    if not isinstance(getattr(cfg, "model", None), LlmModelConfig) or mesh is None or mesh.tensor == 1:
        return None
    if parse_rules(mesh.rules)["activation_embed"] is not None:
        return None
    return f"mesh.rules={','.join(r for r in (mesh.rules, 'activation_embed=tensor') if r)}"
