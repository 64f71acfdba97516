"""What ``xlafit check --tpu`` compiles (:class:`Program`) and what it answers per target
(:class:`TargetReport`, one :class:`Probe` per ``--max-batch`` compile)."""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal, NamedTuple

import jax
import optax
from flax import nnx

from xlafit.config import TrainerConfig
from xlafit.parallel.mesh import Strategy
from xlafit.train.step import LossFn

# The batches one --max-batch search may compile (with the check's own compile at the start
# batch: 6). A fit costs a whole compile (minutes for a 1B model at 2,048 tokens), and past a
# few probes the bracket is narrower than the batch's effect on anything but memory.
MAX_PROBES = 5


def progress(text: str, end: str = "\n") -> None:
    """Progress on stderr (the report itself goes to stdout, or is returned); one write per line,
    so that the lines of compiles in other threads (the eval step's beside the train step's) do
    not run together (``print`` writes the text and its end apart)."""
    sys.stderr.write(text + end)
    sys.stderr.flush()


@dataclasses.dataclass(frozen=True)
class FitLever:
    """A setting that may make a run fit, which ``check --tpu`` compiles to find out.

    Attributes:
        name: what it does, in a few words (``a 4-bit (NF4) frozen base``).
        overrides: the dotted settings that turn it on (``lora.base_dtype=nf4``).
        shrinks: ``state`` (parameters, optimizer state) or ``activations``: a lever of the
            activations cannot help a run whose state alone is over the core's memory.
        helps: ``helps(per_core_batch, device_memory)``: whether it changes the run on a
            device of that memory (the logits in chunks, for a run whose ``auto`` setting
            chunks them already there: no); None: always.
    """

    name: str
    overrides: tuple[str, ...]
    shrinks: str = "activations"
    helps: Callable[[int, float], bool] | None = dataclasses.field(default=None, compare=False)


class ModelLever(NamedTuple):
    """A lever only a program's maker knows (a recipe's ``model.remat``), as ``check --tpu``
    lists it: what it shrinks (``state`` or ``activations``), its text with the setting, and
    :attr:`FitLever.helps` where it helps some runs only."""

    kind: str
    text: str
    helps: Callable[[int, float], bool] | None = None


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
        eval_global_batch: eval examples per call over all cores; ``"train"``: the train step's
            batch, as a run evaluates where ``data.eval_global_batch`` is unset; None skips the
            eval step.
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
    eval_global_batch: int | Literal["train"] | None = None
    flops_per_example: float | None = None
    tokens_per_example: float | None = None
    user_file: str | None = None
    # The kind of model, as the step model's error bands name it (a recipe: llm, bert,
    # resnet, mnist); None: a user's own, never held against a measured step.
    family: str | None = None
    # The run's mesh over the target's cores: (data, fsdp, tensor[, expert]), one may be -1; and its
    # logical-axis rules (xlafit.parallel.sharding). The default is pure data parallelism.
    mesh: tuple[int, ...] = (-1, 1, 1)
    rules: Mapping[str, str | None] | None = None
    # How this program's per-core batch is set ({n}: the number), and levers only its maker
    # knows (a recipe's model.remat): (what they shrink, "state" or "activations", the text).
    batch_syntax: str = "data.per_device_batch={n}"
    eval_batch_syntax: str = "data.eval_global_batch={n}"  # {n}: eval examples per call over all cores
    model_levers: tuple[ModelLever, ...] = ()
    # What the optimizer trains (LoRA: the adapters); the rest is frozen state.
    trainable: Any = nnx.Param
    # Levers the check compiles where the run does not fit (a recipe's: its settings), and
    # the same program with more settings (None: a user's file, which cannot be rebuilt).
    fit_levers: tuple[FitLever, ...] = ()
    with_overrides: Callable[[tuple[str, ...]], Program] | None = None
    # The trainer settings a converted model refuses (a torch module or a Keras model trains
    # data-parallel only): xlafit.train.adapter.Adapted.check, called with each layout.
    settings_check: Callable[[Strategy, TrainerConfig], None] | None = None
    # The programs a run compiles beside its steps, on the same state (GRPO's rollout: the
    # generation, the log-probabilities): ``rollout(model, rows)`` -> [(name, traced)] for the
    # model as the steps' abstract state lays it out and the global batch's rows.
    rollout: Callable[[nnx.Module, int], list[tuple[str, Any]]] | None = None
    # Which of them generates, and its decode loop's trips (the tokens after the prefill's first).
    decode_loop: tuple[str, int] | None = None


@dataclasses.dataclass
class Probe:
    """One compile of ``--max-batch``: the per-core batch, whether it fit, and its time."""

    per_device_batch: int
    fits: bool
    seconds: float


@dataclasses.dataclass
class EvalFit:
    """The eval step's compile at ``per_device_batch`` examples per core.

    ``total`` sums the compiler's buffers (arguments, outputs, temporaries, code); ``peak``
    is the compiler's own peak, which is what must fit: temporaries never live at the same
    time are each counted in the total, so a program the compiler accepts may total more
    than the core's HBM. A refused program has ``needed`` (the compiler's count) and, where
    a smaller eval batch compiles, ``largest`` (per core) and ``fix`` (the setting that
    gives it), found by ``--max-batch``'s search (``probes``).
    """

    fits: bool
    per_device_batch: int
    total: int | None = None
    peak: int | None = None
    needed: int | None = None
    message: str | None = None
    compile_s: float = 0.0
    largest: int | None = None
    fix: str | None = None
    probes: list[Probe] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class ProgramFit:
    """A program the run compiles beside its steps (:attr:`Program.rollout`: GRPO's generation
    and log-probabilities), at the run's batch: whether it fits, the compiler's peak and the sum
    of its buffers per core (or what a refusal asked for and the compiler's ``message``), its
    compile time."""

    name: str
    rows: int  # the rows over all cores
    fits: bool
    total: int | None = None
    peak: int | None = None
    needed: int | None = None
    message: str | None = None
    compile_s: float = 0.0
    # The compiler failed for another reason than memory (an internal error of the TPU compiler
    # for this layout): it does not compile, and ``message`` is the compiler's first line
    failed: bool = False
    # Its time (xlafit.check.rollout_speed): one run, the step model's where the target has rates
    # (``predicted``; else the roofline estimate), with its band or why there is none.
    run_s: float | None = None
    predicted: bool = False
    band: str | None = None
    band_median: float | None = None
    flops: float | None = None  # per core, one run: XLA's count with the products of its loops
    bytes: float | None = None  # per core, XLA's bytes accessed (a loop's body counted once)
    # A generation's decode loop: its trips (the steps after the prefill's first token; each runs
    # whether or not its rows have stopped), their time, FLOPs and HBM bytes per core as the step
    # model counts them, and the floor: every step reads the policy's weights (``weights``: the
    # bytes of each core's shard) from HBM at the target's bandwidth, but for what the compiler
    # keeps in on-chip memory from trip to trip (``on_chip``: bytes of the loop's state).
    decode_steps: int | None = None
    decode_s: float | None = None
    decode_collective_s: float | None = None  # of decode_s, the collectives no kernel hides
    decode_flops: float | None = None
    decode_bytes: float | None = None
    weights: int | None = None
    on_chip: int | None = None
    floor_s: float | None = None


def not_fitting(train_fits: bool | None, evaluation: EvalFit | None, others: Sequence[ProgramFit] = ()) -> list[str]:
    """The programs of a run that do not fit, by name."""
    out = ["train step"] if train_fits is False else []
    out += ["eval step"] if evaluation is not None and not evaluation.fits else []
    return out + [p.name for p in others if not p.fits]


def decide(train_fits: bool | None, evaluation: EvalFit | None, others: Sequence[ProgramFit] = ()) -> bool | None:
    """A run's verdict, from every program it compiles: it fits only when the train step,
    (where the run evaluates) the eval step and the programs beside them (``others``: a
    rollout's) all fit; a run whose first evaluation or rollout does not compile dies there.
    None: the train step failed for another reason than memory (an error), and nothing is known.

    Example:
        >>> decide(True, EvalFit(fits=False, per_device_batch=64))
        False
        >>> decide(True, None), decide(None, None)
        (True, None)
        >>> decide(True, None, [ProgramFit("rollout generation", 64, fits=False)])
        False
    """
    if train_fits is None:
        return None
    return not not_fitting(train_fits, evaluation, others)


@dataclasses.dataclass
class LeverFit:
    """One lever's compile (:class:`FitLever`): the train step at ``per_device_batch`` per core
    with ``overrides``, whether it fits, its memory per core and the step model's prediction.

    ``memory`` is the compiler's peak where it fits (else the sum of its buffers), or what
    the refusal asked for; ``band`` says the prediction's measured error, or that it was
    not validated for such a program (``band_median`` None)."""

    name: str
    overrides: list[str]
    per_device_batch: int
    fits: bool | None = None  # None: not compiled (``message`` says why)
    memory: int | None = None
    step_s: float | None = None
    predicted: bool = False  # step_s is the step model's (else the roofline estimate's)
    band: str | None = None
    band_median: float | None = None
    tokens_per_s: float | None = None
    examples_per_s: float | None = None
    compile_s: float = 0.0
    message: str | None = None


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
    hosts: int = 1  # the slice's TPU VMs (processes): more than one is a multi-host job
    batch_shards: int = 0  # data x fsdp: the cores unless a tensor-parallel group shares its rows
    per_device_batch: int = 0  # per batch shard
    steps_per_call: int = 1
    layout: str = ""  # the mesh line (Strategy.layout)
    train_fits: bool | None = None  # the train step's compile; None: it failed for another reason (``error``)
    capacity: float = 0.0
    capacity_source: str = ""
    memory: dict[str, int] = dataclasses.field(default_factory=dict)
    message: str | None = None  # the compiler's refusal, or the error
    error: Any = None  # a check.Finding for a failure that is not out-of-memory
    flops_per_step: float | None = None
    analytic_flops_per_step: float | None = None
    bytes_per_step: float | None = None
    step_s: float | None = None  # the step model's prediction; the roofline estimate where it has no rates
    predicted: bool = False  # step_s is the step model's (else the bound's)
    band: str | None = None  # the step model's measured error for this device kind, or why there is none
    band_median: float | None = None  # that error's median, |predicted / measured - 1|
    outside_band: bool = False  # no band quoted: the program is unlike those it was measured on (no median then)
    rates: str | None = None  # where the step model's rates come from (built-in, a calibration file)
    bound_s: float | None = None  # the roofline estimate: max(compute, memory)
    compute_s: float | None = None  # FLOPs / peak FLOP/s
    memory_s: float | None = None  # XLA's bytes accessed / HBM bandwidth
    bound: str | None = None  # what bounds the roofline: compute or HBM bandwidth
    examples_per_s: float | None = None
    tokens_per_s: float | None = None
    compile_s: float = 0.0
    eval: EvalFit | None = None  # the eval step's compile, where the run evaluates
    rollout: list[ProgramFit] = dataclasses.field(default_factory=list)  # the programs beside the steps
    max_batch: int | None = None
    max_batch_limit: int | None = None  # the search's upper end: max_batch == it means "at least"
    # the step model at max_batch, from its probe's compile: step_s, examples_per_s, tokens_per_s, band
    max_batch_speed: dict[str, Any] | None = None
    probes: list[Probe] = dataclasses.field(default_factory=list)
    levers: list[str] = dataclasses.field(default_factory=list)  # when it does not fit: what would help
    # The levers compiled (xlafit.check.lever_fits): where the run does not fit, at its batch;
    # under --max-batch, at the smallest batch refused
    lever_fits: list[LeverFit] = dataclasses.field(default_factory=list)

    @property
    def fits(self) -> bool | None:
        """Whether the run fits: :func:`decide` over every program it compiles."""
        return decide(self.train_fits, self.eval, self.rollout)

    @property
    def unfit(self) -> list[str]:
        """The programs that do not fit, by name (``train step``, ``eval step``, a rollout's)."""
        return not_fitting(self.train_fits, self.eval, self.rollout)

    @property
    def rollout_s(self) -> float | None:
        """One generation batch's rollout (its programs' times added); None where one is not priced."""
        times = [p.run_s for p in self.rollout]
        return sum(t for t in times if t is not None) if times and None not in times else None

    @property
    def grpo_step_s(self) -> float | None:
        """One generation batch of a run with a rollout: the rollout, then its train steps
        (``steps_per_call``: GRPO's ``num_iterations``)."""
        rollout = self.rollout_s
        return rollout + self.steps_per_call * self.step_s if rollout is not None and self.step_s else None

    @property
    def rollout_share(self) -> float | None:
        """The rollout's share of :attr:`grpo_step_s`."""
        whole, rollout = self.grpo_step_s, self.rollout_s
        return rollout / whole if whole and rollout is not None else None

    @property
    def flops_per_call(self) -> float | None:
        return self.flops_per_step * self.steps_per_call if self.flops_per_step else None

    @property
    def margin(self) -> float | None:
        """Bytes left per core (negative: over) against the compiler's capacity, of
        :func:`used_bytes`."""
        used = used_bytes(self.memory)
        if used is None or not self.capacity:
            return None
        return self.capacity - used


def used_bytes(memory: Mapping[str, int]) -> int | None:
    """The HBM per core a compiled program takes, as ``check --tpu`` and ``plan`` both count it:
    the compiler's peak where it reports one (the buffers' sum counts buffers that are never
    live at once, and misses what the compiler holds beside them: a small program's peak is
    above it), else the sum (``total``)."""
    return memory.get("peak") or memory.get("total")
