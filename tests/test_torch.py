"""PyTorch modules in xlafit.Trainer through torchax (src/xlafit/integrations/torch.py): the
seed's MNIST network trains as PyTorch eager trains it, BatchNorm's statistics come back into
the module, and dropout draws from the step's key."""

import subprocess
import sys
from pathlib import Path

import numpy as np
import optax
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import xlafit
from helpers import long_form
from xlafit.checkpoint import fingerprint
from xlafit.config import TrainerConfig
from xlafit.data import mnist
from xlafit.errors import ConfigError
from xlafit.integrations.torch import TorchModule, torch_loss


class Net(nn.Module):
    """pytorch/examples' MNIST network, the seed's PyTorch/XLA model."""

    def __init__(self, p1: float = 0.25, p2: float = 0.5) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, 1)
        self.conv2 = nn.Conv2d(32, 64, 3, 1)
        self.dropout1 = nn.Dropout(p1)
        self.dropout2 = nn.Dropout(p2)
        self.fc1 = nn.Linear(9216, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x):
        x = F.relu(self.conv2(F.relu(self.conv1(x))))
        x = self.dropout1(F.max_pool2d(x, 2))
        x = self.dropout2(F.relu(self.fc1(torch.flatten(x, 1))))
        return F.log_softmax(self.fc2(x), dim=1)


def nll(outputs, batch):
    return F.nll_loss(outputs, batch["y"], reduction="none")


def digits(n=64):
    """The first ``n`` embedded MNIST digits (normalised as the recipe reads them), NCHW as the
    torch network takes them."""
    train = mnist.load_embedded()["train"]
    x = train["image"][:n].reshape(n, 28, 28, 1).transpose(0, 3, 1, 2).astype(np.float32)
    return {"x": x, "y": train["label"][:n].astype(np.int64)}


def test_the_seeds_mnist_net_trains_as_pytorch_eager_does(strategy8):
    """Dropout off, 30 SGD steps on the same batch: 8 simulated devices against plain PyTorch
    eager on one CPU, parameters equal within 1e-5 relative."""
    torch.manual_seed(0)
    ours, theirs = Net(0.0, 0.0), Net(0.0, 0.0)
    theirs.load_state_dict(ours.state_dict())
    data = digits()
    opt = torch.optim.SGD(theirs.parameters(), lr=0.05)
    x, y = torch.from_numpy(data["x"]), torch.from_numpy(data["y"])
    for _ in range(30):
        opt.zero_grad()
        F.nll_loss(theirs(x), y).backward()
        opt.step()
    trainer = xlafit.Trainer(
        ours, torch_loss(nll), optax.sgd(0.05), strategy=strategy8, global_batch=64, config=TrainerConfig(epochs=30)
    )
    trainer.fit(data)
    for name, tensor in theirs.state_dict().items():  # written back into the module
        np.testing.assert_allclose(ours.state_dict()[name].numpy(), tensor.numpy(), rtol=1e-5, atol=1e-6, err_msg=name)


def test_batch_norm_statistics_come_back_into_the_module(strategy8):
    torch.manual_seed(0)
    module = nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 26 * 26, 10))
    data = digits()
    trainer = xlafit.Trainer(
        module,
        torch_loss(lambda out, b: F.cross_entropy(out, b["y"], reduction="none")),
        optax.adam(1e-3),
        strategy=strategy8,
        global_batch=32,
        config=TrainerConfig(epochs=2),
    )
    trainer.fit(data)
    bn = module[1]
    assert int(bn.num_batches_tracked) == 4  # 2 epochs of 2 steps
    assert float(bn.running_mean.abs().sum()) > 0 and float((bn.running_var - 1).abs().sum()) > 0
    # the module's statistics are the trainer's
    state = [np.asarray(v[...]) for v in trainer.state.model_state["buffers"].values()]
    for buffer in (bn.running_mean, bn.running_var):
        assert any(v.shape == (4,) and np.allclose(v, buffer.numpy(), rtol=1e-6) for v in state)


def test_dropout_draws_from_the_steps_key_and_eval_is_deterministic():
    torch.manual_seed(0)
    module = TorchModule(nn.Sequential(nn.Linear(16, 16), nn.Dropout(0.5)))
    x = np.ones((4, 16), np.float32)
    module.eval()
    assert np.array_equal(module(x), module(x))
    module.train()
    first, second = np.asarray(module(x)), np.asarray(module(x))
    assert not np.array_equal(first, second)  # a new key each call
    assert (first == 0).mean() == pytest.approx(0.5, abs=0.15)


def test_a_torch_module_is_data_parallel_only(strategy8):
    with pytest.raises(ConfigError, match="torch modules train data-parallel only"):
        xlafit.Trainer(
            nn.Linear(2, 2),
            torch_loss(nll),
            optax.sgd(0.1),
            strategy=xlafit.connect(mesh=(1, 8, 1)),
            global_batch=8,
        )


def test_batch_norm_running_statistics_equal_pytorchs():
    torch.manual_seed(0)
    ours, theirs = nn.BatchNorm2d(4), nn.BatchNorm2d(4)
    x = torch.randn(8, 4, 5, 5)
    module = TorchModule(ours)
    module.train()
    for _ in range(3):
        module(x.numpy())
        theirs(x)
    module.write_back(*_state(module))
    np.testing.assert_allclose(ours.running_mean.numpy(), theirs.running_mean.numpy(), rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(ours.running_var.numpy(), theirs.running_var.numpy(), rtol=1e-5, atol=1e-7)
    assert int(ours.num_batches_tracked) == 3


class _TripleRelu(torch.autograd.Function):
    """A gradient that is not forward's own: three times ReLU's (the classic style)."""

    @staticmethod
    def forward(ctx, x, scale):
        ctx.save_for_backward(x)
        ctx.scale = scale
        return x.clamp(min=0)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return grad * (x > 0) * ctx.scale, None


class _StraightThrough(torch.autograd.Function):
    """Rounding whose gradient passes through (setup_context's style, a tensor kept on ctx)."""

    @staticmethod
    def forward(x):
        return torch.round(x)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.x = inputs[0]

    @staticmethod
    def backward(ctx, grad):
        return grad * torch.ones_like(ctx.x)


class _CustomGradients(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(6, 8), nn.Linear(8, 3)

    def forward(self, x):
        return self.fc2(_StraightThrough.apply(_TripleRelu.apply(self.fc1(x), 3.0) * 4))


def test_a_modules_own_autograd_function_differentiates_through_its_backward():
    """torchax differentiates a torch.autograd.Function's forward and never calls its backward:
    the rounding below gave every layer under it a zero gradient, without a word. The module's
    gradients equal PyTorch's autograd."""
    import jax
    from flax import nnx

    torch.manual_seed(0)
    net = _CustomGradients()
    x, y = torch.randn(16, 6), torch.randint(0, 3, (16,))
    F.cross_entropy(net(x), y).backward()
    module = TorchModule(net)
    graphdef, params, rest = nnx.split(module, nnx.Param, ...)

    def loss(params):
        logits = nnx.merge(graphdef, params, rest)(x.numpy())
        return optax.softmax_cross_entropy_with_integer_labels(logits, y.numpy()).mean()

    grads = jax.grad(loss)(params)
    ours = {name: grads["params"][i][...] for i, name in enumerate(module.param_names)}
    for name, p in net.named_parameters():
        np.testing.assert_allclose(np.asarray(ours[name]), p.grad.numpy(), rtol=1e-5, atol=1e-6, err_msg=name)
    assert np.abs(np.asarray(ours["fc1.weight"])).max() > 0  # through the rounding


def _state(module):
    from flax import nnx

    _, params, rest = nnx.split(module, nnx.Param, ...)
    return params, rest


KILLED_RUN = """
import os, signal, sys, threading, time
from pathlib import Path
sys.path.insert(0, sys.argv[1])
import optax, torch
import xlafit
from test_torch import Net, digits, nll
from xlafit.checkpoint import fingerprint
from xlafit.config import TrainerConfig
from xlafit.integrations.torch import torch_loss

run_dir, kill_after, seed = Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
torch.manual_seed(seed)
trainer = xlafit.Trainer(
    Net(), torch_loss(nll), optax.adam(1e-3), strategy=xlafit.connect(), global_batch=32,
    config=TrainerConfig(epochs=6, log_every_steps=0, checkpoint_every_steps=2), run_dir=run_dir,
)

def kill_once_saved():
    while not any(p.name.isdigit() and int(p.name) >= kill_after for p in (run_dir / "checkpoints").glob("*")):
        time.sleep(0.002)
    os.kill(os.getpid(), signal.SIGKILL)

if kill_after:
    threading.Thread(target=kill_once_saved, daemon=True).start()
state = trainer.fit(digits(128)).state
print("FINGERPRINT", int(state.step), fingerprint((state.params, state.model_state, state.opt_state)))
"""


def test_stopped_then_resumed_with_another_seed_ends_bit_identical(tmp_path, strategy8):
    """A torch module's run (dropout on, checkpoints every 2 steps) stopped at step 6 of 8, then the
    same program with a module from another seed: the end state (parameters, dropout key,
    Adam's moments) has the fingerprint of an uninterrupted run."""

    def run(run_dir, seed, stop_at_step=None):
        torch.manual_seed(seed)
        config = TrainerConfig(epochs=2, log_every_steps=0, checkpoint_every_steps=2, stop_at_step=stop_at_step)
        loss = torch_loss(nll)
        trainer = xlafit.Trainer(
            Net(), loss, optax.adam(1e-3), strategy=strategy8, global_batch=32, config=config, run_dir=run_dir
        )
        state = trainer.fit(digits(128)).state
        trainer.close()
        return int(state.step), fingerprint((state.params, state.model_state, state.opt_state))

    full = run(tmp_path / "full", 0)
    assert full[0] == 8
    assert run(tmp_path / "run", 0, stop_at_step=6)[0] == 6  # in the second epoch
    assert run(tmp_path / "run", 7) == full


@long_form(
    50,
    "test_stopped_then_resumed_with_another_seed_ends_bit_identical (a torch module's exact resume) and "
    "test_preemption's kill -9 loop",
)
def test_killed_with_sigkill_then_resumed_ends_bit_identical(tmp_path):
    """kill -9 in the middle of a torch module's run (dropout on, checkpoints every 2 steps), then
    the same program with a module from another seed: the end state (parameters, dropout key,
    Adam's moments) has the fingerprint of an uninterrupted run."""
    script = tmp_path / "run.py"
    script.write_text(KILLED_RUN)
    run = [sys.executable, str(script), str(Path(__file__).parent)]
    full = subprocess.run([*run, str(tmp_path / "full"), "0", "0"], capture_output=True, text=True, timeout=300)
    assert full.returncode == 0, full.stderr[-3000:]
    expected = [line for line in full.stdout.splitlines() if line.startswith("FINGERPRINT 24 ")]
    assert expected, full.stdout[-2000:]
    killed = subprocess.run([*run, str(tmp_path / "run"), "8", "0"], capture_output=True, text=True, timeout=300)
    assert killed.returncode == -9, killed.stderr[-3000:]
    saved = sorted(int(p.name) for p in (tmp_path / "run" / "checkpoints").glob("*") if p.name.isdigit())
    assert saved and 8 <= max(saved) < 24, saved
    resumed = subprocess.run([*run, str(tmp_path / "run"), "0", "7"], capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from checkpoint" in resumed.stdout and expected[0] in resumed.stdout, resumed.stdout[-2000:]


def test_xlafit_check_reads_a_torch_module_file(tmp_path):
    """`xlafit check FILE` on a file that defines a torch module: a data-dependent branch in
    the module's forward is rule 1 at the user's line; a clean one compiles for a TPU."""
    from xlafit.check import check_file

    source = (
        "import numpy as np, torch\n"
        "import torch.nn.functional as F\n"
        "from xlafit.integrations.torch import torch_loss\n"
        "class Net(torch.nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.fc = torch.nn.Linear(8, 3)\n"
        "    def forward(self, x):\n"
        "        y = self.fc(x)\n"
        "{branch}"
        "        return y\n"
        "model = Net()\n"
        "loss_fn = torch_loss(lambda out, b: F.cross_entropy(out, b['y'], reduction='none'))\n"
        "batch = {{'x': np.ones((4, 8), np.float32), 'y': np.zeros(4, np.int64)}}\n"
    )
    bad = tmp_path / "bad.py"
    bad.write_text(source.format(branch="        if y.sum() > 0:\n            y = y * 2\n"))
    (finding,) = check_file(bad).findings
    assert finding.rule == 1 and finding.line == 10 and finding.code == "if y.sum() > 0:"
    # the rewrite in the model's own operations (it showed jnp.where)
    assert "torch.where(" in finding.fix and "jnp." not in finding.fix
    good = tmp_path / "good.py"
    good.write_text(source.format(branch=""))
    (target,) = check_file(good, tpu="v5e-1").tpu
    assert target.fits is True


def test_a_loss_in_torch_operations_without_torch_loss_names_the_fix(tmp_path):
    """The loss a PyTorch user writes first: torch functions on model(batch["x"]), which is a
    JAX array here. It failed with torch's "must be Tensor, not LinearizeTracer"."""
    from xlafit.check import check_file

    path = tmp_path / "net.py"
    path.write_text(
        "import numpy as np, torch\n"
        "import torch.nn.functional as F\n"
        "model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))\n"
        "batch = {'x': np.ones((4, 8), np.float32), 'y': np.zeros(4, np.int64)}\n"
        "def loss_fn(model, batch):\n"
        "    return F.cross_entropy(model(batch['x']), batch['y'], reduction='none')\n"
    )
    report = check_file(path)
    assert not report.ok
    message = " ".join(f.message for f in report.findings)
    assert "torch_loss(fn)" in message and "must be Tensor" in message
    # The module itself handed to the torch loss: named as the module, not as a JAX array.
    path.write_text(path.read_text().replace("F.cross_entropy(model(batch['x'])", "F.cross_entropy(model"))
    message = " ".join(f.message for f in check_file(path).findings)
    assert "passed the model itself" in message and "model(batch['x'])" in message, message
    # The same loss in jax.numpy on the module's outputs trains as it is.
    jax_loss = lambda model, b: -model(b["x"])[:, 0]  # noqa: E731
    config = TrainerConfig(epochs=1, log_every_steps=1)
    trainer = xlafit.Trainer(nn.Linear(8, 3), jax_loss, optax.sgd(0.1), global_batch=8, config=config)
    assert np.isfinite(trainer.fit({"x": np.ones((16, 8), np.float32)}).history[-1]["loss"])


def test_traces_from_several_threads_take_turns():
    """A plan compiles candidates side by side, and check compiles the eval step beside the
    train step: torchax's one environment and the module's train flag were shared, and about
    one trace in eight failed ("makes a tensor of its own")."""
    import concurrent.futures

    import jax
    import jax.numpy as jnp
    from flax import nnx

    module = TorchModule(nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10)))
    graphdef, params, rest = nnx.split(module, nnx.Param, ...)

    def trace(rows):
        def loss(params, x):
            return jnp.sum(nnx.merge(graphdef, params, rest)(x))

        return jax.jit(jax.grad(loss)).lower(params, jnp.ones((rows, 64))).as_text()

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        assert all(pool.map(trace, range(8, 32)))


def test_check_and_plan_keep_a_torch_module_data_parallel(tmp_path):
    """The trainer refuses FSDP for a torch module: `plan` recommended FSDP 8 for one, and
    `check mesh.fsdp=8` compiled it."""
    from xlafit.check import check_file
    from xlafit.plan import plan_file

    path = tmp_path / "net.py"
    path.write_text(
        "import numpy as np, torch\n"
        "import torch.nn.functional as F\n"
        "from xlafit.integrations.torch import torch_loss\n"
        "model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))\n"
        "batch = {'x': np.ones((4, 64), np.float32), 'y': np.zeros(4, np.int64)}\n"
        "loss_fn = torch_loss(lambda out, b: F.cross_entropy(out, b['y'], reduction='none'))\n"
    )
    plan = plan_file(path, tpu="v5e-4", global_batch=32)
    assert plan.winner is not None and plan.winner.candidate.mesh == (4, 1, 1)
    refused = {mesh for _, mesh, why in plan.skipped if "data-parallel only" in why}
    assert refused >= {(2, 2, 1), (1, 4, 1), (2, 1, 2)}  # FSDP and tensor layouts: the trainer's reason
    with pytest.raises(ConfigError, match="torch modules train data-parallel only.*mesh.fsdp=1"):
        check_file(path, ["mesh.fsdp=4"], tpu="v5e-4")


def test_what_torchax_cannot_run_is_one_line_at_the_users_line():
    class MakesItsOwnTensor(nn.Module):
        def forward(self, x):
            return x + torch.ones(4)  # a CPU tensor of its own, mixed with the model's

    with pytest.raises(
        ConfigError, match=r"makes a tensor of its own at .*test_torch.py:\d+ \(`return x \+ torch.ones"
    ):
        TorchModule(MakesItsOwnTensor())(np.ones((2, 4), np.float32))


def test_a_data_dependent_branch_in_training_is_one_line_at_the_users_line(strategy8):
    class Branches(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 3)

        def forward(self, x):
            y = self.fc(x)
            if y.sum() > 0:  # on the data: no compiled step can follow it
                y = y * 2
            return y

    trainer = xlafit.Trainer(
        Branches(),
        torch_loss(lambda out, b: F.cross_entropy(out, b["y"], reduction="none")),
        optax.sgd(0.1),
        strategy=strategy8,
        global_batch=8,
    )
    data = {"x": np.ones((8, 8), np.float32), "y": np.zeros(8, np.int64)}
    with pytest.raises(ConfigError, match=r"depends on the data at .*test_torch.py:\d+ \(`if y.sum\(\) > 0:") as e:
        trainer.fit(data)
    assert "\n" not in str(e.value)
