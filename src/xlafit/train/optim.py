"""Learning-rate scaling with the batch size, schedules, and the optimizer from config.

The rule of thumb: the learning rate must grow with the global batch, and warmup
plus decay keep large batches stable (Goyal et al. 2017, "Accurate, Large Minibatch SGD";
He et al. 2018, "Bag of Tricks"). The rate in the config is the one tuned at
``reference_batch``; :func:`scaled_lr` moves it to the batch actually used.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from xlafit.config import OptimizerConfig


@dataclasses.dataclass(frozen=True)
class OptimizerPlan:
    """What :func:`make_optimizer` built, for printing at start and logging each step."""

    tx: optax.GradientTransformation
    schedule: optax.Schedule
    peak_lr: float
    decay_steps: int  # the steps the schedule spans, warmup included


def scaled_lr(base_lr: float, global_batch: int, reference_batch: int, rule: str) -> float:
    """Scales ``base_lr`` (tuned at ``reference_batch``) to ``global_batch``.

    Example:
        >>> scaled_lr(0.1, 1024, 256, "linear"), scaled_lr(0.1, 1024, 256, "sqrt")
        (0.4, 0.2)
    """
    ratio = global_batch / reference_batch
    if rule == "linear":
        return base_lr * ratio
    if rule == "sqrt":
        return base_lr * math.sqrt(ratio)
    if rule == "none":
        return base_lr
    raise ValueError(f"unknown learning-rate scaling rule {rule!r}; use none, linear or sqrt.")


def make_schedule(cfg: OptimizerConfig, peak_lr: float, total_steps: int) -> optax.Schedule:
    """Linear warmup from 0 to ``peak_lr``, then cosine, linear, polynomial or no decay."""
    warmup = min(cfg.warmup_steps, total_steps)
    decay_steps = max(total_steps - warmup, 1)
    end = peak_lr * cfg.final_lr_fraction
    if cfg.decay == "cosine":
        decay = optax.cosine_decay_schedule(peak_lr, decay_steps, alpha=cfg.final_lr_fraction)
    elif cfg.decay == "linear":
        decay = optax.linear_schedule(peak_lr, end, decay_steps)
    elif cfg.decay == "polynomial":  # BERT's: (peak - end) * (1 - t / T) ** power + end
        decay = optax.polynomial_schedule(peak_lr, end, cfg.decay_power, decay_steps)
    else:
        decay = optax.constant_schedule(peak_lr)
    if warmup == 0:
        return decay
    return optax.join_schedules([optax.linear_schedule(0.0, peak_lr, warmup), decay], [warmup])


@functools.lru_cache(maxsize=16)
def _compiled(schedule: optax.Schedule) -> Callable[[Any], jax.Array]:
    return jax.jit(schedule)


def schedule_at(schedule: optax.Schedule, steps: int | np.ndarray) -> jax.Array:
    """``schedule(steps)`` as one compiled program (optax schedules are traceable: the
    optimizer calls them inside the train step). Called op by op, a schedule's dozen or so
    ``jnp`` operations compile one by one for each new shape of ``steps``: about two
    CPU-seconds of a training command's start-up and first log line."""
    try:
        compiled = _compiled(schedule)
    except TypeError:  # an unhashable callable: op by op
        return jnp.asarray(schedule(steps))
    return compiled(steps)


def highest_rate(schedule: optax.Schedule, steps: int) -> float:
    """The highest learning rate ``schedule`` gives in its first ``steps`` steps: the peak,
    or less when the run ends during the warmup."""
    return float(np.asarray(schedule_at(schedule, np.arange(max(steps, 1), dtype=np.int32))).max())


def warmup_steps(cfg: OptimizerConfig, steps_per_epoch: int) -> int:
    """``cfg.warmup_epochs`` in steps of this run's batch when set, else ``cfg.warmup_steps``.

    Example:
        >>> warmup_steps(OptimizerConfig(warmup_epochs=5), steps_per_epoch=1251)
        6255
    """
    if cfg.warmup_epochs is None:
        return cfg.warmup_steps
    return round(cfg.warmup_epochs * steps_per_epoch)


def matrices(params):
    """Mask of arrays of rank 2 or more (kernels, embeddings): what weight decay and LARS's
    trust ratio apply to under ``"matrices"``; biases and normalisation scales/offsets
    (rank 1) are left out (Goyal et al. 2017, MLPerf's LARS)."""
    return jax.tree.map(lambda p: p.ndim >= 2, params)


def make_optimizer(
    cfg: OptimizerConfig, global_batch: int, total_steps: int | None = None, steps_per_epoch: int | None = None
) -> OptimizerPlan:
    """Builds the optax chain: optional clipping, then the named optimizer on the schedule.

    The schedule spans ``cfg.decay_steps``, or ``total_steps`` (the run's length) when that
    is null; ``steps_per_epoch`` turns ``cfg.warmup_epochs`` into steps. LAMB (You et al.
    2020) is Adam with a per-layer trust ratio, BERT's large-batch optimizer; LARS (You et
    al. 2017) is momentum SGD with one, ResNet's beyond batches of ~8k (MLPerf: polynomial
    decay of power 2 after a warmup of a few epochs).

    Example:
        >>> from xlafit.config import OptimizerConfig
        >>> plan = make_optimizer(OptimizerConfig(learning_rate=1e-3, reference_batch=128), 256, total_steps=100)
        >>> round(plan.peak_lr, 6), plan.decay_steps
        (0.002, 100)
    """
    steps = cfg.decay_steps or total_steps
    if steps is None:
        raise ValueError("make_optimizer needs total_steps (the run's length) or cfg.decay_steps.")
    if steps_per_epoch is not None:
        cfg = dataclasses.replace(cfg, warmup_steps=warmup_steps(cfg, steps_per_epoch))
    elif cfg.warmup_epochs and not cfg.warmup_steps:  # a run's resolved config has both
        raise ValueError("optimizer.warmup_epochs needs steps_per_epoch to become steps; pass it to make_optimizer.")
    peak = scaled_lr(cfg.learning_rate, global_batch, cfg.reference_batch, cfg.scaling)
    schedule = make_schedule(cfg, peak, steps)
    mask = matrices if cfg.weight_decay_on == "matrices" else None
    mu_dtype = None if cfg.moment_dtype == "float32" else jnp.dtype(cfg.moment_dtype)
    if cfg.name == "adamw":
        opt = optax.adamw(
            schedule, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, mu_dtype=mu_dtype, weight_decay=cfg.weight_decay, mask=mask
        )
    elif cfg.name == "lamb":
        opt = optax.lamb(schedule, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay, mask=mask)
    elif cfg.name == "adam":
        opt = optax.adam(schedule, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, mu_dtype=mu_dtype)
    elif cfg.name == "sgd":
        # PyTorch's SGD: the decay joins the gradient before the momentum (Goyal et al. 2017).
        sgd = optax.sgd(schedule, momentum=cfg.momentum or None, nesterov=cfg.nesterov)
        opt = optax.chain(optax.add_decayed_weights(cfg.weight_decay, mask), sgd) if cfg.weight_decay else sgd
    elif cfg.name == "lars":
        # You et al. 2017, as MLPerf's ResNet: decay, the per-layer trust ratio, the rate, then momentum.
        opt = optax.lars(
            schedule,
            weight_decay=cfg.weight_decay,
            weight_decay_mask=mask if mask is not None else True,
            trust_coefficient=cfg.trust_coefficient,
            trust_ratio_mask=matrices if cfg.trust_ratio_on == "matrices" else True,
            momentum=cfg.momentum,
            nesterov=cfg.nesterov,
        )
    else:
        opt = optax.adadelta(schedule)
    parts = [optax.clip_by_global_norm(cfg.grad_clip_norm)] if cfg.grad_clip_norm else []
    return OptimizerPlan(optax.chain(*parts, opt), schedule, peak, steps)


# The schedule's length where it is not yet known (a Trainer given an OptimizerConfig, before
# fit sees the data): long enough that no warmup is refused; the chain's state is the same.
UNKNOWN_STEPS = 2**30


def chain_of(
    optimizer: optax.GradientTransformation | OptimizerConfig, global_batch: int
) -> optax.GradientTransformation:
    """``optimizer`` as it is, or an OptimizerConfig's chain before the run's length is known:
    its state's structure, for the train state and its shardings (``Trainer.fit`` builds the
    chain again over the run's steps)."""
    if isinstance(optimizer, OptimizerConfig):
        return make_optimizer(optimizer, global_batch, UNKNOWN_STEPS, steps_per_epoch=1).tx
    return optimizer


def scaling_words(cfg: OptimizerConfig, global_batch: int | None, peak_lr: float) -> str:
    """How the peak rate came from ``cfg``'s: ``learning rate: 0.001 at batch 128 -> peak 0.002
    at global batch 256 (linear scaling)``, or that it is not scaled.

    Example:
        >>> scaling_words(OptimizerConfig(learning_rate=1e-3, reference_batch=128), 256, 2e-3)
        'learning rate: 0.001 at batch 128 -> peak 0.002 at global batch 256 (linear scaling)'
    """
    if cfg.scaling == "none":  # the reference batch means nothing: the rate is the rate
        return f"learning rate: peak {peak_lr:.4g}, not scaled with the batch (optimizer.scaling=none)"
    return (
        f"learning rate: {cfg.learning_rate:g} at batch {cfg.reference_batch} -> peak {peak_lr:.4g} at global "
        f"batch {global_batch} ({cfg.scaling} scaling)"
    )


def schedule_words(
    o: OptimizerConfig, global_batch: int | None, plan: OptimizerPlan, run_steps: int | None = None
) -> str:
    """The learning-rate line of a run's start-up: the scaled peak (:func:`scaling_words`), the
    warmup and the decay, as the run of ``run_steps`` steps (default: the schedule's) will do
    them: a warmup longer than the schedule, steps beyond its end, a rate of 0 throughout.

    Example:
        >>> cfg = OptimizerConfig(learning_rate=1e-3, reference_batch=128, warmup_steps=10)
        >>> schedule_words(cfg, 256, make_optimizer(cfg, 256, total_steps=100)).split(", ")[1:]
        ['10 warmup steps', 'cosine decay over 90 steps (optimizer.decay_steps=100: warmup and decay)']
    """
    run_steps = run_steps or plan.decay_steps
    line = scaling_words(o, global_batch, plan.peak_lr) + ", "
    after = run_steps - plan.decay_steps
    last = float(schedule_at(plan.schedule, plan.decay_steps))
    beyond = f", then {last:.4g} for the run's last {after} steps" if after > 0 else ""
    if after > 0 and last == 0:
        beyond += " (warning: at a rate of 0 they do not change the model; optimizer.final_lr_fraction sets the end)"
    if o.warmup_steps >= plan.decay_steps:  # the warm-up is cut to the schedule's length
        if after > 0:
            return line + f"warmup over the schedule's {plan.decay_steps} steps (of {o.warmup_steps} asked){beyond}"
        reached = highest_rate(plan.schedule, plan.decay_steps)
        if reached == 0:  # a warmup's first step has rate 0 (transformers' too): nothing would change
            return line + (
                f"{o.warmup_steps} warmup steps, more than the schedule's {plan.decay_steps}: (warning: every step of "
                "this run has learning rate 0, the warmup's start, so it does not change the model; lower "
                "optimizer.warmup_steps, or train more steps)"
            )
        return line + (
            f"{o.warmup_steps} warmup steps, more than the schedule's {plan.decay_steps}: the rate rises to "
            f"{reached:.4g} and the run ends before the peak and before any decay"
        )
    decay = plan.decay_steps - o.warmup_steps
    return line + (
        f"{o.warmup_steps} warmup steps, {o.decay} decay over {decay} steps "
        f"(optimizer.decay_steps={plan.decay_steps}: warmup and decay){beyond}"
    )
