"""The pure train and eval steps, and :func:`make_steps`, which jits them for a run.

``train_step(state, batches) -> (state, metrics)`` is a pure function jitted with explicit
shardings and a donated state: parameters and optimizer state are replicated over the
``data`` axis, batches are split along it, and XLA inserts the gradient all-reduce (the
work of ``xm.optimizer_step`` in PyTorch/XLA). ``batches`` holds ``k`` stacked batches and
the step runs ``k`` optimizer updates in one call with ``lax.scan`` (Keras'
``steps_per_execution``), which removes per-step dispatch and host syncs.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable, Mapping
from typing import Any, Literal

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from xlafit.config import TrainerConfig
from xlafit.errors import ConfigError
from xlafit.parallel.mesh import Strategy, is_prng_key
from xlafit.parallel.sharding import DEFAULT_RULES, activation_layout
from xlafit.train.compiled import CompiledStep
from xlafit.train.losses import evaluating_rows
from xlafit.train.state import HOST_MEMORY, TrainState, in_memory

log = logging.getLogger("xlafit")

# loss_fn(model, batch) returns per-example losses [B] or a scalar mean, alone or with a dict
# of metrics of the same kind: (losses, {name: values}). Evaluation needs per-example values.
# Typed loosely on purpose: a user's loss_fn names its own model class and batch type.
LossFn = Callable[[Any, Any], Any]

# A metric of this name is each example's weight, not a metric: the loss and the metrics are
# then means weighted by it over the whole batch (accumulated micro-batches and evaluation's
# batches included), not means over examples. A language model's per-row mean loss weighted
# by the row's tokens is the mean over tokens, whatever the packing put in each row.
WEIGHT = "weight"


def split_outputs(out: Any, per_example: bool = False) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Normalises a ``loss_fn`` result to ``(loss, {name: value})``.

    Each value is per example (shape ``[B]``) or already a mean over the batch (a scalar,
    the convention of optax's and flax's own examples). Training takes either; evaluation
    (``per_example=True``) needs ``[B]``, to weight padding rows by zero.
    """
    losses, metrics = out if isinstance(out, tuple) else (out, {})
    for name, value in {"loss": losses, **metrics}.items():
        if not hasattr(value, "ndim"):  # a Python number: computed from no model output, it trains nothing
            raise ValueError(
                f"loss_fn must return the {name} as an array computed from the model's output (one per example, "
                f"shape [batch]); got a {type(value).__name__}."
            )
        if value.ndim > 1:
            raise ValueError(
                f"loss_fn must return one {name} per example (shape [batch]) or a scalar, got shape {value.shape}."
            )
        if per_example and value.ndim == 0:
            raise ValueError(
                f"evaluation needs loss_fn to return one {name} per example (shape [batch]), got a scalar: the "
                "last batch is padded, and only per-example values let its padding rows count zero. Return the "
                "unreduced values (optax's losses without .mean(), torch's with reduction='none'); training takes "
                "them too."
            )
    return losses, dict(metrics)


def batch_mean(x: jax.Array) -> jax.Array:
    """The mean over the batch of a per-example value; a scalar is one already."""
    return x if x.ndim == 0 else x.mean()


def weighted_sums(
    losses: jax.Array, metrics: dict[str, jax.Array], rows: int
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The sums of ``losses`` and ``metrics`` weighted by ``metrics[WEIGHT]`` (per example),
    and that weight's sum under :data:`WEIGHT`: what a step divides by the whole weight. A
    scalar (a mean already) counts as that value for every example."""
    metrics = dict(metrics)
    weight = metrics.pop(WEIGHT)
    weight = jnp.broadcast_to(weight, (rows,)) if weight.ndim == 0 else weight
    total = lambda x: jnp.sum(x * weight) if x.ndim else x * jnp.sum(weight)  # noqa: E731
    return total(losses), {**{k: total(v) for k, v in metrics.items()}, WEIGHT: jnp.sum(weight)}


def batch_sum(x: jax.Array, rows: int) -> jax.Array:
    """The sum over ``rows`` examples of a per-example value, or of a scalar mean."""
    return x * rows if x.ndim == 0 else x.sum()


def _k_steps(one_step: Callable, unroll: bool) -> Callable:
    """``(state, batches[k, ...]) -> (state, metrics[k])`` from a one-batch step."""

    def train_step(state: TrainState, batches: Mapping[str, jax.Array]):
        if not unroll:
            return jax.lax.scan(one_step, state, batches)
        k = jax.tree.leaves(batches)[0].shape[0]
        per_step = []
        for i in range(k):
            state, metrics = one_step(state, jax.tree.map(lambda x, i=i: x[i], batches))
            per_step.append(metrics)
        return state, jax.tree.map(lambda *xs: jnp.stack(xs), *per_step)

    return train_step


# What the compiled step checks before it applies an update (trainer.nan_policy decides):
# "loss" drops an update whose loss is not finite; "gradient" also one whose gradient is not.
Guard = Literal["loss", "gradient"]


def guard_for(nan_policy: str) -> Guard:
    """The step's guard for a ``trainer.nan_policy``: ``skip`` and ``rollback`` go on training
    after a bad batch, so its update must never land (``"gradient"``); ``stop`` ends the run at
    the first non-finite value, so the step checks the loss only (``"loss"``), which costs no
    memory (see :func:`apply_if_finite`)."""
    return "loss" if nan_policy == "stop" else "gradient"


def apply_if_finite(
    state: TrainState,
    grads: nnx.State,
    tx: optax.GradientTransformation,
    model_state: nnx.State,
    metrics: dict[str, jax.Array],
    guard: Guard,
    select: bool,
    opt_on_host: Any = None,
) -> tuple[TrainState, dict[str, jax.Array]]:
    """One optimizer update, dropped when the loss (``guard="loss"``), or the loss or the
    gradient (``guard="gradient"``), is not finite.

    The step counter advances either way (the batch is consumed, the data order stays a
    function of the step); parameters, optimizer state and float model state (batch
    statistics) keep their old values. ``metrics["nonfinite"]`` is 1.0 when the loss or the
    gradient was not finite, whichever the guard; the trainer applies ``trainer.nan_policy``
    when it sees one.

    The gradient guard needs the global norm of every gradient before the first parameter
    may change, so every gradient is alive at once: on TPU v4, v5e and v5p, whose compilers
    otherwise update each parameter as soon as its gradient is ready, that is up to one more
    copy of the parameters per core (measured: 16.09 vs 19.30 GB for a 1.2B-parameter Adam
    step on v5p-8). The loss is known before the backward pass, so the loss guard costs
    nothing when it is a ``where`` per array (``select=True``, for TPUs and GPUs). On CPUs
    (``select=False``) the update runs inside a ``lax.cond`` instead: memory matters less there,
    and XLA:CPU ran those selects as passes of their own (4% of a Keras CNN's step on 8
    simulated devices). Both give the same values.

    ``opt_on_host``: the optimizer state's shardings in host memory, where it lies between
    steps (``trainer.optimizer_offload``; MaxText's ``optimizer_memory_host_offload``): it is
    copied to the devices for the update and the updated state back. When to copy is the
    compiler's choice: with HBM to spare the TPU compiler starts the copies with the step;
    near its limit it spreads them so that less of the state is on the devices at once.
    """
    if opt_on_host is not None:
        state = dataclasses.replace(state, opt_state=jax.device_put(state.opt_state, in_memory(opt_on_host, "device")))
    grad_norm = optax.global_norm(grads)
    loss_ok = jnp.isfinite(metrics["loss"])
    finite = loss_ok & jnp.isfinite(grad_norm)
    applied = finite if guard == "gradient" else loss_ok

    def update(params: nnx.State, opt_state: optax.OptState) -> tuple[nnx.State, optax.OptState]:
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    def keep_old(new: jax.Array, old: jax.Array) -> jax.Array:
        # RNG keys and counters (integers) of the model state advance either way; frozen
        # parameters come back as they went in (no select over a frozen base).
        return jnp.where(applied, new, old) if new is not old and jnp.issubdtype(old.dtype, jnp.floating) else new

    if select and guard == "loss":
        old = (state.params, state.opt_state)
        params, opt_state = jax.tree.map(lambda n, o: jnp.where(applied, n, o), update(*old), old)
    else:
        keep = lambda params, opt_state: (params, opt_state)  # noqa: E731
        params, opt_state = jax.lax.cond(applied, update, keep, state.params, state.opt_state)

    if opt_on_host is not None:
        opt_state = jax.device_put(opt_state, opt_on_host)
    new_state = dataclasses.replace(
        state,
        step=state.step + 1,
        params=params,
        opt_state=opt_state,
        # Float model state (batch-norm running averages) is kept too: a NaN batch would poison it.
        model_state=jax.tree.map(keep_old, model_state, state.model_state),
    )
    return new_state, {**metrics, "grad_norm": grad_norm, "nonfinite": 1.0 - finite.astype(jnp.float32)}


def microbatches(x: jax.Array, accumulate: int, devices: int) -> jax.Array:
    """Splits a batch ``[B, ...]`` into ``[accumulate, B / accumulate, ...]`` without moving
    data between devices: micro-batch ``a`` takes the ``a``-th slice of every device's rows
    (a plain reshape would give micro-batch 0 to the first devices only)."""
    per = x.shape[0] // (devices * accumulate)
    x = x.reshape(devices, accumulate, per, *x.shape[1:]).swapaxes(0, 1)
    return x.reshape(accumulate, devices * per, *x.shape[3:])


def seeded_by_weight(loss_of: Callable) -> Callable:
    """``value_and_grad(loss_of, has_aux=True)``, a weighted loss's (:data:`WEIGHT` among its
    sums) divided by the batch's whole weight through the backward's seed (1 / weight):
    gradients divided after the backward, by a value the forward computes, moved the TPU
    compiler's schedule to keep a model's unscanned layers' recomputed activations alive at once
    (a Gemma 3 1B step on a v5e-8: 2.2 -> 4.5 GiB of temporaries)."""

    def normalized(params, model_state, batch):
        loss, vjp, (metrics, model_state) = jax.vjp(lambda p: loss_of(p, model_state, batch), params, has_aux=True)
        if WEIGHT not in metrics:  # a mean already: value_and_grad's seed of 1
            (grads,) = vjp(jnp.ones_like(loss))
            return (loss, (metrics, model_state)), grads
        total = jnp.maximum(metrics.pop(WEIGHT), 1e-9)
        (grads,) = vjp(jnp.ones_like(loss) / total)
        return (loss / total, ({k: v / total for k, v in metrics.items()}, model_state)), grads

    return normalized


def build_train_step(
    graphdef: nnx.GraphDef,
    loss_fn: LossFn,
    tx: optax.GradientTransformation,
    *,
    unroll: bool = False,
    accumulate: int = 1,
    devices: int = 1,
    grad_sharding: Any = None,
    guard: Guard = "loss",
    select: bool = False,
    trainable: nnx.filterlib.Filter = nnx.Param,
    opt_on_host: Any = None,
) -> Callable:
    """Returns the pure ``(state, batches[k, B, ...]) -> (state, metrics[k])`` function.

    Args:
        unroll: trace the k steps one after another instead of a ``lax.scan`` loop. XLA:CPU
            runs convolutions inside while loops over 10x slower (measured here: 1.44 s vs
            0.13 s per MNIST step on 8 simulated devices), so CPU runs unroll; TPUs and GPUs
            keep the loop, whose program size does not grow with k.
        accumulate: gradient accumulation: each step's batch is cut into this many
            micro-batches whose gradients are averaged before the one update, so a global
            batch larger than memory allows trains as one (activations of one micro-batch
            live at a time).
        devices: batch shards (``data`` x ``fsdp``; to cut micro-batches device-locally).
        grad_sharding: the parameters' shardings. Gradients are constrained to them, so
            that under FSDP XLA reduce-scatters each gradient onto the shards of its
            parameter (and the optimizer updates only its own shard) instead of
            all-reducing it whole onto every device.
        guard, select: what the step checks before it applies an update, and how
            (:func:`apply_if_finite`; the default is ``trainer.nan_policy=stop``'s).
        trainable: the variables ``state.params`` holds (the split the state was made
            with); everything else is ``model_state``, frozen parameters included.
        opt_on_host: the optimizer state's shardings in host memory, where it lies between
            steps (``trainer.optimizer_offload``; None: on the devices).
    """

    def loss_of(params: nnx.State, model_state: nnx.State, batch: Mapping[str, jax.Array]):
        # copy=True gives fresh Variables owned by this trace, so dropout can advance
        # its RNG counter inside grad/scan.
        model = nnx.merge(graphdef, params, model_state, copy=True)
        losses, metrics = split_outputs(loss_fn(model, batch))
        new_model_state = nnx.state(model, nnx.Not(trainable))
        if WEIGHT in metrics:  # weighted sums, divided by the step's whole weight in one_step
            rows = losses.shape[0] if losses.ndim else 1
            loss, sums = weighted_sums(losses, metrics, rows)
            return loss, (sums, new_model_state)
        # The mean over the global batch: under jit on sharded arrays this reduction is
        # the cross-replica all-reduce.
        return batch_mean(losses), ({k: batch_mean(v) for k, v in metrics.items()}, new_model_state)

    grad_fn = jax.value_and_grad(loss_of, has_aux=True)

    normalized = seeded_by_weight(loss_of)

    def accumulated(params, model_state, batch):
        micro = jax.tree.map(lambda x: microbatches(x, accumulate, devices), batch)

        def add(carry, mb):
            total, model_state = carry
            (loss, (metrics, model_state)), grads = grad_fn(params, model_state, mb)
            return (jax.tree.map(jnp.add, total, (loss, metrics, grads)), model_state), None

        first = jax.tree.map(lambda x: x[0], micro)
        (loss, (metrics, model_state)), grads = grad_fn(params, model_state, first)
        carry = ((loss, metrics, grads), model_state)
        rest = jax.tree.map(lambda x: x[1:], micro)
        if unroll:
            for i in range(accumulate - 1):
                carry, _ = add(carry, jax.tree.map(lambda x, i=i: x[i], rest))
        else:
            carry, _ = jax.lax.scan(add, carry, rest)
        (loss, metrics, grads), model_state = carry
        return (loss, (metrics, model_state)), grads  # sums over the micro-batches: one_step divides them

    def one_step(state: TrainState, batch: Mapping[str, jax.Array]) -> tuple[TrainState, dict[str, jax.Array]]:
        if accumulate > 1:
            (loss, (metrics, model_state)), grads = accumulated(state.params, state.model_state, batch)
            # Sums over the micro-batches: weighted ones by the step's whole weight, equal
            # micro-batches' means by their count.
            total = jnp.maximum(metrics.pop(WEIGHT), 1e-9) if WEIGHT in metrics else accumulate
            loss, metrics = loss / total, {k: v / total for k, v in metrics.items()}
            grads = jax.tree.map(lambda g: g / total, grads)
        else:
            (loss, (metrics, model_state)), grads = normalized(state.params, state.model_state, batch)
        if grad_sharding is not None:
            grads = jax.lax.with_sharding_constraint(grads, grad_sharding)
        metrics = {"loss": loss, **metrics}
        return apply_if_finite(state, grads, tx, model_state, metrics, guard, select, opt_on_host)

    return _k_steps(one_step, unroll)


def _ordered_sum(stacked: jax.Array, replicated: jax.sharding.NamedSharding) -> jax.Array:
    """The sum over the leading (chunk) axis, added in chunk order on every device."""
    stacked = jax.lax.with_sharding_constraint(stacked, replicated)
    # Barriers pin the order of the additions: without them XLA may regroup the sum
    # differently in the 1-device and the 8-device program.
    parts = jax.lax.optimization_barrier([stacked[i] for i in range(stacked.shape[0])])
    total = parts[0]
    for part in parts[1:]:
        total = jax.lax.optimization_barrier(total + part)
    return total


def _chunk_mean(new: jax.Array, old: jax.Array, replicated: jax.sharding.NamedSharding) -> jax.Array:
    """The model state after the chunks, from each chunk's (``new``, stacked) and the old one.

    Float state (batch-norm running averages, ``m * old + (1 - m) * chunk statistics``) is their
    mean in chunk order: the running average of the chunks' mean statistics, as ``bn=local``'s
    groups give. Other state (counters, keys) is the same in every chunk.
    """
    if is_prng_key(old):
        return old
    if not jnp.issubdtype(old.dtype, jnp.floating):
        return new[0]
    return (_ordered_sum(new, replicated) / new.shape[0]).astype(old.dtype)


def build_invariant_train_step(
    graphdef: nnx.GraphDef,
    loss_fn: LossFn,
    tx: optax.GradientTransformation,
    mesh: jax.sharding.Mesh,
    chunks: int,
    guard: Guard = "loss",
    select: bool = False,
    trainable: nnx.filterlib.Filter = nnx.Param,
    opt_on_host: Any = None,
) -> Callable:
    """Like :func:`build_train_step`, but the result does not depend on the device count.

    The global batch is cut into ``chunks`` equal chunks. Every chunk's gradient is computed
    by the same per-chunk program (each device takes ``chunks / devices`` of them, one after
    another), the per-chunk gradients are gathered to every device (a copy, no arithmetic)
    and added in chunk order. 1 device, 8 devices, or 2 processes x 4 devices then do the
    same float operations in the same order and end with the same bits (tested), where
    XLA's all-reduce sums in an order that depends on the topology. Dropout keys are derived
    per chunk, so masks do not depend on the topology either.

    Costs: a gather of ``chunks`` gradient copies per step, and chunk-sized kernels.
    """
    devices = mesh.size
    if chunks % devices:
        raise ValueError(f"trainer.invariant_chunks={chunks} must be a multiple of the {devices} devices.")
    per_device = chunks // devices

    def chunk_grads(params, model_state, batch, chunk_index):
        model_state = jax.tree.map(lambda x: jax.random.fold_in(x, chunk_index) if is_prng_key(x) else x, model_state)

        def loss_of(params):
            model = nnx.merge(graphdef, params, model_state, copy=True)
            losses, metrics = split_outputs(loss_fn(model, batch))
            counts = nnx.state(model, nnx.Not(trainable))
            rows = jax.tree.leaves(batch)[0].shape[0]
            if WEIGHT in metrics:
                loss, sums = weighted_sums(losses, metrics, rows)
                return loss, (sums, counts)
            return batch_sum(losses, rows), ({k: batch_sum(v, rows) for k, v in metrics.items()}, counts)

        (loss_sum, (metric_sums, new_state)), grads = jax.value_and_grad(loss_of, has_aux=True)(params)
        return {"loss": loss_sum, **metric_sums}, grads, new_state

    def on_device(params, model_state, batch):
        first = jax.lax.axis_index("data") * per_device
        rows = jax.tree.leaves(batch)[0].shape[0] // per_device
        sums, grads, states = [], [], []
        for j in range(per_device):
            chunk = jax.tree.map(lambda x, j=j: x[j * rows : (j + 1) * rows], batch)
            # The barrier keeps XLA from merging the chunks' matmuls into larger ones, whose
            # blocking, and so rounding, would differ from a single chunk's.
            chunk_params, chunk = jax.lax.optimization_barrier((params, chunk))
            m, g, new_state = chunk_grads(chunk_params, model_state, chunk, first + j)
            sums.append(m)
            grads.append(g)
            states.append(jax.tree.map(lambda new, old: old if is_prng_key(old) else new, new_state, model_state))
        stack = lambda *xs: jnp.stack(xs)  # noqa: E731
        return jax.tree.map(stack, *sums), jax.tree.map(stack, *grads), jax.tree.map(stack, *states)

    spec = jax.sharding.PartitionSpec
    per_chunk = jax.shard_map(
        on_device,
        mesh=mesh,
        in_specs=(spec(), spec(), spec("data")),
        out_specs=(spec("data"), spec("data"), spec("data")),
        check_vma=False,
    )
    replicated = jax.sharding.NamedSharding(mesh, spec())
    ordered_sum = functools.partial(_ordered_sum, replicated=replicated)
    chunk_mean = functools.partial(_chunk_mean, replicated=replicated)

    def one_step(state: TrainState, batch: Mapping[str, jax.Array]):
        n = jax.tree.leaves(batch)[0].shape[0]
        sums, grads, chunk_states = per_chunk(state.params, state.model_state, batch)
        model_state = jax.tree.map(chunk_mean, chunk_states, state.model_state)
        total = jnp.maximum(ordered_sum(sums.pop(WEIGHT)), 1e-9) if WEIGHT in sums else n
        grads = jax.tree.map(lambda g: ordered_sum(g) / total, grads)
        metrics = {k: ordered_sum(v) / total for k, v in sums.items()}
        return apply_if_finite(state, grads, tx, model_state, metrics, guard, select, opt_on_host)

    return _k_steps(one_step, unroll=True)


def build_eval_step(graphdef: nnx.GraphDef, loss_fn: LossFn) -> Callable:
    """Returns ``(state, batch, mask) -> sums``: masked sums of loss and metrics, and the count.

    Sums (not means) so that batches, and processes, combine exactly on the host.
    """

    def eval_step(state: TrainState, batch: Mapping[str, jax.Array], mask: jax.Array) -> dict[str, jax.Array]:
        model = nnx.merge(graphdef, state.params, state.model_state, copy=True)
        with evaluating_rows(mask):  # a loss's batch-wide statistics may leave the padding rows out
            losses, metrics = split_outputs(loss_fn(model, batch), per_example=True)
        weighted = WEIGHT in metrics
        weights = mask * metrics.pop(WEIGHT) if weighted else mask  # padding rows weigh 0 either way
        sums = {"loss": jnp.sum(losses * weights)}
        sums.update({k: jnp.sum(v * weights) for k, v in metrics.items()})
        if weighted:  # evaluate() divides by it instead of the count
            sums[WEIGHT] = jnp.sum(weights)
        sums["count"] = jnp.sum(mask)
        return sums

    return eval_step


def make_steps(
    train_graphdef: nnx.GraphDef,
    eval_graphdef: nnx.GraphDef,
    loss_fn: LossFn,
    tx: optax.GradientTransformation,
    strategy: Strategy,
    config: TrainerConfig,
    global_batch: int,
    state_sharding: TrainState | None = None,
    trainable: nnx.filterlib.Filter = nnx.Param,
) -> tuple[CompiledStep, CompiledStep]:
    """The train and eval steps of a run, jitted with their shardings and donation.

    The one place that decides what program trains: :class:`~xlafit.Trainer` runs it, and
    ``xlafit check --tpu`` compiles it for a TPU slice (a strategy over the slice's devices).
    The state lies as ``state_sharding`` says (a :class:`TrainState` of shardings, from
    :func:`~xlafit.train.state.state_shardings`; default: replicated), stays so after every step, and is donated;
    batches are split along ``data`` x ``fsdp``; on CPUs the ``k`` steps of a call are
    unrolled, elsewhere a ``lax.scan``. ``trainable`` is the filter the state's ``params``
    were split with (default ``nnx.Param``; LoRA: the adapters). With
    ``config.optimizer_offload`` the optimizer state lies in the host's pinned memory between
    steps (:func:`~xlafit.train.state.opt_state_on_host`), and each step brings it to the devices for the update.

    Raises:
        ConfigError: ``accumulate_steps`` or ``invariant_chunks`` does not divide the batch,
            or ``invariant_chunks`` with a sharded state; ``optimizer_offload`` on devices
            that address no pinned host memory.
    """
    chunks, accumulate = config.invariant_chunks, config.accumulate_steps
    devices = strategy.num_replicas
    per_device = global_batch // devices
    if per_device % accumulate:
        raise ConfigError(
            f"trainer.accumulate_steps={accumulate} must divide the per-device batch {per_device}; "
            f"use one of {[d for d in range(1, per_device + 1) if per_device % d == 0]}."
        )
    if chunks is not None and accumulate > 1:
        raise ConfigError(
            "trainer.invariant_chunks already runs chunks one after another on each device; "
            "set trainer.accumulate_steps=1 with it."
        )
    if chunks is not None and not strategy.data_parallel_only:
        raise ConfigError(
            "trainer.invariant_chunks keeps its bit-identical guarantee for pure data parallelism only; "
            "set trainer.invariant_chunks=null with mesh.fsdp or mesh.tensor above 1."
        )
    replicated = strategy.replicated
    state_in: Any = replicated if state_sharding is None else state_sharding
    opt_on_host = _opt_state_on_host(strategy, state_sharding) if config.optimizer_offload else None
    if opt_on_host is not None:
        state_in = dataclasses.replace(state_in, opt_state=opt_on_host)
    cpu = strategy.platform == "cpu"
    guard, select = guard_for(config.nan_policy), not cpu
    if chunks is not None:
        if chunks % devices or global_batch % chunks:
            raise ConfigError(
                f"trainer.invariant_chunks={chunks} must be a multiple of the {devices} devices and divide "
                f"the global batch {global_batch}; try {devices * max(1, chunks // devices)} or null."
            )
        step_fn = build_invariant_train_step(
            train_graphdef, loss_fn, tx, strategy.mesh, chunks, guard, select, trainable, opt_on_host
        )
    else:
        grads = None if state_sharding is None or strategy.data_parallel_only else state_sharding.params
        step_fn = build_train_step(
            train_graphdef,
            loss_fn,
            tx,
            unroll=cpu,
            accumulate=accumulate,
            devices=devices,
            grad_sharding=grads,
            guard=guard,
            select=select,
            trainable=trainable,
            opt_on_host=opt_on_host,
        )
    step_fn = _with_activation_layout(step_fn, strategy)
    eval_fn = _with_activation_layout(build_eval_step(eval_graphdef, loss_fn), strategy)
    train_step = CompiledStep(
        "train step",
        step_fn,
        in_shardings=(state_in, strategy.batch_sharding(1)),
        out_shardings=(state_in, replicated),
        donate_argnums=0,
    )
    eval_step = CompiledStep(
        "eval step",
        eval_fn,
        in_shardings=(state_in, strategy.batch, strategy.batch),
        out_shardings=replicated,
    )
    return train_step, eval_step


def _opt_state_on_host(strategy: Strategy, state_sharding: TrainState | None) -> Any:
    """The optimizer state's shardings in the host's pinned memory (``trainer.optimizer_offload``).

    Raises:
        ConfigError: the strategy's devices address no pinned host memory.
    """
    if HOST_MEMORY not in strategy.memory_kinds:
        raise ConfigError(
            f"trainer.optimizer_offload=true keeps the optimizer state in the host's pinned memory, which these "
            f"{strategy.platform} devices do not address: set trainer.optimizer_offload=false."
        )
    if state_sharding is None:
        raise ValueError("trainer.optimizer_offload needs the state's shardings (state_sharding).")
    return in_memory(state_sharding.opt_state, HOST_MEMORY)


def _with_activation_layout(fn: Callable, strategy: Strategy) -> Callable:
    """``fn`` traced on the strategy's mesh: :func:`xlafit.parallel.sharding.constrain` pins
    activations unless the run is data-parallel only (XLA lays those out alone)."""
    rules = strategy.rules if strategy.rules is not None else DEFAULT_RULES
    pin = not strategy.data_parallel_only

    def traced(*args: Any) -> Any:
        with activation_layout(strategy.mesh, rules, pin):
            return fn(*args)

    return traced
