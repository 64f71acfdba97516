"""The bert recipe: the Korean demo corpus built once, then the model and its loss on it."""

import jax.numpy as jnp
import numpy as np
import pytest

from xlafit.recipes import bert as recipe
from xlafit.recipes import load_config


def test_demo_corpus_is_built_once_into_the_cache(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("XLAFIT_CACHE", str(tmp_path))
    cfg = load_config("bert", ["data.vocab_size=1000"])
    train, evaluation = recipe.load_data(cfg)
    assert "building the Korean demo corpus" in capsys.readouterr().out
    assert len(train) > 150 and len(evaluation) > 10 and train.vocab_size == 1000
    again, _ = recipe.load_data(cfg)
    assert "building" not in capsys.readouterr().out and again.location == train.location
    model = recipe.build_model(cfg, train)
    assert model.cfg.num_layers == 2 and model.cfg.hidden_size == 128  # the tiny preset
    losses, metrics = recipe.loss_fn(model, {k: jnp.asarray(v) for k, v in train.take(np.arange(4)).items()})
    assert losses.shape == (4,) and metrics["masked_accuracy"].shape == (4,)
    assert float(losses.mean()) == pytest.approx(np.log(1000), abs=0.5)  # untrained: about uniform


def test_sequence_length_and_vocabulary_come_from_the_data():
    from helpers import mlm_dataset
    from xlafit.errors import ConfigError

    data = mlm_dataset(n=40, t=64, vocab=1000)
    data.location = "prepared/mlm"
    cfg = load_config("bert", ["data.data_dir=prepared/mlm"])
    assert cfg.data.seq_len is None and cfg.data.vocab_size is None  # nothing to set by hand
    used = recipe.from_data(cfg, data)
    assert (used.data.seq_len, used.data.vocab_size) == (64, 1000)  # what config.yaml records
    with pytest.raises(ConfigError, match="data.seq_len=128 but prepared/mlm holds sequences of 64 tokens"):
        recipe.from_data(load_config("bert", ["data.data_dir=prepared/mlm", "data.seq_len=128"]), data)
    with pytest.raises(ConfigError, match="data.vocab_size=2000 but the tokenizer of prepared/mlm has 1000"):
        recipe.from_data(load_config("bert", ["data.data_dir=prepared/mlm", "data.vocab_size=2000"]), data)
    # a setting that agrees is fine
    agreed = load_config("bert", ["data.data_dir=prepared/mlm", "data.seq_len=64"])
    assert recipe.from_data(agreed, data).data.seq_len == 64
