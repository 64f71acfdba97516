"""A run's directory: where it is (:func:`checkpoint_dir`), refusing one that is not a run's
(:func:`refuse_foreign_dir`), starting it (:func:`start_run_dir`: created by
:func:`make_run_dir`, an earlier run moved aside for ``--restart`` by :func:`move_aside`,
``config.yaml`` written whole or not at all), finding the
checkpoints a user names (:func:`checkpoints_of`), and the log of processes other than 0
(:func:`log_to_file`). Local paths and URLs (``gs://bucket/run``) alike."""

from __future__ import annotations

import atexit
import datetime
import logging
import os
import re
import tempfile
from pathlib import Path
from typing import Any

import yaml
from etils import epath

from xlafit.checkpoint import COMMIT, ORBAX_METADATA
from xlafit.config import Config, RunConfig
from xlafit.errors import ConfigError, StorageError, WriteError, write_failed
from xlafit.io import hub
from xlafit.io.paths import (
    RUN_MARKERS,
    as_path,
    check_bucket,
    dated_sibling,
    describe_error,
    is_url,
    move,
    refresh,
    upload,
)
from xlafit.runlock import LOCK

# The log of a process other than 0 (log_to_file), in the run directory from its start.
PROCESS_LOG = re.compile(r"process-\d+\.log")


def _run(cfg: Config | RunConfig) -> RunConfig:
    """The ``run`` section: of a recipe's config, or of a user file's run (``xlafit train FILE.py``)."""
    return cfg.run if isinstance(cfg, Config) else cfg


def checkpoint_dir(cfg: Config | RunConfig) -> epath.Path:
    """``run.checkpoint_dir`` (a path or URL), or the run directory's ``checkpoints/``."""
    run = _run(cfg)
    if run.checkpoint_dir:
        return as_path(run.checkpoint_dir)
    if not run.run_dir:
        raise ConfigError("no run directory: set run.run_dir (--run-dir) or run.checkpoint_dir.")
    return as_path(run.run_dir) / "checkpoints"


def refuse_foreign_dir(cfg: Config | RunConfig) -> None:
    """Refuses a local ``run.run_dir`` that holds files but no run's (``config.yaml``, metrics,
    checkpoints): the run would write among them, and ``--restart`` would move them all aside
    with it. Hidden entries (``.ipynb_checkpoints``) do not count, nor the job's own
    ``process-<n>.log`` (each process other than 0 opens its log there as soon as it starts,
    before process 0 writes ``config.yaml``); a URL is not listed (a bucket's prefix may hold
    millions of objects).

    Raises:
        ConfigError: naming a few of the files and the fix.
    """
    run_dir = _run(cfg).run_dir
    if not run_dir or is_url(run_dir):
        return
    path = Path(run_dir).expanduser()
    if not path.is_dir() or any((path / marker).exists() for marker in RUN_MARKERS):
        return
    names = sorted(
        p.name + ("/" if p.is_dir() else "")
        for p in path.iterdir()
        if not p.name.startswith(".") and not PROCESS_LOG.fullmatch(p.name)
    )
    if names:
        shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
        raise ConfigError(
            f"--run-dir {run_dir} holds files that are no xlafit run's ({shown}): the run would write its config, "
            "metrics and checkpoints among them, and --restart would move them all aside. Give a new or empty "
            "directory, e.g. --run-dir " + str(Path(run_dir) / "run") + "."
        )


def make_run_dir(run_dir: epath.Path, cfg: Config | RunConfig) -> None:
    """Creates ``run_dir`` (or finds it writable); for a URL, checks that its buckets exist.

    Raises:
        ConfigError: the directory cannot be created, or its bucket does not exist; the
            message names it and the fix.
        WriteError: the directory holds a run and cannot be written (read-only): the fix is
            to make it writable, not another directory, which would start the run over.
    """
    if is_url(run_dir):
        # No mkdir on a URL: object stores have no directories, and gcsfs would create a
        # missing bucket. Writing config.yaml (start_run_dir) is the test that the bucket takes writes.
        for where, what in ((run_dir, "--run-dir"), (checkpoint_dir(cfg), "run.checkpoint_dir")):
            try:
                check_bucket(where, what)
            except StorageError as e:
                raise ConfigError(str(e)) from None
        return
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(
            f"cannot create the run directory {run_dir}: {e.strerror}. Choose another --run-dir."
        ) from None
    if not os.access(run_dir, os.W_OK):
        if any((run_dir / marker).exists() for marker in RUN_MARKERS):
            raise WriteError(
                f"the run directory {run_dir} is not writable, and training writes there: to train on (or resume) "
                "its run, make it writable (its permissions, or remount it read-write) and run the same command "
                "again; a finished run needs no writes: `xlafit generate`, `inspect` and `export` read it as it is."
            )
        raise ConfigError(f"the run directory {run_dir} is not writable. Choose another --run-dir.")


# Settings naming a local path (a model, a tokenizer, the data, the run) that config.yaml
# records absolute, so that `xlafit generate`, `export` and a resume find them from any
# directory (a run directory may hold them relative, as they were given).
RECORDED_PATHS = ("model.init_from_hf", "data.tokenizer", "data.data_dir", "data.eval_data_dir", "run.run_dir")


def recorded(tree: dict[str, Any]) -> dict[str, Any]:
    """A config's ``to_dict()`` as ``config.yaml`` records it: the :data:`RECORDED_PATHS` that
    are relative paths existing here made absolute (:func:`xlafit.io.hub.absolute`), and
    ``run.resume`` true: ``--restart`` (``run.resume=false``) is what one command did, not a
    setting of the run, so that the file given back with ``--config`` goes on with the run."""
    out = {k: dict(v) if isinstance(v, dict) else v for k, v in tree.items()}
    if isinstance(out.get("run"), dict) and "resume" in out["run"]:
        out["run"]["resume"] = True
    for key in RECORDED_PATHS:
        section, name = key.split(".")
        if isinstance(out.get(section), dict) and isinstance(out[section].get(name), str):
            out[section][name] = hub.absolute(out[section][name])
    return out


def start_run_dir(run_dir: epath.Path, cfg: Config) -> None:
    """Creates ``run_dir`` (:func:`make_run_dir`), moves an earlier run aside for
    ``--restart`` (:func:`move_aside`) and writes ``config.yaml`` (locally: a temporary file
    renamed over it, so that it is never left empty or half written). Process 0 only.

    Raises:
        ConfigError: the directory cannot be created or written, or its bucket does not
            exist; the message names it and the fix.
        WriteError: ``config.yaml`` cannot be written (a full disk); the message names it.
    """
    make_run_dir(run_dir, cfg)
    if not cfg.run.resume:
        for line in move_aside(run_dir, checkpoint_dir(cfg)):
            print(line, flush=True)
    path = run_dir / "config.yaml"
    text = yaml.safe_dump(recorded(cfg.to_dict()), sort_keys=False)
    if is_url(run_dir):  # an object is written whole or not at all
        try:
            path.write_text(text)
        except Exception as e:
            raise ConfigError(f"cannot write the run directory: {describe_error(path, e)}") from None
        return
    write_atomically(Path(path), text)


def write_atomically(path: Path, text: str) -> None:
    """Writes ``text`` to the local file ``path`` through a temporary file beside it, renamed
    over it once whole: a full disk leaves the earlier file as it was (and no temporary).

    Raises:
        WriteError: the file cannot be written; the message names it and the fix.
    """
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise write_failed(path, e) from None


def move_aside(run_dir: epath.Path, checkpoints: epath.Path) -> list[str]:
    """``--restart``: moves an earlier run in ``run_dir`` to a dated sibling,
    ``<run_dir>-before-restart-<UTC time>``, and says where. Nothing is deleted.

    The whole earlier run moves (config.yaml, metrics, TensorBoard, checkpoints, tokenizer),
    so the sibling is a run directory that ``xlafit inspect`` and ``xlafit export hf`` read
    as any other. Checkpoints kept outside the run directory (``run.checkpoint_dir``) move
    to their own dated sibling, and the moved ``config.yaml`` points at them. A run
    directory holding neither checkpoints nor metrics is left as it is. On a URL a move is
    a copy of every object then a delete (an interruption leaves two copies, never none).

    Returns:
        The lines to print: what moved where.

    Example:
        >>> import tempfile
        >>> run = as_path(tempfile.mkdtemp()) / "run"
        >>> (run / "checkpoints" / "5").mkdir(parents=True)
        >>> _ = (run / "metrics.jsonl").write_text("{}\\n")
        >>> lines = move_aside(run, run / "checkpoints")
        >>> sorted(p.name for p in run.iterdir()), "-before-restart-" in lines[0]
        ([], True)
    """
    when = datetime.datetime.now(datetime.UTC)
    refresh(run_dir)
    refresh(checkpoints)
    inside = str(checkpoints).startswith(str(run_dir).rstrip("/") + "/")
    has_checkpoints = checkpoints.exists() and any(True for _ in checkpoints.iterdir())
    if not (has_checkpoints or (run_dir / "metrics.jsonl").exists()):
        return []
    lines = []
    moved_checkpoints = None
    if has_checkpoints and not inside:
        moved_checkpoints = dated_sibling(checkpoints, "before-restart", when)
        move(checkpoints, moved_checkpoints)
        lines.append(f"--restart: moved the earlier checkpoints {checkpoints} to {moved_checkpoints}")
    # The lock stays: the process moving the run aside holds it (xlafit.runlock).
    entries = [p for p in run_dir.iterdir() if p.name != LOCK] if run_dir.exists() else []
    if entries:
        target = dated_sibling(run_dir, "before-restart", when)
        if not is_url(target):
            target.mkdir(parents=True)
        for entry in entries:
            move(entry, target / entry.name)
        if moved_checkpoints is not None and (target / "config.yaml").exists():
            saved = yaml.safe_load((target / "config.yaml").read_text()) or {}
            if isinstance(saved, dict) and isinstance(saved.get("run"), dict):
                saved["run"]["checkpoint_dir"] = str(moved_checkpoints)
                (target / "config.yaml").write_text(yaml.safe_dump(saved, sort_keys=False))
        lines.append(
            f"--restart: moved the earlier run in {run_dir} (checkpoints, metrics, config) to {target}; "
            f"nothing was deleted (xlafit inspect {target})"
        )
    return lines


def checkpoints_of(target: str) -> tuple[epath.Path, int | None]:
    """The checkpoint directory a user means by ``target``, and the step where ``target`` is
    one checkpoint's folder (``runs/demo/checkpoints/2``): a run directory (its
    ``config.yaml`` says where its checkpoints are; default ``checkpoints/``), a checkpoint
    directory itself, or one step's folder in it; local or a URL.

    Raises:
        ConfigError: ``target`` does not exist, or is none of these.
    """
    path = as_path(target)
    refresh(path)
    try:
        if (path / "config.yaml").exists():  # a run directory: its checkpoints may live elsewhere
            saved = yaml.safe_load((path / "config.yaml").read_text()) or {}
            where = (saved.get("run") or {}).get("checkpoint_dir") if isinstance(saved, dict) else None
            return (as_path(where) if where else path / "checkpoints"), None
        if (path / "checkpoints").is_dir():
            return path / "checkpoints", None
        if path.is_dir():
            one_step = path.name.isdigit() and any((path / name).exists() for name in (COMMIT, ORBAX_METADATA))
            return (path.parent, int(path.name)) if one_step else (path, None)
        exists = path.exists()
    except Exception as e:
        if not is_url(path):
            raise
        raise ConfigError(f"cannot read {target}: {describe_error(path, e)}") from None
    what = "is a file" if exists else "does not exist"
    raise ConfigError(
        f"{target} {what}: give a run directory (what `xlafit train --run-dir` writes) or its checkpoints/ folder."
    )


def log_to_file(path: epath.Path) -> None:
    """Processes other than 0 print nothing; their own events go to their own file. For a
    URL run directory the file is written locally and uploaded when the process exits."""
    local = Path(path)
    if is_url(path):
        local = local_log(path)
        atexit.register(_upload_log, local, path)
    local.parent.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(local)  # appends, as to an earlier attempt's lines
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
    logging.getLogger("xlafit").addHandler(handler)
    logging.getLogger("xlafit").setLevel(logging.INFO)


def local_log(target: epath.Path) -> Path:
    """The local file a URL's log is written to before its upload: it starts with the lines an
    earlier attempt of the run uploaded there (a resume after a preemption), which the upload
    would otherwise replace; a local log keeps them by appending."""
    local = Path(tempfile.mkdtemp(prefix="xlafit-log-")) / target.name
    try:
        if target.exists():
            local.write_bytes(target.read_bytes())
    except Exception as e:  # the log is not worth a stop: say so
        print(f"warning: could not read the earlier {target}; its lines will be replaced: {e}", flush=True)
    return local


def _upload_log(local: Path, target: epath.Path) -> None:
    try:
        upload(local, target)
    except Exception as e:  # at exit: say so, never raise
        print(f"warning: could not upload {local} to {target}: {e}", flush=True)
