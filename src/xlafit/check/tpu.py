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
- the predicted step time (:mod:`xlafit.predict`: each kernel of the compiled program at the
  generation's achievable rates, along its schedule) with the model's measured error band
  for that generation, and beside it the roofline lower bound
  ``max(FLOPs / peak FLOP/s, bytes / HBM bandwidth)`` per core from the datasheet numbers
  of :data:`xlafit.platform.hardware.GENERATIONS` (the bytes as XLA's cost analysis counts
  them, more than the HBM traffic where operations reuse data on chip: only the compute term
  is a strict bound). Both are estimates, not measurements;
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
import re
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from xlafit.check.batch_search import largest_batch
from xlafit.check.levers import levers
from xlafit.check.program import EvalFit, Program, ProgramFit, TargetReport, progress
from xlafit.check.rollout_speed import price, weights_per_core
from xlafit.check.rules import Finding, classify
from xlafit.check.speed import model_step, roofline
from xlafit.errors import ConfigError, XlafitError
from xlafit.parallel.mesh import Strategy, make_mesh
from xlafit.parallel.sharding import bytes_per_device
from xlafit.platform import hardware as tpu
from xlafit.platform.cpu import release_freed_memory
from xlafit.train.state import abstract_state, state_shardings
from xlafit.train.step import make_steps

# How far --max-batch searches unless told: a per-core batch beyond it is rarely the question.
MAX_BATCH_LIMIT = 2**16


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
    mesh: tuple[int, ...] = (-1, 1, 1),
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
    sizes (the compiler's ``arguments`` add the TPU's tile padding to them).

    Arrays in the host's memory (``trainer.optimizer_offload``'s optimizer state) are the
    compiler's ``host_*`` sizes, apart from the HBM's, as ``host memory``; its peak counts
    them too, and they are taken out of it: what must fit is the HBM's.
    """
    m = compiled.memory_analysis()
    host = sum(
        int(getattr(m, f"host_{name}_size_in_bytes", 0) or 0) * sign
        for name, sign in (("argument", 1), ("output", 1), ("alias", -1), ("temp", 1))
    )
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
        out["peak"] = peak - host
    if host:
        out["host memory"] = host
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


def _compile(
    lower: Callable[[], Any], dump_to: Path | None = None, options: Mapping[str, Any] | None = None
) -> tuple[Any, float]:
    """Lowers and compiles; the compiler's out-of-memory refusal becomes :class:`OutOfMemory`.

    ``dump_to``: a directory for the compiler's dump (``xla_dump_to``: the optimised program
    and its buffer assignment, written even when the program does not fit); ``options``:
    compiler options (XLA and libtpu flags by name, as MaxText's recipes set them).
    """
    t0 = time.perf_counter()
    lowered = lower()
    try:
        given = {**(options or {}), **({"xla_dump_to": str(dump_to)} if dump_to else {})}
        compiled = lowered.compile(given or None)
    except Exception as e:  # XlaRuntimeError; its type is private to jaxlib
        text = str(e)
        if "RESOURCE_EXHAUSTED" in text or "Ran out of memory" in text:
            first = next((line for line in text.splitlines() if "memory" in line.lower()), text.splitlines()[0])
            raise OutOfMemory(first.strip()) from None
        raise
    finally:  # the compiler's freed buffers back to the system: the next compile starts lean
        release_freed_memory()
    return compiled, time.perf_counter() - t0


def trainer_refusal(program: Program, target: tpu.Target, mesh: tuple[int, ...]) -> str | None:
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
        self.state = abstract_state(params, model_state, program.tx, self.strategy, program.config.optimizer_offload)
        self.shardings = state_shardings(self.state)
        self.state_bytes = bytes_per_device(self.state)  # each core's shards in its own memory
        self.largest_fit: tuple[int, Any] | None = None  # the largest batch :meth:`fits` compiled, and its program

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

    def compile_train(
        self, per_device: int, dump_to: Path | None = None, options: Mapping[str, Any] | None = None
    ) -> tuple[Any, float]:
        p, s = self.program, self.strategy
        rows = per_device * s.num_replicas
        train_step, _ = self._make_steps(rows)
        batch = _batch(p.example, rows, (p.config.steps_per_call,), s.batch_sharding(1))
        return _compile(lambda: _trace(train_step._jitted, self.state, batch).lower(), dump_to, options)

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
            if self.largest_fit is None or per_device > self.largest_fit[0]:
                self.largest_fit = (per_device, compiled)
            return True, time.perf_counter() - t0, memory_of(compiled, 0, 0)["total"]
        except OutOfMemory as e:
            return False, time.perf_counter() - t0, needed_bytes(e.message)


def needed_bytes(message: str) -> int | None:
    """The bytes per core that a refused program needs, from the compiler's message
    ("... HLO temporaries (23.88G) exceeds available HBM (15.75G)", or, from its memory
    space assignment, "Used 15.79G of 15.75G hbm")."""
    needed = re.search(r"\((\d+(?:\.\d+)?)([KMGT])\) exceeds", message) or re.search(
        r"Used (\d+(?:\.\d+)?)([KMGT]) of \d+(?:\.\d+)?[KMGT] hbm", message
    )
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


def check_target(target: tpu.Target, program: Program, max_batch: bool | int = False) -> TargetReport:
    """Compiles ``program`` for ``target`` and reports memory, verdict, FLOPs and roofline."""
    with no_persistent_cache(), concurrent.futures.ThreadPoolExecutor(1) as pool:
        steps = Steps(target, program)
        n = steps.strategy.num_replicas
        report = TargetReport(
            target.name,
            device_kind=steps.strategy.mesh.devices.flat[0].device_kind,
            devices=steps.strategy.mesh.devices.size,
            hosts=target.hosts,
            batch_shards=n,
            per_device_batch=program.per_device_batch or max(1, (program.global_batch or n) // n),
            steps_per_call=program.config.steps_per_call,
            layout=steps.strategy.layout(),
        )
        report.capacity, report.capacity_source = usable_hbm(target)
        g = program.global_batch
        if program.per_device_batch is None and g and g % n:  # not rounded down in silence
            lower, upper = max(n, g // n * n), (g // n + 1) * n
            choices = f"{lower} or {upper}" if lower != upper else f"{lower}"
            report.error = Finding(
                0,
                f"global batch {g} does not divide over the {n} batch shards of {target.name}; use a multiple of "
                f"{n} ({choices}), or give --per-device-batch.",
                kind="batch",
            )
            report.message = report.error.message
            return report
        # The eval step compiles in a thread beside the train step: the TPU compiler holds
        # no Python lock, and compiling one program keeps one core busy. Where it does not
        # fit, the search for the eval batch that does waits for the train step's verdict.
        evaluation = None
        if program.eval_global_batch:
            per_core = (
                report.per_device_batch
                if program.eval_global_batch == "train"
                else -(-program.eval_global_batch // n)  # the last batch padded
            )
            evaluation = pool.submit(eval_compile, steps, per_core)
        train_report(report, steps, target)
        if evaluation is not None and report.error is None:
            report.eval = evaluation.result()
            if report.eval is not None and not report.eval.fits:
                verdict = "fits" if report.train_fits else "does not fit"
                progress(f"{target.name}: the train step {verdict}")
                search_eval_batch(steps, report.eval, report.capacity)
        if program.rollout is not None and report.error is None:
            report.rollout = rollout_fits(steps, report.per_device_batch * n)
        if max_batch and report.error is None:
            report.max_batch_limit = MAX_BATCH_LIMIT if max_batch is True else int(max_batch)
            report.max_batch, report.probes = largest_batch(
                steps,
                report.per_device_batch,
                report.train_fits,
                report.memory.get("total"),
                report.capacity,
                limit=report.max_batch_limit,
                fixed_bytes=steps.state_bytes,
            )
            report.max_batch_speed = speed_at_largest(report, steps, target)
    return report


def speed_at_largest(report: TargetReport, steps: Steps, target: tpu.Target) -> dict[str, Any] | None:
    """The step model's step and throughput at ``--max-batch``'s answer (the roofline estimate
    where the device has no step model: ``predicted`` False), from the program its search
    compiled there (no compile more); None where it is the run's own batch or none fit."""
    fit = steps.largest_fit
    if not report.max_batch or fit is None or fit[0] != report.max_batch or fit[0] == report.per_device_batch:
        return None
    at = dataclasses.replace(
        report, per_device_batch=fit[0], step_s=None, examples_per_s=None, tokens_per_s=None, predicted=False
    )
    hlo = fit[1].as_text()
    roofline(at, target.peak_flops, target.hbm_bandwidth, steps.program, fit[1], report.steps_per_call, hlo)
    model_step(at, steps.program, hlo, report.steps_per_call, target.generation.device_kinds[0], target.ici_bandwidth)
    if at.step_s is None:
        return None
    speed = ("step_s", "predicted", "examples_per_s", "tokens_per_s", "band", "outside_band")
    return {key: getattr(at, key) for key in speed}


def train_report(report: TargetReport, steps: Steps, target: tpu.Target, settings: str = "") -> None:
    """The train step's verdict, memory, FLOPs and roofline into ``report`` (``settings``: a
    lever's, said in the progress line)."""
    program, per_device, k = steps.program, report.per_device_batch, report.steps_per_call
    what = f"the train step with {settings}" if settings else "the train step"
    progress(f"{target.name}: compiling {what}, {per_device} per core, {k} step(s) per call ...")
    try:
        compiled, report.compile_s = steps.compile_train(per_device)
    except OutOfMemory as e:
        report.train_fits, report.message = False, e.message
        report.memory["state"] = steps.state_bytes
        if (needed := needed_bytes(e.message)) is not None:
            report.memory["total"] = needed
        report.levers = levers(report, target, program)
    except TraceFailure as e:  # the user's code fails on any device: rules 1, 2, or a plain error
        finding = classify(e.original, program.user_file)
        report.error = finding if finding.rule else dataclasses.replace(finding, kind=TRACE_FAILURE)
        report.message = finding.message
    except ConfigError as e:  # the run's settings and this slice (a preset's invariant_chunks and its cores)
        report.error = Finding(0, str(e), kind=f"the run's settings do not suit {target.name}")
        report.message = str(e)
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
        report.train_fits = True
        report.memory = memory_of(compiled, steps.state_bytes, tree_bytes(program.example) * per_device * k)
        hlo = compiled.as_text()  # seconds for a large program: read once
        roofline(report, target.peak_flops, target.hbm_bandwidth, program, compiled, k, hlo)
        model_step(report, program, hlo, k, target.generation.device_kinds[0], target.ici_bandwidth)


def rollout_fits(steps: Steps, rows: int) -> list[ProgramFit]:
    """The programs a run compiles beside its steps (:attr:`Program.rollout`), each compiled at
    the run's ``rows`` on the steps' state, as the run lays it out."""
    program, target = steps.program, steps.target
    assert program.rollout is not None
    name = target.name if target else "this host"
    model = nnx.merge(steps.eval_graphdef, steps.state.params, steps.state.model_state)
    weights = weights_per_core(model)
    decode, trips = program.decode_loop or ("", 0)
    out = []
    for what, traced in program.rollout(model, rows):
        progress(f"{name}: compiling the {what}, {rows} rows over {steps.strategy.num_replicas} batch shard(s) ...")
        try:
            compiled, seconds = _compile(traced.lower)
        except OutOfMemory as e:
            out.append(ProgramFit(what, rows, False, needed=needed_bytes(e.message), message=e.message))
            continue
        except Exception as e:  # the TPU compiler's own fault on this layout (XlaRuntimeError: INTERNAL)
            first = next((line.strip() for line in str(e).splitlines() if line.strip()), type(e).__name__)
            out.append(ProgramFit(what, rows, False, message=first, failed=True))
            continue
        memory = memory_of(compiled, steps.state_bytes, 0)
        fit = ProgramFit(what, rows, True, memory["total"], memory.get("peak"), compile_s=seconds)
        if target is not None:
            devices = steps.strategy.mesh.devices.size
            price(fit, compiled, target, program, devices, weights, trips if what == decode else None)
        out.append(fit)
    return out


def eval_fit(steps: Steps, per_device: int, capacity: float) -> EvalFit | None:
    """The eval step's verdict and memory at ``per_device`` per core (plan's); where it does
    not fit, the largest eval batch that does (:func:`search_eval_batch`). None: another failure."""
    out = eval_compile(steps, per_device)
    if out is not None and not out.fits:
        search_eval_batch(steps, out, capacity)
    return out


def eval_compile(steps: Steps, per_device: int) -> EvalFit | None:
    """The eval step's verdict and memory at ``per_device`` per core, one compile. None: a
    failure that is not about memory (the train step reports it)."""
    name = steps.target.name if steps.target else "this host"
    progress(f"{name}: compiling the eval step, {per_device} per core ...")
    try:
        compiled, seconds = steps.compile_eval(per_device)
    except OutOfMemory as e:
        return EvalFit(False, per_device, needed=needed_bytes(e.message), message=e.message)
    except Exception:  # the train step reports the failure
        return None
    memory = memory_of(compiled, steps.state_bytes, 0)
    return EvalFit(True, per_device, total=memory["total"], peak=memory.get("peak"), compile_s=seconds)


def search_eval_batch(steps: Steps, refused: EvalFit, capacity: float) -> None:
    """Into ``refused`` (an eval step that does not fit): the largest eval batch that compiles
    (:func:`largest_eval_batch`) and the setting that gives it."""
    refused.largest, refused.probes = largest_eval_batch(steps, refused.per_device_batch, refused.needed, capacity)
    if refused.largest:
        refused.fix = steps.program.eval_batch_syntax.format(n=refused.largest * steps.strategy.num_replicas)


class EvalSteps:
    """A program's eval step as :func:`largest_batch` probes it, at per-core batches that
    the run's loop settings allow (``trainer.invariant_chunks`` divides the eval batch too)."""

    def __init__(self, steps: Steps) -> None:
        self.steps, self.program, self.strategy = steps, steps.program, steps.strategy

    @property
    def target(self) -> tpu.Target | None:
        return self.steps.target

    def fits(self, per_device: int) -> tuple[bool, float, int | None]:
        t0 = time.perf_counter()
        try:
            compiled, _ = self.steps.compile_eval(per_device)
        except OutOfMemory as e:
            return False, time.perf_counter() - t0, needed_bytes(e.message)
        memory = memory_of(compiled, 0, 0)
        return True, time.perf_counter() - t0, memory.get("peak") or memory["total"]


def largest_eval_batch(steps: Steps, refused: int, needed: int | None, capacity: float) -> tuple[int, list[Any]]:
    """The largest per-core eval batch below ``refused`` that compiles, found as
    ``--max-batch`` finds the train step's: the first probe where the bytes, in proportion
    to the batch, meet the capacity (the refusal said it ``needed``), then halving or
    narrowing; 0 when not even one example per core fits."""
    guess = int(refused * capacity / needed) if needed and capacity else refused // 2
    guess = max(1, min(guess, refused - 1))
    label = f"{steps.target.name if steps.target else 'this host'} eval step"
    syntax = steps.program.eval_batch_syntax
    given = syntax.format(n=refused * steps.strategy.num_replicas)
    progress(
        f"{label}: the run's eval batch, {refused} per core ({given}), does not fit: searching for the largest that "
        f"compiles, one compile a probe; set {syntax.format(n='N')} to skip the search."
    )
    return largest_batch(
        EvalSteps(steps), guess, None, capacity=capacity, limit=refused - 1, label=label, probe_name="eval batch probe"
    )


def check_targets(targets: list[tpu.Target], program: Program, max_batch: bool | int = False) -> list[TargetReport]:
    """:func:`check_target` for each target, in order."""
    with no_persistent_cache():
        return [check_target(t, program, max_batch) for t in targets]
