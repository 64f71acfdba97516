"""Frozen parameters (a LoRA run's base model) and checkpoints.

Parameters the trainable filter leaves out are not trained, so a checkpoint leaves them out
too (a LoRA checkpoint is the adapters' megabytes, not the base model's gigabytes). It keeps
their fingerprint instead (:func:`xlafit.models.lora.state_fingerprint`), and a resume puts
the run's own frozen parameters back beside the restored ones, refusing a checkpoint trained
on another base model.
"""

from __future__ import annotations

import dataclasses

import jax
from flax import nnx

from xlafit.checkpoint import Checkpointer
from xlafit.errors import CheckpointError
from xlafit.train.step import TrainState

# The checkpoint metadata key of the frozen parameters' fingerprint.
BASE_FINGERPRINT = "base_fingerprint"


def frozen_filter(trainable: nnx.filterlib.Filter, model_state: nnx.State) -> nnx.filterlib.Filter | None:
    """The parameters ``trainable`` leaves out (frozen: out of checkpoints), or None when none is."""
    frozen = nnx.All(nnx.Param, nnx.Not(trainable))
    return frozen if jax.tree.leaves(model_state.filter(frozen)) else None


def frozen_part(state: TrainState, frozen: nnx.filterlib.Filter) -> nnx.State:
    """The frozen parameters of ``state``."""
    part, _ = state.model_state.split(frozen, ...)
    return part


def checkpointed(
    state: TrainState, frozen: nnx.filterlib.Filter | None, fingerprint: str | None
) -> tuple[TrainState, dict[str, str]]:
    """What a checkpoint holds: ``state`` without its frozen parameters, and their fingerprint."""
    if frozen is None:
        return state, {}
    _, rest = state.model_state.split(frozen, ...)
    assert fingerprint is not None  # computed with the frozen filter
    return dataclasses.replace(state, model_state=rest), {BASE_FINGERPRINT: fingerprint}


def restore(
    ckpt: Checkpointer, state: TrainState, frozen: nnx.filterlib.Filter | None, fingerprint: str | None
) -> tuple[TrainState, int]:
    """The newest intact checkpoint in the shape of ``state``, its frozen parameters put back beside it.

    Raises:
        CheckpointError: its frozen parameters were others than this run's (another base
            model): the message names both fingerprints.
    """
    if frozen is None:
        return ckpt.restore(state)
    restored, step = ckpt.restore(checkpointed(state, frozen, fingerprint)[0])
    saved = ckpt.saved_metadata(step).get(BASE_FINGERPRINT)
    if saved != fingerprint:
        raise CheckpointError(
            f"checkpoint {step} in {ckpt.directory} was trained on another frozen base model "
            f"(fingerprint {saved or 'none'}, this run's base {fingerprint}); resume with the "
            "base model it was trained on, or start over with --restart or another --run-dir."
        )
    model_state = nnx.merge_state(frozen_part(state, frozen), restored.model_state)
    return dataclasses.replace(restored, model_state=model_state), step
