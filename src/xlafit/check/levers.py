"""What would make a program that does not fit fit on a TPU slice (``xlafit check --tpu``'s
levers): settings that apply to it, with their syntax, ordered by what its memory is made of.
"""

from __future__ import annotations

import math

from xlafit.check.program import Program, TargetReport
from xlafit.check.tpu_report import gib
from xlafit.platform import hardware as tpu

__all__ = ["levers"]


def levers(report: TargetReport, target: tpu.Target, program: Program) -> list[str]:
    """What would make a program that does not fit fit on ``target``, as settings that apply to
    it (with their syntax), ordered by what the memory is made of.

    When the train state (parameters, optimizer state) alone takes half the core's HBM or more,
    the levers that split or move the state come first; otherwise those that shrink the
    activations (a smaller or accumulated batch, fewer steps per call, rematerialisation).
    When the state alone takes more than the core has, no batch fits: only the state's levers
    are given.
    """
    state, capacity = report.memory.get("state", 0), report.capacity or target.hbm_bytes
    n = target.num_devices
    _, fsdp, tensor, expert = _sizes(program.mesh, n)
    per_core, k = report.per_device_batch, report.steps_per_call
    state_levers, activation_levers = [], []
    # About: the state of one copy, as the mesh splits it now (a mixture of experts' experts,
    # most of its parameters, over expert too).
    whole = state * fsdp * tensor * expert
    if n > 1 and fsdp * tensor * expert < n:  # a data axis holds copies of the state: FSDP splits them
        state_levers.append(
            f"FSDP: mesh.fsdp={n // (tensor * expert)} (parameters and optimizer state split over the {n} cores: "
            f"{gib(state)} -> about {gib(whole / n)} per core)"
        )
    # Another generation with the same cores: the same state per core, in more HBM.
    bigger = sorted(
        (g.hbm_gib / (1 if g.megacore else g.cores_per_chip), g.name)
        for g in tpu.GENERATIONS.values()
        if g.hbm_gib / (1 if g.megacore else g.cores_per_chip) * 2**30 > max(target.hbm_bytes, state)
    )
    if bigger:
        state_levers.append(
            "a TPU with more HBM per core: " + ", ".join(f"{name} ({gib:g} GiB)" for gib, name in bigger[:3])
        )
    if whole / n >= capacity:  # even split over every core of the slice, it does not fit
        cores = 2 * n
        while whole / cores >= capacity:
            cores *= 2
        still = f"split over all {n} cores the state still takes about {gib(whole / n)} per core; " if n > 1 else ""
        state_levers.append(
            f"a larger slice: {still}{cores} cores or more with mesh.fsdp={cores} bring the state to about "
            f"{gib(whole / cores)} per core"
        )
    if per_core > 1:
        smaller = program.batch_syntax.format(n=max(1, per_core // 2))
        activation_levers.append(f"a smaller per-core batch: {smaller} (or --max-batch to find the largest)")
        activation_levers.append(
            f"gradient accumulation: trainer.accumulate_steps=2 with a per-core batch of {per_core // 2} "
            "(the same global batch in two micro-batches)"
        )
    if k > 1:
        activation_levers.append(f"fewer steps per call: trainer.steps_per_call=1 (each call holds its {k} batches)")
    for lever in program.model_levers:
        if lever.helps is None or lever.helps(per_core, target.hbm_bytes):  # not a setting the run has in effect
            (state_levers if lever.kind == "state" else activation_levers).append(lever.text)
    if state >= capacity:  # no batch fits: a smaller batch, accumulation or remat cannot help
        return state_levers
    if state >= 0.5 * capacity:
        return [*state_levers, *activation_levers]
    return [*activation_levers, *state_levers]


def _sizes(mesh: tuple[int, ...], devices: int) -> tuple[int, int, int, int]:
    """``(data, fsdp, tensor, expert)`` of a program's mesh (``MeshConfig.sizes``: expert only
    above 1), its -1 (the devices left) resolved over ``devices``."""
    sizes = [*mesh[:4], *(1,) * (4 - len(mesh))]
    fixed = math.prod(x for x in sizes if x != -1)
    data, fsdp, tensor, expert = (devices // max(fixed, 1) if x == -1 else x for x in sizes)
    return data, fsdp, tensor, expert
