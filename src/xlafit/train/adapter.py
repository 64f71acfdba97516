"""Models from other frameworks, turned into what the trainer trains: an ``nnx.Module``.

The :class:`~xlafit.train.trainer.Trainer` (and ``xlafit check``) know no framework but Flax
NNX. A model from another one (a Keras 3 model) is converted once, before the trainer sees
it, into an :class:`Adapted`: the ``nnx.Module`` whose ``nnx.Param`` variables are trained,
the loss in the trainer's form, a hook that writes trained values back into the original
model, and the settings the framework cannot honour.

Each framework's conversion lives in ``xlafit/integrations/<framework>.py`` as
``to_adapted(model, loss_fn) -> Adapted``; :data:`ADAPTERS` maps the framework's top-level
package to that module, which is imported only when one of its models arrives, so neither the
framework nor its adapter loads for anyone else. Adding a framework is a module there and a
row here.

An ``nnx.Module`` is trained as it is, and its trained values are written back into it too
(:func:`write_into`): the trainer's state is a copy placed on the mesh, and the caller's
module is what a notebook's next cell uses.

Example:
    >>> from flax import nnx
    >>> adapted = adapt(nnx.Linear(2, 2, rngs=nnx.Rngs(0)), loss_fn=None)
    >>> type(adapted.module).__name__, adapted.write_back is not None
    ('Linear', True)
"""

from __future__ import annotations

import dataclasses
import importlib
import weakref
from collections.abc import Callable
from typing import Any

import jax
from flax import nnx

from xlafit.config import TrainerConfig
from xlafit.errors import ConfigError
from xlafit.parallel.mesh import Strategy

# A framework's top-level package -> the xlafit module that adapts its models.
ADAPTERS = {"keras": "xlafit.integrations.keras", "torch": "xlafit.integrations.torch"}


@dataclasses.dataclass
class Adapted:
    """A model as the trainer takes it.

    Attributes:
        module: the ``nnx.Module``: its ``nnx.Param`` variables are trained, the rest of its
            state (batch statistics, seed state) is model state, updated by the step.
        loss_fn: ``loss_fn(module, batch)`` -> per-example losses (and metrics).
        write_back: puts trained ``(params, model_state)`` back into the original model; the
            trainer calls it at every checkpoint and at the end of ``fit``.
        check: refuses trainer settings the framework cannot honour (``ConfigError``).
    """

    module: nnx.Module
    loss_fn: Any
    write_back: Callable[[nnx.State, nnx.State], None] | None = None
    check: Callable[[Strategy, TrainerConfig], None] | None = None


def write_into(module: nnx.Module, params: nnx.State, model_state: nnx.State) -> None:
    """The trained ``params`` and the model state that training changes (batch statistics,
    seed counters) into the caller's ``module``, one variable at a time, each a copy on the
    devices: the next train step donates the state's own arrays, and one at a time the
    module's earlier array is freed before the next copy is made. Frozen parameters
    (``model_state``'s ``nnx.Param``), which training never changes, are left as they are."""
    trained = dict(_by_path(params))
    trained.update((path, leaf) for path, leaf in _by_path(model_state) if not isinstance(leaf, nnx.Param))
    for path, variable in _by_path(nnx.state(module)):
        value = trained.get(path)
        if value is not None:
            variable.set_value((value.get_value() if isinstance(value, nnx.Variable) else value).copy())


def _write_into_while_held(module: nnx.Module) -> Callable[[nnx.State, nnx.State], None]:
    """:func:`write_into` ``module`` while someone holds it: the trainer keeps no reference of
    its own, so a module nobody else holds (a recipe's model read from Hugging Face files) is
    freed once its values are placed, not kept beside the trained state for the whole run."""
    held = weakref.ref(module)

    def write_back(params: nnx.State, model_state: nnx.State) -> None:
        module = held()
        if module is not None:
            write_into(module, params, model_state)

    return write_back


def _by_path(state: nnx.State) -> list[tuple[str, Any]]:
    """``state``'s variables (or arrays) by their path, e.g. ``['layers'][0]['kernel']``."""
    leaves = jax.tree_util.tree_leaves_with_path(state, is_leaf=lambda x: isinstance(x, nnx.Variable))
    return [(jax.tree_util.keystr(path), leaf) for path, leaf in leaves]


def require_data_parallel(strategy: Strategy, models: str) -> None:
    """Refuses FSDP and tensor parallelism for ``models`` (e.g. "Keras models"), whose
    parameters name no logical axes to split them by."""
    if not strategy.data_parallel_only:
        raise ConfigError(
            f"{models} train data-parallel only (their parameters carry no logical axes); "
            "set mesh.fsdp=1 and mesh.tensor=1."
        )


def framework_of(model: Any) -> str | None:
    """The framework in :data:`ADAPTERS` that ``model``'s class (or a base class) comes from."""
    for cls in type(model).__mro__:
        root = cls.__module__.split(".")[0]
        if root in ADAPTERS:
            return root
    return None


def adapt(model: Any, loss_fn: Any) -> Adapted:
    """``model`` as an :class:`Adapted`: an ``nnx.Module`` as it is, an :class:`Adapted` as
    given, a model of a framework in :data:`ADAPTERS` through that framework's adapter."""
    if isinstance(model, Adapted):
        return model
    framework = framework_of(model)
    if framework is None:
        return Adapted(model, loss_fn, write_back=_write_into_while_held(model))
    # The framework's adapter, imported by name when one of its models arrives: the framework
    # itself (Keras, ...) is loaded by nobody else.
    adapter = importlib.import_module(ADAPTERS[framework])
    return adapter.to_adapted(model, loss_fn)
