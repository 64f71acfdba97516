import re

import numpy as np
import pytest
import yaml

from xlafit.config import (
    DataConfig,
    LoraConfig,
    MeshConfig,
    OptimizerConfig,
    RunConfig,
    TrainerConfig,
    resolve_batch,
)
from xlafit.errors import ConfigError
from xlafit.overrides import parse_overrides
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
    with pytest.raises(
        ConfigError, match=r"my_model.py is a file, not a recipe .* xlafit train my_model.py .* xlafit check"
    ):
        load_config("my_model.py")


def test_yaml_values_parse():
    assert parse_overrides(["a.b=null", "a.c=true", "d=2", "e=3e-4"]) == {
        "a": {"b": None, "c": True},
        "d": 2,
        "e": 3e-4,
    }


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: TrainerConfig(epochs=1, steps_per_call=0), r"trainer.steps_per_call=0 must be a positive number"),
        (lambda: TrainerConfig(epochs=0), r"trainer.epochs=0 must be a positive number"),
        (lambda: TrainerConfig(nan_policy="ignore"), r"trainer.nan_policy='ignore' is not allowed; choose one of stop"),
        (lambda: TrainerConfig(watchdog_factor=0.5), r"trainer.watchdog_factor=0.5"),
        (
            lambda: MeshConfig(data=-1, fsdp=-1),
            r"at most one of mesh.data, mesh.fsdp, mesh.tensor, mesh.expert may be -1",
        ),
        (lambda: OptimizerConfig(learning_rate=0), r"optimizer.learning_rate=0 must be positive"),
    ],
)
def test_a_config_built_in_python_refuses_what_the_cli_refuses(build, message):
    """The library gets every check the command makes: a section refuses its impossible values
    however it is built (steps_per_call=0 used to spin the trainer forever)."""
    with pytest.raises(ConfigError, match=message):
        build()


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: TrainerConfig(epochs="3"), r"^trainer\.epochs='3' has the wrong type: expected int\.$"),
        (lambda: TrainerConfig(epochs=True), r"^trainer\.epochs=True has the wrong type: expected int\.$"),
        (
            lambda: TrainerConfig(stop_at_step=2.5),
            r"^trainer\.stop_at_step=2\.5 has the wrong type: expected int or null\.$",
        ),
        (
            lambda: TrainerConfig(watchdog_factor="20"),
            r"^trainer\.watchdog_factor='20' has the wrong type: expected float\.$",
        ),
        (lambda: OptimizerConfig(learning_rate="1e-3"), r"^optimizer\.learning_rate='1e-3' has the wrong type"),
        (lambda: OptimizerConfig(nesterov=1), r"^optimizer\.nesterov=1 has the wrong type: expected bool\.$"),
        (lambda: DataConfig(global_batch="32"), r"^data\.global_batch='32' has the wrong type: expected int or null"),
        (lambda: MeshConfig(fsdp="2"), r"^mesh\.fsdp='2' has the wrong type: expected int\.$"),
        (lambda: RunConfig(run_dir=5), r"^run\.run_dir=5 has the wrong type: expected str or null\.$"),
        (lambda: LoraConfig(rank=None), r"^lora\.rank=None has the wrong type: expected int\.$"),
    ],
)
def test_a_config_field_of_the_wrong_type_is_named_with_the_type_it_takes(build, message):
    with pytest.raises(ConfigError, match=message):
        build()


def test_numpy_numbers_fill_config_fields():
    """An int is a float too, and NumPy's scalars count (a count computed with NumPy)."""
    assert TrainerConfig(epochs=np.int64(2), checkpoint_every_minutes=np.float32(0.5), watchdog_factor=3).epochs == 2


def test_a_field_of_several_types_or_null_takes_each_of_them():
    """``model.grpo.reward_weights`` (``float | str | None``) takes a list of weights, as the
    GRPO guide writes it, a single number and null; another type is named with all three."""
    weights = lambda value: load_config("llm", [f"model.grpo.reward_weights={value}"]).model.grpo.reward_weights  # noqa: E731
    assert weights("1,0.5") == "1,0.5"
    assert weights("2") == 2
    assert weights("null") is None
    with pytest.raises(ConfigError, match=r"reward_weights=True is not allowed: expected float or str or null\.$"):
        weights("true")


def test_the_presets_setting_gives_way_to_the_users_mesh(caplog):
    with caplog.at_level("WARNING", logger="xlafit"):
        cfg = load_config("mnist", ["mesh.fsdp=8"])
    assert cfg.trainer.invariant_chunks is None and cfg.mesh.fsdp == 8
    assert "the preset's trainer.invariant_chunks=8" in caplog.text and "off for this mesh" in caplog.text
    with pytest.raises(ConfigError, match="trainer.invariant_chunks keeps its bit-identical guarantee"):
        load_config("mnist", ["mesh.fsdp=8", "trainer.invariant_chunks=8"])  # the user's own choice is refused
    # "The devices left" moves to the axis the user gives it; two of the user's own are refused.
    assert load_config("llm", ["mesh.fsdp=-1"]).mesh.sizes == (1, -1, 1)
    assert load_config("llm", []).mesh.sizes == (-1, 1, 1)
    with pytest.raises(ConfigError, match="at most one of mesh.data, mesh.fsdp, mesh.tensor, mesh.expert may be -1"):
        load_config("llm", ["mesh.fsdp=-1", "mesh.data=-1"])


def test_an_override_that_is_a_path_says_which_flag_takes_it():
    """``xlafit check mnist --tpu v5e-8 --json out.json``: check's --json takes no file, so the
    path became an override; the error says so instead of only asking for key=value."""
    from xlafit.overrides import parse_overrides

    with pytest.raises(ConfigError, match=r"looks like a file or directory: name it with its flag .*redirect it"):
        parse_overrides(["runs/out.json"])
    with pytest.raises(ConfigError) as err:
        parse_overrides(["epochs"])
    assert "looks like a file" not in str(err.value)


def test_a_partial_config_file_is_refused_with_the_whole_preset_to_start_from(tmp_path):
    """--config replaces the recipe's preset: a file with a section or two is not merged into it."""
    part = tmp_path / "t2.yaml"
    part.write_text("trainer:\n  epochs: 2\n")
    with pytest.raises(ConfigError) as e:
        load_config("mnist", preset=part)
    assert str(e.value) == (
        f"{part} is not a whole config (missing sections: model, data, optimizer, cpu): --config replaces mnist's "
        "preset rather than adding to it. Start from the preset: `xlafit config mnist > my.yaml`, then edit my.yaml "
        "and pass --config my.yaml; or give the changes as overrides on the command line (trainer.epochs=2)."
    )
    # settings that would not apply as overrides are not offered as the fix (a typo was), nor
    # are settings the file does not hold (an empty file was offered trainer.epochs=2)
    part.write_text("trainer:\n  epochz: 2\n")
    with pytest.raises(ConfigError, match=r"Its settings would not apply as overrides either: .*epochz") as e:
        load_config("mnist", preset=part)
    assert "command line (trainer.epochz=2)" not in str(e.value)
    part.write_text("")
    with pytest.raises(ConfigError) as e:
        load_config("mnist", preset=part)
    assert str(e.value) == (
        f"{part} is empty; a --config file is a whole config: `xlafit config mnist > my.yaml`, then edit my.yaml "
        "and pass --config my.yaml."
    )
    whole = tmp_path / "my.yaml"
    whole.write_text(yaml.safe_dump(load_config("mnist", ["trainer.epochs=2"]).to_dict()))
    assert load_config("mnist", preset=whole).trainer.epochs == 2


def test_another_recipes_config_file_says_whose_it_is(tmp_path):
    other = tmp_path / "b.yaml"
    other.write_text(yaml.safe_dump(load_config("bert").to_dict()))
    expected = f"{other} is a config of the bert recipe (recipe: bert), not of mnist: use it with bert"
    with pytest.raises(ConfigError, match=re.escape(expected)):
        load_config("mnist", preset=other)
    assert load_config("bert", preset=other).recipe == "bert"


@pytest.mark.parametrize(
    ("key", "said"),
    [
        ("model.preference.rpo_alpha=1", "(TRL's rpo_alpha is model.preference.sft_weight here)"),
        ("model.preference.loss_type=ipo", "(for preferences, TRL's loss_type is model.objective=dpo, simpo or orpo"),
        ("model.preference.max_length=64", "(TRL's max_length is data.seq_len here"),
        ("trainer.num_train_epochs=3", "(TRL's num_train_epochs is trainer.epochs here)"),
        ("trainer.max_steps=20", "(TRL's max_steps is a number of trainer.epochs here, which sets the schedule's"),
        ("data.dataset_text_field=body", "(TRL's dataset_text_field is data.text_column here)"),
        ("data.packing=false", "(TRL's packing is always on here: rows are packed, their segment ids keeping"),
        ("data.assistant_only_loss=true", "(TRL's assistant_only_loss=True is data.loss_on=assistant here"),
        ("data.completion_only_loss=false", "(TRL's completion_only_loss=True is data.loss_on=assistant here"),
    ],
)
def test_trls_names_are_refused_with_xlafits_setting_for_them(key, said):
    """The fifteenth walk: TRL's names (rpo_alpha, loss_type, max_length, ...) got "unknown
    config key" and the keys of the section, where max_length's counterpart is not even listed."""
    with pytest.raises(ConfigError) as e:
        load_config("llm", [key])
    assert str(e.value).startswith(f"unknown config key {key.split('=')[0]} {said}"), str(e.value)


def test_a_misspelt_remat_is_refused_as_the_config_is_read(tmp_path):
    """The sixteenth walk: `model.remat=ful` with model.init_from_hf (whose sizes are read when
    the model is built) was a ValueError traceback after the data was read and the run
    directory written; with a preset it was one line."""
    with pytest.raises(ConfigError, match=r"^model.remat=ful: give one of none, full, .*, offload_attention\.$"):
        load_config("llm", [f"model.init_from_hf={tmp_path}", "model.remat=ful"])
