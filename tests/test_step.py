"""The train step: gradient accumulation."""

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import xlafit
from helpers import mlm_dataset
from xlafit.config import TrainerConfig
from xlafit.models.bert import BertConfig, BertForMaskedLM
from xlafit.recipes import bert as recipe


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
