"""One training run of a recipe, start to finish: :func:`train_and_evaluate`.

config -> devices -> data -> model -> optimizer -> run directory -> :class:`Trainer` -> report.
The command ``xlafit train`` parses its arguments into a :class:`~xlafit.config.Config` and
calls this; the training loop itself is :meth:`xlafit.Trainer.fit`.

A run directory holds ``config.yaml`` (the config as resolved: batch sizes, schedule length,
what the data decided), ``metrics.jsonl``, ``tensorboard/``, ``checkpoints/`` and the
recipe's artifacts (a tokenizer). It may be a local path or a URL (``gs://bucket/run``,
docs/guides/cloud-storage.md). Running the same command again resumes from the newest intact checkpoint,
after checking that the new config continues the same run; ``--restart`` moves the earlier
run aside (:func:`~xlafit.rundir.start_run_dir`) and deletes nothing.

Example:
    >>> import xlafit
    >>> cfg = xlafit.load_config("mnist", ["trainer.epochs=1", "run.run_dir=/tmp/xlafit-doc-run"])
    >>> result = xlafit.train_and_evaluate(cfg)                       # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import logging
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple, cast

import jax
import jax.numpy as jnp
import yaml
from etils import epath
from flax import nnx

from xlafit.checkpoint import check_directory, check_not_all_set_aside
from xlafit.config import Config, LoraConfig, check_device_split, resolve_batch
from xlafit.data.dataset import as_dataset
from xlafit.errors import ConfigError, going_on_with
from xlafit.io.paths import (
    as_path,
    is_url,
    reach,
    reading,
)
from xlafit.kept_files import check_kept_files, save_kept_files
from xlafit.models.lora import ADAPTER, BASE, apply_lora
from xlafit.models.quantized import quantize_base
from xlafit.models.quantized_embed import quantize_embeddings
from xlafit.overrides import load_yaml, migrate
from xlafit.parallel.agree import from_process_0, same_settings, shared_directory
from xlafit.parallel.cluster import connect
from xlafit.parallel.mesh import Strategy
from xlafit.parallel.sharding import parse_rules
from xlafit.recipes import get_recipe
from xlafit.recipes.base import Recipe
from xlafit.recipes.registry import preset_path
from xlafit.rundir import (
    checkpoint_dir,
    log_to_file,
    make_run_dir,
    recorded,
    refuse_foreign_dir,
    start_run_dir,
)
from xlafit.runlock import hold_run_dir
from xlafit.train.loop import FitResult
from xlafit.train.optim import OptimizerPlan, make_optimizer, schedule_words, warmup_steps
from xlafit.train.report import EXPERT_TOKENS
from xlafit.train.signals import handle_signals
from xlafit.train.trainer import Trainer

log = logging.getLogger("xlafit")

# Config keys whose change makes a checkpoint's state or trajectory another run's, refused on
# resume: the model and its training, the batch and the data order, and the rows themselves
# (data.seq_len cuts the text into other rows, data.demo is another dataset; the held-out share
# moves records between training and evaluation, so that a new held-out set holds trained ones;
# the template, format, text column and loss mask make other rows or another loss; the tokenizer
# is compared by its contents, check_kept_files),
# where a step would mean other examples. Everything else (logging, evaluation's own settings,
# checkpoint policy, devices with the same global batch, epochs with the same schedule, where
# the data lies) may change between segments of one run.
BREAKING = (
    "recipe",
    "model",
    "lora",
    "optimizer",
    "data.global_batch",
    "data.seed",
    "data.seq_len",
    "data.demo",
    "data.eval_fraction",
    "data.chat_template",
    "data.format",
    "data.text_column",
    "data.loss_on",
    "trainer.invariant_chunks",
)
# Keys under BREAKING that a run may change on resume: what its rewards say (a hackathon's
# reward shaping between sessions), not its checkpoints, data order or programs' parameters.
CONTINUABLE = ("model.grpo.rewards", "model.grpo.reward_weights")


def train_and_evaluate(cfg: Config) -> FitResult:
    """Runs one recipe end to end: devices, data, model, optimizer, fit, final evaluation.

    SIGTERM/SIGINT at any point stop it cleanly: during training after a checkpoint
    (:class:`~xlafit.train.signals.Preempted`, which the ``xlafit`` command turns into exit
    status 75), during start-up before anything is trained. ``run.resume=false`` is the
    command's ``--restart``. While it runs, the run directory is held
    (:func:`~xlafit.runlock.hold_run_dir`): another run there is refused.
    """
    with handle_signals(), contextlib.ExitStack() as held:
        recipe = get_recipe(cfg.recipe)
        strategy = connect(
            cfg.run.simulate_devices,
            cpu=cfg.cpu,
            mesh=cfg.mesh.sizes,
            rules=parse_rules(cfg.mesh.rules),
        )
        same_settings(_flatten(cfg.to_dict()))  # each process of a job read its own command line
        recipe.validate(cfg)
        named_dir = bool(cfg.run.run_dir)  # else a new directory, made for this run (resolve)
        refuse_foreign_dir(cfg)
        train_data, eval_data = recipe.load_data(cfg)
        train_data = as_dataset(train_data)
        evaluates = eval_data is not None and len(as_dataset(eval_data)) > 0
        cfg, run = resolve(recipe.from_data(cfg, train_data), strategy, len(train_data), evaluates)
        plan = make_optimizer(cfg.optimizer, run.global_batch)
        run_dir, run_steps = run.run_dir, cfg.trainer.epochs * (len(train_data) // run.global_batch)
        if cfg.run.checkpoint_dir:  # before the resume check or --restart lists it
            check_directory(cfg.run.checkpoint_dir)
        if strategy.process_index == 0:  # one training per run directory: the job's process 0 holds it
            make_run_dir(run_dir, cfg)
            for line in held.enter_context(hold_run_dir(run_dir)):
                print(line, flush=True)
        shared_directory(run_dir)  # a job's checkpoints need every process to write into one directory
        if cfg.run.resume:
            check_continuation(
                run_dir,
                cfg,
                announce=strategy.process_index == 0,
                kept=lambda: check_kept_files(recipe, cfg, run_dir, train_data),
            )
        if strategy.process_index == 0:  # said once the run is sure to start (not before a refusal)
            warn_where_chunks_are_not_bit_identical(recipe, cfg)
            start_run_dir(run_dir, cfg)
            save_kept_files(recipe, cfg, run_dir, train_data)
            print(f"run directory: {run_dir}", flush=True)
            if not (cfg.run.resume and _saved_step(cfg) >= run_steps):  # a finished run trains nothing
                print(describe_schedule(cfg, plan, run_steps), flush=True)
        else:
            log_to_file(run_dir / f"process-{strategy.process_index}.log")
        trainer = recipe_trainer(recipe, cfg, run, strategy, train_data, plan, keep=True)
        # A stop says how to go on; the same command would start over in another new directory
        with going_on_with(None if named_dir else how_to_go_on(run_dir, "run.run_dir")):
            try:
                result = trainer.fit(train_data, eval=eval_data)
            finally:
                trainer.close()
    if strategy.process_index == 0 and result.eval is not None:
        print(final_report(result.eval, result.eval_step, int(result.state.step), recipe.eval_unit(cfg)), flush=True)
    stopped = int(result.state.step) == cfg.trainer.stop_at_step and int(result.state.step) < run_steps
    if strategy.process_index == 0 and not named_dir and stopped:
        print(how_to_go_on(run_dir, "run.run_dir"), flush=True)
    return result


def how_to_go_on(run_dir: epath.Path | str, key: str | None = None) -> str:
    """How to go on with a run whose directory was made for it: with that directory named
    (``--run-dir``, and the setting ``key`` from Python), as the same command without it starts
    over in another new one.

    Example:
        >>> how_to_go_on("runs/mnist-1")
        'Run again with --run-dir runs/mnist-1 to go on: the same command would start a new run.'
    """
    where = str(run_dir) if is_url(run_dir) else str(Path(run_dir))
    also = f" ({key}={where})" if key else ""
    return f"Run again with --run-dir {where}{also} to go on: the same command would start a new run."


# The first JAX whose XLA:CPU rounds the MNIST CNN's per-chunk gradient differently in the
# programs of different layouts (1 and 8 devices, 1 process and 2), measured; the suite's pin
# (0.10) holds them bit for bit; 0.11 was not measured.
CPU_ROUNDS_PER_LAYOUT = (0, 12)


def _jax_release() -> tuple[int, ...]:
    """The installed JAX's release, e.g. ``(0, 12)``."""
    return tuple(int(p) for p in jax.__version__.split(".")[:2] if p.isdigit())


def warn_where_chunks_are_not_bit_identical(recipe: Recipe, cfg: Config) -> None:
    """Says so when ``trainer.invariant_chunks`` cannot keep its promise, bit-identical runs
    on any device count: on the CPU with YNNPACK's kernels (``cpu.fast_paths``), which round
    differently per device layout, on the CPU with a JAX whose XLA:CPU rounds per layout
    (:data:`CPU_ROUNDS_PER_LAYOUT`), and with a recipe whose bit-identity the suite does not
    check (the llm recipe's is measured not to hold: see docs/explanations/determinism.md)."""
    chunks = cfg.trainer.invariant_chunks
    if not chunks:
        return
    if jax.default_backend() == "cpu" and cfg.cpu.fast_paths:
        log.warning(
            "warning: trainer.invariant_chunks=%s with cpu.fast_paths=true: YNNPACK's CPU kernels round differently "
            "per device layout, so runs on different device counts agree to float rounding, not bit for bit; set "
            "cpu.fast_paths=false for bit-identical runs.",
            chunks,
        )
    if jax.default_backend() == "cpu" and recipe.bit_identical_chunks and _jax_release() >= CPU_ROUNDS_PER_LAYOUT:
        log.warning(
            "warning: trainer.invariant_chunks=%s: JAX %s's XLA:CPU rounds a per-chunk gradient differently in the "
            "programs of different device layouts, so runs on other device or process counts agree to float "
            "rounding, not bit for bit (they do on the JAX the suite pins, 0.10; docs/explanations/determinism.md).",
            chunks,
            jax.__version__,
        )
    if not recipe.bit_identical_chunks:
        log.warning(
            "warning: trainer.invariant_chunks=%s sums the gradients in one fixed order, but the %s recipe's runs "
            "on different device counts are not held bit-identical: XLA can round a per-chunk gradient differently "
            "in the programs for different device counts (measured for the llm recipe, full fine-tuning and "
            "LoRA), so they agree to float rounding. The suite checks bit-identity for the mnist recipe only "
            "(docs/explanations/determinism.md).",
            chunks,
            cfg.recipe,
        )


def recipe_trainer(
    recipe: Recipe, cfg: Config, run: Resolved, strategy: Strategy, train: Any, plan: OptimizerPlan, keep: bool
) -> Trainer:
    """The trainer of a resolved recipe run, as ``xlafit train`` builds it. ``keep``: with the
    run directory (metrics, checkpoints, resume); without it, nothing is written (a benchmark)."""
    return Trainer(
        model_builder(recipe, cfg, train),
        recipe.loss(cfg),
        plan.tx,
        strategy=strategy,
        global_batch=run.global_batch,
        config=cfg.trainer,
        learning_rate=plan.schedule,
        run_dir=run.run_dir if keep else None,
        checkpoint_dir=cfg.run.checkpoint_dir if keep else None,
        eval_global_batch=run.eval_batch,
        data_seed=cfg.data.seed,
        prefetch=cfg.data.prefetch,
        resume=cfg.run.resume and keep,
        trainable=ADAPTER if cfg.lora.rank else nnx.Param,
        rollout=recipe.rollout(cfg, train),
        **recipe.throughput(cfg, train),
    )


def model_builder(recipe: Recipe, cfg: Config, train: Any) -> Callable[[], nnx.Module] | nnx.Module:
    """What the trainer builds the model from: the recipe's ``build_model`` as a function,
    run inside ``jax.jit`` so that each device creates only its own slices (the same values
    as built eagerly: tested); a model imported from Hugging Face files is read on the host
    instead (its weights are data, not a computation) and then placed slice by slice.
    With ``lora.rank`` set, the model gets its adapters (:func:`with_lora`)."""
    if getattr(cfg.model, "init_from_hf", None):
        return with_lora(recipe.build_model(cfg, train), cfg.lora, cfg.trainer.seed)
    return lambda: with_lora(recipe.build_model(cfg, train), cfg.lora, cfg.trainer.seed)


def with_lora(model: nnx.Module, lora: LoraConfig, seed: int) -> nnx.Module:
    """``model`` with the adapters ``lora`` asks for (none at rank 0), its base weights cast
    to ``lora.base_dtype`` (``nf4``, ``int4``, ``int8``: its dense layers and experts quantized, where a
    reader of Hugging Face files has not done it already, its embedding tables too with
    ``lora.quantize_embeddings``, the rest in bfloat16); the
    adapters' ``A`` drawn from ``seed``."""
    if not lora.rank:
        return model
    model = apply_lora(model, lora.target_names, rank=lora.rank, alpha=lora.alpha, rngs=nnx.Rngs(seed + 2))
    if lora.quantized:
        if lora.quantize_embeddings:  # before quantize_base casts the tables to bfloat16
            model = quantize_embeddings(model, lora.base_dtype, lora.base_block)
        return quantize_base(model, lora.base_dtype, lora.base_block)
    if lora.base_dtype != "float32":
        dtype = jnp.dtype(lora.base_dtype)
        nnx.update(model, jax.tree.map(lambda x: x.astype(dtype), nnx.state(model, BASE)))
    return model


class Resolved(NamedTuple):
    """What :func:`resolve` decided, typed: the config records the same values."""

    run_dir: epath.Path  # a local path or a URL
    global_batch: int
    eval_batch: int


def resolve(cfg: Config, strategy: Strategy, num_examples: int, evaluates: bool = True) -> tuple[Config, Resolved]:
    """``cfg`` with what this run decides filled in: batch sizes for these devices, the
    schedule's length and the run directory, so that ``config.yaml`` records what was used
    and a resume on another device count keeps the global batch. ``evaluates``: the run has
    evaluation data (without it, the eval batch need not split over the devices)."""
    check_device_split(cfg, strategy.num_replicas, strategy.data_parallel_only, evaluates)
    per_device, global_batch = resolve_batch(cfg.data, strategy.num_replicas)
    eval_batch = (cfg.data.eval_global_batch or global_batch) if evaluates else global_batch  # unused without
    steps_per_epoch = num_examples // global_batch
    if steps_per_epoch == 0:
        raise ConfigError(
            f"the training set ({num_examples} examples) is smaller than one global batch ({global_batch}); "
            "lower data.global_batch."
        )
    if cfg.run.run_dir:
        run_dir = cfg.run.run_dir
    else:
        now = datetime.datetime.now(datetime.UTC)
        # the time process 0 names: each process of a job starts at its own moment
        run_dir = from_process_0(str(Path("runs") / f"{cfg.recipe}-{now:%Y%m%d-%H%M%S}"))
    resolved = dataclasses.replace(
        cfg,
        data=dataclasses.replace(
            cfg.data, per_device_batch=per_device, global_batch=global_batch, eval_global_batch=eval_batch
        ),
        optimizer=dataclasses.replace(
            cfg.optimizer,
            decay_steps=cfg.optimizer.decay_steps or cfg.trainer.epochs * steps_per_epoch,
            warmup_steps=warmup_steps(cfg.optimizer, steps_per_epoch),
        ),
        run=dataclasses.replace(cfg.run, run_dir=run_dir),
    )
    return resolved, Resolved(as_path(run_dir), global_batch, eval_batch)


def _saved_step(cfg: Config) -> int:
    """The newest step the run's checkpoint directory holds (0 where it holds none)."""
    checkpoints = checkpoint_dir(cfg)
    with reading(checkpoints):
        return max(_saved_steps(checkpoints), default=0)


def _saved_steps(checkpoints: epath.Path) -> list[int]:
    """The steps of the checkpoints in ``checkpoints`` (none where it does not exist)."""
    return [int(p.name) for p in checkpoints.iterdir() if p.name.isdigit()] if checkpoints.exists() else []


def describe_schedule(cfg: Config, plan: OptimizerPlan, run_steps: int | None = None) -> str:
    """The learning-rate line of the start-up: scaled peak, warmup and decay, as the run of
    ``run_steps`` steps (default: the schedule's) will do them (:func:`schedule_words`), with
    a warning where the preset's warmup takes most of a short run."""
    run_steps = run_steps or plan.decay_steps
    line = schedule_words(cfg.optimizer, cfg.data.global_batch, plan, run_steps)
    return line + (_long_warmup(cfg, run_steps) if cfg.optimizer.warmup_steps < plan.decay_steps else "")


def _long_warmup(cfg: Config, run_steps: int) -> str:
    """A warning where the preset's warmup, which the user did not set, takes more than half
    of a short run's steps: it trains mostly below its peak rate."""
    o = cfg.optimizer
    preset = load_yaml(preset_path(cfg.recipe)).get("optimizer") or {}
    if o.warmup_epochs is not None or o.warmup_steps != preset.get("warmup_steps") or 2 * o.warmup_steps <= run_steps:
        return ""
    return (
        f" (warning: the preset's {o.warmup_steps} warmup steps are {o.warmup_steps / run_steps:.0%} of this run's "
        f"{run_steps}, which trains mostly below its peak rate; set optimizer.warmup_steps, e.g. "
        f"optimizer.warmup_steps={max(1, run_steps // 10)})"
    )


def final_report(
    metrics: dict[str, float], at: int | None = None, last: int | None = None, unit: str = "examples"
) -> str:
    """The last lines of a run: the final evaluation, and its headline metric alone; ``at``,
    the step it evaluated, named where it is not the run's ``last`` (a run stopped by
    ``trainer.stop_at_step`` between evaluations reports the model of an earlier step);
    ``unit``, what its count counts (the recipe's :attr:`~xlafit.recipes.base.Recipe.eval_unit`).

    Example:
        >>> print(final_report({"loss": 4.5, "count": 8}, at=16, last=20))
        test (the last evaluation, at step 16; the run stopped at step 20): loss=4.5000  (8 examples)
    """
    when = "" if at is None or at == last else f" (the last evaluation, at step {at}; the run stopped at step {last})"
    lines = [f"test{when}: {metrics_in_words(metrics, unit)}"]
    if "accuracy" in metrics:
        lines.append(f"test accuracy: {metrics['accuracy']:.4f}")
    if "masked_accuracy" in metrics:
        lines.append(f"masked-token accuracy: {metrics['masked_accuracy']:.4f}")
    if (ppl := perplexity(metrics)) is not None:
        of = "" if not when else f" (of the model at step {at})"
        lines.append(f"perplexity{of}: {ppl:.2f}")
    return "\n".join(lines)


def metrics_in_words(metrics: dict[str, float], unit: str = "examples") -> str:
    """An evaluation's metrics (a MoE's expert counts left out) and their count in ``unit``.

    Example:
        >>> metrics_in_words({"loss": 4.5, "count": 1}, "rows")
        'loss=4.5000  (1 row)'
    """
    shown = "  ".join(f"{k}={v:.4f}" for k, v in metrics.items() if k != "count" and not k.startswith(EXPERT_TOKENS))
    count = metrics["count"]
    return f"{shown}  ({count} {unit if count != 1 else unit.removesuffix('s')})"


def perplexity(metrics: dict[str, float]) -> float | None:
    """A language model's perplexity: exp of its mean next-token loss (a MoE's without its
    router's); None for another model's metrics."""
    if "token_accuracy" not in metrics:
        return None
    return math.exp(metrics.get("nll_loss", metrics["loss"]))


# --------------------------------------------------------------------------- the resume check


def _flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, object]:
    flat: dict[str, object] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def _shown(flat: dict[str, object], key: str) -> str:
    """A setting's value as the config writes it (``null``, ``true``; a text quoted)."""
    if key not in flat:
        return "(not set)"
    value = flat[key]
    return (
        repr(value)
        if isinstance(value, str)
        else yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("...").strip()
    )


def _saved_config(run_dir: epath.Path) -> dict[str, Any]:
    """The run's ``config.yaml``; refuses to go on without it (it is what the resume checks)."""
    path = run_dir / "config.yaml"
    fix = (
        "Without it xlafit cannot check that this command continues the same run. Put the run's config.yaml "
        "back, or start over with --restart (run.resume=false) or another --run-dir."
    )
    if not path.exists():
        raise ConfigError(f"cannot resume {run_dir}: it has checkpoints but no config.yaml. {fix}")
    try:
        saved = yaml.safe_load(path.read_text())
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        mark = getattr(e, "problem_mark", None)
        where = f"line {mark.line + 1}: " if mark is not None else ""
        problem = getattr(e, "problem", None) or type(e).__name__
        raise ConfigError(
            f"cannot resume {run_dir}: its config.yaml is not valid YAML ({where}{problem}). {fix}"
        ) from None
    if not isinstance(saved, dict) or "recipe" not in saved:
        raise ConfigError(f"cannot resume {run_dir}: its config.yaml is not an xlafit run config. {fix}")
    return saved


def _a(recipe: str) -> str:
    """A recipe's name after its article, as it is said: "an llm", "an mnist", "a bert"."""
    return f"{'an' if recipe in ('llm', 'mnist') or recipe[:1] in 'aeiou' else 'a'} {recipe}"


def check_continuation(
    run_dir: epath.Path | Path, cfg: Config, announce: bool = True, kept: Callable[[], None] | None = None
) -> None:
    """Refuses to resume a run whose checkpoints were made under an incompatible config.

    ``cfg`` is the resolved config (:func:`resolve`). Nothing happens when the run has no
    checkpoints yet. ``kept``: called before the config's checks (data prepared again changes
    the schedule's length too, which is then not what to name), and before the changed
    settings are announced (:func:`check_kept_files`).

    Raises:
        ConfigError: the run's ``config.yaml`` is missing or unreadable, or a
            :data:`BREAKING` key differs from it; the message names each difference and
            the fix.
        CheckpointError: every checkpoint of the run was set aside as corrupt
            (:func:`~xlafit.checkpoint.check_not_all_set_aside`).
    """
    checkpoints = checkpoint_dir(cfg)
    reach(checkpoints)
    with reading(checkpoints):
        check_not_all_set_aside(checkpoints)
        if not _saved_steps(checkpoints):
            return
    # Local paths compared absolute: as config.yaml records them, as typed, or as an older run holds them.
    saved = _flatten(recorded(migrate(_saved_config(as_path(run_dir)), f"{run_dir}/config.yaml")))
    now = _flatten(recorded(cfg.to_dict()))
    restart = "or start over with --restart (run.resume=false) or another --run-dir"
    if saved["recipe"] != now["recipe"]:
        raise ConfigError(
            f"cannot resume {run_dir}: it holds {_a(str(saved['recipe']))} run, and this is {now['recipe']}. "
            "Choose another --run-dir, or start over there with --restart (run.resume=false)."
        )
    changed = [k for k in sorted(set(saved) | set(now)) if saved.get(k) != now.get(k)]
    # A key that only one side has comes from another xlafit version (a setting added or
    # removed since the run began): announced below, never a reason to refuse.
    breaking = [
        k
        for k in changed
        if k in saved and k in now and any(k == b or k.startswith(b + ".") for b in BREAKING) and k not in CONTINUABLE
    ]
    if kept is not None:  # first: data or files not the run's say so, whatever settings they change
        kept()
    if breaking:
        diffs = "; ".join(f"{k}: {_shown(saved, k)} in the run, {_shown(now, k)} now" for k in breaking)
        hint = ""
        if "optimizer.decay_steps" in breaking and "trainer.epochs" in changed:
            hint = (
                f" trainer.epochs {saved.get('trainer.epochs')} -> {now.get('trainer.epochs')} would stretch the "
                "learning-rate schedule over the new length, so the rate would jump back up at the next step. "
            )
            if saved.get("optimizer.final_lr_fraction"):
                length = saved["optimizer.decay_steps"]
                hint += (
                    f"To train longer on the run's schedule, add optimizer.decay_steps={length} (the added steps then "
                    "train at its final rate)."
                )
            else:  # the schedule ends at 0: steps past it would run and save without changing a weight
                hint += (
                    "The run's schedule ends at a learning rate of 0 (optimizer.final_lr_fraction=0), so steps past "
                    "its end would not train: to train longer, start over with the new trainer.epochs."
                )
        elif breaking == ["optimizer.decay_steps"]:
            data = [k for k in changed if k.startswith("data.")]
            because = f"this data ({', '.join(data)} changed)" if data else "this data"
            hint = (
                " optimizer.decay_steps was not given: it is the run's length, trainer.epochs x the steps of an epoch "
                f"of {because}. To go on with the run's schedule, add "
                f"optimizer.decay_steps={saved['optimizer.decay_steps']}"
            )
            length, run_length, epochs = (
                cast(int, v)
                for v in (now["optimizer.decay_steps"], saved["optimizer.decay_steps"], now["trainer.epochs"])
            )
            if length < run_length:
                enough = math.ceil(run_length * epochs / length)
                hint += (
                    f" and trainer.epochs={enough} (with this data, {epochs} epochs are {length} steps: the run would "
                    "stop before its schedule ends)"
                )
            hint += "."
        raise ConfigError(
            f"cannot resume {run_dir}: {diffs}. This change breaks continuation from its checkpoints.{hint} "
            f"Use the run's values (see its config.yaml), {restart}."
        )
    safe = [k for k in changed if k != "run.resume"]
    if safe and announce:
        print(
            "resuming with changed settings: " + "; ".join(f"{k} {_shown(saved, k)} -> {_shown(now, k)}" for k in safe),
            flush=True,
        )
