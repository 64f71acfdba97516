"""What a run tells of its progress: the start-up lines (:func:`announce`) and the logged
record of the calls since the last log (:func:`progress_record`)."""

from __future__ import annotations

from typing import Any

import optax

from xlafit.config import TrainerConfig
from xlafit.data.dataset import Dataset
from xlafit.data.loader import TrainOrder
from xlafit.parallel.mesh import Strategy
from xlafit.parallel.sharding import bytes_per_device
from xlafit.platform.cpu import keeping_freed_memory
from xlafit.platform.hardware import peak_flops
from xlafit.train.loop import lr_at, peak_lr, times
from xlafit.train.nonfinite import applied_means
from xlafit.train.report import RunReport
from xlafit.train.state import TrainState

__all__ = ["IN_MEMORY", "announce", "in_memory_start", "progress_record"]

# How to go on after a stop where no checkpoint holds the run: the trainer's memory does.
IN_MEMORY = (
    "Calling fit again on this trainer goes on from there: the run lives in this process's memory alone "
    "(gone when it ends; give run_dir to keep checkpoints)."
)

# The start-up lines said once a process, not at every run in it.
_said = {"host memory": False}


def announce(
    report: RunReport,
    s: Strategy,
    cfg: TrainerConfig,
    state: TrainState,
    *,
    restored: int | None,
    order: TrainOrder,
    train: Dataset,
    total: int,
    global_batch: int,
    learning_rate: optax.Schedule | float | None,
    flops_per_example: float | None,
    peak: float | None,
) -> float | None:
    """The start-up lines: resume point, devices and batch, steps, dropped examples, MFU peak.

    Returns the peak FLOP/s the MFU is measured against: ``peak``, or the devices' looked up
    when ``flops_per_example`` is given and ``peak`` is None; None when there is none.
    """
    spe = order.steps_per_epoch
    if restored is not None and restored >= total:
        report.print(f"the run is finished: checkpoint {restored} is its last step ({cfg.epochs} epochs)")
    elif restored is not None:
        report.print(f"resumed from checkpoint {restored} (epoch {restored // spe + 1} of {cfg.epochs})")
    report.print(
        f"devices: {s.num_devices} x {s.platform} ({s.process_count} process(es))   "
        f"per-device batch: {global_batch // s.num_replicas}   global batch: {global_batch}"
    )
    if keeping_freed_memory() and not _said["host memory"]:
        # Users see the process grow by its temporaries and should know why; once a process,
        # as it holds for the process (a notebook's every fit said it again). The setting is
        # the config's for a recipe or the command, connect's for a Trainer.
        _said["host memory"] = True
        report.print(
            "host memory: freed blocks are kept for the next step (no page faults; the process holds "
            "more memory); cpu.keep_memory=false returns them, in Python "
            "xlafit.connect(cpu=xlafit.platform.cpu.CpuConfig(keep_memory=False)) before JAX starts"
        )
    if not s.data_parallel_only:
        held = bytes_per_device((state.params, state.opt_state)) / 2**20
        report.print(f"{s.layout()}; parameters + optimizer state: {held:.1f} MiB per device")
    dropped = len(train) - spe * global_batch
    if order.plan is None and dropped:
        report.print(
            f"each epoch trains on {spe * global_batch} of {len(train)} examples: the last partial batch "
            f"({dropped}) is left out, a different one every epoch since the order is reshuffled"
        )
    if flops_per_example and peak is None:
        try:
            peak, source = peak_flops(list(s.mesh.devices.flat))
            report.print(f"MFU against {peak / 1e12:.4g} TFLOP/s: {source}")
        except LookupError as e:
            report.print(f"MFU not reported: {e}")
    if restored is None or restored < total:  # a finished run trains nothing: no steps to tell
        highest = peak_lr(learning_rate, total)
        report.print(
            f"steps: {spe}/epoch x {cfg.epochs} epochs = {total}   steps per call: {cfg.steps_per_call}"
            + (f"   peak learning rate: {highest:.4g}" if highest is not None else "")
        )
    return peak


def progress_record(
    step: int,
    spe: int,
    pending: list,
    values: list,
    busy: float,
    wait: float,
    *,
    global_batch: int,
    learning_rate: optax.Schedule | float | None,
    tokens_per_example: float | None,
    flops_per_example: float | None,
    peak: float | None,
    compiles: int,
) -> dict[str, Any]:
    """The logged record of the calls in ``pending``: means of their metrics over the
    applied updates, throughput over ``busy`` seconds, and the input wait."""
    steps_done = step - pending[0][0]
    record: dict[str, Any] = {"step": step, "epoch": round(step / spe, 3), **applied_means(values)}
    rate = steps_done * global_batch / busy
    record.update(
        {
            "learning_rate": lr_at(learning_rate, step - 1),
            "examples_per_sec": rate,
            "tokens_per_sec": times(rate, tokens_per_example),
            "mfu": times(rate, flops_per_example, peak),
            "step_time_s": busy / steps_done,
            "input_wait_s": wait,
            "compiles": compiles,
        }
    )
    return {k: v for k, v in record.items() if v is not None}


def in_memory_start(start: int, total: int, steps_per_epoch: int, epochs: int) -> str:
    """Where a fit of a trainer that an earlier fit (with no checkpoint) took to ``start`` begins."""
    if start >= total:
        return (
            f"this trainer's run is finished: step {start} is its last ({epochs} epochs), so fit trains nothing more; "
            "to train on, make a new Trainer of the model (it holds the trained values) for the epochs to add"
        )
    epoch = start // steps_per_epoch + 1
    return f"going on from step {start} (epoch {epoch} of {epochs}), held in this trainer's memory"
