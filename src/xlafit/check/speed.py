"""How fast a compiled train step runs on a device: the step model's prediction
(:mod:`xlafit.predict`: every kernel at the device's achievable rates) with its measured
error band, and the roofline estimate (FLOPs at peak, bytes at datasheet bandwidth) beside
it. The estimate's compute term is a strict lower bound on the step; its memory term is not
(XLA's bytes accessed include buffers kept in on-chip memory), so the estimate may lie above
the prediction (:func:`above_prediction`)."""

from __future__ import annotations

import re
from typing import Any

from flax import nnx

from xlafit.check.program import Program, TargetReport
from xlafit.predict.hlo import kernel_flops, loop_flops
from xlafit.predict.model import Link, predict
from xlafit.predict.rates import Kind, parameter_count, rates_for

# The error bands come from steps of seconds; a step under SHORTEST_BANDED_S is bound by kernel
# launch and host dispatch, which the step model does not price: its band would mislead there.
SHORTEST_BANDED_S = 1e-3
OUTSIDE_BAND = (
    "no error band: a step under 1 ms is outside the range the step model was measured on (so short a step is "
    "bound by launch and dispatch costs the model does not price)"
)


def outside_band(step_s: float | None) -> bool:
    """Whether a predicted step is too short for the step model's measured error to hold."""
    return step_s is not None and 0 < step_s < SHORTEST_BANDED_S


def program_kind(program: Program, devices: int, step_s: float) -> Kind:
    """What a prediction of ``program``'s step is for, to hold against the programs its
    error band was measured on (:meth:`xlafit.predict.rates.Band.unlike`)."""
    training = "full" if program.trainable is nnx.Param else "lora"
    return Kind(program.family, parameter_count(program.model), devices, step_s, training)


def above_prediction(step_s: float, compute_s: float, memory_s: float) -> str:
    """Why a roofline estimate above the predicted step ``step_s`` does not contradict it, in
    a few words; ``""`` when neither term is above it. The memory term is XLA's count of bytes
    accessed, buffers the compiler keeps in on-chip memory (a TPU's VMEM) included, where the
    step model counts HBM traffic only (docs/explanations/step-model.md). A compute term above
    it is the prediction's error: no step runs its FLOPs faster than the chip's peak.

    Example:
        >>> above_prediction(0.0239, 0.012, 0.0574).split(";")[0]
        "above the predicted step: its memory term counts XLA's bytes accessed, buffers kept in on-chip memory included"
        >>> above_prediction(0.07, 0.012, 0.0574)
        ''
    """
    if memory_s > step_s and memory_s >= compute_s:
        return (
            "above the predicted step: its memory term counts XLA's bytes accessed, buffers kept in on-chip memory "
            "included; the step model counts HBM traffic only"
        )
    if compute_s > step_s:  # no step runs its FLOPs faster than the chip's peak
        return (
            "above the predicted step: the step's FLOPs at the chip's peak take longer than the prediction, which "
            "is too fast here (the step model found fewer FLOPs in the compiled kernels); the compute term is the "
            "floor"
        )
    return ""


def steps_in_cost(hlo: str, k: int) -> int:
    """How many of a call's ``k`` steps XLA's cost analysis counted: one when the steps stayed
    a loop (a ``while`` body is counted once), ``k`` when the compiler unrolled them."""
    if k == 1:
        return 1
    return 1 if re.search(r"\bwhile\(", hlo) else k


def roofline(
    report: TargetReport, peak: float, bandwidth: float, program: Program, compiled: Any, k: int, hlo: str
) -> None:
    """Fills FLOPs, bytes and the roofline estimate from the compiled program of ``k`` steps:
    XLA's cost analysis, plus the FLOPs of the Pallas kernels it cannot see (splash
    attention: :func:`xlafit.predict.hlo.kernel_flops`) and the products of loops inside a step,
    which it counts once (:func:`xlafit.predict.hlo.loop_flops`), over one device's ``peak``
    FLOP/s and HBM ``bandwidth`` (bytes/s)."""
    cost, counted = compiled.cost_analysis() or {}, steps_in_cost(hlo, k)
    # The products of loops inside a step (a scan over layers), which the cost analysis counts once.
    inner = loop_flops(hlo, {k} if k > 1 else ())
    flops = (float(cost.get("flops", 0.0)) + inner) / counted + kernel_flops(hlo) / k or None
    report.flops_per_step = flops
    report.bytes_per_step = float(cost.get("bytes accessed", 0.0)) / counted or None
    rows = report.per_device_batch * report.batch_shards  # the global batch
    if program.flops_per_example:  # per core: a tensor-parallel group splits its shard's work
        report.analytic_flops_per_step = program.flops_per_example * rows / report.devices
    if flops is None:
        return
    # Never less than the model's own FLOPs: XLA's count of a TPU program can fall short of
    # them (an 8B Llama's step counted 0.89x its analytic FLOPs, recomputed forward and all),
    # and a step faster than its model FLOPs at peak would claim an MFU above 100 %.
    compute = max(flops, report.analytic_flops_per_step or 0.0) / peak
    memory = (report.bytes_per_step or 0.0) / bandwidth
    report.compute_s, report.memory_s = compute, memory
    report.bound_s = report.step_s = max(compute, memory)
    report.bound = "compute" if compute >= memory else "HBM bandwidth"
    _throughput(report, program)


def _throughput(report: TargetReport, program: Program) -> None:
    rows = report.per_device_batch * report.batch_shards
    assert report.step_s
    report.examples_per_s = rows / report.step_s
    if program.tokens_per_example:
        report.tokens_per_s = report.examples_per_s * program.tokens_per_example


def model_step(
    report: TargetReport,
    program: Program,
    hlo: str,
    k: int,
    device_kind: str,
    link: Link = None,
    calibration: str | None = None,
) -> None:
    """The step model's prediction of one step of a compiled program (its text ``hlo``, ``k``
    steps per call) on
    ``device_kind``, with its error band, into ``report`` (after :func:`roofline`); where the
    device has no rates the report keeps the roofline estimate and its band says why."""
    rates = rates_for(device_kind, calibration)
    if rates is None:
        report.band = (
            f"no step model for {device_kind}: the roofline estimate only (xlafit bench --calibrate on one measures it)"
        )
        return
    prediction = predict(hlo, rates, link, report.devices)
    if prediction.seconds <= 0:
        return
    report.step_s = prediction.seconds / k
    report.predicted = True
    report.band, report.band_median = rates.band_for(program_kind(program, report.devices, report.step_s))
    report.outside_band = report.band_median is None and rates.band is not None
    if outside_band(report.step_s):
        report.band, report.band_median, report.outside_band = OUTSIDE_BAND, None, True
    report.rates = rates.origin
    _throughput(report, program)
