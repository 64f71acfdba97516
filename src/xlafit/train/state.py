"""The state a run trains, as one pytree (:class:`TrainState`), and where its parts lie:
the layout a strategy gives it, and the optimizer state in the host's memory
(``trainer.optimizer_offload``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx, struct

from xlafit.parallel.mesh import Strategy
from xlafit.parallel.sharding import check_rules


@struct.dataclass
class TrainState:
    """Everything that changes during training, as one pytree.

    Attributes:
        step: optimizer steps taken (int32 scalar).
        params: the variables trained: the model's ``nnx.Param`` variables, or those of the
            trainer's ``trainable`` filter (LoRA: the adapters).
        opt_state: the optax state.
        model_state: the model's other variables (dropout RNG counters, batch statistics,
            parameters left frozen).
    """

    step: jax.Array
    params: nnx.State
    opt_state: optax.OptState
    model_state: nnx.State


# Where ``trainer.optimizer_offload`` keeps the optimizer state between steps: the host's
# page-locked memory, which the devices read and write by DMA (a pageable buffer would be
# staged through a pinned one on every copy).
HOST_MEMORY = "pinned_host"


def abstract_state(
    params: nnx.State,
    model_state: nnx.State,
    tx: optax.GradientTransformation,
    layout: Strategy | jax.sharding.Sharding,
    optimizer_offload: bool = False,
) -> TrainState:
    """The :class:`TrainState` of these variables as ``ShapeDtypeStruct`` leaves laid out as
    the strategy lays them (:meth:`~xlafit.parallel.mesh.Strategy.shardings`), or all with one
    sharding: what compiling a step needs, with nothing allocated (``params`` may come from
    ``nnx.eval_shape``). ``optimizer_offload``: the optimizer state in the host's pinned
    memory (:func:`opt_state_on_host`)."""

    def init(params: nnx.State, model_state: nnx.State) -> TrainState:
        return TrainState(jnp.zeros((), jnp.int32), params, tx.init(params), model_state)

    shapes = jax.eval_shape(init, params, model_state)
    if isinstance(layout, Strategy):
        if layout.rules is not None:  # where the model's axis names meet mesh.rules
            check_rules(shapes, layout.rules)
        shardings = layout.shardings(shapes)
    else:
        shardings = jax.tree.map(lambda _: layout, shapes)
    state = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), shapes, shardings)
    return opt_state_on_host(state) if optimizer_offload else state


def in_memory(shardings: Any, kind: str) -> Any:
    """A tree of shardings, each the same layout in memory ``kind`` (``device``, ``pinned_host``)."""
    return jax.tree.map(lambda s: s.with_memory_kind(kind), shardings)


def opt_state_on_host(state: TrainState) -> TrainState:
    """An abstract state whose optimizer state lies in the host's pinned memory, each leaf
    split over the devices' hosts as it would be over the devices (``trainer.optimizer_offload``).

    Example:
        >>> import optax
        >>> from xlafit.parallel.cluster import connect
        >>> params = {"w": jax.ShapeDtypeStruct((4, 4), jnp.float32)}
        >>> state = abstract_state(params, {}, optax.adam(1e-3), connect(), optimizer_offload=True)
        >>> sorted({x.sharding.memory_kind for x in jax.tree.leaves(state.opt_state)})
        ['pinned_host']
    """

    def on_host(x: jax.ShapeDtypeStruct) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding.with_memory_kind(HOST_MEMORY))

    return dataclasses.replace(state, opt_state=jax.tree.map(on_host, state.opt_state))


def state_shardings(state: TrainState) -> TrainState:
    """The shardings of a state of arrays or ``ShapeDtypeStruct``s, as a tree of its shape."""
    return jax.tree.map(lambda x: x.sharding, state)


def initial_state(
    strategy: Strategy,
    tx: optax.GradientTransformation,
    build: Callable[[], nnx.Module] | None,
    params: nnx.State,
    model_state: nnx.State,
    shardings: TrainState,
    trainable: nnx.filterlib.Filter = nnx.Param,
) -> TrainState:
    """The train state on the devices, each holding its own slices of it: the model ``build``
    makes (inside jit, so that no device and no host ever holds the whole model, as
    big_vision's ``jit(init, out_shardings)``), or ``params`` and ``model_state`` placed slice
    by slice; the optimizer's state initialised where it lies."""
    if build is not None:

        def init() -> tuple[nnx.State, nnx.State]:
            module = build()
            module.train()
            _, p, s = nnx.split(module, trainable, ...)  # type: ignore[misc]  # flax's overloads
            return p, s

        params, model_state = jax.jit(init, out_shardings=(shardings.params, shardings.model_state))()
    else:
        params = strategy.put(params, shardings.params)
        model_state = strategy.put(model_state, shardings.model_state)
    return TrainState(
        step=strategy.replicate(jnp.zeros((), jnp.int32)),
        params=params,
        opt_state=jax.jit(tx.init, out_shardings=shardings.opt_state)(params),
        model_state=model_state,
    )
