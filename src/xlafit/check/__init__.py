"""``xlafit check``: try a training step with XLA on the CPU before the TPU, automated.

The Hugging Face TPU guide's three XLA rules, checked up front instead of after a long
compile on the accelerator:

1. no data-dependent Python control flow (``if``/``while`` on an array's value);
2. no data-dependent shapes (boolean-mask indexing, ``jnp.unique``, ``jnp.nonzero``);
3. every new input shape compiles a new program: pad to a few fixed shapes.

The rules themselves: :mod:`xlafit.check.rules`; the step checked here:
:mod:`xlafit.check.step`; user files and recipes: :mod:`xlafit.check.files` and
:mod:`xlafit.check.recipes`; the TPU compiles: :mod:`xlafit.check.tpu`.

A user file defines ``model`` (an ``nnx.Module``, or a Keras 3 model with the JAX backend),
``loss_fn(model, batch)`` (per-example losses ``[B]``, or ``(losses, {metric: [B]})``;
optional for a compiled Keras model) and ``batch`` (a dict of arrays, a small real batch;
``{"x": ..., "y": ...}`` for Keras). Optional: ``dataset`` (an iterable of examples, dicts of arrays whose first
axis is the sequence) or ``lengths`` (one length per example) for rule 3.

The train step is traced abstractly (rules 1 and 2 fail at trace time; the failure is
mapped to the user's file and line), then run once on ``batch``, then compiled at the
per-device batch to read XLA's memory and cost analyses.
"""

from __future__ import annotations

from xlafit.check.files import check_file, file_program, file_settings, importable, load_file
from xlafit.check.recipes import assumed_settings, check_command, check_recipe, recipe_program
from xlafit.check.report import Report
from xlafit.check.rules import Finding, classify
from xlafit.check.step import check_step, to_json

__all__ = [
    "Finding",
    "Report",
    "assumed_settings",
    "check_command",
    "check_file",
    "check_recipe",
    "check_step",
    "classify",
    "file_program",
    "file_settings",
    "importable",
    "load_file",
    "recipe_program",
    "to_json",
]
