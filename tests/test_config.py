import pytest

from xlafit.config import DataConfig, parse_overrides, resolve_batch
from xlafit.errors import ConfigError
from xlafit.recipes import load_config


def test_preset_and_overrides():
    cfg = load_config("mnist", ["trainer.epochs=3", "optimizer.learning_rate=1e-3", "data.seed=7"])
    assert cfg.trainer.epochs == 3
    assert cfg.optimizer.learning_rate == pytest.approx(1e-3)
    assert cfg.data.seed == 7
    assert cfg.data.global_batch == 128  # from the preset


def test_per_device_override_replaces_preset_global_batch():
    cfg = load_config("mnist", ["data.per_device_batch=32"])
    assert cfg.data.global_batch is None
    assert resolve_batch(cfg.data, 8) == (32, 256)


def test_unknown_key_names_valid_keys():
    with pytest.raises(ConfigError, match=r"unknown config key trainer\.epoch\b.*trainer\.epochs"):
        load_config("mnist", ["trainer.epoch=3"])


def test_unknown_section():
    with pytest.raises(ConfigError, match="unknown config key optimiser.*optimizer"):
        load_config("mnist", ["optimiser.name=adam"])


def test_wrong_type():
    with pytest.raises(ConfigError, match=r"trainer\.epochs='three' has the wrong type: expected int"):
        load_config("mnist", ["trainer.epochs=three"])


def test_bad_choice():
    with pytest.raises(ConfigError, match="choose one of adamw, adam, lamb, sgd, lars, adadelta"):
        load_config("mnist", ["optimizer.name=lion"])


def test_negative_learning_rate():
    with pytest.raises(ConfigError, match="learning_rate=-0.1 must be positive"):
        load_config("mnist", ["optimizer.learning_rate=-0.1"])


def test_zero_batch():
    with pytest.raises(ConfigError, match="data.per_device_batch=0 must be a positive number"):
        load_config("mnist", ["data.per_device_batch=0"])


def test_batch_not_divisible():
    with pytest.raises(ConfigError, match=r"global_batch=100 does not divide evenly over 8 devices.*global_batch=96"):
        resolve_batch(DataConfig(global_batch=100), 8)


def test_malformed_override():
    with pytest.raises(ConfigError, match="key.sub=value"):
        parse_overrides(["trainer.epochs"])


def test_unknown_recipe():
    with pytest.raises(ConfigError, match="unknown recipe 'cifar'; available: mnist"):
        load_config("cifar")


def test_yaml_values_parse():
    assert parse_overrides(["a.b=null", "a.c=true", "d=2", "e=3e-4"]) == {
        "a": {"b": None, "c": True},
        "d": 2,
        "e": 3e-4,
    }
