"""What ``xlafit plan`` may try on a slice: meshes the model's axes allow, and the levers.

A candidate is one way to run: the mesh (``data x fsdp x tensor`` = the slice's devices; for
a mixture of experts ``data x fsdp x tensor x expert``, with the expert-parallel layouts of
:func:`expert_meshes` beside them), the model's rematerialisation policy (where the model has
``model.remat``), whether its layers are scanned (``model.scan_layers``, where it has that),
the per-core batch and the gradient accumulation. Each is written as the dotted overrides
that ``xlafit train`` takes, so the plan's answer is a command.

Example:
    >>> meshes(8)
    [(8, 1, 1), (4, 2, 1), (2, 4, 1), (1, 8, 1), (4, 1, 2), (2, 2, 2), (1, 4, 2), (2, 1, 4), (1, 2, 4), (1, 1, 8)]
    >>> expert_meshes(8, 128)
    [(1, 1, 1, 8), (1, 2, 1, 4), (1, 4, 1, 2)]
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import jax
from flax import nnx
from jax.sharding import PartitionSpec

from xlafit.errors import ConfigError
from xlafit.parallel.sharding import DEFAULT_RULES, divisors, logical_axes, tree_specs

# The remat policies a plan tries where the model has model.remat, cheapest first: none keeps
# every activation, dots_saveable recomputes the elementwise work only, full keeps one per layer;
# offload (the llm recipe's) keeps that one in the host's memory, copied over PCIe.
REMAT_LADDER = ("none", "dots_saveable", "full")
OFFLOAD_LADDER = (*REMAT_LADDER, "offload")
# Memory levers (Candidate.memory) are compiled on this many refused layouts, those closest
# to fitting: each is one compile per layout, and a far refusal is rarely saved by one.
MEMORY_LAYOUTS = 2


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One way to run on one target; ``overrides()`` says it as ``xlafit train`` keys."""

    target: str
    mesh: tuple[int, ...]  # data, fsdp, tensor; and expert for a mixture of experts (MeshConfig.sizes's order)
    per_device_batch: int  # examples per batch shard per optimizer step
    accumulate: int = 1  # micro-batches per step (trainer.accumulate_steps)
    remat: str | None = None  # None: the model has no model.remat
    # Settings that change the numerics (bf16 compute, bf16 optimizer moments): dotted key, value.
    numerics: tuple[tuple[str, str], ...] = ()
    scan: bool | None = None  # model.scan_layers; None: the model has no such setting
    # Settings that shrink memory beyond remat (a LoRA run's 4-bit base, the logits in chunks):
    # dotted key, value.
    memory: tuple[tuple[str, str], ...] = ()

    @property
    def expert(self) -> int:
        """The expert axis (1: none, or a mixture of experts laid without it)."""
        return self.mesh[3] if len(self.mesh) > 3 else 1

    @property
    def shards(self) -> int:
        """Batch shards: data x fsdp x expert (a tensor group shares its shard)."""
        return self.mesh[0] * self.mesh[1] * self.expert

    @property
    def global_batch(self) -> int:
        return self.per_device_batch * self.shards

    @property
    def data_parallel(self) -> bool:
        """Pure data parallelism: every axis but ``data`` of size 1."""
        return all(n == 1 for n in self.mesh[1:])

    @property
    def layout(self) -> str:
        """The mesh in a few characters (:func:`layout_of`)."""
        return layout_of(self.mesh)

    @property
    def levers(self) -> str:
        """The candidate's levers beyond the mesh, for a table (``remat full, accumulate 2``)."""
        parts = []
        if self.remat not in (None, "none"):
            parts.append(f"remat {self.remat}")
        if self.accumulate > 1:
            parts.append(f"accumulate {self.accumulate}")
        if self.scan:
            parts.append("scan layers")
        parts += [f"{key.rsplit('.', 1)[-1]}={value}" for key, value in self.memory]
        parts += [f"{key.rsplit('.', 1)[-1]}={value} (numerics)" for key, value in self.numerics]
        return ", ".join(parts) or "-"

    def overrides(self, batch_key: str = "data.per_device_batch") -> dict[str, Any]:
        """The dotted keys that run this candidate (``xlafit train RECIPE key=value ...``)."""
        data, fsdp, tensor = self.mesh[:3]
        out: dict[str, Any] = {"mesh.data": data, "mesh.fsdp": fsdp, "mesh.tensor": tensor}
        if len(self.mesh) > 3:  # a mixture of experts: the plan's expert axis, 1 included
            out["mesh.expert"] = self.expert
        if batch_key:
            out[batch_key] = self.per_device_batch
        out["trainer.accumulate_steps"] = self.accumulate
        if self.remat is not None:
            out["model.remat"] = self.remat
        if self.scan is not None:
            out["model.scan_layers"] = self.scan
        out.update(self.memory)
        out.update(self.numerics)
        return out


def layout_of(mesh: tuple[int, ...]) -> str:
    """``DP 8``, ``FSDP 8``, ``DP 2 x FSDP 2 x TP 2``, ``FSDP 2 x EP 4`` (expert parallelism):
    a ``(data, fsdp, tensor[, expert])`` mesh in a few characters.

    Example:
        >>> layout_of((1, 2, 1, 4)), layout_of((4, 1, 2, 1)), layout_of((1, 1, 1))
        ('FSDP 2 x EP 4', 'DP 4 x TP 2', '1 device')
    """
    sizes = (mesh[0], mesh[1], mesh[3] if len(mesh) > 3 else 1, mesh[2])
    parts = [f"{name} {n}" for name, n in zip(("DP", "FSDP", "EP", "TP"), sizes, strict=True) if n > 1]
    return " x ".join(parts) or "1 device"


def memory_candidates(
    refused: list[Candidate],
    memory: tuple[tuple[str, str], ...],
    ladder: tuple[str, ...] = REMAT_LADDER,
    fitted: list[Candidate] | None = None,
) -> list[Candidate]:
    """Each memory lever alone on the first :data:`MEMORY_LAYOUTS` of ``refused`` (the layouts
    closest to fitting first); given what fits after those (``fitted``), all the levers
    together with the costliest remat of ``ladder`` on the first, where none of those layouts
    fits with any lever.

    Example:
        >>> a, b = Candidate("v5e-8", (8, 1, 1), 1, remat="full"), Candidate("v5e-8", (1, 8, 1), 1, remat="full")
        >>> chunks = (("model.logits_chunk", "1024"),)
        >>> [c.levers for c in memory_candidates([a, b], chunks)]
        ['remat full, logits_chunk=1024', 'remat full, logits_chunk=1024']
        >>> [c.levers for c in memory_candidates([a, b], chunks, OFFLOAD_LADDER, fitted=[])]
        ['remat offload, logits_chunk=1024']
    """
    if not memory or not refused:
        return []
    closest = refused[:MEMORY_LAYOUTS]
    if fitted is None:
        return [dataclasses.replace(c, memory=(m,)) for c in closest for m in memory]
    if any(f.target == c.target and f.mesh == c.mesh for c in closest for f in fitted):
        return []
    c = closest[0]
    return [dataclasses.replace(c, memory=memory, remat=ladder[-1] if c.remat is not None else None)]


def meshes(devices: int) -> list[tuple[int, int, int]]:
    """Every ``(data, fsdp, tensor)`` whose product is ``devices``, tensor-parallel last
    (smaller tensor groups first), data parallelism first within each."""
    found = []
    for tensor in divisors(devices):
        rest = devices // tensor
        for fsdp in divisors(rest):
            found.append((rest // fsdp, fsdp, tensor))
    return found


def expert_meshes(devices: int, experts: int) -> list[tuple[int, int, int, int]]:
    """The expert-parallel layouts of a mixture of ``experts`` experts on ``devices``:
    ``(data, fsdp, tensor, expert)`` with every expert axis above 1 that divides both, FSDP
    over the devices left (the other weights and the optimizer state split there), the
    largest expert axis first; none for a dense model (``experts`` 0)."""
    return [(1, devices // e, 1, e) for e in reversed(divisors(devices)) if e > 1 and experts and experts % e == 0]


def experts_of(params: Any, rules: Mapping[str, str | None] | None = None) -> int:
    """The number of experts of a mixture of experts: the size of the parameters' dimensions
    that the rules send to the ``expert`` mesh axis (logical ``experts``), their greatest
    common divisor where several sizes appear; 0 for a model with none.

    Example:
        >>> from xlafit.parallel.sharding import logical
        >>> stack = nnx.Param(logical(nnx.initializers.zeros, "experts", "embed", "mlp")(jax.random.key(0), (8, 4, 16)))
        >>> experts_of({"w": stack}), experts_of({"w": nnx.Param(jax.numpy.zeros((4, 16)))})
        (8, 0)
    """
    rules = rules or DEFAULT_RULES
    found = 0
    for x in jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, nnx.Variable)):
        names = logical_axes(x) if isinstance(x, nnx.Variable) else None
        shape = tuple(getattr(x.get_value() if isinstance(x, nnx.Variable) else x, "shape", ()))
        for size, name in zip(shape, names or (), strict=False):
            if name is not None and rules.get(name) == "expert":
                found = math.gcd(found, size)
    return found


def mesh_refusal(params: Any, mesh: tuple[int, ...], rules: Mapping[str, str | None] | None = None) -> str | None:
    """Why the model's parameters cannot, or need not, be laid over ``mesh``; None: they can.

    A named dimension that does not divide over its mesh axis cannot (the sharding rules'
    own error); a ``tensor`` (or ``fsdp``) axis that splits no parameter need not: it would
    only repeat the same work on more devices.
    """
    data, fsdp, tensor = mesh[:3]
    expert = mesh[3] if len(mesh) > 3 else 1
    shape = {"data": data, "fsdp": fsdp, "tensor": tensor, "expert": expert}
    try:
        specs = tree_specs(params, shape, rules or DEFAULT_RULES)
    except ConfigError as e:
        return str(e)
    used = {
        axis
        for spec in _leaves(specs)
        for entry in spec
        for axis in (entry if isinstance(entry, tuple) else (entry,))
        if axis is not None
    }
    if tensor > 1 and "tensor" not in used:
        return (
            "no parameter of the model is split over tensor (its named axes send nothing there; "
            'name a dense kernel\'s axes with xlafit.parallel.sharding.logical(init, "embed", "mlp") '
            "or send one of its names there with mesh.rules)"
        )
    if fsdp > 1 and "fsdp" not in used:
        return "no parameter of the model is split over fsdp (its named axes send nothing there)"
    if expert > 1 and "expert" not in used:
        return "no parameter of the model is split over expert (it has no stacked experts named experts)"
    return None


def _leaves(specs: Any) -> list[PartitionSpec]:
    return jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, PartitionSpec))


def params_of(model: nnx.Module) -> Any:
    """The model's parameters (abstract or not), as the sharding rules see them."""
    return nnx.state(model, nnx.Param)
