"""The files a run keeps beside its checkpoints that give their numbers a meaning (its
tokenizer, its classes, a fingerprint of its data): written when a run starts
(:func:`save_kept_files`), and compared with what the same config would write now before a
run resumes or is scored (:func:`check_kept_files`).
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

from etils import epath

from xlafit.config import Config
from xlafit.data import files, shards
from xlafit.errors import ConfigError
from xlafit.io.paths import as_path, reading
from xlafit.recipes.base import Recipe

# The records of the data a run read: of prepared shards (resnet, bert), of data files (llm).
DATA_FINGERPRINTS = (shards.FINGERPRINT_FILE, files.FINGERPRINT_FILE)


def save_kept_files(recipe: Recipe, cfg: Config, run_dir: epath.Path | Path, train: Any, data: bool = True) -> None:
    """Writes the recipe's files (:attr:`Recipe.save_artifacts`) and, with ``data``, the
    fingerprint of its data files (:attr:`Recipe.data_fingerprint`,
    :data:`~xlafit.data.files.FINGERPRINT_FILE`) to ``run_dir``."""
    recipe.save_artifacts(cfg, run_dir, train)
    found = recipe.data_fingerprint(cfg) if data and recipe.data_fingerprint is not None else None
    if found is not None:
        (run_dir / files.FINGERPRINT_FILE).write_text(json.dumps(found) + "\n")


def check_kept_files(
    recipe: Recipe, cfg: Config, run_dir: epath.Path | Path, train: Any, scoring: bool = False, given: str | None = None
) -> None:
    """Refuses to resume when a file that gives the checkpoints' numbers their meaning
    (:attr:`Recipe.kept_files`: a tokenizer, the class names, the data's fingerprint) would
    be another: the recipe's files for this config are written to a scratch folder and compared
    with the run's (JSON by its content), before anything in the run directory is written.
    ``scoring``: the run is to be evaluated (``xlafit eval``), not resumed, and of the data's
    fingerprint only its evaluation split counts; ``given``: on data given for it, whose
    fingerprint is not the run's by design (and is not computed).

    Raises:
        ConfigError: naming the file, what it is, and the fix.
    """
    if not recipe.kept_files:
        return
    with tempfile.TemporaryDirectory() as scratch:
        save_kept_files(recipe, cfg, Path(scratch), train, data=given is None)
        for name, what in recipe.kept_files.items():
            if given is not None and name in DATA_FINGERPRINTS:
                continue
            before, now = as_path(run_dir) / name, Path(scratch) / name
            with reading(before):
                if not (before.exists() and now.exists()) or _same_file(
                    before.read_text(), now.read_text(), name, scoring
                ):
                    continue
                theirs, ours = before.read_text().strip(), now.read_text().strip()
            both = f" (the run's: {theirs}; now: {ours})" if len(theirs) + len(ours) < 300 else ""
            both += _moved_on(theirs, ours) if name == files.FINGERPRINT_FILE else ""
            if given is not None:
                thing = what.split(";")[0]
                raise ConfigError(
                    f"{given} does not fit {run_dir}: its {thing} and the run's differ{both}; give data prepared as "
                    "the run's was."
                )
            if scoring:
                raise ConfigError(
                    f"cannot score {run_dir} on its own evaluation data: its {name} differs from the {what}{both}. Put "
                    f"that back as it was when the run trained (the run's own copy is {run_dir}/{name}), or give the "
                    "data to score with --data."
                )
            raise ConfigError(
                f"cannot resume {run_dir}: its {name} differs from this run's {what}{both}. Use the run's settings "
                f"and data (see its config.yaml; its own copy is {run_dir}/{name}), or start over with --restart "
                "(run.resume=false) or another --run-dir."
            )


def _same_file(before: str, now: str, name: str, scoring: bool) -> bool:
    """Whether a kept file and the one the config writes now say the same (JSON: by content;
    a data fingerprint, when ``scoring``: its evaluation split's)."""
    if name.endswith(".json"):
        try:
            theirs, ours = json.loads(before), json.loads(now)
        except json.JSONDecodeError:
            return before == now
        if name in DATA_FINGERPRINTS:  # the files' hashes; not where a hub dataset's branch pointed
            theirs, ours = ({k: v for k, v in d.items() if k != files.PINNED} for d in (theirs, ours))
            if scoring:
                return bool(theirs.get("eval") == ours.get("eval"))
        return bool(theirs == ours)
    return before == now


def _moved_on(before: str, now: str) -> str:
    """:func:`xlafit.data.files.moved_on` of two data fingerprints as kept (JSON)."""
    try:
        return files.moved_on(json.loads(before), json.loads(now))
    except (json.JSONDecodeError, AttributeError):
        return ""
