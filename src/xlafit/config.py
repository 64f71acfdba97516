"""Typed run configuration: the sections' dataclasses, their checks, the batch per device.

A run is described by one :class:`Config`. It is built from a recipe's YAML preset, then
from ``key.sub=value`` overrides given on the command line (:mod:`xlafit.overrides`), and
validated before any device is touched. An impossible value raises :class:`ConfigError`
with a message that names the fix.
"""

from __future__ import annotations

import dataclasses
import logging
import numbers
import types
import typing
from collections.abc import Sequence
from typing import Any, Literal

from xlafit.errors import ConfigError
from xlafit.io.paths import check_bucket_name
from xlafit.platform.cpu import CpuConfig

log = logging.getLogger("xlafit")


def type_name(tp: Any) -> str:
    """An annotation as a user reads it: ``int``, ``int or null``, ``'stop' | 'skip'``."""
    if typing.get_origin(tp) is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if is_optional(tp):
        return f"{type_name(strip_optional(tp))} or null"
    if is_choice(tp):
        return " or ".join(type_name(a) for a in typing.get_args(tp))
    return getattr(tp, "__name__", str(tp))


def is_optional(tp: Any) -> bool:
    """Whether the annotation ``tp`` allows None (``int | None``)."""
    return typing.get_origin(tp) in (typing.Union, types.UnionType) and type(None) in typing.get_args(tp)


def is_choice(tp: Any) -> bool:
    """Whether ``tp`` is a union of values without None: a number or a name (``int | Literal["auto"]``)."""
    return typing.get_origin(tp) in (typing.Union, types.UnionType) and not is_optional(tp)


def strip_optional(tp: Any) -> Any:
    """``int | None`` -> ``int``; ``float | str | None`` -> ``float | str``."""
    args = tuple(a for a in typing.get_args(tp) if a is not type(None))
    return args[0] if len(args) == 1 else typing.Union[args]  # noqa: UP007 (arms known only at run time)


# The value types a config field may have, and what passes for each: an int is a float too,
# a bool is no number (YAML's ``true`` for a count is a mistake); NumPy's scalars count.
SCALARS: dict[type, tuple[type, ...]] = {
    bool: (bool,),
    int: (numbers.Integral,),
    float: (numbers.Real,),
    str: (str,),
}


def check_type(value: Any, tp: Any, key: str) -> None:
    """Refuses ``value`` unless it fits the annotation ``tp``: one of :data:`SCALARS`, a
    ``Literal``'s choices, either or None (``int | None``), or a union of them (``int |
    Literal["auto"]``). Other annotations pass unchecked.

    Example:
        >>> check_type("3", int, "trainer.epochs")
        Traceback (most recent call last):
        ...
        xlafit.errors.ConfigError: trainer.epochs='3' has the wrong type: expected int.
    """
    inner = strip_optional(tp) if is_optional(tp) else tp
    if inner is not tp and value is None:
        return
    if is_choice(inner):
        for arm in typing.get_args(inner):
            try:
                check_type(value, arm, key)
            except ConfigError:
                continue
            return
        raise ConfigError(f"{key}={value!r} is not allowed: expected {type_name(tp)}.")
    if typing.get_origin(inner) is Literal:
        if value not in typing.get_args(inner):
            choices = ", ".join(map(str, typing.get_args(inner)))
            raise ConfigError(f"{key}={value!r} is not allowed; choose one of {choices}.")
        return
    allowed = SCALARS.get(inner)
    if allowed is not None and (not isinstance(value, allowed) or (inner is not bool and isinstance(value, bool))):
        raise ConfigError(f"{key}={value!r} has the wrong type: expected {type_name(tp)}.")


def check_positive(value: Any, key: str) -> None:
    """Refuses a count that must be positive (a batch, epochs); None passes (not set)."""
    if value is not None and value <= 0:
        raise ConfigError(f"{key}={value} must be a positive number.")


def check_non_negative(value: Any, key: str) -> None:
    """Refuses an amount that must not be negative (a prefetch depth, a period); None passes."""
    if value is not None and value < 0:
        raise ConfigError(f"{key}={value} must be zero or more.")


def _check_section(section: Any, name: str, positive: Sequence[str] = (), non_negative: Sequence[str] = ()) -> None:
    """Refuses a section's impossible values, whoever built it (a YAML preset, an override, or
    Python: ``TrainerConfig(steps_per_call=0)``): a value of the wrong type (``epochs="3"``), a
    ``Literal`` field outside its choices, a count that must be positive, an amount that must
    not be negative."""
    hints = typing.get_type_hints(type(section))
    for field in dataclasses.fields(section):
        check_type(getattr(section, field.name), hints[field.name], f"{name}.{field.name}")
    for key in positive:
        check_positive(getattr(section, key), f"{name}.{key}")
    for key in non_negative:
        check_non_negative(getattr(section, key), f"{name}.{key}")


def check_fraction(value: float, key: str) -> None:
    """Refuses a held-out share outside ``[0, 1)``: 1 or more leaves nothing to train on."""
    if not 0 <= value < 1:
        raise ConfigError(
            f"{key}={value:g} is the share of the data held out for evaluation: give a number from 0 (none) up to, "
            "not including, 1 (e.g. 0.1)."
        )


@dataclasses.dataclass
class DataConfig:
    """How batches are formed.

    ``global_batch`` is what the optimizer sees per step. Set one of the two: with
    ``global_batch`` null it is ``per_device_batch`` x the number of devices (the
    TPUStrategy convention ``16 * num_replicas_in_sync``); with ``global_batch`` set each
    device gets ``global_batch / devices``, and the division must be exact. Both set must
    agree. Neither: 16 per device. A run records both as it resolved them.
    """

    per_device_batch: int | None = None
    global_batch: int | None = None
    eval_global_batch: int | None = None  # default: the training global batch
    data_dir: str | None = None  # recipe-specific files; null = the embedded data
    prefetch: int = 2  # batches put on the devices ahead of the step
    seed: int = 0  # data order: a pure function of (seed, step)

    def __post_init__(self) -> None:
        _check_section(self, "data", ("per_device_batch", "global_batch", "eval_global_batch"), ("prefetch",))
        if self.data_dir:
            check_bucket_name(self.data_dir, f"data.data_dir={self.data_dir}", ConfigError)


@dataclasses.dataclass
class OptimizerConfig:
    """Optimizer and learning-rate schedule.

    ``learning_rate`` is the peak rate at ``reference_batch``; the rate used is scaled to
    the real global batch by ``scaling`` (linear: Goyal et al. 2017; sqrt: Krizhevsky 2014,
    for adaptive optimizers).
    """

    name: Literal["adamw", "adam", "lamb", "sgd", "lars", "adadelta"] = "adamw"  # the optimizer (optax's)
    learning_rate: float = 1e-3
    reference_batch: int = 128
    scaling: Literal["none", "linear", "sqrt"] = "linear"
    warmup_steps: int = 0  # steps of linear warmup from 0 to the peak rate
    # Warmup in epochs (Goyal et al. 2017: 5; MLPerf's LARS: a few); when set it decides:
    # a run turns it into warmup_steps for its batch and records both.
    warmup_epochs: float | None = None
    decay: Literal["cosine", "linear", "polynomial", "constant"] = "cosine"  # the rate's shape after warmup
    # Steps the schedule spans, warmup included (null: the whole run, trainer.epochs x steps
    # per epoch); past them the rate stays at its final value. A run records the value it
    # used, so more epochs later need this set to keep the schedule (see xlafit.run).
    decay_steps: int | None = None
    decay_power: float = 1.0  # polynomial decay's exponent (1.0: linear)
    final_lr_fraction: float = 0.0  # end of decay, as a fraction of the peak
    weight_decay: float = 0.0  # decoupled weight decay (AdamW's; L2 for sgd and lars)
    # "matrices": decay weight matrices and embeddings only, not biases or LayerNorm (BERT)
    weight_decay_on: Literal["all", "matrices"] = "all"
    b1: float = 0.9  # Adam-family moments: the first's decay
    b2: float = 0.999  # the second's decay
    eps: float = 1e-8  # added to Adam's denominator
    momentum: float = 0.9  # sgd and lars
    nesterov: bool = False  # sgd and lars: Nesterov momentum
    # lars (You et al. 2017): each layer's step is scaled by trust_coefficient x |w| / |update|;
    # "matrices" leaves biases and batch-norm parameters out of it (MLPerf), as
    # weight_decay_on="matrices" leaves them out of weight decay.
    trust_coefficient: float = 0.001
    trust_ratio_on: Literal["all", "matrices"] = "matrices"  # lars: which parameters get the trust ratio
    grad_clip_norm: float | None = None  # clip the gradients' global norm to this (null: no clipping)
    # adam and adamw: the dtype of the first moment (optax's mu_dtype); bfloat16 halves it, and
    # changes the numerics (xlafit plan offers it only with --allow-numerics)
    moment_dtype: Literal["float32", "bfloat16"] = "float32"

    def __post_init__(self) -> None:
        if self.moment_dtype != "float32" and self.name not in ("adam", "adamw"):
            raise ConfigError(
                f"optimizer.moment_dtype={self.moment_dtype} applies to adam and adamw (optax's mu_dtype), not "
                f"{self.name}; remove it or use optimizer.name=adamw."
            )
        _check_section(
            self,
            "optimizer",
            ("reference_batch", "decay_steps"),
            ("warmup_steps", "warmup_epochs", "weight_decay"),
        )
        if self.learning_rate <= 0:
            raise ConfigError(
                f"optimizer.learning_rate={self.learning_rate} must be positive "
                "(it is the peak rate at optimizer.reference_batch; try 1e-3)."
            )
        if not 0.0 <= self.momentum < 1.0:
            raise ConfigError(f"optimizer.momentum={self.momentum} must lie in [0, 1) (0.9 is usual).")
        if self.trust_coefficient <= 0:
            raise ConfigError(f"optimizer.trust_coefficient={self.trust_coefficient} must be positive (0.001).")
        if not 0.0 <= self.final_lr_fraction <= 1.0:
            raise ConfigError(f"optimizer.final_lr_fraction={self.final_lr_fraction} must lie in [0, 1].")
        if self.grad_clip_norm is not None and self.grad_clip_norm <= 0:
            raise ConfigError("optimizer.grad_clip_norm must be positive, or null for no clipping.")


@dataclasses.dataclass
class TrainerConfig:
    """The training loop."""

    epochs: int = 1  # passes over the training data
    steps_per_call: int = 1  # k optimizer steps per compiled call (lax.scan)
    accumulate_steps: int = 1  # micro-batches per optimizer step (gradient accumulation)
    log_every_steps: int = 10  # 0: never
    eval_every_epochs: int = 1  # evaluate at the end of every N-th epoch (and at the last)
    checkpoint_every_steps: int = 0  # also every N steps (0: at the end of every epoch only)
    checkpoint_every_minutes: float = 0.0  # also when this much time passed since the last (0: off)
    keep_checkpoints: int = 3  # the last K
    keep_every_steps: int = 0  # and, for good, every checkpoint whose step is a multiple of this (0: none)
    # What a non-finite loss or gradient does: stop (the update of a non-finite loss is
    # dropped; name the step, the last good checkpoint, and whether the last update landed),
    # skip (go on without that batch's update), or rollback (reload the last checkpoint and go
    # on, the offending update dropped again); skip and rollback drop any update whose loss or
    # gradient is not finite.
    nan_policy: Literal["stop", "skip", "rollback"] = "stop"
    stop_at_step: int | None = None  # stop (with a checkpoint) at this step; schedule unchanged
    # Sum gradients over this many equal chunks of the global batch in a fixed order, so 1
    # device, 8 devices or several processes train bit-identical models (a multiple of the
    # device count; null: XLA's all-reduce, faster, equal only to float rounding). Checked for
    # the mnist recipe; the llm recipe's agree to rounding only (docs/explanations/determinism.md).
    # On CPU it also needs cpu.fast_paths=false: YNNPACK kernels round differently per layout.
    invariant_chunks: int | None = None
    # Compiles allowed per step (train, eval); one more stops the run naming the input shape
    # that changed. null: the programs the run plans (steps-per-call values x data shapes).
    max_compiles: int | None = None
    seed: int = 0  # parameter init and dropout
    # Keep the optimizer state (Adam's two moments) in the host's pinned memory between steps:
    # each step brings it to the devices for the update and writes it back (MaxText's
    # optimizer_memory_host_offload). The devices' memory holds it only around the update; the
    # price is its bytes over the host link twice a step. Full fine-tuning only (LoRA's state is small).
    optimizer_offload: bool = False
    # Hang watchdog of multi-process jobs (xlafit.train.watchdog): when no call of the train
    # step finishes for max(watchdog_floor_s, watchdog_factor x the median call time), each
    # process writes its Python stacks to its log and exits with 75, to be run again from the
    # last checkpoint; a peer stuck in a collective otherwise holds the whole job forever. The
    # first call (compiling) and evaluations are not timed; the floor must exceed a checkpoint
    # save and a later compile (10 minutes: PyTorch's default collective timeout). 0: off.
    watchdog_factor: float = 20.0
    watchdog_floor_s: float = 600.0  # the shortest time taken for a hang, seconds

    def __post_init__(self) -> None:
        positive: tuple[str, ...] = (
            "epochs",
            "steps_per_call",
            "accumulate_steps",
            "eval_every_epochs",
            "keep_checkpoints",
        )
        positive += ("stop_at_step", "invariant_chunks", "max_compiles")
        non_negative = ("log_every_steps", "checkpoint_every_steps", "checkpoint_every_minutes", "keep_every_steps")
        _check_section(self, "trainer", positive, non_negative)
        validate_watchdog(self)


@dataclasses.dataclass
class MeshConfig:
    """How the devices are laid out: ``data`` x ``fsdp`` x ``tensor`` = the device count.

    ``data``: plain data parallelism. ``fsdp``: data parallelism with parameters and
    optimizer state split over it (FSDP / ZeRO-3). ``tensor``: Megatron tensor parallelism
    (MLP units and attention heads split). One size may be -1: the devices left. Batches are
    split over ``data`` x ``fsdp``. The default, every device on ``data``, is pure data
    parallelism. ``rules`` overrides the logical-axis table of :mod:`xlafit.parallel.sharding`:
    ``"embed=fsdp,vocab=null"``.
    """

    data: int = -1
    fsdp: int = 1
    tensor: int = 1
    expert: int = 1  # expert parallelism: a mixture of experts' experts split over it, the batch too
    rules: str | None = None

    def __post_init__(self) -> None:
        _check_section(self, "mesh")
        sizes = {"mesh.data": self.data, "mesh.fsdp": self.fsdp, "mesh.tensor": self.tensor, "mesh.expert": self.expert}
        for key, value in sizes.items():
            if value == 0 or value < -1:
                raise ConfigError(f"{key}={value} must be a positive number of devices, or -1 (the devices left).")
        if sum(v == -1 for v in sizes.values()) > 1:
            raise ConfigError(
                "at most one of mesh.data, mesh.fsdp, mesh.tensor, mesh.expert may be -1 (the devices left)."
            )

    @property
    def sizes(self) -> tuple[int, ...]:
        """``(data, fsdp, tensor)``, and ``expert`` when it is not 1 (:func:`~xlafit.parallel.mesh.make_mesh`'s)."""
        return (self.data, self.fsdp, self.tensor) + ((self.expert,) if self.expert != 1 else ())

    @property
    def data_parallel_only(self) -> bool:
        return self.fsdp == 1 and self.tensor == 1 and self.expert == 1


@dataclasses.dataclass
class LoraConfig:
    """Low-rank adapters (LoRA, Hu et al. 2021): with ``rank`` above 0 the model's layers named
    in ``targets`` get rank-``rank`` adapters, only those are trained and checkpointed, and
    every other parameter is frozen (``xlafit.models.lora``)."""

    rank: int = 0  # 0: full fine-tuning (every parameter trains); e.g. 16: adapters of rank 16, the base frozen
    alpha: float = 16.0  # PEFT's lora_alpha: the adapters' update is scaled by alpha / rank
    # the adapted layers: attribute names of nnx.Linear layers, comma-separated (PEFT's
    # target_modules; Llama's attention projections by default); `experts` adapts a mixture of
    # experts' stacked weights, each expert's own (PEFT's target_parameters); `all-linear` every
    # attention and MLP projection (experts too), as PEFT's shorthand: no router, no output layer
    targets: str = "q_proj,k_proj,v_proj,o_proj"
    # the frozen base weights' dtype: bfloat16 halves their memory (the adapters stay float32);
    # nf4, int4 or int8 quantize its dense layers with Qwix (QLoRA; the embeddings, the output
    # layer and the norms in bfloat16), nf4 and int4 a quarter of bfloat16's memory
    base_dtype: Literal["float32", "bfloat16", "nf4", "int4", "int8"] = "float32"
    base_block: int = 64  # nf4/int4/int8: weights per quantization scale, along each layer's input features
    # with a quantized base_dtype: the token embeddings (and an untied output layer) quantized
    # too, in the same type and blocks (along each token's features); false keeps them bfloat16
    quantize_embeddings: bool = False

    def __post_init__(self) -> None:
        _check_section(self, "lora", (), ("rank",))
        if self.alpha <= 0:
            raise ConfigError(
                f"lora.alpha={self.alpha:g} must be positive: the adapters' update is scaled by lora.alpha / "
                "lora.rank, so at 0 nothing trains (PEFT's usual value is twice the rank, e.g. lora.alpha=32)."
            )
        if self.rank and not self.target_names:
            raise ConfigError("lora.targets is empty; name the layers to adapt, e.g. lora.targets=q_proj,v_proj.")
        if self.quantized and not self.rank:
            raise ConfigError(
                f"lora.base_dtype={self.base_dtype} quantizes the frozen base of a LoRA fine-tune, and lora.rank is 0 "
                "(full fine-tuning, which cannot train quantized weights): set lora.rank (e.g. lora.rank=16), or "
                "lora.base_dtype=float32 to train every weight."
            )
        if self.base_block < 1:
            raise ConfigError(f"lora.base_block={self.base_block} must be positive (64: bitsandbytes' NF4 blocks).")
        if self.quantize_embeddings and not self.quantized:
            raise ConfigError(
                f"lora.quantize_embeddings=true quantizes the embeddings of a quantized base, and lora.base_dtype is "
                f"{self.base_dtype}: add lora.base_dtype=nf4 (or int4, int8), or drop lora.quantize_embeddings."
            )
        if self.quantize_embeddings and "lm_head" in self.target_names:
            raise ConfigError(
                "lora.quantize_embeddings=true quantizes the output layer, and lora.targets adapts lm_head: drop "
                "lm_head from lora.targets, or drop lora.quantize_embeddings to keep it in bfloat16."
            )

    @property
    def quantized(self) -> bool:
        """Whether the base is quantized (``nf4``, ``int4``, ``int8``)."""
        return self.base_dtype in ("nf4", "int4", "int8")

    @property
    def target_names(self) -> tuple[str, ...]:
        return tuple(t.strip() for t in self.targets.split(",") if t.strip())


@dataclasses.dataclass
class RunConfig:
    """Where the run writes and on what it runs."""

    run_dir: str | None = None  # default: runs/<recipe>-<UTC time>
    checkpoint_dir: str | None = None  # default: <run_dir>/checkpoints; may be a URL (gs://bucket/run)
    simulate_devices: int | None = None  # N CPU devices (rehearse an N-core TPU)
    resume: bool = True  # continue from the run directory's newest checkpoint

    def __post_init__(self) -> None:
        _check_section(self, "run", ("simulate_devices",))
        for key in ("run_dir", "checkpoint_dir"):  # refused before any data is read or step is run
            if value := getattr(self, key):
                check_bucket_name(value, f"run.{key}={value}", ConfigError)


@dataclasses.dataclass
class Config:
    """Everything one training run needs. ``model`` is the recipe's own dataclass."""

    recipe: str
    model: Any
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    optimizer: OptimizerConfig = dataclasses.field(default_factory=OptimizerConfig)
    trainer: TrainerConfig = dataclasses.field(default_factory=TrainerConfig)
    run: RunConfig = dataclasses.field(default_factory=RunConfig)
    mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)
    lora: LoraConfig = dataclasses.field(default_factory=LoraConfig)  # rank 0: no adapters
    cpu: CpuConfig = dataclasses.field(default_factory=CpuConfig)  # on a CPU only (xlafit.platform.cpu)

    def to_dict(self) -> dict[str, Any]:
        """A plain nested dict (YAML/JSON friendly)."""
        return dataclasses.asdict(self)


def validate(cfg: Config) -> None:
    """Rejects settings of one section that another makes impossible (each section refuses
    its own impossible values when it is built)."""
    validate_mesh(cfg.mesh, cfg.trainer)
    if cfg.trainer.optimizer_offload and cfg.lora.rank:
        raise ConfigError(
            f"trainer.optimizer_offload=true moves a full fine-tune's optimizer state to host memory; with "
            f"lora.rank={cfg.lora.rank} it is the adapters' own, a small fraction of the model, and the copies would "
            "cost more than they save: set trainer.optimizer_offload=false (or lora.rank=0 to train every weight)."
        )


def validate_mesh(mesh: MeshConfig, trainer: TrainerConfig) -> None:
    """Rejects trainer settings the mesh cannot keep (the sizes themselves: :class:`MeshConfig`)."""
    if trainer.invariant_chunks is not None and not mesh.data_parallel_only:
        # Its fixed summation order gathers whole per-chunk gradients on every device: the
        # opposite of sharding them, and its bit-exactness is proven for replicated state only.
        raise ConfigError(
            "trainer.invariant_chunks keeps its bit-identical guarantee for pure data parallelism only; "
            "set trainer.invariant_chunks=null with mesh.fsdp or mesh.tensor above 1."
        )


def validate_watchdog(cfg: TrainerConfig) -> None:
    """Rejects watchdog settings that would take a healthy step for a hang."""
    if cfg.watchdog_factor != 0 and cfg.watchdog_factor <= 1:
        raise ConfigError(
            f"trainer.watchdog_factor={cfg.watchdog_factor} would take an ordinary step for a hang; "
            "use 0 (off) or a multiple of the median call time above 1, e.g. 20."
        )
    if cfg.watchdog_floor_s < 0:
        raise ConfigError(f"trainer.watchdog_floor_s={cfg.watchdog_floor_s} must be zero or more seconds.")


DEFAULT_PER_DEVICE_BATCH = 16


def resolve_batch(cfg: DataConfig, num_devices: int) -> tuple[int, int]:
    """Returns ``(per_device_batch, global_batch)`` for ``num_devices`` devices.

    Example:
        >>> resolve_batch(DataConfig(global_batch=128), 8), resolve_batch(DataConfig(per_device_batch=32), 8)
        ((16, 128), (32, 256))

    Raises:
        ConfigError: the global batch does not divide evenly over the devices, or the two
            settings disagree.
    """
    if cfg.global_batch is None:
        per_device = cfg.per_device_batch or DEFAULT_PER_DEVICE_BATCH
        return per_device, per_device * num_devices
    if cfg.per_device_batch is not None and cfg.per_device_batch * num_devices != cfg.global_batch:
        raise ConfigError(
            f"data.per_device_batch={cfg.per_device_batch} and data.global_batch={cfg.global_batch} disagree on "
            f"{num_devices} devices ({cfg.per_device_batch} x {num_devices} = {cfg.per_device_batch * num_devices}). "
            "Set only one of them (data.global_batch=null to use the per-device batch)."
        )
    if cfg.global_batch % num_devices:
        lower = cfg.global_batch // num_devices * num_devices
        raise ConfigError(
            f"data.global_batch={cfg.global_batch} does not divide evenly over {num_devices} devices. "
            f"Use a multiple of {num_devices} (for example data.global_batch={max(lower, num_devices)}), "
            "or set data.per_device_batch instead."
        )
    return cfg.global_batch // num_devices, cfg.global_batch


def check_device_split(cfg: Config, devices: int, data_parallel_only: bool = True, evaluates: bool = True) -> None:
    """Refuses, in one message, every batch setting that ``devices`` devices cannot split,
    with the overrides that run on them (a device count such as ``--simulate 3`` often
    meets the global batch, the eval batch and the invariant chunks at once).

    Raises:
        ConfigError: one line per setting, then the overrides to add.
    """
    data, chunks = cfg.data, cfg.trainer.invariant_chunks
    n_devices = f"{devices} device" + ("s" if devices != 1 else "")
    problems: list[str] = []
    fixes: dict[str, int | str] = {}
    per_device = data.per_device_batch
    global_batch = data.global_batch or (per_device or DEFAULT_PER_DEVICE_BATCH) * devices
    if data.global_batch is not None and per_device is not None and per_device * devices != data.global_batch:
        problems.append(
            f"data.global_batch={data.global_batch} (data.per_device_batch={per_device} x {n_devices} is "
            f"{per_device * devices}: set one of them)"
        )
        fixes["data.global_batch"] = "null"
        global_batch = per_device * devices
    elif data.global_batch is not None and data.global_batch % devices:
        problems.append(f"data.global_batch={data.global_batch}")
        global_batch = fixes["data.global_batch"] = max(data.global_batch // devices * devices, devices)
    eval_batch = data.eval_global_batch
    if evaluates and eval_batch is not None and eval_batch % devices:  # no evaluation data: no eval batch
        problems.append(f"data.eval_global_batch={eval_batch}")
        fixes["data.eval_global_batch"] = max(eval_batch // devices * devices, devices)
    if chunks is not None and data_parallel_only and (chunks % devices or global_batch % chunks):
        problems.append(f"trainer.invariant_chunks={chunks} (a multiple of the devices dividing the global batch)")
        # the largest such multiple up to the chunks asked for; the devices themselves always are one
        fixes["trainer.invariant_chunks"] = max(
            m for m in range(devices, max(chunks, devices) + 1, devices) if global_batch % m == 0
        )
    if not problems:
        return
    add = " ".join(f"{key}={value}" for key, value in fixes.items())
    if len(problems) == 1 and fixes.get("data.global_batch") == "null":  # the two batch settings disagree
        head = f"{problems[0]}."
    elif len(problems) == 1:
        head = f"{problems[0]} does not divide evenly over {n_devices}."
    else:
        head = f"these batch settings do not divide evenly over {n_devices}:" + "".join(
            f"\n  {problem}" for problem in problems
        )
    instead = " (or set data.per_device_batch instead)" if fixes.get("data.global_batch", "null") != "null" else ""
    raise ConfigError(f"{head}\nTo run on {n_devices}, add: {add}{instead}.")
