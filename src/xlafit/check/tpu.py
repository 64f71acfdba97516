"""``xlafit check --tpu``: compile the real train step for TPU slices, on this machine.

For each target (:mod:`xlafit.platform.hardware`) the run's own train and eval steps
(:func:`xlafit.train.step.make_steps`: the trainer's shardings, donation, steps per call,
gradient accumulation and dtypes) are lowered with abstract inputs laid over the slice's
devices and compiled by libtpu. Nothing is allocated: the model may come from
``nnx.eval_shape``, so a model larger than this machine's memory can be checked. The report:

- per-core HBM from the compiler's memory analysis (state, batch, outputs, temporaries,
  generated code) against the capacity the compiler allows, and the verdict; the compiler's
  out-of-memory refusal *is* the "does not fit" verdict, with the levers that help;
- FLOPs per step from XLA's cost analysis of the compiled program. Inside the ``lax.scan``
  of ``k`` steps per call XLA counts the loop body, one step, once: the call does ``k`` times
  that. An analytic count, where the model has one, is shown beside it;
- a roofline lower bound of the step time: ``max(FLOPs / peak FLOP/s, bytes / HBM bandwidth)``
  per core, from the datasheet numbers of :data:`xlafit.platform.hardware.GENERATIONS`, with the bytes as
  XLA's cost analysis counts them (every operand and result of the program's operations;
  more than the HBM traffic where operations reuse data on chip, so the memory term leans
  high, and only the compute term is a strict bound). An estimate, not a measurement:
  real steps are slower (MFU below 100 %, collectives, input);
- the compile time on this machine;
- with ``max_batch``, the largest per-core batch that compiles (a far probe just past where
  the bytes, growing from the state, reach the capacity; then the bytes interpolated at the
  capacity, bisection as the fallback;
  each probe one compile, refusals are fast).

Each compile takes seconds to minutes here, so a line on stderr says what is compiling and
how each ``--max-batch`` probe ended, as it happens.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import functools
import math
import re
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from xlafit.check.hlo import kernel_flops, loop_flops
from xlafit.check.rules import Finding, classify
from xlafit.config import TrainerConfig
from xlafit.errors import ConfigError, XlafitError
from xlafit.parallel.mesh import Strategy, make_mesh
from xlafit.parallel.sharding import bytes_per_device
from xlafit.platform import hardware as tpu
from xlafit.train.step import LossFn, abstract_state, make_steps, state_shardings

# How far --max-batch searches unless told: a per-core batch beyond it is rarely the question.
MAX_BATCH_LIMIT = 2**16


def _progress(text: str, end: str = "\n") -> None:
    """Progress on stderr (the report itself goes to stdout, or is returned)."""
    print(text, end=end, file=sys.stderr, flush=True)


@dataclasses.dataclass
class Program:
    """What to compile: one run's model, loss, optimizer, loop settings and example layout.

    Attributes:
        model: an ``nnx.Module``, concrete or from ``nnx.eval_shape``.
        loss_fn: ``loss_fn(model, batch)`` as for :class:`xlafit.Trainer`.
        tx: the optimizer.
        config: the loop settings (steps per call, accumulation, invariant chunks).
        example: one example's arrays as ``ShapeDtypeStruct`` (no batch axis).
        per_device_batch: train examples per core per step; None: ``global_batch`` over the
            target's cores.
        global_batch: examples per step over all cores, when ``per_device_batch`` is None.
        eval_global_batch: eval examples per call over all cores; None skips the eval step.
        flops_per_example: analytic training FLOPs of one example, when the model has a count.
        tokens_per_example: for a tokens/s estimate.
        user_file: the user's file, to place failures at its lines.
    """

    model: nnx.Module
    loss_fn: LossFn
    tx: optax.GradientTransformation
    config: TrainerConfig
    example: dict[str, jax.ShapeDtypeStruct]
    per_device_batch: int | None
    global_batch: int | None = None
    eval_global_batch: int | None = None
    flops_per_example: float | None = None
    tokens_per_example: float | None = None
    user_file: str | None = None
    # The run's mesh over the target's cores: (data, fsdp, tensor), one may be -1; and its
    # logical-axis rules (xlafit.parallel.sharding). The default is pure data parallelism.
    mesh: tuple[int, int, int] = (-1, 1, 1)
    rules: Mapping[str, str | None] | None = None
    # How this program's per-core batch is set ({n}: the number), and levers only its maker
    # knows (a recipe's model.remat): (what they shrink, "state" or "activations", the text).
    batch_syntax: str = "data.per_device_batch={n}"
    model_levers: tuple[tuple[str, str], ...] = ()
    # What the optimizer trains (LoRA: the adapters); the rest is frozen state.
    trainable: Any = nnx.Param
    # The trainer settings a converted model refuses (a torch module or a Keras model trains
    # data-parallel only): xlafit.train.adapter.Adapted.check, called with each layout.
    settings_check: Callable[[Strategy, TrainerConfig], None] | None = None


@dataclasses.dataclass
class Probe:
    """One compile of ``--max-batch``: the per-core batch, whether it fit, and its time."""

    per_device_batch: int
    fits: bool
    seconds: float


@dataclasses.dataclass
class TargetReport:
    """The answer for one TPU target (see the module docstring).

    ``memory`` is per core, in bytes, from ``compiled.memory_analysis()``: ``arguments``
    (the ``state`` and ``batch``, whose own sizes are given beside, with tile padding),
    ``outputs`` (what is not aliased to a donated argument), ``temporaries``, ``generated
    code``, and ``total`` = arguments + outputs + temporaries + generated code; ``peak`` is
    the compiler's own peak where it reports one.
    """

    target: str
    device_kind: str = ""
    devices: int = 0  # the slice's cores
    batch_shards: int = 0  # data x fsdp: the cores unless a tensor-parallel group shares its rows
    per_device_batch: int = 0  # per batch shard
    steps_per_call: int = 1
    layout: str = ""  # the mesh line (Strategy.layout)
    fits: bool | None = None  # None: it failed for another reason (``error``)
    capacity: float = 0.0
    capacity_source: str = ""
    memory: dict[str, int] = dataclasses.field(default_factory=dict)
    message: str | None = None  # the compiler's refusal, or the error
    error: Any = None  # a check.Finding for a failure that is not out-of-memory
    flops_per_step: float | None = None
    analytic_flops_per_step: float | None = None
    bytes_per_step: float | None = None
    step_s: float | None = None
    compute_s: float | None = None  # FLOPs / peak FLOP/s
    memory_s: float | None = None  # XLA's bytes accessed / HBM bandwidth
    bound: str | None = None
    examples_per_s: float | None = None
    tokens_per_s: float | None = None
    compile_s: float = 0.0
    eval: dict[str, Any] | None = None
    max_batch: int | None = None
    max_batch_limit: int | None = None  # the search's upper end: max_batch == it means "at least"
    probes: list[Probe] = dataclasses.field(default_factory=list)
    levers: list[str] = dataclasses.field(default_factory=list)  # when it does not fit: what would help

    @property
    def flops_per_call(self) -> float | None:
        return self.flops_per_step * self.steps_per_call if self.flops_per_step else None

    @property
    def margin(self) -> float | None:
        """Bytes left per core (negative: over), against the compiler's capacity."""
        total = self.memory.get("total")
        return None if total is None or not self.capacity else self.capacity - total


_UNITS = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}  # the compiler's byte counts: "(15.75G)"


# The title of a failure raised while tracing the step (a KeyError in loss_fn, mismatched
# shapes): the program fails on any device, the CPU too, and no TPU is to blame.
TRACE_FAILURE = "fails while tracing the train step (on any device, not only a TPU)"


class TraceFailure(Exception):
    """An exception raised while tracing a step (``original``), before any lowering for a TPU."""

    def __init__(self, original: Exception) -> None:
        super().__init__(str(original))
        self.original = original


class OutOfMemory(Exception):
    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


def _strategy(
    target: tpu.Target | None,
    mesh: tuple[int, int, int] = (-1, 1, 1),
    rules: Any = None,
    devices: list[Any] | None = None,
) -> Strategy:
    """A strategy over ``target``'s devices, or over ``devices`` (this host's own) when given."""
    if devices is None:
        assert target is not None, "a target or devices"
        devices = tpu.devices(target)
    devices = sorted(devices, key=lambda d: (d.process_index, d.id))
    return Strategy(make_mesh(devices, *mesh), rules)


@functools.cache
def usable_hbm(target: tpu.Target) -> tuple[float, str]:
    """``(bytes, source)``: the HBM per core that the compiler lets a program use.

    Asked of the compiler itself: a program that needs far more than any TPU has is refused
    within a second with "exceeds available HBM (15.75G)". The datasheet's number (16 GiB
    on v5e) is the fallback when the message does not say.
    """
    strategy = _strategy(target)
    x = jax.ShapeDtypeStruct((2**18,), jnp.float32, sharding=strategy.replicated)
    try:  # a 256 GiB result
        jax.jit(lambda v: jnp.outer(v, v) + 1, out_shardings=strategy.replicated).lower(x).compile()
    except Exception as e:
        found = re.search(r"available HBM \((\d+(?:\.\d+)?)([KMGT])\)", str(e))
        if found:
            return float(found.group(1)) * _UNITS[found.group(2)], "the TPU compiler's limit"
    return target.hbm_bytes, f"{target.source} (datasheet)"


def tree_bytes(tree: Any) -> int:
    """Bytes of a tree of ``ShapeDtypeStruct``s (a PRNG key counts as its key data)."""
    total = 0
    for x in jax.tree.leaves(tree):
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            x = jax.eval_shape(jax.random.key_data, x)
        total += int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize
    return total


def _batch(example: dict[str, jax.ShapeDtypeStruct], rows: int, leading: tuple[int, ...], sharding: Any) -> dict:
    return {k: jax.ShapeDtypeStruct((*leading, rows, *v.shape), v.dtype, sharding=sharding) for k, v in example.items()}


def memory_of(compiled: Any, state_bytes: int, batch_bytes: int) -> dict[str, int]:
    """Per-core bytes: the compiler's memory analysis, and the state's and the batch's own
    sizes (the compiler's ``arguments`` add the TPU's tile padding to them)."""
    m = compiled.memory_analysis()
    out = {
        "state": state_bytes,
        "batch": batch_bytes,
        "arguments": int(m.argument_size_in_bytes),
        "outputs": int(m.output_size_in_bytes - m.alias_size_in_bytes),
        "temporaries": int(m.temp_size_in_bytes),
        "generated code": int(m.generated_code_size_in_bytes),
    }
    out["total"] = out["arguments"] + out["outputs"] + out["temporaries"] + out["generated code"]
    peak = int(getattr(m, "peak_memory_in_bytes", 0) or 0)
    if peak:
        out["peak"] = peak
    return out


@contextlib.contextmanager
def no_persistent_cache() -> Iterator[None]:
    """JAX's persistent compilation cache off for TPU programs compiled here: the
    compile-only client can write an entry but not load one back ("PjRtCompiler must be
    constructed with a Client"), and the entries would only fill the user's cache."""
    from jax.experimental.compilation_cache import compilation_cache

    before = bool(getattr(jax.config, "jax_enable_compilation_cache"))  # noqa: B009  (a typed-stub gap)
    if not before:  # already off (a nested call)
        yield
        return
    jax.config.update("jax_enable_compilation_cache", False)
    compilation_cache.reset_cache()  # JAX decides "cache or not" once per process: ask again
    try:
        yield
    finally:
        jax.config.update("jax_enable_compilation_cache", before)
        compilation_cache.reset_cache()


def _trace(jitted: Any, *args: Any) -> Any:
    """``jitted.trace(*args)``; what the tracing raises (the user's code, on any device) is a
    :class:`TraceFailure`, apart from what lowering for the TPU raises later."""
    try:
        return jitted.trace(*args)
    except Exception as e:
        raise TraceFailure(e) from e


def _compile(lower: Callable[[], Any], dump_to: Path | None = None) -> tuple[Any, float]:
    """Lowers and compiles; the compiler's out-of-memory refusal becomes :class:`OutOfMemory`.

    ``dump_to``: a directory for the compiler's dump (``xla_dump_to``: the optimised program
    and its buffer assignment, written even when the program does not fit).
    """
    t0 = time.perf_counter()
    lowered = lower()
    try:
        compiled = lowered.compile({"xla_dump_to": str(dump_to)} if dump_to else None)
    except Exception as e:  # XlaRuntimeError; its type is private to jaxlib
        text = str(e)
        if "RESOURCE_EXHAUSTED" in text or "Ran out of memory" in text:
            first = next((line for line in text.splitlines() if "memory" in line.lower()), text.splitlines()[0])
            raise OutOfMemory(first.strip()) from None
        raise
    return compiled, time.perf_counter() - t0


def trainer_refusal(program: Program, target: tpu.Target, mesh: tuple[int, int, int]) -> str | None:
    """What the trainer would refuse for ``program`` over ``mesh`` on ``target`` (a converted
    model's settings check: a torch module or a Keras model trains data-parallel only), or None."""
    if program.settings_check is None:
        return None
    try:
        strategy = _strategy(target, mesh, program.rules)
    except XlafitError:  # a mesh the slice cannot take: the caller's to report
        return None
    try:
        program.settings_check(strategy, program.config)
    except ConfigError as e:
        return str(e)
    return None


class Steps:
    """A program's steps for one target (or for this host's ``devices``, target None), with
    the abstract state, compiled at any batch."""

    def __init__(self, target: tpu.Target | None, program: Program, devices: list[Any] | None = None) -> None:
        self.target = target
        self.program = program
        self.strategy = _strategy(target, program.mesh, program.rules, devices)
        if program.settings_check is not None:  # what the trainer would refuse, refused here too
            program.settings_check(self.strategy, program.config)
        model = program.model
        model.train()
        graphdef, params, model_state = nnx.split(model, program.trainable, ...)  # type: ignore[misc]  # flax's overloads
        self.train_graphdef: nnx.GraphDef = graphdef
        model.eval()
        self.eval_graphdef = nnx.graphdef(model)
        model.train()
        self.state = abstract_state(params, model_state, program.tx, self.strategy)
        self.shardings = state_shardings(self.state)
        self.state_bytes = bytes_per_device(self.state)  # each core's shards

    def _make_steps(self, rows: int) -> tuple[Any, Any]:
        """The run's train and eval steps for ``rows`` examples per step over all cores."""
        p = self.program
        return make_steps(
            self.train_graphdef,
            self.eval_graphdef,
            p.loss_fn,
            p.tx,
            self.strategy,
            p.config,
            rows,
            self.shardings,
            trainable=p.trainable,
        )

    def compile_train(self, per_device: int, dump_to: Path | None = None) -> tuple[Any, float]:
        p, s = self.program, self.strategy
        rows = per_device * s.num_replicas
        train_step, _ = self._make_steps(rows)
        batch = _batch(p.example, rows, (p.config.steps_per_call,), s.batch_sharding(1))
        return _compile(lambda: _trace(train_step._jitted, self.state, batch).lower(), dump_to)

    def compile_eval(self, per_device: int) -> tuple[Any, float]:
        p, s = self.program, self.strategy
        rows = per_device * s.num_replicas
        _, eval_step = self._make_steps(rows)
        batch = _batch(p.example, rows, (), s.batch)
        mask = jax.ShapeDtypeStruct((rows,), jnp.float32, sharding=s.batch)
        return _compile(lambda: eval_step._jitted.lower(self.state, batch, mask))

    def primitive_site(self, message: str, user_file: str, per_device: int) -> tuple[str, int] | None:
        """Where in ``user_file`` the operation named by a lowering error ("rule for primitive
        'eig' not found for platform tpu") is called.

        Each equation of a jaxpr keeps the Python frames of its call up to the enclosing
        ``jit`` (``jnp.linalg`` functions are jitted): the user's line is in the innermost
        frame of ``user_file`` along the chain of enclosing equations.
        """
        found = re.search(r"primitive '([^']+)'", message)
        if found is None:
            return None
        p = self.program

        def loss(params: Any, model_state: Any, batch: Any) -> Any:  # forward only
            return p.loss_fn(nnx.merge(self.train_graphdef, params, model_state, copy=True), batch)

        batch = {k: jax.ShapeDtypeStruct((per_device, *v.shape), v.dtype) for k, v in p.example.items()}
        abstract = lambda tree: jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)  # noqa: E731
        jaxpr = jax.make_jaxpr(loss)(abstract(self.state.params), abstract(self.state.model_state), batch)
        target = Path(user_file).resolve()
        for chain in _equations(jaxpr.jaxpr):
            if chain[-1].primitive.name != found.group(1):
                continue
            for eqn in reversed(chain):  # the operation, then the calls that enclose it
                tb = eqn.source_info.traceback
                for frame in tb.frames if tb is not None else []:  # innermost first
                    if Path(frame.file_name).resolve() == target:
                        return frame.file_name, frame.line_num
        return None

    def fits(self, per_device: int) -> tuple[bool, float, int | None]:
        """Whether the train step compiles at ``per_device``, the seconds it took, and the
        bytes per core it needs (the memory analysis, or the compiler's refusal)."""
        t0 = time.perf_counter()
        try:
            compiled, _ = self.compile_train(per_device)
            return True, time.perf_counter() - t0, memory_of(compiled, 0, 0)["total"]
        except OutOfMemory as e:
            return False, time.perf_counter() - t0, needed_bytes(e.message)


def needed_bytes(message: str) -> int | None:
    """The bytes per core that a refused program needs, from the compiler's message
    ("... HLO temporaries (23.88G) exceeds available HBM (15.75G)")."""
    needed = re.search(r"\((\d+(?:\.\d+)?)([KMGT])\) exceeds", message)
    return int(float(needed.group(1)) * _UNITS[needed.group(2)]) if needed else None


def _equations(jaxpr: Any, outer: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    """Every equation of ``jaxpr`` and of the jaxprs inside it (jit, scan, cond, ...), each
    as the chain of equations that encloses it, itself last."""
    for eqn in jaxpr.eqns:
        chain = (*outer, eqn)
        yield chain
        for value in eqn.params.values():
            for sub in value if isinstance(value, (list, tuple)) else (value,):
                inner = getattr(sub, "jaxpr", sub)  # a ClosedJaxpr holds its Jaxpr
                if hasattr(inner, "eqns"):
                    yield from _equations(inner, chain)


def steps_in_cost(compiled: Any, k: int) -> int:
    """How many of a call's ``k`` steps XLA's cost analysis counted: one when the steps stayed
    a loop (a ``while`` body is counted once), ``k`` when the compiler unrolled them."""
    if k == 1:
        return 1
    return 1 if re.search(r"\bwhile\(", compiled.as_text()) else k


def _roofline(report: TargetReport, peak: float, bandwidth: float, program: Program, compiled: Any, k: int) -> None:
    """Fills FLOPs, bytes and the roofline bound from the compiled program of ``k`` steps:
    XLA's cost analysis, plus the FLOPs of the Pallas kernels it cannot see (splash
    attention: :func:`xlafit.check.hlo.kernel_flops`) and the products of loops inside a step,
    which it counts once (:func:`xlafit.check.hlo.loop_flops`), over one device's ``peak``
    FLOP/s and HBM ``bandwidth`` (bytes/s)."""
    cost, counted, hlo = compiled.cost_analysis() or {}, steps_in_cost(compiled, k), compiled.as_text()
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
    report.step_s = max(compute, memory)
    report.bound = "compute" if compute >= memory else "HBM bandwidth"
    report.examples_per_s = rows / report.step_s
    if program.tokens_per_example:
        report.tokens_per_s = report.examples_per_s * program.tokens_per_example


def check_target(target: tpu.Target, program: Program, max_batch: bool | int = False) -> TargetReport:
    """Compiles ``program`` for ``target`` and reports memory, verdict, FLOPs and roofline."""
    with no_persistent_cache(), concurrent.futures.ThreadPoolExecutor(1) as pool:
        steps = Steps(target, program)
        n = steps.strategy.num_replicas
        report = TargetReport(
            target.name,
            device_kind=steps.strategy.mesh.devices.flat[0].device_kind,
            devices=steps.strategy.mesh.devices.size,
            batch_shards=n,
            per_device_batch=program.per_device_batch or max(1, (program.global_batch or n) // n),
            steps_per_call=program.config.steps_per_call,
            layout=steps.strategy.layout(),
        )
        report.capacity, report.capacity_source = usable_hbm(target)
        g = program.global_batch
        if program.per_device_batch is None and g and g % n:  # not rounded down in silence
            lower, upper = max(n, g // n * n), (g // n + 1) * n
            report.error = Finding(
                0,
                f"global batch {g} does not divide over the {n} batch shards of {target.name}; use a multiple of "
                f"{n} ({lower} or {upper}), or give --per-device-batch.",
                kind="batch",
            )
            report.message = report.error.message
            return report
        # The eval step compiles in a thread beside the train step: the TPU compiler holds
        # no Python lock, and compiling one program keeps one core busy.
        evaluation = None
        if program.eval_global_batch:
            evaluation = pool.submit(_eval_report, steps, -(-program.eval_global_batch // n))  # last batch padded
        _train_report(report, steps, target)
        if evaluation is not None and report.error is None:
            report.eval = evaluation.result()
        if max_batch and report.error is None:
            report.max_batch_limit = MAX_BATCH_LIMIT if max_batch is True else int(max_batch)
            report.max_batch, report.probes = largest_batch(
                steps,
                report.per_device_batch,
                report.fits,
                report.memory.get("total"),
                report.capacity,
                limit=report.max_batch_limit,
                fixed_bytes=steps.state_bytes,
            )
    return report


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
        fits=True,
    )
    if compiled is None:
        compiled, report.compile_s = steps.compile_train(report.per_device_batch)
    report.memory = memory_of(compiled, steps.state_bytes, tree_bytes(program.example) * report.per_device_batch * k)
    _roofline(report, peak, bytes_per_s, program, compiled, k)
    return LocalPrediction(report, peak, peak_source, bytes_per_s, bandwidth_source)


def _table_row(row: tuple[float, str] | None, what: str, table: str, kind: str) -> tuple[float, str]:
    if row is None:
        raise LookupError(f"no {what} known for {kind!r}; add it to xlafit.platform.hardware.{table}, or give it.")
    return row


def _train_report(report: TargetReport, steps: Steps, target: tpu.Target) -> None:
    """The train step's verdict, memory, FLOPs and roofline into ``report``."""
    program, per_device, k = steps.program, report.per_device_batch, report.steps_per_call
    _progress(f"{target.name}: compiling the train step, {per_device} per core, {k} step(s) per call ...")
    try:
        compiled, report.compile_s = steps.compile_train(per_device)
    except OutOfMemory as e:
        report.fits, report.message = False, e.message
        report.memory["state"] = steps.state_bytes
        if (needed := needed_bytes(e.message)) is not None:
            report.memory["total"] = needed
        report.levers = levers(report, target, program)
    except TraceFailure as e:  # the user's code fails on any device: rules 1, 2, or a plain error
        finding = classify(e.original, program.user_file)
        report.error = finding if finding.rule else dataclasses.replace(finding, kind=TRACE_FAILURE)
        report.message = finding.message
    except Exception as e:  # a failure that is not about memory: placed at the user's line
        finding = classify(e, program.user_file)
        if finding.rule == 0:
            finding = dataclasses.replace(finding, kind=f"compiles for the CPU, not for {target.name}")
            if finding.line is None and program.user_file:  # raised while lowering: no user frame
                site = steps.primitive_site(str(e), program.user_file, per_device)
                if site is not None:
                    code = Path(site[0]).read_text().splitlines()[site[1] - 1].strip()
                    finding = dataclasses.replace(finding, file=site[0], line=site[1], code=code)
        report.error = finding
        report.message = finding.message
    else:
        report.fits = True
        report.memory = memory_of(compiled, steps.state_bytes, tree_bytes(program.example) * per_device * k)
        _roofline(report, target.peak_flops, target.hbm_bandwidth, program, compiled, k)


def _eval_report(steps: Steps, per_device: int) -> dict[str, Any] | None:
    """The eval step's verdict and memory at ``per_device`` examples per core."""
    try:
        compiled, seconds = steps.compile_eval(per_device)
    except OutOfMemory as e:
        return {"fits": False, "per_device_batch": per_device, "message": e.message}
    except Exception:  # the train step reports the failure
        return None
    total = memory_of(compiled, steps.state_bytes, 0)["total"]
    return {"fits": True, "per_device_batch": per_device, "total": total, "compile_s": seconds}


class BatchProber(Protocol):
    """What :func:`largest_batch` probes: a program on a target, compiled at any batch
    (:class:`Steps`, or a planner's recording of them)."""

    program: Program
    strategy: Strategy

    @property
    def target(self) -> tpu.Target | None: ...

    def fits(self, per_device: int) -> tuple[bool, float, int | None]: ...


def largest_batch(
    steps: BatchProber,
    start: int,
    start_fits: bool | None,
    start_bytes: int | None = None,
    capacity: float = 0.0,
    multiple: int = 8,
    limit: int = 2**16,
    tolerance: float = 0.02,
    fixed_bytes: int | None = None,
    enough: Callable[[int], bool] | None = None,
    label: str | None = None,
) -> tuple[int, list[Probe]]:
    """The largest per-core batch that compiles, and the probes that found it.

    A probe that does not fit is cheap (the compiler refuses it at buffer assignment, in
    seconds, and says how much it needed); one that fits costs a whole compile (minutes for
    BERT-base). So the search reaches far first: 16x ``start`` (again while that fits), or
    halving when ``start`` does not fit. Then it narrows the bracket between the last fit
    and the first refusal by interpolating the bytes each needed (per-core memory grows about
    linearly with the batch: the state is fixed, activations scale) at ``capacity``, falling
    back to bisection when an interpolation lands on the same side twice, until the first
    refusal is within ``tolerance`` (2 %) of the last fit: a fit of 55,000 examples per core
    costs two minutes to compile, and the next multiple of 8 is no answer worth them. Batches stay
    multiples of ``multiple`` (8: a TPU vector register holds 8 rows of a float32 tile) and
    of what the loop needs (``trainer.accumulate_steps``, ``invariant_chunks`` per core);
    below ``multiple``, of the loop's unit only. 0: not even the smallest batch fits.
    With ``fixed_bytes`` (what does not grow with the batch: the state), each reach follows
    a line to the capacity instead of 16x: from the state through the first fit, then
    through the last two fits. ``enough(batch)``, asked after each new fit, ends the search
    there when it says so (a planner stops once a larger batch no longer runs faster).
    ``start`` itself, known to fit, may be below ``multiple``: it is not compiled again.
    ``label`` names the search in its progress lines (several may run at once).
    """
    config = steps.program.config
    base = config.accumulate_steps
    if config.invariant_chunks:
        base = math.lcm(base, config.invariant_chunks // steps.strategy.num_replicas)
    unit = math.lcm(base, multiple)
    probing = _Probing(steps, label or (steps.target.name if steps.target else "this host"), enough)
    first = start if start_fits and start % base == 0 else max(unit, start // unit * unit)
    known = start_fits is not None and first == start
    if known and start_bytes is not None:
        probing.needs[first] = start_bytes
    if start_fits if known else probing.fits(first):
        good, bad = _reach_up(probing, first, fixed_bytes, capacity, unit, limit)
        if not bad:
            return good, probing.probes
    else:
        (good, bad), unit = _halve_down(probing, first, base), base
        if not good:
            return 0, probing.probes
    return _narrow(probing, good, bad, capacity, unit, tolerance, base), probing.probes


class _Probing:
    """The probes of one batch search: each compiled once, announced as it starts and ends,
    with the bytes the compiler reported; ``enough`` may end the search after a fit."""

    def __init__(self, steps: BatchProber, name: str, enough: Callable[[int], bool] | None) -> None:
        self.steps, self.name, self.enough = steps, name, enough
        self.probes: list[Probe] = []
        self.needs: dict[int, int] = {}  # per-core batch -> bytes per core, as the compiler said
        self.done = False  # ``enough`` said so

    def fits(self, batch: int) -> bool:
        n = len(self.probes) + 1
        _progress(f"{self.name}: --max-batch probe {n}: {batch} per core ...")
        ok, seconds, needed = self.steps.fits(batch)
        self.probes.append(Probe(batch, ok, seconds))
        verdict = "fits" if ok else "does not fit" + (f", needs {_gib(needed)}" if needed is not None else "")
        _progress(f"{self.name}: --max-batch probe {n}: {batch} per core {verdict} ({seconds:.0f} s)")
        if needed is not None:
            self.needs[batch] = needed
        self.done = bool(ok and self.enough is not None and self.enough(batch))
        return ok


def _reach_up(
    probing: _Probing, good: int, fixed_bytes: int | None, capacity: float, unit: int, limit: int
) -> tuple[int, int]:
    """From a fit, far probes upward until one is refused: ``(last fit, refusal)``, the
    refusal 0 when the search ends without one (the limit, or ``enough``)."""
    line = (0, fixed_bytes)  # the reach's line starts at the state, then runs through the last two fits
    while True:
        far = _reach(good, probing.needs.get(good), line, capacity, unit, limit)
        if far <= good:
            return good, 0
        if not probing.fits(far):
            return good, far
        line, good = (good, probing.needs.get(good)), far
        if probing.done:
            return good, 0


def _halve_down(probing: _Probing, bad: int, base: int) -> tuple[int, int]:
    """From a refusal, halving until a batch fits: ``(that fit, the last refusal)``, the fit
    0 when not even ``base`` does."""
    while True:
        half = bad // 2 // base * base
        if half < base:
            return 0, bad
        if probing.fits(half):
            return half, bad
        bad = half


def _narrow(probing: _Probing, good: int, bad: int, capacity: float, multiple: int, tolerance: float, base: int) -> int:
    """The bracket between a fit and a refusal narrowed to ``tolerance``: the last fit.
    Probes are multiples of ``multiple``, or of ``base`` once the refusal is at or below it."""
    streak: list[bool] = []  # the outcomes of the interpolated probes since the last bisection
    while not probing.done:
        unit = base if bad <= multiple else multiple
        if _up(good + 1, unit) >= bad or bad - good <= tolerance * good:
            break
        floor = good // unit * unit  # the start may be a known fit below the unit
        guess = _interpolate(good, bad, probing.needs, capacity, unit)
        if guess is not None:
            # Near the capacity the compiler packs tighter and the line lands just above the
            # last fit, which crept up 8 at a time (a v5p search: 33800, 33808, 33816, 33824,
            # two minutes each). A guess at least `tolerance` above it ends the search with one
            # cheap refusal, or moves it up that much.
            guess = min(max(guess, floor + max(unit, int(tolerance * good) // unit * unit)), bad - unit)
        if guess is None or streak[-2:] in ([True, True], [False, False]):
            guess, streak = floor + (bad - floor) // unit // 2 * unit, []
            ok = probing.fits(guess)
        else:
            ok = probing.fits(guess)
            streak.append(ok)
        good, bad = (guess, bad) if ok else (good, guess)
    return good


def _reach(batch: int, used: int | None, line: tuple[int, int | None], capacity: float, unit: int, limit: int) -> int:
    """The next far probe above a fitting ``batch``: 16x, or, given the line's other point
    (``(0, the state's bytes)`` at first, then the previous fit), 5 % beyond where the line
    through it and ``(batch, used)`` crosses ``capacity``: most likely a cheap refusal that
    brackets the answer closely. A fit there moves the line to the last two fits, whose slope
    is the activations' own (the state's line also carries the gradients and the update's
    buffers, which do not grow with the batch, and so undershoots)."""
    other, other_used = line
    if used is None or other_used is None or not capacity or used <= other_used or batch <= other:
        return min(limit, batch * 16) // unit * unit
    per_example = (used - other_used) / (batch - other)
    crossing = batch + (capacity - used) / per_example
    return min(limit, max(_up(batch + 1, unit), int(crossing * 1.05) // unit * unit))


def _up(batch: int, unit: int) -> int:
    """The smallest multiple of ``unit`` at or above ``batch``."""
    return -(-batch // unit) * unit


def _interpolate(good: int, bad: int, needs: dict[int, int], capacity: float, unit: int) -> int | None:
    """The batch at which the line through the bracket's (batch, bytes) meets ``capacity``,
    rounded down to ``unit`` and kept strictly inside the bracket; None when unknown."""
    if not capacity or good not in needs or bad not in needs or needs[bad] <= needs[good]:
        return None
    slope = (needs[bad] - needs[good]) / (bad - good)
    guess = int(good + (capacity - needs[good]) / slope) // unit * unit
    return min(max(guess, _up(good + 1, unit)), bad - unit)


def check_targets(targets: list[tpu.Target], program: Program, max_batch: bool | int = False) -> list[TargetReport]:
    """:func:`check_target` for each target, in order."""
    with no_persistent_cache():
        return [check_target(t, program, max_batch) for t in targets]


def levers(report: TargetReport, target: tpu.Target, program: Program) -> list[str]:
    """What would make a program that does not fit fit on ``target``, as settings that apply to
    it (with their syntax), ordered by what the memory is made of.

    When the train state (parameters, optimizer state) alone takes half the core's HBM or more,
    the levers that split or move the state come first; otherwise those that shrink the
    activations (a smaller or accumulated batch, fewer steps per call, rematerialisation).
    """
    state, capacity = report.memory.get("state", 0), report.capacity or target.hbm_bytes
    n, (_, fsdp, tensor) = target.num_devices, program.mesh
    per_core, k = report.per_device_batch, report.steps_per_call
    state_levers, activation_levers = [], []
    if n > 1 and fsdp == 1 and tensor == 1:
        state_levers.append(
            f"FSDP: mesh.fsdp={n} (parameters and optimizer state split over the {n} cores: "
            f"{_gib(state)} -> about {_gib(state / n)} per core)"
        )
    bigger = sorted(
        (g.hbm_gib / (1 if g.megacore else g.cores_per_chip), g.name)
        for g in tpu.GENERATIONS.values()
        if g.hbm_gib / (1 if g.megacore else g.cores_per_chip) * 2**30 > target.hbm_bytes
    )
    if bigger:
        state_levers.append(
            "a TPU with more HBM per core: " + ", ".join(f"{name} ({gib:g} GiB)" for gib, name in bigger[:3])
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
    for kind, text in program.model_levers:
        (state_levers if kind == "state" else activation_levers).append(text)
    if state >= 0.5 * capacity:
        return [*state_levers, *activation_levers]
    return [*activation_levers, *state_levers]


# --------------------------------------------------------------------------- formatting


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if abs(n) >= 2**30 / 100 else f"{n / 2**20:.1f} MiB"


def _rate(x: float | None, unit: str) -> str:
    if not x:
        return "-"
    for scale, prefix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if x >= scale:
            return f"{x / scale:.3g}{prefix} {unit}"
    return f"{x:.3g} {unit}"


def target_peak(r: TargetReport) -> str:
    t = tpu.parse_target(r.target)
    return f"{t.peak_flops / 1e12:.4g} TFLOP/s bf16 per core"


def format_report(r: TargetReport) -> str:
    """One target's report, as lines for a terminal."""
    shared = (
        f"; each batch shard is shared by a tensor group of {r.devices // r.batch_shards} cores"
        if r.batch_shards and r.batch_shards != r.devices
        else ""
    )
    batch = f"per-core batch {r.per_device_batch} (global {r.per_device_batch * r.batch_shards}{shared}), "
    if r.error is not None and r.error.kind == "batch":  # no per-core batch: the error says why
        batch = ""
    head = f"{r.target} ({r.devices} x {r.device_kind}), {batch}{r.steps_per_call} step(s) per call"
    lines = [head, f"  {r.layout}"] if r.layout and "replicated" not in r.layout else [head]
    if r.error is not None:
        where = f" at {r.error.file}:{r.error.line}" if r.error.file and r.error.line else ""
        lines.append(f"  ✗ {r.error.title}{where}")
        if r.error.code:
            lines.append(f"      {r.error.line} | {r.error.code}")
        lines.append(f"    {r.message}")
        return "\n".join(lines)
    lines += _fit_lines(r) + _eval_lines(r) + _speed_lines(r)
    if r.fits:
        lines.append(f"  compiled in {r.compile_s:.1f} s on this machine")
    if r.probes:
        lines.append(_probe_line(r))
    return "\n".join(lines)


def _fit_lines(r: TargetReport) -> list[str]:
    """The verdict: HBM per core and its parts, or by how much it is over and the levers."""
    cap = f"{_gib(r.capacity)} per core ({r.capacity_source})"
    if not r.fits:
        need = f" needs {_gib(r.memory['total'])}," if "total" in r.memory else ""
        over = f" over by {_gib(-(r.margin or 0))}" if r.margin is not None else ""
        lines = [f"  ✗ does not fit:{need} {cap}{over}", f"    the compiler: {r.message}"]
        if r.levers:
            state = r.memory.get("state")
            made_of = f" (the train state takes {_gib(state)} per core)" if state else ""
            lines.append(f"    levers, most promising first{made_of}:")
            lines += [f"      - {lever}" for lever in r.levers]
        return lines
    m = r.memory
    parts = ", ".join(
        f"{k} {_gib(m[k])}" for k in ("state", "batch", "outputs", "temporaries", "generated code") if k in m
    )
    peak = f", compiler's peak {_gib(m['peak'])}" if "peak" in m else ""
    lines = [f"  HBM per core: {_gib(m['total'])} of {cap}{peak}", f"    {parts}"]
    if (r.margin or 0) >= 0:
        share = m["total"] / r.capacity if r.capacity else 0
        lines.append(f"  ✓ fits, {_gib(r.margin or 0)} to spare ({share:.0%} used)")
    else:  # accepted by the compiler, whose own peak is what must fit
        lines.append(
            f"  ✓ fits, with nothing to spare: the compiler placed it within {_gib(r.capacity)}; the parts above "
            "add up to more because buffers that are never live at the same time are each counted"
        )
    return lines


def _eval_lines(r: TargetReport) -> list[str]:
    if r.eval is None:
        return []
    e = r.eval
    if not e["fits"]:
        return [f"  eval step (batch {e['per_device_batch']} per core): does not fit: {e['message']}"]
    return [
        f"  eval step (batch {e['per_device_batch']} per core): fits, {_gib(e['total'])}, "
        f"compiled in {e['compile_s']:.1f} s"
    ]


def _speed_lines(r: TargetReport) -> list[str]:
    """FLOPs per step (XLA's count against the analytic one) and the roofline estimate."""
    lines = []
    if r.flops_per_step:
        analytic = ""
        if r.analytic_flops_per_step:
            analytic = (
                f" (analytic {r.analytic_flops_per_step:.4g}, XLA/analytic "
                f"{r.flops_per_step / r.analytic_flops_per_step:.3f})"
            )
        lines.append(f"  FLOPs per core per step (XLA): {r.flops_per_step:.4g}{analytic}")
        if r.steps_per_call > 1 and r.flops_per_call:
            lines.append(f"    per call of {r.steps_per_call} steps: {r.flops_per_call:.4g}")
    if r.step_s and r.compute_s is not None and r.memory_s is not None:
        tokens = f", {_rate(r.tokens_per_s, 'tokens/s')}" if r.tokens_per_s else ""
        lines.append(
            f"  roofline (an estimate, not a measurement): step >= {r.step_s * 1e3:.3g} ms, "
            f"<= {_rate(r.examples_per_s, 'examples/s')}{tokens}"
        )
        lines.append(
            f"    compute {r.compute_s * 1e3:.3g} ms at {target_peak(r)} (a strict lower bound); memory "
            f"{r.memory_s * 1e3:.3g} ms for XLA's count of {r.bytes_per_step or 0:.3g} bytes accessed (may "
            "overstate HBM traffic)"
        )
    return lines


def _probe_line(r: TargetReport) -> str:
    """--max-batch's answer; at the search's limit it is a lower bound, and says so."""
    probes = ", ".join(f"{p.per_device_batch}{'✓' if p.fits else '✗'} {p.seconds:.1f}s" for p in r.probes)
    if r.max_batch_limit is not None and r.max_batch is not None and r.max_batch >= r.max_batch_limit:
        answer = f">= {r.max_batch} (the search's limit; --max-batch-limit {r.max_batch_limit * 4} searches further)"
    else:
        refused = min((p.per_device_batch for p in r.probes if not p.fits), default=None)
        bound = f" ({refused} does not)" if refused is not None and refused > (r.max_batch or 0) + 8 else ""
        answer = f"{r.max_batch}{bound}"
    return f"  largest per-core batch that fits: {answer}   probes: {probes}"


def format_table(reports: list[TargetReport]) -> str:
    """Targets side by side: verdict, HBM per core, largest batch, roofline."""
    rows = [("target", "fits", "HBM/core", "of", "max batch", "step >=", "examples/s <=", "compile")]
    for r in reports:
        total = r.memory.get("total")
        rows.append(
            (
                r.target,
                "error" if r.error is not None else "yes" if r.fits else "no",
                _gib(total) if total else "-",
                _gib(r.capacity) if r.capacity else "-",
                str(r.max_batch) if r.max_batch is not None else "-",
                f"{r.step_s * 1e3:.3g} ms" if r.step_s else "-",
                _rate(r.examples_per_s, "").strip() or "-",
                f"{r.compile_s:.0f} s" if r.compile_s else "-",
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in rows)


def to_json(r: TargetReport) -> dict[str, Any]:
    out = dataclasses.asdict(r)
    out["error"] = None if r.error is None else {**dataclasses.asdict(r.error), "title": r.error.title}
    out["flops_per_call"] = r.flops_per_call
    out["margin"] = r.margin
    return out
