"""What ``xlafit plan`` may try on a slice: meshes the model's axes allow, and the levers.

A candidate is one way to run: the mesh (``data x fsdp x tensor`` = the slice's devices),
the model's rematerialisation policy (where the model has ``model.remat``), whether its
layers are scanned (``model.scan_layers``, where it has that), the per-core batch and the
gradient accumulation. Each is written as the dotted overrides that
``xlafit train`` takes, so the plan's answer is a command.

Example:
    >>> meshes(8)
    [(8, 1, 1), (4, 2, 1), (2, 4, 1), (1, 8, 1), (4, 1, 2), (2, 2, 2), (1, 4, 2), (2, 1, 4), (1, 2, 4), (1, 1, 8)]
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax
from flax import nnx
from jax.sharding import PartitionSpec

from xlafit.errors import ConfigError
from xlafit.parallel.sharding import DEFAULT_RULES, divisors, tree_specs

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
    mesh: tuple[int, int, int]  # data, fsdp, tensor
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
    def shards(self) -> int:
        """Batch shards: data x fsdp (a tensor group shares its shard)."""
        return self.mesh[0] * self.mesh[1]

    @property
    def global_batch(self) -> int:
        return self.per_device_batch * self.shards

    @property
    def layout(self) -> str:
        """``DP 8``, ``FSDP 8``, ``DP 2 x FSDP 2 x TP 2``: the mesh in a few characters."""
        parts = [f"{name} {n}" for name, n in zip(("DP", "FSDP", "TP"), self.mesh, strict=True) if n > 1]
        return " x ".join(parts) or "1 device"

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
        data, fsdp, tensor = self.mesh
        out: dict[str, Any] = {"mesh.data": data, "mesh.fsdp": fsdp, "mesh.tensor": tensor}
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


def mesh_refusal(params: Any, mesh: tuple[int, int, int], rules: Mapping[str, str | None] | None = None) -> str | None:
    """Why the model's parameters cannot, or need not, be laid over ``mesh``; None: they can.

    A named dimension that does not divide over its mesh axis cannot (the sharding rules'
    own error); a ``tensor`` (or ``fsdp``) axis that splits no parameter need not: it would
    only repeat the same work on more devices.
    """
    data, fsdp, tensor = mesh
    shape = {"data": data, "fsdp": fsdp, "tensor": tensor}
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
    return None


def _leaves(specs: Any) -> list[PartitionSpec]:
    return jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, PartitionSpec))


def params_of(model: nnx.Module) -> Any:
    """The model's parameters (abstract or not), as the sharding rules see them."""
    return nnx.state(model, nnx.Param)
