"""A user's loss that a compiled step cannot follow is one line at the user's line."""

import numpy as np
import optax
import pytest
from flax import nnx

import xlafit
from xlafit.errors import ConfigError

X = np.random.default_rng(0).normal(size=(16, 4)).astype(np.float32)
Y = (X[:, 0] > 0).astype(np.int32)


def _fit(loss_fn, y=Y):
    trainer = xlafit.Trainer(
        nnx.Linear(4, 2, rngs=nnx.Rngs(0)), loss_fn, optax.sgd(0.1), global_batch=8,
        config=xlafit.config.TrainerConfig(epochs=1),
    )  # fmt: skip
    try:
        trainer.fit({"x": X, "y": y})
    finally:
        trainer.close()


def _losses(model, batch):
    return optax.softmax_cross_entropy_with_integer_labels(model(batch["x"]), batch["y"])


def masked_mean(model, batch):
    losses = _losses(model, batch)
    return losses[batch["y"] > 0].mean()  # a selection whose size depends on the labels


def branching(model, batch):
    losses = _losses(model, batch)
    if losses.mean() > 1:  # a branch on a traced value
        return losses * 2
    return losses


@pytest.mark.parametrize(
    ("loss_fn", "says", "line"),
    [
        (masked_mean, "cannot compile an array whose shape depends on the data", "losses[batch"),
        (branching, "cannot follow Python control flow on a traced value", "if losses.mean() > 1"),
    ],
)
def test_a_loss_the_step_cannot_follow_is_named_at_its_line(loss_fn, says, line):
    """Trainer.fit raised JAX's NonConcreteBooleanIndexError or TracerBoolConversionError
    from inside its own frames; `xlafit check FILE` named the line, fit did not."""
    with pytest.raises(ConfigError, match=says) as caught:
        _fit(loss_fn)
    message = str(caught.value)
    assert "test_traced.py:" in message and line in message and "`xlafit check FILE`" in message


def test_float_labels_for_an_integer_label_loss_name_the_cast():
    with pytest.raises(ConfigError, match="the loss takes integer labels and the batch gave floats") as caught:
        _fit(_losses, y=Y.astype(np.float32))
    assert "test_traced.py:" in str(caught.value) and "astype(np.int32)" in str(caught.value)
