"""Where every array of a run lies on the ``('data', 'fsdp', 'tensor')`` mesh.

A model names the axes of its parameters (``embed``, ``mlp``, ``heads``, ``vocab``,
``conv_out``, ...) with :func:`logical` when it creates them; one table of rules maps those
names to mesh axes (:data:`DEFAULT_RULES`, overridable with ``mesh.rules``). This is the
MaxText / t5x scheme: the model says what an axis *is*, the run decides where it goes.

- ``data``: pure data parallelism; everything is replicated along it.
- ``fsdp``: data parallelism whose parameters and optimizer state are split along it
  (ZeRO-3): XLA gathers each weight where a layer needs it and reduce-scatters its gradient.
- ``tensor``: Megatron tensor parallelism: ``mlp`` and ``heads`` (and ``vocab``) split.
- ``expert``: expert parallelism: a mixture of experts' stacked expert weights split by
  expert (``experts``); the mesh has this axis only when ``mesh.expert`` is above 1, and
  the batch is split over it too (each of its devices computes its own rows' attention).

Batches are split over ``data`` x ``fsdp`` (x ``expert``). A parameter with no names (a user's own model),
or whose names send no dimension to ``fsdp`` (a LayerNorm scale, a bias), is split over
``fsdp`` along its largest free dimension that ``fsdp`` divides, or replicated when none
does (:func:`default_spec`): under FSDP every parameter that can be split is. Every other
variable (dropout RNG state, a scalar step count) is replicated. Optimizer state built by
optax from the parameters carries the parameters' names, so it lies exactly as its
parameter does.

Example:
    >>> spec_for("kernel", (768, 3072), ("embed", "mlp"), DEFAULT_RULES, {"data": 1, "fsdp": 4, "tensor": 2})
    P('fsdp', 'tensor')
    >>> default_spec((10, 4096), {"data": 1, "fsdp": 8, "tensor": 1})
    P(None, 'fsdp')
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import math
from collections.abc import Callable, Iterator, Mapping
from typing import Any, cast

import jax
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from xlafit.errors import ConfigError

log = logging.getLogger("xlafit")

MESH_AXES = ("data", "fsdp", "expert", "tensor")  # "expert" only in a mesh with mesh.expert > 1
BATCH_AXES = ("data", "fsdp", "expert")  # the batch is split over these

__all__ = ["BATCH_AXES", "DEFAULT_RULES", "MESH_AXES", "logical", "parse_rules", "tree_shardings"]

# Logical axis -> mesh axis (None: replicated). A model may use any other name: unknown
# names are replicated, so a new model's own names need a row here or in
# mesh.rules only where it wants a split.
DEFAULT_RULES: Mapping[str, str | None] = {
    "embed": "fsdp",  # the model width (BERT's hidden size, a dense layer's input features)
    "mlp": "tensor",  # MLP hidden units: column-parallel in, row-parallel out (Megatron)
    "heads": "tensor",  # attention heads (Megatron)
    # key/value heads of grouped-query attention (Llama): fewer than the query heads, so a
    # tensor axis larger than their count can replicate them with mesh.rules=kv_heads=null
    "kv_heads": "tensor",
    "vocab": "tensor",  # vocabulary rows of the embedding / the tied output layer
    "conv_out": "fsdp",  # a convolution's output channels
    "conv_in": None,
    "kernel_h": None,
    "kernel_w": None,
    "positions": None,
    "types": None,
    "norm": None,  # LayerNorm / BatchNorm scales and offsets: small, replicated
    "layers": None,  # the stacked layers of a scanned model (model.scan_layers)
    "experts": "expert",  # a mixture of experts' stacked expert weights (expert parallelism)
    "classes": None,
    # the residual stream's width between decoder layers (activations, not parameters):
    # whole on each device of a tensor-parallel group by default; activation_embed=tensor
    # splits it, as MaxText's activation_embed: a layer's output is reduce-scattered instead of
    # all-reduced, and the activations remat keeps take a quarter of the memory at tensor 4
    "activation_embed": None,
}

# The logical names only activations carry (constrain in xlafit's models), never a parameter:
# a mesh.rules entry for one is not a misspelt parameter axis (check_rules)
ACTIVATION_AXES = ("activation_embed",)


def logical(init: Callable, *names: str | None) -> Callable:
    """``init`` whose parameter carries the logical axis ``names`` (one per dimension).

    ``nnx.with_partitioning`` with eager sharding off: the model is built the same with or
    without a mesh, and the run lays the names over its mesh (:func:`tree_shardings`).

    Example:
        >>> layer = nnx.Linear(4, 8, kernel_init=logical(nnx.initializers.lecun_normal(), "embed", "mlp"),
        ...                    rngs=nnx.Rngs(0))
        >>> logical_axes(layer.kernel)
        ('embed', 'mlp')
    """
    return nnx.with_partitioning(init, names, eager_sharding=False)


def logical_axes(variable: nnx.Variable) -> tuple[str | None, ...] | None:
    """The logical axis names a variable was created with, or None."""
    names = variable.get_metadata().get("out_sharding")
    return tuple(names) if names else None


def parse_rules(text: str | None) -> dict[str, str | None]:
    """:data:`DEFAULT_RULES` updated by ``mesh.rules``: ``"embed=fsdp,vocab=null,conv_out=tensor"``.

    Example:
        >>> parse_rules("vocab=null,mlp=fsdp")["vocab"], parse_rules("vocab=null,mlp=fsdp")["mlp"]
        (None, 'fsdp')

    Raises:
        ConfigError: an entry is not ``name=axis`` or names an axis that the mesh lacks.
    """
    rules = dict(DEFAULT_RULES)
    for item in (text or "").split(","):
        if not item.strip():
            continue
        name, sep, axis = (part.strip() for part in item.partition("="))
        if not sep or not name:
            raise ConfigError(f"mesh.rules entry {item!r} is not name=axis (for example embed=fsdp,vocab=null).")
        if axis in ("null", "none", "None", ""):
            rules[name] = None
        elif axis in MESH_AXES:
            rules[name] = axis
        else:
            raise ConfigError(
                f"mesh.rules: {name}={axis} names no mesh axis; use one of {', '.join(MESH_AXES)} or null."
            )
    return rules


def check_rules(tree: Any, rules: Mapping[str, str | None]) -> list[str]:
    """Warns about the ``mesh.rules`` entries that no variable of ``tree`` (a train state,
    abstract or not) is named for: a misspelt name (``embd=fsdp``) would otherwise pass in
    silence and the run be laid out as if it were not there. An entry is one that adds a name
    to :data:`DEFAULT_RULES` or sends one of its names elsewhere. A warning, not an error: a
    name that only activations carry (:func:`constrain` in a model's own code) is a rule that
    works, and only the traced step knows those names.

    Returns:
        The entries warned about, as ``name=axis``.

    Example:
        >>> layer = nnx.eval_shape(lambda: nnx.Linear(4, 8, kernel_init=logical(nnx.initializers.lecun_normal(),
        ...                        "embed", "mlp"), rngs=nnx.Rngs(0)))
        >>> state = nnx.state(layer)
        >>> check_rules(state, parse_rules("mlp=fsdp")), check_rules(state, parse_rules("embd=fsdp"))
        ([], ['embd=fsdp'])
    """
    carried: set[str] = set()
    for x in jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, nnx.Variable)):
        if isinstance(x, nnx.Variable):
            carried.update(name for name in logical_axes(x) or () if name)
    stray = [
        f"{name}={axis or 'null'}"
        for name, axis in rules.items()
        if name not in carried
        and name not in ACTIVATION_AXES
        and (name not in DEFAULT_RULES or DEFAULT_RULES[name] != axis)
    ]
    has = f"its axes are {', '.join(sorted(carried))}" if carried else "its parameters name no axes"
    message = (
        f"warning: mesh.rules: {', '.join(stray)} names a logical axis that no parameter of this model carries "
        f"({has}). A misspelt name changes nothing: correct it. A name that only the model's activations carry "
        "(constrain) is fine."
    )
    if stray and message not in _WARNED:  # once per process: a plan compiles many layouts
        _WARNED.add(message)
        log.warning("%s", message)
    return stray


_WARNED: set[str] = set()


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def spec_for(
    name: str,
    shape: tuple[int, ...],
    names: tuple[str | None, ...],
    rules: Mapping[str, str | None],
    mesh_shape: Mapping[str, int],
) -> PartitionSpec:
    """The ``PartitionSpec`` of an annotated array: each logical name through ``rules``.

    A mesh axis of size 1 splits nothing; a mesh axis already used by an earlier dimension
    of the same array is not used twice (a square ``embed x embed`` matrix splits once).

    Raises:
        ConfigError: a split dimension does not divide over its mesh axis (naming the
            parameter, the axis and the sizes that would work), or the names do not match
            the array's rank.
    """
    if len(names) != len(shape):
        raise ConfigError(f"{name} has shape {shape} but {len(names)} logical axis names {names}; give one per axis.")
    used: set[str] = set()
    spec: list[str | None] = []
    for dim, (size, logical_name) in enumerate(zip(shape, names, strict=True)):
        axis = rules.get(logical_name) if logical_name is not None else None
        if axis is None or mesh_shape.get(axis, 1) == 1 or axis in used:
            spec.append(None)
            continue
        n = mesh_shape[axis]
        if size % n:
            works = [d for d in divisors(size) if d <= max(mesh_shape.values()) * 8][:8]
            raise ConfigError(
                f"parameter {name} {tuple(shape)}: dimension {dim} ({logical_name!r}, {size}) does not divide over "
                f"mesh.{axis}={n}. Use mesh.{axis} in {works} (sizes that divide {size}), or map {logical_name!r} "
                f"elsewhere with mesh.rules={logical_name}=null."
            )
        used.add(axis)
        spec.append(axis)
    if "fsdp" not in used and mesh_shape.get("fsdp", 1) > 1:
        # ZeRO-3 splits every parameter: one whose names send nothing to fsdp (a LayerNorm
        # scale, a bias, a replicated-over-tensor kernel) is split like an unannotated one,
        # along its largest free dimension that fsdp divides.
        free = [d if spec[d] is None else None for d in range(len(shape))]
        fallback = default_spec(tuple(shape[d] if d is not None else 1 for d in free), mesh_shape)
        spec = [
            a if a is not None else (f if free[d] is not None else None)
            for d, (a, f) in enumerate(zip(spec, tuple(fallback) + (None,) * (len(shape) - len(fallback)), strict=True))
        ]
    return PartitionSpec(*spec)


def default_spec(shape: tuple[int, ...], mesh_shape: Mapping[str, int]) -> PartitionSpec:
    """An unannotated parameter: split over ``fsdp`` along its largest dimension that
    ``fsdp`` divides (the first of equal ones), else replicated."""
    n = mesh_shape.get("fsdp", 1)
    if n == 1:
        return PartitionSpec()
    fitting = [d for d in range(len(shape)) if shape[d] % n == 0]
    if not fitting:
        return PartitionSpec()
    dim = max(fitting, key=lambda d: (shape[d], -d))
    return PartitionSpec(*[("fsdp" if d == dim else None) for d in range(len(shape))])


def path_name(path: tuple) -> str:
    """``model_state/dropout1/rngs/count/value``: a pytree path without its container types,
    so the saved tree (nested dicts) and the live one (dataclasses, nnx.State) compare."""
    names = []
    for entry in path:
        for attr in ("key", "name", "idx"):
            if hasattr(entry, attr):
                names.append(str(getattr(entry, attr)))
                break
    return "/".join(names)


def _path_name(path: tuple) -> str:
    """:func:`path_name` without the variables' ``value`` entries: the parameter's own name."""
    return "/".join(p for p in path_name(path).split("/") if p != "value")


def tree_specs(tree: Any, mesh_shape: Mapping[str, int], rules: Mapping[str, str | None]) -> Any:
    """``tree`` (a state of ``nnx.Variable``s and arrays, or their ``ShapeDtypeStruct``s)
    with every leaf replaced by its ``PartitionSpec``: annotated variables through
    ``rules``, unannotated ``nnx.Param``s by :func:`default_spec`, everything else
    replicated. Variables keep their place (and metadata) in the tree, so the result has
    the structure that ``jax.jit``'s shardings need."""

    def leaf(path: tuple, x: Any) -> Any:
        if isinstance(x, nnx.Variable):
            value = x.get_value()
            shape = tuple(getattr(value, "shape", ()))
            names = logical_axes(x)
            if names is not None:
                spec = spec_for(_path_name(path), shape, names, rules, mesh_shape)
            elif isinstance(x, nnx.Param):
                spec = default_spec(shape, mesh_shape)
            else:
                spec = PartitionSpec()
            return x.replace(spec)
        return PartitionSpec()

    return jax.tree_util.tree_map_with_path(leaf, tree, is_leaf=lambda x: isinstance(x, nnx.Variable))


def tree_shardings(tree: Any, mesh: Mesh, rules: Mapping[str, str | None]) -> Any:
    """:func:`tree_specs` as ``NamedSharding``s on ``mesh``."""
    specs = tree_specs(tree, dict(mesh.shape), rules)
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, PartitionSpec))


def bytes_per_device(tree: Any, memory: str = "device") -> int:
    """Bytes each device holds of a tree of sharded arrays (or ``ShapeDtypeStruct``s with a
    sharding) in its ``memory`` (``device``: its own; ``host``: its host's, pinned or not,
    where host offloading keeps arrays): the largest shard of each leaf, summed. A PRNG key
    counts as its key data."""
    total = 0
    for x in jax.tree.leaves(tree):
        kind = getattr(getattr(x, "sharding", None), "memory_kind", None) or "device"
        if kind.endswith("host") != (memory == "host"):
            continue
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            x = jax.eval_shape(jax.random.key_data, x)
            shard = x.shape
        else:
            sharding = getattr(x, "sharding", None)
            shard = sharding.shard_shape(x.shape) if sharding is not None else x.shape
        size = 1
        for n in shard:
            size *= n
        total += size * x.dtype.itemsize
    return total


# The logical axes a decode step splits its weights along where FSDP splits them along their
# width: the MLP's hidden units and the vocabulary (decode_layout)
DECODE_SPLIT = ("mlp", "vocab")


def decode_axes(mesh: Mesh | None) -> tuple[str, ...] | None:
    """The mesh axes :func:`decode_layout` splits the MLP's hidden units and the vocabulary
    over (``fsdp``, and ``tensor`` where it has several devices), or None where ``fsdp`` has
    one device (the weights are not split along their width)."""
    sizes = dict(mesh.shape) if mesh is not None else {}
    if sizes.get("fsdp", 1) == 1:
        return None
    return tuple(a for a in ("fsdp", "tensor") if sizes.get(a, 1) > 1)


def decode_layout(tree: Any, mesh: Mesh | None) -> Any:
    """A model's state (``nnx.Variable``s, inside a traced program) laid out for decoding one
    token a row at a time: where ``fsdp`` splits the weights along their width (``embed``),
    the MLP's weights and the embedding table are split along their hidden units and their
    vocabulary instead (over ``fsdp`` x ``tensor``), Megatron's column/row split; every other
    variable keeps its layout.

    Under FSDP each device holds a slice of every weight's ``embed`` axis, so a decode step's
    product of a few rows with a weight ends in a sum of partial products over the devices:
    for the output layer an all-reduce of ``[rows, vocab]`` logits every step (33.6 MB for 64
    rows of Gemma's 262,144 tokens), for each MLP two of ``[rows, intermediate]``. Split along
    ``mlp`` and ``vocab``, the MLP's column-parallel products need no sum and its row-parallel
    one sums ``[rows, embed]``; the logits stay split by vocabulary (the greedy or sampled
    choice reduces over it). Each device still reads only its share of the weights. The
    re-layout is one exchange of the weights before the loop, not one per step.

    ``mesh``: the mesh the state lies on (None, or one without ``fsdp``: ``tree`` unchanged).
    A mixture of experts' stacked weights (``experts``) keep their layout.
    """
    axes = decode_axes(mesh)
    if axes is None:
        return tree
    assert mesh is not None
    shards = row_shards((mesh, axes))

    def leaf(x: Any) -> Any:
        names = logical_axes(x) if isinstance(x, nnx.Variable) else None
        if not names or "experts" in names:
            return x
        value = x.get_value()
        split = [d for d, name in enumerate(names) if name in DECODE_SPLIT]
        if len(names) != value.ndim or not split or value.shape[split[0]] % shards:
            return x
        spec: list[Any] = [None] * value.ndim
        spec[split[0]] = axes
        return x.replace(jax.lax.with_sharding_constraint(value, NamedSharding(mesh, PartitionSpec(*spec))))

    return jax.tree.map(leaf, tree, is_leaf=lambda x: isinstance(x, nnx.Variable))


# --------------------------------------------------------------------------- activations

_ACTIVE: contextvars.ContextVar[tuple[Mesh, Mapping[str, str | None], bool] | None] = contextvars.ContextVar(
    "xlafit_sharding", default=None
)


@contextlib.contextmanager
def activation_layout(mesh: Mesh, rules: Mapping[str, str | None], pin: bool = True) -> Iterator[None]:
    """While a step is traced: :func:`constrain` lays activations over ``mesh`` by ``rules``
    (with ``pin=False`` it leaves them to XLA, as a data-parallel run does) and
    :func:`active_layout` names the mesh to kernels that run per shard."""
    token = _ACTIVE.set((mesh, rules, pin))
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def active_layout() -> tuple[Mesh, Mapping[str, str | None]] | None:
    """The mesh and rules of the step being traced, or None outside one (a model called on
    its own): what a per-shard kernel (``shard_map``) needs to split its inputs."""
    active = _ACTIVE.get()
    return None if active is None else active[:2]


def batch_axes(mesh: Mesh, size: int) -> tuple[str, ...] | None:
    """The mesh axes a batch of ``size`` rows splits over (``data`` x ``fsdp`` x ``expert``,
    those of more than one device), or None when it does not divide over them."""
    sizes = dict(mesh.shape)
    axes = tuple(a for a in BATCH_AXES if sizes.get(a, 1) > 1)
    return axes if axes and size % math.prod(sizes[a] for a in axes) == 0 else None


def constrain(x: jax.Array, *names: str | None) -> jax.Array:
    """Pins activation ``x`` to its logical axes (``"batch"``: ``data`` x ``fsdp``; others
    through the rules), inside a step of a sharded run; outside one (a model called on
    its own, pure data parallelism) it returns ``x`` untouched.

    Without these hints XLA's sharding propagation may carry a weight's split onto the
    activations (hidden states split over ``fsdp`` along ``embed``, then gathered back
    whole: "involuntary full rematerialization"), or compute every head on every device of
    a tensor-parallel group.
    """
    active = _ACTIVE.get()
    if active is None or not active[2]:
        return x
    mesh, rules, _ = active
    sizes = dict(mesh.shape)
    spec: list[Any] = []
    for size, name in zip(x.shape, names, strict=True):
        if name == "batch":
            spec.append(batch_axes(mesh, size))
            continue
        axis = rules.get(name) if name is not None else None
        spec.append(axis if axis is not None and sizes.get(axis, 1) > 1 and size % sizes[axis] == 0 else None)
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, PartitionSpec(*spec)))


# --------------------------------------------------------------------------- rows beside a state


def rows_layout(tree: Any) -> tuple[Mesh, tuple[str, ...]] | None:
    """The mesh the arrays of ``tree`` lie on (a model's state; arrays or ``ShapeDtypeStruct``s
    with a sharding) and its batch axes of more than one device: where a program on that state
    splits its rows. None where the arrays lie on no mesh, or on one without such an axis
    (one device, a tensor-parallel group alone).

    A jitted program given the state committed to a mesh and its rows uncommitted (host
    values, or an array on one device) lays the rows out as XLA's propagation chooses:
    replicated beside replicated weights, so that every device computes every row. Rows
    placed with :func:`rows_sharding` are split as the train step splits a batch.
    """
    for leaf in jax.tree.leaves(tree):
        sharding = getattr(leaf, "sharding", None)
        if isinstance(sharding, NamedSharding):
            sizes = dict(sharding.mesh.shape)
            axes = tuple(a for a in BATCH_AXES if sizes.get(a, 1) > 1)
            return (cast(Mesh, sharding.mesh), axes) if axes else None
    return None


def row_shards(layout: tuple[Mesh, tuple[str, ...]] | None) -> int:
    """The devices (or tensor-parallel groups) that each take their own rows: 1 without a layout."""
    if layout is None:
        return 1
    mesh, axes = layout
    return math.prod(dict(mesh.shape)[a] for a in axes)


def rows_sharding(layout: tuple[Mesh, tuple[str, ...]], ndim: int) -> NamedSharding:
    """An array ``[rows, ...]`` of ``ndim`` axes with its rows split over ``layout``'s batch axes."""
    mesh, axes = layout
    return NamedSharding(mesh, PartitionSpec(axes, *([None] * (ndim - 1))))


def to_host(x: Any) -> np.ndarray:
    """The whole of ``x`` (an array) as a NumPy array on this host; in a job of several
    processes, the parts that other processes' devices hold are gathered from them (every
    process calls it)."""
    if not isinstance(x, jax.Array) or x.is_fully_addressable:
        return np.asarray(x)
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))
