"""The recipes by name: each one's module (``xlafit/recipes/NAME.py``), its preset
(``NAME.yaml`` beside it) and the typed config built from them."""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from xlafit.config import Config
from xlafit.errors import ConfigError
from xlafit.overrides import build_config, load_yaml, parse_overrides
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
                f"{name} is a file, not a recipe ({', '.join(RECIPES)}): xlafit train {name} trains the model it "
                "defines (or xlafit.Trainer in Python: docs/guides/own-model.md); xlafit check and xlafit plan take "
                "the file as it is."
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
    tree = load_yaml(preset_path(name, preset))
    if preset:
        check_whole(name, tree, preset)
    return config_from_dict(name, tree, parse_overrides(overrides))


def check_whole(name: str, tree: Mapping[str, Any], path: str | Path) -> None:
    """Refuses a ``--config`` file that cannot stand in for recipe ``name``'s preset: another
    recipe's config, or a part of one (the file replaces the preset, it is not merged into it).

    Raises:
        ConfigError: naming the file's recipe, or the sections it lacks, and the fix.
    """
    start = f"`xlafit config {name} > my.yaml`, then edit my.yaml and pass --config my.yaml"
    other = tree.get("recipe")
    if other is not None and other != name:
        raise ConfigError(
            f"{path} is a config of the {other} recipe (recipe: {other}), not of {name}: use it with {other}, "
            f"or start from {name}'s own: {start}."
        )
    required = [
        f.name
        for f in dataclasses.fields(Config)
        if f.name != "recipe" and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    ]
    if not tree:
        raise ConfigError(f"{path} is empty; a --config file is a whole config: {start}.")
    if any(section not in tree for section in required):
        missing = [section for section in load_yaml(preset_path(name)) if section not in tree]
        head = (
            f"{path} is not a whole config (missing sections: {', '.join(missing)}): --config replaces {name}'s "
            f"preset rather than adding to it. Start from the preset: {start}"
        )
        dotted = _dotted(tree)
        try:  # the file's own settings as overrides, offered only if they apply
            config_from_dict(name, load_yaml(preset_path(name)), parse_overrides(dotted))
        except ConfigError as e:
            raise ConfigError(f"{head}. Its settings would not apply as overrides either: {e}") from None
        raise ConfigError(f"{head}; or give the changes as overrides on the command line ({' '.join(dotted[:6])}).")


def _dotted(tree: Mapping[str, Any], prefix: str = "") -> list[str]:
    """``tree``'s values as dotted ``key.sub=value`` overrides."""
    items: list[str] = []
    for key, value in tree.items():
        if isinstance(value, Mapping) and value:
            items += _dotted(value, f"{prefix}{key}.")
        else:
            items.append(f"{prefix}{key}={'null' if value is None else value}")
    return items


def preset_path(name: str, preset: str | Path | None = None) -> Path:
    """The YAML preset a run of recipe ``name`` starts from: ``preset``, or the recipe's own."""
    get_recipe(name)  # an unknown name is refused before any file is read
    return Path(preset).expanduser() if preset else Path(__file__).with_name(f"{name}.yaml")


def config_from_dict(name: str, preset: Mapping[str, Any], overrides: Mapping[str, Any] | None = None) -> Config:
    """A recipe's :class:`Config` from a plain dict (a preset, or a run's ``config.yaml``)."""
    recipe = get_recipe(name)
    return build_config(name, preset, overrides or {}, recipe.model_config, recipe.data_config)
