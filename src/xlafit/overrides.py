"""Reading a :class:`~xlafit.config.Config`: a recipe's YAML preset, dotted ``key=value``
overrides merged over it, every value coerced to its field's type, and keys that moved
read under their new names.

Every mistake a user can make here (an unknown key, a value of the wrong type, a file that
is not YAML) raises :class:`~xlafit.errors.ConfigError` naming the valid keys or the fix.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import yaml

from xlafit.config import (
    SCALARS,
    Config,
    DataConfig,
    MeshConfig,
    check_type,
    is_choice,
    is_optional,
    strip_optional,
    type_name,
    validate,
)
from xlafit.errors import ConfigError

log = logging.getLogger("xlafit")


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Checks ``value`` against the annotation ``tp`` (:func:`~xlafit.config.check_type`, the rule
    of the config's own checks); ints are accepted for floats, and become floats."""
    inner = strip_optional(tp) if is_optional(tp) else tp
    arms = typing.get_args(inner) if is_choice(inner) else (inner,)
    if any(typing.get_origin(arm) is not Literal and arm not in SCALARS for arm in arms):
        raise TypeError(f"unsupported config annotation {tp!r} for {key}")
    if value is None and inner is tp and typing.get_origin(tp) is not Literal:
        raise ConfigError(f"{key} is empty (given as {key}= or null); give it a value of type {type_name(tp)}.")
    check_type(value, tp, key)
    return float(value) if inner is float and value is not None else value


# TRL's and Hugging Face TrainingArguments' names a user moving a script tries, with xlafit's
# setting for each (or what xlafit does instead): named where such a key is unknown.
TRL_NAMES = {
    "rpo_alpha": "TRL's rpo_alpha is model.preference.sft_weight here",
    "cpo_alpha": "TRL's cpo_alpha is model.preference.sft_weight here",
    "simpo_gamma": "TRL's simpo_gamma is model.preference.gamma here",
    "precompute_ref_log_probs": "TRL's precompute_ref_log_probs=True is model.preference.reference=precomputed here",
    "loss_type": "for preferences, TRL's loss_type is model.objective=dpo, simpo or orpo here (TRL's other DPO "
    "losses, IPO's and hinge's among them, are not offered); for GRPO, model.grpo.loss_type",
    "max_length": "TRL's max_length is data.seq_len here: each row's tokens at most",
    "max_prompt_length": "TRL's max_prompt_length has no counterpart here: a row is cut at data.seq_len from its end, "
    "its prompt kept whole (GRPO refuses a prompt with no room for a completion)",
    "num_train_epochs": "TRL's num_train_epochs is trainer.epochs here",
    "max_steps": "TRL's max_steps is a number of trainer.epochs here, which sets the schedule's length; "
    "trainer.stop_at_step stops at a step and leaves the schedule as it is",
    "per_device_train_batch_size": "TRL's per_device_train_batch_size is data.per_device_batch here",
    "gradient_accumulation_steps": "TRL's gradient_accumulation_steps is trainer.accumulate_steps here",
    "logging_steps": "TRL's logging_steps is trainer.log_every_steps here",
    "save_steps": "TRL's save_steps is trainer.checkpoint_every_steps here",
    "dataset_text_field": "TRL's dataset_text_field is data.text_column here",
    "packing": "TRL's packing is always on here: rows are packed, their segment ids keeping each document's "
    "attention and loss to itself",
    "assistant_only_loss": "TRL's assistant_only_loss=True is data.loss_on=assistant here (the default), False "
    "data.loss_on=all",
    "completion_only_loss": "TRL's completion_only_loss=True is data.loss_on=assistant here (the default), False "
    "data.loss_on=all",
}


def from_dict(
    cls: type, data: Mapping[str, Any], prefix: str = "", model_cls: type | None = None, data_cls: type | None = None
) -> Any:
    """Builds dataclass ``cls`` from a nested mapping, rejecting unknown keys and bad types.

    Args:
        cls: the dataclass to build.
        data: nested plain values (from YAML).
        prefix: the dotted path of ``data`` inside the whole config, for messages.
        model_cls: the recipe's model dataclass, used for the ``model`` field of
            :class:`Config`.
        data_cls: the recipe's data dataclass (a :class:`DataConfig` subclass), if any.

    Returns:
        An instance of ``cls``.
    """
    if not isinstance(data, Mapping):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'} must be a mapping of keys to values, got {data!r}.")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        valid = ", ".join(prefix + name for name in fields)
        trl = f" ({TRL_NAMES[unknown[0]]})" if unknown[0] in TRL_NAMES else ""
        raise ConfigError(f"unknown config key {prefix}{unknown[0]}{trl}. Valid keys here: {valid}.")
    kwargs = {}
    for name, value in data.items():
        tp = hints[name]
        if name == "model" and cls is Config:
            tp = model_cls
        if name == "data" and cls is Config and data_cls is not None:
            tp = data_cls
        # is_dataclass is true of instances too; an annotation naming a dataclass is its type.
        if isinstance(tp, type) and dataclasses.is_dataclass(tp):
            kwargs[name] = from_dict(tp, value or {}, f"{prefix}{name}.")
        else:
            kwargs[name] = _coerce(value, tp, prefix + name)
    try:
        return cls(**kwargs)
    except TypeError as e:  # a required field is missing
        raise ConfigError(f"{prefix.rstrip('.') or 'config'}: {e}") from None


def parse_overrides(overrides: Sequence[str]) -> dict[str, Any]:
    """Turns ``["trainer.epochs=3", "data.seed=1"]`` into a nested dict.

    Values are parsed as YAML scalars, so ``3`` is an int, ``1e-3`` a float, ``null``
    None and ``true`` a bool.
    """
    nested: dict[str, Any] = {}
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key or any(not part for part in key.split(".")):
            hint = ""
            if not sep and re.search(r"/|\.(json|ya?ml|png|txt|csv)$", item):
                hint = (
                    " It looks like a file or directory: name it with its flag (--data-dir DIR, --run-dir DIR, "
                    "--config FILE); --json of check, plan, inspect and generate takes none (it prints JSON: "
                    "redirect it, > FILE)."
                )
            raise ConfigError(
                f"override {item!r} is not of the form key.sub=value (for example trainer.epochs=3).{hint}"
            )
        value = yaml.safe_load(raw) if raw.strip() else None
        # YAML 1.1 reads "1e-3" as a string; numbers in scientific notation are common here.
        if isinstance(value, str):
            try:
                value = float(value) if any(c in value for c in ".eE") else value
            except ValueError:
                pass
        node = nested
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {item!r} conflicts with another override of {part}.")
        node[leaf] = value
    return nested


def merge_overrides(*groups: Sequence[str]) -> list[str]:
    """``groups`` of overrides as one list with each key once, at its last value (the one that
    wins): ``merge_overrides(["data.global_batch=8"], ["data.global_batch=null"])`` is
    ``["data.global_batch=null"]``."""
    merged: dict[str, str] = {}
    for item in (item for group in groups for item in group):
        merged[item.partition("=")[0].strip()] = item
    return list(merged.values())


def deep_merge(base: dict[str, Any], update: Mapping[str, Any]) -> dict[str, Any]:
    """Returns ``base`` updated by ``update``, merging nested dicts key by key."""
    merged = dict(base)
    for key, value in update.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), Mapping):
            merged[key] = deep_merge(dict(merged[key]), value)
        else:
            merged[key] = value
    return merged


def load_yaml(path: str | Path) -> dict[str, Any]:
    """Reads a YAML preset; an empty file is an empty mapping."""
    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f) or {}
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist.") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {path} is not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping at the top level.")
    return data


def build_config(
    recipe: str,
    preset: Mapping[str, Any],
    overrides: Mapping[str, Any],
    model_cls: type,
    data_cls: type = DataConfig,
) -> Config:
    """Merges preset and overrides into a validated :class:`Config`.

    A user who overrides ``data.per_device_batch`` (and not ``data.global_batch``) means
    the per-device size: the preset's global batch is dropped so the two cannot disagree.
    """
    preset, overrides = migrate(preset, "the preset"), migrate(overrides, "the overrides")
    data_over = overrides.get("data", {}) if isinstance(overrides.get("data"), Mapping) else {}
    merged = deep_merge(dict(preset), overrides)
    if "per_device_batch" in data_over and "global_batch" not in data_over:
        merged.setdefault("data", {})["global_batch"] = None
    merged["recipe"] = recipe
    _preset_gives_way(merged, overrides)
    cfg = from_dict(Config, merged, model_cls=model_cls, data_cls=data_cls)
    if not isinstance(cfg.data, data_cls):  # no data section at all: the recipe's defaults
        cfg.data = data_cls()
    validate(cfg)
    return cfg


# Keys that moved, old -> new: a preset, an override or a run's config.yaml that still has
# the old one is read with a one-line note.
MOVED = {
    "run.xla_cpu_fast_paths": "cpu.fast_paths",
    "run.xla_cpu_ynn_fusion": "cpu.ynn_fusion",
    "run.cpu_keep_memory": "cpu.keep_memory",
    "run.cpu_async_dispatch": "cpu.async_dispatch",
}
# Keys that are gone, with why: dropped with a note.
REMOVED = {"model.conv": "ResNet's convolutions are XLA's on every platform"}


def migrate(tree: Mapping[str, Any], source: str) -> dict[str, Any]:
    """``tree`` (nested) with moved keys under their new names and removed ones dropped, each
    with a one-line note naming ``source`` (a preset, the overrides, a run's config.yaml).

    Example:
        >>> migrate({"run": {"cpu_keep_memory": False}}, "overrides")
        {'run': {}, 'cpu': {'keep_memory': False}}
    """
    out = {k: dict(v) if isinstance(v, Mapping) else v for k, v in tree.items()}
    moved, dropped = [], []
    for old, new in (*MOVED.items(), *((k, "") for k in REMOVED)):
        section, key = old.split(".")
        if not isinstance(out.get(section), dict) or key not in out[section]:
            continue
        value = out[section].pop(key)
        if not new:
            dropped.append(f"{old} ({REMOVED[old]})")
            continue
        new_section, new_key = new.split(".")
        if isinstance(out.setdefault(new_section, {}), dict):
            out[new_section].setdefault(new_key, value)
        moved.append(f"{old} is now {new}")
    if moved or dropped:
        gone = [f"{', '.join(dropped)}: no longer a setting, ignored"] if dropped else []
        log.warning("note: %s: %s", source, "; ".join(moved + gone))
    return out


def _preset_gives_way(merged: dict[str, Any], overrides: Mapping[str, Any]) -> None:
    """A setting the preset chose, not the user, yields to the user's mesh: a mesh axis the
    preset sized -1 (the devices left) is 1 when the user gives another axis -1; the preset's
    ``trainer.invariant_chunks`` (pure data parallelism only) is dropped, with a note, when the
    overrides ask for FSDP or tensor parallelism."""
    trainer, mesh = merged.get("trainer") or {}, merged.get("mesh") or {}
    mine: Mapping[str, Any] = overrides["mesh"] if isinstance(overrides.get("mesh"), Mapping) else {}
    if -1 in mine.values():  # the user's "the devices left" replaces the preset's
        defaults = {f.name: f.default for f in dataclasses.fields(MeshConfig)}
        for axis in ("data", "fsdp", "tensor", "expert"):
            if mesh.get(axis, defaults[axis]) == -1 and axis not in mine:
                merged["mesh"] = mesh = {**mesh, axis: 1}
    asked = overrides.get("trainer") if isinstance(overrides.get("trainer"), Mapping) else {}
    split = any(mesh.get(axis, 1) not in (1, None) for axis in ("fsdp", "tensor", "expert"))
    if split and trainer.get("invariant_chunks") is not None and "invariant_chunks" not in (asked or {}):
        log.warning(
            "note: the preset's trainer.invariant_chunks=%s (bit-identical across device counts) holds for pure "
            "data parallelism only; it is off for this mesh",
            trainer["invariant_chunks"],
        )
        merged["trainer"] = {**trainer, "invariant_chunks": None}
