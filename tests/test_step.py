"""The train step: gradient accumulation, the non-finite guards."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import xlafit
from helpers import mlm_dataset
from xlafit.config import TrainerConfig
from xlafit.models.bert import BertConfig, BertForMaskedLM
from xlafit.recipes import bert as recipe
from xlafit.train.state import TrainState
from xlafit.train.step import build_train_step


def test_gradient_accumulation_equals_one_big_batch(strategy8):
    ds = mlm_dataset(n=64, t=32, vocab=300)
    results = []
    for accumulate in (1, 4):
        cfg = BertConfig.preset("tiny", vocab_size=300, max_position_embeddings=32, hidden_dropout=0.0)
        trainer = xlafit.Trainer(
            BertForMaskedLM(cfg, rngs=nnx.Rngs(0)),
            recipe.loss_fn,
            optax.sgd(0.5),
            strategy=strategy8,
            global_batch=32,
            config=TrainerConfig(epochs=1, accumulate_steps=accumulate, log_every_steps=1),
        )
        result = trainer.fit(ds)
        results.append((result, jax.tree.leaves(nnx.to_pure_dict(result.state.params))))
    (a, pa), (b, pb) = results
    assert a.history[-1]["loss"] == pytest.approx(b.history[-1]["loss"], rel=1e-5)
    for x, y in zip(pa, pb, strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-4, atol=1e-6)


def _guarded_step(guard, select):
    model = nnx.Linear(4, 2, rngs=nnx.Rngs(0))  # its bias starts at 0
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    tx = optax.adam(0.1)
    state = TrainState(jnp.zeros((), jnp.int32), params, tx.init(params), rest)

    def loss_fn(model, batch):
        y = model(batch["x"])
        # 0 always; its gradient is 0 * inf = NaN when batch["bad_grad"] is 1 (sqrt at 0)
        bad = batch["bad_grad"][0]
        kink = 0.0 * jnp.sqrt(jnp.abs(model.bias[0]) * bad + (1.0 - bad))
        return jnp.mean(y**2, axis=-1) + kink

    return jax.jit(build_train_step(graphdef, loss_fn, tx, unroll=True, guard=guard, select=select)), state


def _batch(x_value=1.0, bad_grad=0.0):
    return {"x": np.full((1, 8, 4), x_value, np.float32), "bad_grad": np.full((1, 8), bad_grad, np.float32)}


@pytest.mark.parametrize("select", [False, True])
@pytest.mark.parametrize("guard", ["loss", "gradient"])
def test_the_guards_drop_a_nonfinite_loss_and_only_the_gradient_guard_a_nonfinite_gradient(guard, select):
    step, state = _guarded_step(guard, select)
    before = jax.tree.leaves(nnx.to_pure_dict(state.params))
    # a NaN loss: every guard keeps the parameters, the optimizer state, and counts the step
    after, metrics = step(state, _batch(x_value=np.nan))
    assert metrics["nonfinite"][0] == 1.0 and int(after.step) == 1
    for x, y in zip(before, jax.tree.leaves(nnx.to_pure_dict(after.params)), strict=True):
        np.testing.assert_array_equal(x, y)
    assert int(after.opt_state[0].count) == 0
    # a finite loss with a NaN gradient: flagged either way; applied only under the loss guard
    step, state = _guarded_step(guard, select)
    after, metrics = step(state, _batch(bad_grad=1.0))
    assert np.isfinite(metrics["loss"][0]) and not np.isfinite(metrics["grad_norm"][0])
    assert metrics["nonfinite"][0] == 1.0
    finite = all(np.isfinite(x).all() for x in jax.tree.leaves(nnx.to_pure_dict(after.params)))
    assert finite == (guard == "gradient")


def test_the_select_and_cond_forms_of_the_loss_guard_give_the_same_bits():
    results = []
    for select in (False, True):
        step, state = _guarded_step("loss", select)
        for _ in range(3):
            state, _ = step(state, _batch(x_value=0.5))
        results.append(jax.tree.leaves(nnx.to_pure_dict(state.params)))
    for x, y in zip(*results, strict=True):
        np.testing.assert_array_equal(x, y)


def test_a_loss_fn_returning_a_python_number_is_named():
    """``return 1.0`` failed with "'float' object has no attribute 'ndim'"."""
    from xlafit.train.step import split_outputs

    with pytest.raises(ValueError, match=r"the loss as an array computed from the model's output .*got a float"):
        split_outputs(1.0)
    with pytest.raises(ValueError, match=r"the accuracy as an array .*got a int"):
        split_outputs((jnp.ones(3), {"accuracy": 1}))
    assert split_outputs(jnp.ones(3))[0].shape == (3,)
