"""How long the programs a run compiles beside its steps take (GRPO's rollout: the generation
with its key/value cache, the log-probabilities), priced as the train step is
(:mod:`xlafit.check.speed`): the step model's prediction of one run of each, with its band where
the step model was validated on such programs (else why not), the roofline estimate where the
device has no rates.

A generation's decode loop (:func:`xlafit.models.generation.generate`: after the prefill's first
token, ``max_completion_length - 1`` steps of one token per row) is a ``while`` loop of the
compiled program; the step model counts its body once per trip (the trip count read from the
loop's condition). Every trip runs, whether or not its rows have stopped: the loop keeps its
fixed number of steps. Beside its prediction stands its floor: each step reads every weight
of the policy, each core its own shard (:func:`weights_per_core`), from HBM, but for what the
compiler keeps in on-chip memory from one step to the next (the loop's state laid out there:
all of a tiny model's weights may be): ``steps x weights / HBM bandwidth``. No decode loop on
that chip runs faster.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np
from flax import nnx

from xlafit.check.program import Program, ProgramFit
from xlafit.check.speed import OUTSIDE_BAND, outside_band, program_kind
from xlafit.platform import hardware as tpu
from xlafit.predict.hlo import array_bytes, kernel_flops, loop_flops
from xlafit.predict.model import predict
from xlafit.predict.ops import hbm_bytes, loop_kernels, loop_state
from xlafit.predict.rates import rates_for

# Lookup tables that a decode step reads one row of (an input embedding not tied to the output
# head; Gemma 4's per-layer embeddings), by their attribute in the llm recipe's models.
_LOOKUPS = ("embed_tokens_per_layer", "embed_tokens")


# The bytes of a float a TPU's matrix unit reads at JAX's default precision (bfloat16 passes)
_DEFAULT_PRECISION_BYTES = 2


def weights_per_core(model: nnx.Module) -> int:
    """The bytes of the policy's weights that each core holds and must read for one step of the
    model over one token per row: each ``nnx.Param`` (a LoRA run's frozen base and adapters, a
    quantized base as stored), its shard on the core (FSDP, tensor and expert shards alike). A
    core may read more: the compiler may gather a weight's other shards first; for a decode step
    it often keeps each core's shard and reduces the products instead. A float counts at the
    narrowest size a product reads it in: the model's compute dtype, and on a TPU at most
    bfloat16's two bytes (at JAX's default matmul precision a float32 product runs on bfloat16
    inputs, and the compiler may convert a weight once, outside the loop), so the count stays
    a floor. An input embedding is looked up a row at a time and left out, unless it is also
    the output head (tied)."""
    cfg = getattr(model, "cfg", None)
    compute = (
        _DEFAULT_PRECISION_BYTES if cfg is None else min(np.dtype(cfg.compute_dtype).itemsize, _DEFAULT_PRECISION_BYTES)
    )
    tied = bool(getattr(cfg, "tie_embeddings", False))
    total = 0
    for path, leaf in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        names = [str(p) for p in path]
        if any(n == _LOOKUPS[0] or (n == _LOOKUPS[1] and not tied) for n in names):
            continue
        x = leaf.get_value() if isinstance(leaf, nnx.Variable) else leaf
        itemsize = np.dtype(x.dtype).itemsize
        if jax.dtypes.issubdtype(x.dtype, np.floating):
            itemsize = min(itemsize, compute)
        sharding = getattr(x, "sharding", None)
        total += int(np.prod(sharding.shard_shape(x.shape) if sharding is not None else x.shape)) * itemsize
    return total


def price(
    fit: ProgramFit,
    compiled: Any,
    target: tpu.Target,
    program: Program,
    devices: int,
    weights: int,
    decode_steps: int | None = None,
) -> None:
    """One run of a compiled rollout program into ``fit``: FLOPs and bytes per core, the step
    model's time with its band (or the roofline estimate), and where ``decode_steps`` is given
    and the program has a loop of that many trips, the decode loop's part with its floor for
    ``weights`` bytes per core (:func:`weights_per_core`)."""
    hlo = compiled.as_text()
    cost = compiled.cost_analysis() or {}
    # XLA's count takes a loop's body once: the products of the decode loop (and of scanned
    # layers) added for every further trip.
    fit.flops = float(cost.get("flops", 0.0)) + loop_flops(hlo) + kernel_flops(hlo) or None
    fit.bytes = float(cost.get("bytes accessed", 0.0)) or None
    roofline = max((fit.flops or 0.0) / target.peak_flops, (fit.bytes or 0.0) / target.hbm_bandwidth)
    device_kind = target.generation.device_kinds[0]
    rates = rates_for(device_kind)
    if rates is None:
        fit.run_s = roofline or None
        fit.band = f"no step model for {device_kind}: the roofline estimate only"
    else:
        prediction = predict(hlo, rates, target.ici_bandwidth, devices)
        fit.run_s, fit.predicted = prediction.seconds or roofline or None, prediction.seconds > 0
        if fit.predicted:
            kind = dataclasses.replace(program_kind(program, devices, prediction.seconds), program=fit.name)
            fit.band, fit.band_median = rates.band_for(kind)
            if outside_band(fit.run_s):
                fit.band, fit.band_median = OUTSIDE_BAND, None
    if not decode_steps:
        return
    loop = loop_kernels(hlo, decode_steps)
    if loop is None:  # unrolled, or no loop of that count: the whole run's time stands alone
        return
    fit.decode_steps = decode_steps
    fit.decode_flops = sum(k.flops * k.count for k in loop)
    fit.decode_bytes = sum(k.bytes * k.count for k in loop)
    if rates is not None:
        loop_time = predict(loop, rates, target.ici_bandwidth, devices)
        fit.decode_s, fit.decode_collective_s = loop_time.seconds, loop_time.exposed_collective_s
    else:
        fit.decode_s = max(fit.decode_flops / target.peak_flops, fit.decode_bytes / target.hbm_bandwidth)
    # What the loop carries in on-chip memory (a small model's weights may all stay there) is
    # not read from HBM each step: the floor counts the rest of the weights.
    carried = loop_state(hlo, decode_steps) or ""
    fit.weights, fit.on_chip = weights, array_bytes(carried) - hbm_bytes(carried)
    fit.floor_s = max(0, weights - fit.on_chip) / target.hbm_bandwidth * decode_steps
