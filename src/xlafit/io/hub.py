"""Hugging Face hub ids as model and tokenizer locations: ``meta-llama/Llama-3.2-1B`` is
downloaded once into the Hugging Face cache (``$HF_HOME``, as ``transformers`` does) and
read from there; a local directory or a URL is used as it is. Data files on the hub are
named ``hf://datasets/org/name/path`` (a file, folder or glob of a dataset repository, with
``@revision`` after the name if not main): downloaded into the same cache, read from there.

Only what a run reads is downloaded (configs, tokenizer files, safetensors weights; never
pickled ``*.bin`` checkpoints). ``HF_TOKEN`` authenticates gated and private models;
``HF_HUB_OFFLINE=1`` reads the cache only. What goes wrong is one line naming the fix: a
gated model whose license was not accepted, a model the hub does not have, a model not in
the cache while offline.

A name reads as a local path when it is absolute, starts with ``~`` or ``.``, exists, or
its first folder exists here (``runs/new-hf`` beside ``runs/``): a local path that is missing,
or an xlafit run directory rather than a Hugging Face one, is refused in one line.

Example:
    >>> is_hub_id("meta-llama/Llama-3.2-1B"), is_hub_id("./runs/demo-llm-hf"), is_hub_id("gs://b/m")
    (True, False, False)
"""

from __future__ import annotations

import re
from pathlib import Path

from xlafit.errors import ConfigError

__all__ = [
    "FILES",
    "SHAPE_FILES",
    "absolute",
    "check_local",
    "dataset_path",
    "is_hub_id",
    "is_local",
    "pinned",
    "resolve",
]

# What a run reads of a model repository; a check that compiles for shapes alone reads no weights.
FILES = ["*.json", "*.safetensors", "*.jinja", "tokenizer.model", "*.txt"]
SHAPE_FILES = [f for f in FILES if f != "*.safetensors"]
_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_DATASET = re.compile(r"^hf://datasets/(?P<repo>[\w.-]+/[\w.-]+)(?:@(?P<revision>[^/]+))?(?:/(?P<path>.*))?$")


def is_local(name: str) -> bool:
    """Whether ``name`` reads as a local path (see the module docstring), existing or not."""
    if "://" in name:
        return False
    path = Path(name).expanduser()
    first = Path(path.parts[0]) if len(path.parts) > 1 else None
    return path.is_absolute() or name.startswith((".", "~")) or path.exists() or bool(first and first.is_dir())


def absolute(name: str | None) -> str | None:
    """``name`` as an absolute path where it is a relative path that exists here, else as it
    is: a run records where its model and tokenizer were, so that ``xlafit generate``,
    ``export`` and a resume find them from any directory.

    Example:
        >>> absolute("meta-llama/Llama-3.2-1B"), absolute(None), absolute("~/models/llama")
        ('meta-llama/Llama-3.2-1B', None, '~/models/llama')
    """
    if name is None or "://" in name or name.startswith("~") or Path(name).is_absolute() or not Path(name).exists():
        return name
    return str(Path(name).absolute())


def _named(what: str, name: str) -> str:
    """A setting and its value as a message names them: ``model.init_from_hf=org/name``, or
    for a description (``the model``) ``the model org/name``.

    Example:
        >>> _named("model.init_from_hf", "org/name"), _named("the model", "org/name")
        ('model.init_from_hf=org/name', 'the model org/name')
    """
    return f"{what} {name}" if " " in what else f"{what}={name}"


def is_hub_id(name: str) -> bool:
    """Whether ``name`` reads as ``org/name`` and names no local path or URL."""
    return "://" not in name and bool(_ID.match(name)) and not is_local(name)


def check_local(name: str, what: str = "model.init_from_hf") -> None:
    """Refuses a local path that cannot be a Hugging Face model or tokenizer: a missing one,
    or an xlafit run directory (it has ``config.yaml`` or ``checkpoints/``, no ``config.json``).
    Hub ids and URLs pass: they are checked where they are read.

    Raises:
        ConfigError: the path is missing, or a run directory that needs ``xlafit export hf`` first.
    """
    if is_hub_id(name) or not is_local(name):
        return
    path = Path(name).expanduser()
    if not path.exists():
        raise ConfigError(
            f"{_named(what, name)}: no such file or directory; give the path of a Hugging Face model directory, or "
            "a hub id org/name."
        )
    run = (path / "config.yaml").exists() or (path / "checkpoints").is_dir()
    if path.is_dir() and run and not (path / "config.json").exists():
        raise ConfigError(
            f"{_named(what, name)} is an xlafit run directory, not a Hugging Face one; export it first "
            f"(xlafit export hf {name} --out DIR) and give DIR."
        )


def resolve(name: str, revision: str | None = None, what: str = "model.init_from_hf", weights: bool = True) -> str:
    """A local directory for ``name``: itself, or a hub id's snapshot in the Hugging Face
    cache (downloaded there first when it is not).

    Args:
        name: a local directory or file, a URL, or a hub id ``org/name``.
        revision: a branch, tag or commit of the hub repository (default: main).
        what: the setting that named it, for the errors.
        weights: False to download the configuration and tokenizer files alone
            (:data:`SHAPE_FILES`: ``xlafit check`` compiles a model from its ``config.json``); a
            later call with True downloads the weights beside them.

    Raises:
        ConfigError: gated, not on the hub, offline and not cached, or unreachable; a local
            path that is missing or an xlafit run directory (:func:`check_local`).
    """
    if not is_hub_id(name):
        check_local(name, what)
        return str(Path(name).expanduser()) if is_local(name) else name
    return _snapshot(name, revision, FILES if weights else SHAPE_FILES, "model", what)


def dataset_path(url: str, what: str = "data.train_files") -> str:
    """The local path of ``hf://datasets/org/name[@revision]/path``: the files of the dataset
    repository that ``path`` names (a file, a folder's files or a glob; the whole repository
    when none), downloaded into the Hugging Face cache first when they are not there.

    Raises:
        ConfigError: not of that form, gated, not on the hub, offline and not cached.
    """
    found = _DATASET.match(url)
    if found is None:
        raise ConfigError(
            f"{_named(what, url)}: a Hugging Face path reads hf://datasets/org/name/path (a dataset repository, then a "
            "file, folder or glob in it)."
        )
    path = (found.group("path") or "").strip("/")
    patterns = [path] if any(c in path for c in "*?[") else [path, f"{path}/*"] if path else ["*"]
    folder = _snapshot(found.group("repo"), found.group("revision"), patterns, "dataset", what, url)
    return str(Path(folder) / path) if path else folder


def pinned(url: str, read: str) -> str | None:
    """``url`` (``hf://datasets/org/name[@revision]/path``) at the commit whose snapshot in the
    Hugging Face cache ``read`` (a file it named, :func:`dataset_path`) lies in: the data a run
    read, whatever the branch names now; None where ``read`` is not in a snapshot.

    Example:
        >>> pinned("hf://datasets/org/chats/train", "/hf/hub/datasets--org--chats/snapshots/abc1/train/a.jsonl")
        'hf://datasets/org/chats@abc1/train'
    """
    found, parts = _DATASET.match(url), Path(read).parts
    at = [i for i in range(1, len(parts) - 1) if parts[i] == "snapshots" and parts[i - 1].startswith("datasets--")]
    if found is None or not at:
        return None
    path = found.group("path")
    return f"hf://datasets/{found.group('repo')}@{parts[at[-1] + 1]}" + (f"/{path}" if path else "")


def _snapshot(repo: str, revision: str | None, patterns: list[str], kind: str, what: str, name: str = "") -> str:
    import huggingface_hub
    from huggingface_hub import errors

    name = name or repo
    page = f"https://huggingface.co/{'datasets/' if kind == 'dataset' else ''}{repo}"
    try:
        return huggingface_hub.snapshot_download(repo, repo_type=kind, revision=revision, allow_patterns=patterns)
    except errors.GatedRepoError:
        raise ConfigError(
            f"{_named(what, name)} is gated: accept its license at {page} and set HF_TOKEN to a token of that account."
        ) from None
    except errors.RevisionNotFoundError:
        raise ConfigError(f"{_named(what, name)}: the hub has no revision {revision!r} of it.") from None
    except errors.RepositoryNotFoundError:
        raise ConfigError(
            f"{_named(what, name)}: the Hugging Face hub has no such {kind} (or it is private: set HF_TOKEN); for a "
            "local directory give its path (./name)."
        ) from None
    except errors.LocalEntryNotFoundError:
        download = (
            f"hf download {repo}"
            + (" --repo-type dataset" if kind == "dataset" else "")
            + (f" --revision {revision}" if revision else "")
        )
        raise ConfigError(
            f"{_named(what, name)} is not in the Hugging Face cache and the hub cannot be reached (offline or "
            f"HF_HUB_OFFLINE=1): download it where the hub is reachable ({download}) into the same "
            "HF_HOME, or for a local directory give its path as ./name."
        ) from None
    except (OSError, errors.HfHubHTTPError) as e:
        raise ConfigError(
            f"{_named(what, name)}: the hub could not be read ({e}); retry, or give a local path."
        ) from None
