"""The recipes by name: each one's module (``xlafit/recipes/NAME.py``), its preset
(``NAME.yaml`` beside it) and the typed config built from them."""

from __future__ import annotations

import importlib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from xlafit.config import Config, build_config, load_yaml, parse_overrides
from xlafit.errors import ConfigError
from xlafit.recipes.base import Recipe

RECIPES = ("mnist", "bert", "resnet", "llm")


def get_recipe(name: str) -> Recipe:
    """The :class:`Recipe` called ``name``.

    Example:
        >>> get_recipe("mnist").name
        'mnist'
    """
    if name not in RECIPES:
        if name.endswith(".py"):
            raise ConfigError(
                f"{name} is a file, not a recipe ({', '.join(RECIPES)}): a model of your own trains in Python with "
                "xlafit.Trainer (docs/guides/own-model.md); xlafit check and xlafit plan take the file as it is."
            )
        raise ConfigError(f"unknown recipe {name!r}; available: {', '.join(RECIPES)}.")
    return importlib.import_module(f"xlafit.recipes.{name}").RECIPE


def load_config(name: str, overrides: Sequence[str] = (), preset: str | Path | None = None) -> Config:
    """The recipe's preset (or ``preset``, a YAML file) with dotted ``overrides`` applied.

    Example:
        >>> cfg = load_config("mnist", ["trainer.epochs=1"])
        >>> cfg.trainer.epochs
        1
    """
    return config_from_dict(name, load_yaml(preset_path(name, preset)), parse_overrides(overrides))


def preset_path(name: str, preset: str | Path | None = None) -> Path:
    """The YAML preset a run of recipe ``name`` starts from: ``preset``, or the recipe's own."""
    get_recipe(name)  # an unknown name is refused before any file is read
    return Path(preset).expanduser() if preset else Path(__file__).with_name(f"{name}.yaml")


def config_from_dict(name: str, preset: Mapping[str, Any], overrides: Mapping[str, Any] | None = None) -> Config:
    """A recipe's :class:`Config` from a plain dict (a preset, or a run's ``config.yaml``)."""
    recipe = get_recipe(name)
    return build_config(name, preset, overrides or {}, recipe.model_config, recipe.data_config)
