"""Trainer's arguments are refused by name before anything is built, compiled or written
(train/arguments.py): the own-model guide's MLP with one argument wrong at a time."""

import pathlib

import numpy as np
import optax
import pytest
from flax import nnx

import xlafit
from xlafit.config import OptimizerConfig, TrainerConfig
from xlafit.errors import ConfigError
from xlafit.train.adapter import Adapted
from xlafit.train.arguments import check_model


class MLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.hidden = nnx.Linear(20, 16, rngs=rngs)
        self.out = nnx.Linear(16, 2, rngs=rngs)

    def __call__(self, x):
        return self.out(nnx.relu(self.hidden(x)))


def loss_fn(model, batch):
    return optax.softmax_cross_entropy_with_integer_labels(model(batch["x"]), batch["y"])


BAD = {
    "negative batch": ({"global_batch": -1}, r"^global_batch=-1 must be a positive number\.$"),
    "zero batch": ({"global_batch": 0}, r"^global_batch=0 must be a positive number\.$"),
    "batch as a string": ({"global_batch": "32"}, r"^global_batch='32' has the wrong type: expected int\.$"),
    "batch as a bool": ({"global_batch": True}, r"^global_batch=True has the wrong type: expected int\.$"),
    "both batches": (
        {"per_device_batch": 4},
        r"^give global_batch=32 or per_device_batch=4, not both \(the global batch is per_device_batch x the "
        r"strategy's 8 replicas\)\.$",
    ),
    "no batch": ({"global_batch": None}, r"^Trainer needs global_batch= .* or per_device_batch= \(.* 8 replicas\)\.$"),
    "zero per-device batch": (
        {"global_batch": None, "per_device_batch": 0},
        r"^per_device_batch=0 must be a positive number\.$",
    ),
    "zero eval batch": ({"eval_global_batch": 0}, r"^eval_global_batch=0 must be a positive number\.$"),
    "eval batch off the devices": (
        {"eval_global_batch": 12},
        r"^eval_global_batch=12 does not divide over 8 devices; use a multiple of 8 \(e\.g\. 8\)\.$",
    ),
    "optimizer by name": (
        {"optimizer": "adam"},
        r"^optimizer must be an optax\.GradientTransformation \(e\.g\. optax\.adamw\(1e-3\)\) or an "
        r"xlafit\.config\.OptimizerConfig \(its rate scaled with the global batch\), got str\.$",
    ),
    "optimizer as a rate": ({"optimizer": 1e-3}, r"optax\.GradientTransformation .*, got float\.$"),
    "a config's rate and a logged one": (
        {"optimizer": OptimizerConfig(), "learning_rate": 1e-3},
        r"^learning_rate \(only logged\) is for an optax optimizer: .* Leave learning_rate out\.$",
    ),
    "config as a dict": (
        {"config": {"epochs": 1}},
        r"^config must be an xlafit\.config\.TrainerConfig, got dict: "
        r"TrainerConfig\(\*\*\{'epochs': 1\}\) builds one\.$",
    ),
    "strategy by name": ({"strategy": "tpu"}, r"^strategy must be what xlafit\.connect\(\) returns .* got str\.$"),
    "run_dir as a number": ({"run_dir": 5}, r"^run_dir must be a str or os\.PathLike .*, got int\.$"),
    "checkpoint_dir as a number": ({"checkpoint_dir": 5}, r"^checkpoint_dir must be a str or os\.PathLike"),
    "no loss": ({"loss_fn": None}, r"^loss_fn must be a callable \(model, batch\) -> per-example losses .*NoneType"),
    "loss by name": ({"loss_fn": "cross_entropy"}, r"^loss_fn must be a callable .*got str\.$"),
    "model by name": ({"model": "mlp"}, r"^model must be an nnx\.Module, a function that builds one .*got str\.$"),
    "learning rate by name": ({"learning_rate": "1e-3"}, r"^learning_rate .*optax schedule.*got str\.$"),
    "seed as a float": ({"data_seed": 0.5}, r"^data_seed=0\.5 has the wrong type: expected int\.$"),
    "negative prefetch": ({"prefetch": -1}, r"^prefetch=-1 must be zero or more\.$"),
    "resume as a string": ({"resume": "no"}, r"^resume='no' has the wrong type: expected bool\.$"),
    "zero FLOPs": ({"flops_per_example": 0}, r"^flops_per_example=0 must be a positive number\.$"),
}


@pytest.mark.parametrize(("bad", "message"), BAD.values(), ids=BAD.keys())
def test_a_wrong_argument_is_refused_by_name_before_anything_is_built(strategy8, tmp_path, bad, message):
    built = []

    def build():
        built.append(True)
        return MLP(nnx.Rngs(0))

    args = {"model": build, "loss_fn": loss_fn, "optimizer": optax.adamw(1e-2), "strategy": strategy8}
    args |= {"global_batch": 32, "config": TrainerConfig(epochs=1), "run_dir": tmp_path / "run", **bad}
    with pytest.raises(ConfigError, match=message):
        xlafit.Trainer(args.pop("model"), args.pop("loss_fn"), args.pop("optimizer"), **args)
    assert built == []  # refused before the model was built (or anything compiled)
    assert not (tmp_path / "run").exists()


def test_a_model_function_must_return_a_module(strategy8):
    with pytest.raises(ConfigError, match=r"^the model function returned int, not an nnx\.Module; it must build"):
        xlafit.Trainer(lambda: 3, loss_fn, optax.sgd(0.1), strategy=strategy8, global_batch=32)


def test_numpy_numbers_and_paths_are_accepted(strategy8, tmp_path):
    trainer = xlafit.Trainer(
        nnx.Linear(2, 2, rngs=nnx.Rngs(0)),
        lambda m, b: (m(b["x"]) ** 2).sum(-1),
        optax.sgd(0.1),
        strategy=strategy8,
        global_batch=np.int64(16),
        config=TrainerConfig(epochs=np.int64(1)),
        run_dir=pathlib.Path(tmp_path),
        data_seed=np.int32(3),
        tokens_per_example=np.float32(4.0),
        flops_per_example=100,  # an int is a float
    )
    assert (trainer.global_batch, trainer.eval_global_batch) == (16, 16)
    assert type(trainer.global_batch) is int


def test_per_device_batch_is_times_the_strategys_replicas(strategy8):
    """Trainer(per_device_batch=16) was a raw TypeError; the recipes' data.per_device_batch."""
    trainer = xlafit.Trainer(MLP(nnx.Rngs(0)), loss_fn, optax.sgd(0.1), strategy=strategy8, per_device_batch=4)
    assert (trainer.global_batch, trainer.eval_global_batch) == (32, 32)


def test_a_foreign_models_loss_is_its_adapters_to_check():
    """A Keras model's loss may be a name or None (model.compile's): the adapter decides."""
    check_model(Adapted(nnx.Linear(2, 2, rngs=nnx.Rngs(0)), loss_fn), None)


def test_an_optimizer_config_scales_its_rate_to_the_batch_and_spans_the_run(strategy8, capsys):
    """A Trainer took an optax optimizer only: a PyTorch/XLA user's "fix the LR by hand" was
    left to them, with no rate printed. An OptimizerConfig (the recipes' optimizer.*) is scaled
    from its reference batch to the global batch, its schedule spans the run fit sees, it is
    printed at start and logged, and it trains as the optax chain make_optimizer builds."""
    from xlafit.train.optim import make_optimizer

    rng = np.random.default_rng(0)
    x = rng.normal(size=(256, 20)).astype("float32")
    data = {"x": x, "y": (x[:, 0] > 0).astype("int32")}
    cfg = OptimizerConfig(name="sgd", learning_rate=0.01, reference_batch=16, warmup_steps=2, decay="linear")
    config = TrainerConfig(epochs=2, log_every_steps=1)
    trainer = xlafit.Trainer(lambda: MLP(nnx.Rngs(0)), loss_fn, cfg, strategy=strategy8, global_batch=64, config=config)
    history = trainer.fit(data).history
    out = capsys.readouterr().out
    assert "learning rate: 0.01 at batch 16 -> peak 0.04 at global batch 64 (linear scaling)" in out
    assert "peak learning rate: 0.04" in out
    rates = [round(r["learning_rate"], 6) for r in history]  # 8 steps: 2 of warmup from 0, then down to 0 at 8
    assert rates == [0.0, 0.02, 0.04, 0.033333, 0.026667, 0.02, 0.013333, 0.006667]
    plan = make_optimizer(cfg, 64, total_steps=8, steps_per_epoch=4)
    same = xlafit.Trainer(
        lambda: MLP(nnx.Rngs(0)), loss_fn, plan.tx, strategy=strategy8, global_batch=64, config=config
    )
    same.fit(data)
    capsys.readouterr()
    np.testing.assert_array_equal(
        np.asarray(trainer.state.params["out"]["kernel"].value), np.asarray(same.state.params["out"]["kernel"].value)
    )
