"""What a trainer's checkpoint holds beside the state: frozen parameters' fingerprint, run settings.

Parameters the trainable filter leaves out are not trained, so a checkpoint leaves them out
too (a LoRA checkpoint is the adapters' megabytes, not the base model's gigabytes). It keeps
their fingerprint instead (:func:`xlafit.models.lora.state_fingerprint`), and a resume puts
the run's own frozen parameters back beside the restored ones, refusing a checkpoint trained
on another base model.

A checkpoint also records the settings that give its step a meaning (:data:`RUN_SETTINGS`):
the data order is a function of the seed, the global batch and the step, so a resume with
another global batch or data seed would train other examples than the run's next ones. Such a
resume is refused; a checkpoint written without them (an older run) restores unchecked.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import jax
from flax import nnx

from xlafit.checkpoint import Checkpointer
from xlafit.errors import CheckpointError, ConfigError
from xlafit.models.lora import state_fingerprint
from xlafit.models.quantized import QuantizedParam
from xlafit.train.state import TrainState

# The checkpoint metadata key of the frozen parameters' fingerprint.
BASE_FINGERPRINT = "base_fingerprint"
# The checkpoint metadata keys of the settings a resume must keep: Trainer argument -> config key.
RUN_SETTINGS = {"global_batch": "data.global_batch", "data_seed": "data.seed"}
# The steps of the learning-rate schedule an OptimizerConfig made for the run (its warmup and
# decay): a resume with more epochs would make another, its rate jumping back up mid-run.
SCHEDULE_STEPS = "schedule_steps"


def run_settings(global_batch: int, data_seed: int, schedule_steps: int | None = None) -> dict[str, str]:
    """The :data:`RUN_SETTINGS` of a run, as checkpoint metadata (strings), and with
    ``schedule_steps`` the length of the learning-rate schedule an OptimizerConfig made
    (:data:`SCHEDULE_STEPS`)."""
    settings = {"global_batch": str(global_batch), "data_seed": str(data_seed)}
    return settings if schedule_steps is None else {**settings, SCHEDULE_STEPS: str(schedule_steps)}


def frozen_filter(trainable: nnx.filterlib.Filter, model_state: nnx.State) -> nnx.filterlib.Filter | None:
    """The parameters ``trainable`` leaves out (frozen: out of checkpoints), or None when none is."""
    frozen = nnx.All(nnx.Param, nnx.Not(trainable))
    return frozen if jax.tree.leaves(model_state.filter(frozen)) else None


def check_trainable(params: nnx.State) -> None:
    """Refuses a trainable filter that selects a quantized base's weights (full fine-tuning of
    a quantized model): their 4- or 8-bit codes have no gradient.

    Raises:
        ConfigError: naming the fix (adapters, or an unquantized base).
    """
    if jax.tree.leaves(params.filter(QuantizedParam)):
        raise ConfigError(
            "the model's base is quantized (lora.base_dtype=nf4, int4 or int8) and the trainer was asked to train "
            "every parameter: quantized weights cannot be trained. Train LoRA adapters on it (lora.rank=16; "
            "Trainer(..., trainable=xlafit.models.lora.ADAPTER)), or fine-tune an unquantized base "
            "(lora.base_dtype=bfloat16 or float32)."
        )


def frozen_part(state: TrainState, frozen: nnx.filterlib.Filter) -> nnx.State:
    """The frozen parameters of ``state``."""
    part, _ = state.model_state.split(frozen, ...)
    return part


def frozen_fingerprint(state: TrainState, frozen: nnx.filterlib.Filter | None) -> str | None:
    """The fingerprint of ``state``'s frozen parameters, or None when none is frozen."""
    # note: gathers a few values of every frozen array to the host
    return None if frozen is None else state_fingerprint(frozen_part(state, frozen))


def checkpointed(
    state: TrainState, frozen: nnx.filterlib.Filter | None, fingerprint: str | None, settings: Mapping[str, str]
) -> tuple[TrainState, dict[str, str]]:
    """What a checkpoint holds: ``state`` without its frozen parameters, and as metadata
    their fingerprint and the run's ``settings`` (:func:`run_settings`)."""
    if frozen is None:
        return state, dict(settings)
    _, rest = state.model_state.split(frozen, ...)
    assert fingerprint is not None  # computed with the frozen filter
    return dataclasses.replace(state, model_state=rest), {**settings, BASE_FINGERPRINT: fingerprint}


def check_settings(ckpt: Checkpointer, step: int, settings: Mapping[str, str]) -> None:
    """Refuses checkpoint ``step`` when it records another value of one of ``settings``.

    Raises:
        CheckpointError: the message names the setting, the run's value and this one's.
    """
    saved = ckpt.saved_metadata(step)
    for name, value in settings.items():
        if name == SCHEDULE_STEPS and name in saved and saved[name] != value:
            raise CheckpointError(
                f"checkpoint {step} in {ckpt.directory} was trained on a learning-rate schedule of {saved[name]} steps "
                f"(the OptimizerConfig's warmup and decay over the run) and this run's spans {value}: resuming would "
                f"move the rate to another schedule mid-run. To train on with the schedule it had, give "
                f"OptimizerConfig(..., decay_steps={saved[name]}) (the steps past it keep its last rate); or start "
                "over with another run_dir (the command: another --run-dir or --restart)."
            )
        if name in saved and saved[name] != value:  # absent: written before xlafit recorded it
            raise CheckpointError(
                f"checkpoint {step} in {ckpt.directory} was trained with {name}={saved[name]} and this run has "
                f"{name}={value}: its steps would mean other examples (another data order, another epoch length). "
                f"Resume with {name}={saved[name]} ({RUN_SETTINGS.get(name, name)} in a config), or start over with "
                "another run_dir (the command: another --run-dir or --restart)."
            )


def restore(
    ckpt: Checkpointer,
    state: TrainState,
    frozen: nnx.filterlib.Filter | None,
    fingerprint: str | None,
    settings: Mapping[str, str],
    step: int | None = None,
) -> tuple[TrainState, int]:
    """Checkpoint ``step`` (default: the newest intact one) in the shape of ``state``, its
    frozen parameters put back beside it.

    Raises:
        CheckpointError: it was trained with other ``settings`` (:func:`check_settings`), or
            its frozen parameters were others than this run's (another base model): the
            message names both values.
    """
    if frozen is None:
        restored, step = ckpt.restore(state, step)
        check_settings(ckpt, step, settings)
        return restored, step
    restored, step = ckpt.restore(checkpointed(state, frozen, fingerprint, settings)[0], step)
    check_settings(ckpt, step, settings)
    saved = ckpt.saved_metadata(step).get(BASE_FINGERPRINT)
    if saved != fingerprint:
        raise CheckpointError(
            f"checkpoint {step} in {ckpt.directory} was trained on another frozen base model "
            f"(fingerprint {saved or 'none'}, this run's base {fingerprint}); resume with the "
            "base model it was trained on, or start over with --restart or another --run-dir."
        )
    model_state = nnx.merge_state(frozen_part(state, frozen), restored.model_state)
    return dataclasses.replace(restored, model_state=model_state), step
