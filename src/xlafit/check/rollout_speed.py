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
of the policy from HBM (:func:`weights_per_core`), ``steps x weights / HBM bandwidth``; no
decode loop on that chip runs faster.
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
from xlafit.predict.hlo import kernel_flops, loop_flops
from xlafit.predict.model import predict
from xlafit.predict.ops import loop_kernels
from xlafit.predict.rates import rates_for

# Lookup tables that a decode step reads one row of (an input embedding not tied to the output
# head; Gemma 4's per-layer embeddings), by their attribute in the llm recipe's models.
_LOOKUPS = ("embed_tokens_per_layer", "embed_tokens")
_GATHERED = ("data", "fsdp")  # the mesh axes whose shards a step gathers before it computes


def weights_per_core(model: nnx.Module) -> int:
    """The bytes of the policy's weights that one core reads from HBM for one step of the model
    over one token per row: each ``nnx.Param`` (a LoRA run's frozen base and adapters, a
    quantized base as stored) with its FSDP (and data) shards gathered, its tensor and expert
    shards not (each core computes its own); a float wider than the model's compute dtype
    counted at the compute dtype's size (a cast the compiler may hoist out of the loop), so the
    count stays a floor. An input embedding is looked up a row at a time and left out, unless it
    is also the output head (tied)."""
    cfg = getattr(model, "cfg", None)
    compute = np.dtype(cfg.compute_dtype).itemsize if cfg is not None else None
    tied = bool(getattr(cfg, "tie_embeddings", False))
    total = 0
    for path, leaf in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        names = [str(p) for p in path]
        if any(n == _LOOKUPS[0] or (n == _LOOKUPS[1] and not tied) for n in names):
            continue
        x = leaf.get_value() if isinstance(leaf, nnx.Variable) else leaf
        itemsize = np.dtype(x.dtype).itemsize
        if compute and jax.dtypes.issubdtype(x.dtype, np.floating):
            itemsize = min(itemsize, compute)
        sharding = getattr(x, "sharding", None)
        shard = sharding.shard_shape(x.shape) if sharding is not None else x.shape
        gathered = 1
        spec = getattr(sharding, "spec", None)
        if spec is not None:
            sizes = dict(sharding.mesh.shape)
            for entry in spec:
                for axis in (entry,) if isinstance(entry, str) else entry or ():
                    gathered *= sizes[axis] if axis in _GATHERED else 1
        total += int(np.prod(shard)) * gathered * itemsize
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
        fit.decode_s = predict(loop, rates, target.ici_bandwidth, devices).seconds
    else:
        fit.decode_s = max(fit.decode_flops / target.peak_flops, fit.decode_bytes / target.hbm_bandwidth)
    fit.weights = weights
    fit.floor_s = weights / target.hbm_bandwidth * decode_steps
