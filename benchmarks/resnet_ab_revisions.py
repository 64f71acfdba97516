"""ResNet-50's bare train step with the model of an earlier git revision against the working
tree's, both compiled in one process and timed in alternating rounds (machine noise hits both).

    python benchmarks/resnet_ab_revisions.py REVISION BATCH ROUNDS
    python benchmarks/resnet_ab_revisions.py c85ec33 8 20   # before the fused batch norm (BENCHMARKS.md)

``src/xlafit/models/resnet.py`` at REVISION is loaded as a module of its own; everything else
(JAX, the rest of xlafit) is the working tree's. Each variant: ResNet-50, 224 px random images,
float32, Nesterov SGD, state donated, three warm-up calls, then ROUNDS timed calls each. The
losses of the first calls are printed to show both variants train the same network.
"""

import importlib.util
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
from xlafit.models import resnet as current

revision, batch, rounds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
xlafit.connect()
root = Path(__file__).resolve().parent.parent
source = subprocess.run(
    ["git", "show", f"{revision}:src/xlafit/models/resnet.py"], cwd=root, check=True, capture_output=True, text=True
).stdout
path = Path(tempfile.mkdtemp()) / "resnet_at_revision.py"
path.write_text(source)
spec = importlib.util.spec_from_file_location("resnet_at_revision", path)
assert spec is not None and spec.loader is not None
earlier = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = earlier
spec.loader.exec_module(earlier)

x = jnp.asarray(np.random.default_rng(0).standard_normal((batch, 224, 224, 3), dtype=np.float32))
y = jnp.asarray(np.random.default_rng(1).integers(0, 1000, batch), jnp.int32)
tx = optax.sgd(0.1, momentum=0.9, nesterov=True)
runs = {}
for name, module in ((revision, earlier), ("working tree", current)):
    model = module.ResNet(50, 1000, rngs=nnx.Rngs(0))
    model.train()
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss_fn(params, rest, x, y, graphdef=graphdef):
        m = nnx.merge(graphdef, params, rest, copy=True)
        return optax.softmax_cross_entropy_with_integer_labels(m(x), y).mean(), nnx.state(m, nnx.Not(nnx.Param))

    def step(params, rest, opt, x, y, loss_fn=loss_fn):
        (loss, rest), g = jax.value_and_grad(loss_fn, has_aux=True)(params, rest, x, y)
        updates, opt = tx.update(g, opt, params)
        return optax.apply_updates(params, updates), rest, opt, loss

    compiled = jax.jit(step, donate_argnums=(0, 1, 2)).lower(params, rest, tx.init(params), x, y).compile()
    state, losses = (params, rest, tx.init(params)), []
    for _ in range(3):  # warm-up: the heap grows to the program's temporaries here
        *state, loss = compiled(*state, x, y)
        losses.append(float(loss))  # note: a host sync point
    runs[name] = [compiled, state, [], losses]
for _ in range(rounds):
    for run in runs.values():
        t0 = time.perf_counter()
        *run[1], loss = run[0](*run[1], x, y)
        jax.block_until_ready(run[1])
        run[2].append(time.perf_counter() - t0)
for name, (_, _, times, losses) in runs.items():
    print(
        f"{name}: median {np.median(times):.3f} s/step over {rounds} rounds"
        f" (min {min(times):.3f}, max {max(times):.3f}); first losses {[round(v, 4) for v in losses]}"
    )
