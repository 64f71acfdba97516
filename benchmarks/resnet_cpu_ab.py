"""ResNet-50 train steps compiled in one process and timed in alternating rounds: the A/B
tool behind BENCHMARKS.md's ResNet CPU knobs (machine noise hits every variant alike).

    YNN=dot,eltwise,reduce python benchmarks/resnet_cpu_ab.py BATCH ROUNDS f32 xla bf16 torch
    python benchmarks/resnet_cpu_ab.py 8 20 git:c85ec33 f32   # the model before the fused batch norm

Each variant: the bare jitted step (forward, backward, Nesterov SGD), 224 px images, one
warm-up call, then ROUNDS timed calls per variant, interleaved. ``torch``: the same step
of Hugging Face's ResNetForImageClassification in PyTorch eager, channels-last. ``f32``: the
model's default convolutions (oneDNN on one CPU device); ``xla``: float32 with XLA's own.
``git:REV``: the float32 model of ``src/xlafit/models/resnet.py`` as it was at git revision
REV (the rest of xlafit is the working tree's).
"""

import importlib.util
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import xlafit
from xlafit.models.resnet import ResNet

batch, rounds, variants = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3:]
xlafit.connect(ynn_fusion=os.environ.get("YNN", "dot,eltwise,reduce"))
x = jnp.asarray(np.random.default_rng(0).standard_normal((batch, 224, 224, 3), dtype=np.float32))
y = jnp.zeros((batch,), jnp.int32)
tx = optax.sgd(0.1, momentum=0.9, nesterov=True)
runs = {}


def torch_step():
    import torch
    import transformers

    torch.manual_seed(0)
    hf = transformers.ResNetForImageClassification(transformers.ResNetConfig(num_labels=1000)).train()
    hf = hf.to(memory_format=torch.channels_last)  # type: ignore[call-arg]
    opt = torch.optim.SGD(hf.parameters(), lr=0.1, momentum=0.9, nesterov=True)
    tx_ = torch.from_numpy(np.asarray(x)).permute(0, 3, 1, 2).contiguous(memory_format=torch.channels_last)
    ty = torch.zeros(batch, dtype=torch.int64)

    def run(*state):
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.cross_entropy(hf(pixel_values=tx_).logits, ty)
        loss.backward()
        opt.step()
        return state

    return run


def model_at_revision(revision):
    root = Path(__file__).resolve().parent.parent
    show = ["git", "show", f"{revision}:src/xlafit/models/resnet.py"]
    path = Path(tempfile.mkdtemp()) / "resnet_at_revision.py"
    path.write_text(subprocess.run(show, cwd=root, check=True, capture_output=True, text=True).stdout)
    spec = importlib.util.spec_from_file_location(f"resnet_at_{revision}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


for v in variants:
    if v == "torch":
        fn = torch_step()
        fn()
        runs[v] = [lambda *state, fn=fn: (*fn(*state[:3]), None), [None, None, None], []]
        continue
    if v.startswith("git:"):
        model = model_at_revision(v[4:]).ResNet(50, 1000, rngs=nnx.Rngs(0))
    else:
        dtype = {"f32": "float32", "xla": "float32", "bf16": "bfloat16"}[v]
        model = ResNet(50, 1000, dtype=dtype, conv="xla" if v == "xla" else "auto", rngs=nnx.Rngs(0))
    model.train()
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss_fn(params, rest, x, y, graphdef=graphdef):
        m = nnx.merge(graphdef, params, rest, copy=True)
        return optax.softmax_cross_entropy_with_integer_labels(m(x), y).mean(), nnx.state(m, nnx.Not(nnx.Param))

    def step(params, rest, opt, x, y, loss_fn=loss_fn):
        (loss, rest), g = jax.value_and_grad(loss_fn, has_aux=True)(params, rest, x, y)
        updates, opt = tx.update(g, opt, params)
        return optax.apply_updates(params, updates), rest, opt, loss

    t0 = time.perf_counter()
    compiled = jax.jit(step).lower(params, rest, tx.init(params), x, y).compile()
    print(v, "compile", round(time.perf_counter() - t0, 1), flush=True)
    out = jax.block_until_ready(compiled(params, rest, tx.init(params), x, y))
    runs[v] = [compiled, list(out[:3]), []]
for _ in range(rounds):
    for v in variants:
        compiled, state, times = runs[v]
        t0 = time.perf_counter()
        out = jax.block_until_ready(compiled(*state, x, y))
        times.append(time.perf_counter() - t0)
        runs[v][1] = list(out[:3])
for v in variants:
    times = runs[v][2]
    print(f"{v} batch {batch}: median {np.median(times):.3f} s/step, {batch / np.median(times):.2f} images/s, {times}")
