"""``check --tpu``'s prediction for this host's own devices (:func:`predict_here`), to hold
against the steps measured on them: the same train step, cost analysis and roofline, priced
at the devices' rows of the hardware table or at given figures.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from xlafit.check.program import Program, TargetReport
from xlafit.check.speed import model_step, roofline
from xlafit.check.tpu import Steps, memory_of, tree_bytes
from xlafit.platform import hardware as tpu

__all__ = ["LocalPrediction", "predict_here"]


@dataclasses.dataclass
class LocalPrediction:
    """:func:`predict_here`'s answer: the report, and the figures it was priced with."""

    report: TargetReport
    peak_flops: float  # one device's FLOP/s
    peak_source: str
    hbm_bandwidth: float  # one device's HBM bytes/s
    bandwidth_source: str


def predict_here(
    program: Program,
    peak_flops: float | None = None,
    bandwidth: float | None = None,
    compiled: Any = None,
) -> LocalPrediction:
    """The prediction of ``check --tpu`` for this host's own devices, to hold against steps
    measured on them: the same train step (:func:`xlafit.train.step.make_steps`, the run's
    shardings over ``program.mesh``) compiled for the devices at hand, the same cost analysis
    and roofline, over the device's rows of the hardware table
    (:func:`~xlafit.platform.hardware.table_peak`, :func:`~xlafit.platform.hardware.table_bandwidth`).

    Args:
        program: what to compile, as for ``check --tpu``.
        peak_flops, bandwidth: one device's FLOP/s and HBM bytes/s in place of the table's
            (a CPU has no row).
        compiled: the train step's program as a run here compiled it (``Trainer.train_step``,
            one step per call), read instead of compiling it again: the program measured is
            then the program predicted.

    Raises:
        LookupError: the device has no row in the table and no figure was given.
    """
    devices = jax.devices()
    kind = devices[0].device_kind
    peak, peak_source = (
        (peak_flops, "given") if peak_flops else _table_row(tpu.table_peak(kind), "peak FLOP/s", "GPUS", kind)
    )
    bytes_per_s, bandwidth_source = (
        (bandwidth, "given") if bandwidth else _table_row(tpu.table_bandwidth(kind), "HBM bandwidth", "GPU_HBM", kind)
    )
    steps = Steps(None, program, devices)
    n, k = steps.strategy.num_replicas, program.config.steps_per_call
    report = TargetReport(
        kind,
        device_kind=kind,
        devices=len(devices),
        batch_shards=n,
        per_device_batch=program.per_device_batch or max(1, (program.global_batch or n) // n),
        steps_per_call=k,
        layout=steps.strategy.layout(),
        train_fits=True,
    )
    if compiled is None:
        compiled, report.compile_s = steps.compile_train(report.per_device_batch)
    report.memory = memory_of(compiled, steps.state_bytes, tree_bytes(program.example) * report.per_device_batch * k)
    hlo = compiled.as_text()
    roofline(report, peak, bytes_per_s, program, compiled, k, hlo)
    model_step(report, program, hlo, k, kind)
    return LocalPrediction(report, peak, peak_source, bytes_per_s, bandwidth_source)


def _table_row(row: tuple[float, str] | None, what: str, table: str, kind: str) -> tuple[float, str]:
    if row is None:
        raise LookupError(f"no {what} known for {kind!r}; add it to xlafit.platform.hardware.{table}, or give it.")
    return row
