"""Recipes: a preset, a model, a loss and data wiring per workload (:class:`Recipe`).

``xlafit/recipes/NAME.py`` defines ``RECIPE``; ``NAME.yaml`` beside it is its preset.
:func:`load_config` builds a run's typed config from them; :func:`xlafit.train_and_evaluate`
runs it.
"""

from xlafit.recipes.base import Recipe, Throughput
from xlafit.recipes.registry import RECIPES, config_from_dict, get_recipe, load_config, preset_path

__all__ = ["RECIPES", "Recipe", "Throughput", "config_from_dict", "get_recipe", "load_config", "preset_path"]
