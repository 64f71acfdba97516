"""Builders shared by several test files (pyproject.toml puts tests/ on sys.path)."""

import optax
from flax import nnx

import xlafit
from xlafit.config import TrainerConfig
from xlafit.recipes import mnist as mnist_recipe


def cnn_trainer(strategy, run_dir=None, *, tx=None, epochs=2, stop_at_step=None, log_every_steps=1, **config):
    """The MNIST CNN with Adam (or ``tx``) at global batch 64 on ``strategy``."""
    return xlafit.Trainer(
        xlafit.models.MnistCNN(rngs=nnx.Rngs(params=0, dropout=1)),
        mnist_recipe.loss_fn,
        tx or optax.adam(1e-3),
        strategy=strategy,
        global_batch=64,
        config=TrainerConfig(epochs=epochs, stop_at_step=stop_at_step, log_every_steps=log_every_steps, **config),
        run_dir=run_dir,
    )
