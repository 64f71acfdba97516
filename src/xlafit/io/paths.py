"""Paths that may be URLs: a local directory and ``gs://bucket/dir`` (any fsspec URL) alike.

Everything xlafit writes (run directories, checkpoints, prepared data, tokenizers, exports)
goes through :func:`as_path`, an ``etils.epath.Path`` that keeps the ``//`` of a URL
(``pathlib.Path("gs://b/run")`` is ``gs:/b/run``). Object stores differ from a disk in
three ways that matter here, handled by the helpers below:

- there is no append: ``open(url, "a")`` on gs:// silently starts a new object, so a file
  that grows (``metrics.jsonl``, TensorBoard events) is written in a local copy and
  uploaded whole (:class:`LocalCopy`); one upload replaces the object whole or not at all;
- there are no directories and no rename: a "move" copies every object and then deletes the
  originals (:func:`move`), so an interruption leaves both copies, never neither;
- gcsfs creates a missing *bucket* when asked to make a directory in it, so nothing here
  calls ``mkdir`` on a URL; a missing bucket is reported instead (:func:`check_bucket`);
- a bucket name that Cloud Storage refuses (``gs://wb``, ``gs://YOUR-BUCKET``) can pass
  gcsfs's calls and fail only at Orbax's first checkpoint write, after the steps it was
  to keep: such a name is refused before the first access (:func:`invalid_bucket`).

Example:
    >>> str(as_path("gs://bucket/run") / "checkpoints")
    'gs://bucket/run/checkpoints'
    >>> is_url("runs/a"), is_url("gs://bucket/run")
    (False, True)
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import os
import re
import shutil
import socket
import tempfile
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import fsspec
from etils import epath

from xlafit.errors import ConfigError, StorageError, XlafitError

AnyPath = str | os.PathLike[str]


# What a run of `xlafit train` writes first (config.yaml) and what it keeps: one of them marks
# a run directory (a run refuses other folders; data preparation refuses run directories).
RUN_MARKERS = ("config.yaml", "metrics.jsonl", "checkpoints")
# A store's scheme without the two slashes of a URL (`gs:/bucket`, `gs:bucket`), as a typo writes it.
MALFORMED_URL = re.compile(r"(gs|gcs|s3|hf|az|abfs|memory):/?(?!/)", re.IGNORECASE)
# The package that serves a store's URLs, for the message when it is missing.
INSTALL = {"gs": "pip install 'xlafit[gcs]'", "gcs": "pip install 'xlafit[gcs]'", "s3": "pip install s3fs"}


def local(path: AnyPath) -> str:
    """``path`` as text: a ``file://`` URL as the local path it names, and a local path's
    leading ``~`` as the home directory (a shell leaves it in a quoted path or a YAML value).

    Example:
        >>> local("file:///tmp/run"), local("gs://bucket/run"), local("~/run") == os.path.expanduser("~/run")
        ('/tmp/run', 'gs://bucket/run', True)
    """
    text = os.fspath(path)
    if problem := malformed_url(text):  # to pathlib, `gs:/bucket/run` is the local folder ./gs:/bucket/run
        raise ConfigError(f"{text}: {problem}")
    text = text.removeprefix("file://") if text.startswith("file://") else text
    return os.path.expanduser(text) if text.startswith("~") else text


def malformed_url(text: str) -> str:
    """Why ``text`` is a store's URL with a slash missing (``gs:/bucket/run``, ``gs:bucket``),
    with the URL it likely means; ``""`` for anything else.

    Example:
        >>> malformed_url("gs:/my-bucket/run")
        'gs:/ is not a URL: a URL has two slashes after its scheme (gs://my-bucket/run).'
        >>> malformed_url("gs://my-bucket/run"), malformed_url("runs/a")
        ('', '')
    """
    found = MALFORMED_URL.match(text)
    if not found:
        return ""
    scheme, rest = found.group(1), text[found.end() :]
    return f"{found.group(0)} is not a URL: a URL has two slashes after its scheme ({scheme}://{rest})."


def is_url(path: AnyPath) -> bool:
    """Whether ``path`` names an object in a store (``gs://``, ``s3://``, ``memory://``...)."""
    return "://" in local(path)


def require_store(path: AnyPath) -> None:
    """Raises a one-line :class:`StorageError` when the client library for ``path``'s store is
    not installed (gcsfs for ``gs://``), or its protocol is unknown; nothing for local paths."""
    if not is_url(path):
        return
    protocol = local(path).split("://", 1)[0]
    try:
        fsspec.get_filesystem_class(protocol)
    except ImportError:
        fix = INSTALL.get(protocol, f"install the fsspec package for {protocol}://")
        raise StorageError(f"{path}: {protocol}:// needs a client library that is not installed: {fix}.") from None
    except ValueError:
        raise StorageError(
            f"{path}: no storage is known for {protocol}://; use a local path, file://, gs:// or another fsspec URL."
        ) from None


_RESOLVED: set[str] = set()  # storage hosts whose names resolved in this process


def _require_resolvable(url: AnyPath) -> None:
    """Raises :class:`StorageError` at once when the name of the Cloud Storage host that gcsfs
    will connect to (its own ``_location``: ``STORAGE_EMULATOR_HOST``, or the universe's
    ``storage.`` host) does not resolve (no network, no DNS): gcsfs would otherwise probe for
    credentials and retry for about a minute, silently, before failing the same way. A host
    that resolved once is not looked up again, so a lookup that fails later in a run is left
    to gcsfs's retries. Behind a proxy (``HTTPS_PROXY``) the proxy resolves names, and a gcsfs
    without ``_location`` is not second-guessed: nothing is looked up then."""
    if any(os.environ.get(v) for v in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return
    try:
        from gcsfs.core import _location

        host = urlsplit(_location()).hostname
    except Exception:  # another gcsfs: its endpoint is its business
        return
    if not host or host in _RESOLVED:
        return
    try:
        socket.getaddrinfo(host, None)
    except OSError as e:
        where = "STORAGE_EMULATOR_HOST" if os.environ.get("STORAGE_EMULATOR_HOST") else "the network"
        raise StorageError(
            f"the storage service for {url} cannot be reached ({host}: {e.strerror or e}). Check {where} and run again."
        ) from None
    _RESOLVED.add(host)


def as_path(path: AnyPath) -> epath.Path:
    """``path`` as an ``epath.Path``: local paths as they are, URLs with their ``//``."""
    require_store(path)
    try:
        return epath.Path(local(path))
    except KeyError:  # fsspec knows the protocol (hdfs://), but etils' paths, which Orbax writes through, do not
        protocol = local(path).split("://", 1)[0]
        raise StorageError(
            f"{path}: {protocol}:// cannot hold a run's directory or checkpoints (Orbax writes through etils' paths, "
            "which know gs://, s3://, az:// and hf://); use a local path, file:// or gs://."
        ) from None


def filesystem(path: AnyPath) -> tuple[fsspec.AbstractFileSystem, str]:
    """The fsspec filesystem of ``path`` and the path inside it (no protocol): the first access
    to a store, where a Cloud Storage host whose name does not resolve is refused at once."""
    reach(path)
    fs, inner = fsspec.core.url_to_fs(local(path))
    return fs, inner.rstrip("/")


def reach(path: AnyPath) -> None:
    """Before the first read or write of ``path``: a URL with no client library, whose bucket
    name Cloud Storage refuses, or whose Cloud Storage host's name does not resolve, is
    refused at once (:class:`StorageError`); nothing for local paths."""
    require_store(path)
    if local(path).startswith(("gs://", "gcs://")):
        check_bucket_name(path, os.fspath(path))
        _require_resolvable(path)


@contextlib.contextmanager
def reading(path: AnyPath, error: type[XlafitError] = ConfigError, name: str | None = None) -> Iterator[None]:
    """Around a first read of ``path``: a failure to read a URL becomes one ``error`` line,
    "cannot read NAME: why, and the fix" (:func:`describe_error`); xlafit's own errors and a
    local path's pass through as they are."""
    try:
        yield
    except XlafitError:
        raise
    except Exception as e:
        if not is_url(path):
            raise
        raise error(f"cannot read {name or path}: {describe_error(path, e)}") from None


def refresh(path: AnyPath) -> None:
    """Forgets the directory listings that gcsfs caches for ``path``'s store, in both clients
    (fsspec's and etils'), so that what another process wrote since is seen. No-op locally."""
    if not is_url(path):
        return
    from etils.epath import backend

    for fs in (filesystem(path)[0], backend.fsspec_backend.fs(os.fspath(path))):
        fs.invalidate_cache()


def describe_error(url: AnyPath, e: BaseException) -> str:
    """One sentence on why an access to ``url`` failed, with the fix, for the common causes."""
    if isinstance(e, StorageError):  # already one sentence with the fix
        return str(e)
    chain = [e]  # Orbax and TensorStore wrap the client's error: look at every cause
    while (cause := chain[-1].__cause__ or chain[-1].__context__) is not None and len(chain) < 10:
        chain.append(cause)
    root = next((c for c in chain if isinstance(c, (PermissionError, ConnectionError, FileNotFoundError))), e)
    text = " ".join(f"{type(root).__name__}: {root}".split())  # one line: some clients put the body on a second
    text = re.sub(r" ?\[tensorstore_spec='.*?'\]", "", text)  # TensorStore appends its whole spec: noise here
    everything = " ".join(f"{type(c).__name__}: {c}" for c in chain)
    code = getattr(root, "code", None)
    bucket = bucket_of(url)
    if invalid := invalid_bucket(url):
        return invalid
    if (
        code == 403
        or isinstance(root, PermissionError)
        or re.search(r"\b403\b|Forbidden|PERMISSION_DENIED", everything)
    ):
        return (
            f"permission denied writing or reading {url} ({text}). Grant this machine's service account "
            f"roles/storage.objectAdmin on gs://{bucket} (docs/getting-started/cloud-tpu-vm.md), or choose another "
            "location."
        )
    if any(getattr(c, "code", None) == 401 for c in chain) or re.search(
        r"Anonymous caller|Invalid Credentials|\b401\b|UNAUTHENTICATED", everything
    ):
        return (
            f"{url} refused this machine: it has no Google credentials, or they have expired ({text}). "
            "On a workstation: gcloud auth application-default login; a Cloud TPU VM or GCE machine uses its "
            "service account (docs/getting-started/cloud-tpu-vm.md)."
        )
    if isinstance(root, FileNotFoundError) and bucket and not bucket_exists(url):
        return (
            f"the bucket gs://{bucket} of {url} does not exist. Create it "
            f"(gcloud storage buckets create gs://{bucket}) or fix the URL."
        )
    unreachable = (
        "Cannot connect",
        "Connection refused",
        "UNAVAILABLE",
        "Empty reply from server",
        "Couldn't connect",
        "Server disconnected",
    )
    if any(word in everything for word in unreachable) or isinstance(root, ConnectionError):
        return f"the storage service for {url} cannot be reached ({text}). Check the network and run again."
    return f"{url}: {text}."


def bucket_of(url: AnyPath) -> str:
    """The bucket of a ``gs://`` / ``s3://`` URL, or ``""``."""
    text = os.fspath(url)
    if not is_url(text) or text.startswith(("file://", "memory://")):
        return ""
    return text.split("://", 1)[1].split("/", 1)[0]


def bucket_exists(url: AnyPath) -> bool:
    """Whether the bucket of ``url`` exists (True for local paths and bucketless URLs)."""
    bucket = bucket_of(url)
    if not bucket:
        return True
    fs, _ = filesystem(url)
    try:
        fs.invalidate_cache(bucket)
        return bool(fs.exists(bucket))
    except Exception:  # unreachable or forbidden: the caller's own access says which
        return True


# Cloud Storage's bucket naming rules (https://cloud.google.com/storage/docs/buckets#naming).
_BUCKET_CHARACTER = re.compile(r"[a-z0-9._-]")
_IP_ADDRESS = re.compile(r"\d{1,3}(\.\d{1,3}){3}")


def bucket_name_problem(name: str) -> str:
    """Why Cloud Storage would refuse ``name`` as a bucket name, or ``""`` when it would not:
    3 to 63 lowercase letters, digits, ``-``, ``_`` and ``.``, starting and ending with a
    letter or digit; with dots up to 222, each dot-separated part up to 63; not an IP
    address; no ``goog`` prefix and no ``google`` inside.

    Example:
        >>> bucket_name_problem("my-bucket"), bucket_name_problem("wb")
        ('', 'it has 2 characters, a name has 3 to 63')
        >>> bucket_name_problem("YOUR-BUCKET")
        "it has uppercase letters; a name has lowercase letters, digits, '-', '_' and '.'"
    """
    parts = name.split(".")
    if other := sorted({c for c in name if not _BUCKET_CHARACTER.fullmatch(c)}):
        has = "uppercase letters" if all(c.isupper() for c in other) else " ".join(map(repr, other))
        return f"it has {has}; a name has lowercase letters, digits, '-', '_' and '.'"
    if len(name) < 3 or (len(name) > 63 and len(parts) == 1):
        return f"it has {len(name)} characters, a name has 3 to 63"
    if len(name) > 222:
        return f"it has {len(name)} characters, a name with dots has at most 222"
    if not (name[0].isalnum() and name[-1].isalnum()):
        return "a name starts and ends with a letter or a digit"
    if (wrong := next((part for part in parts if not 1 <= len(part) <= 63), None)) is not None:
        return f"a part between dots has {len(wrong)} characters, each has 1 to 63"
    if _IP_ADDRESS.fullmatch(name):
        return "a name cannot be an IP address"
    if name.startswith("goog") or "google" in name:
        return "a name cannot start with 'goog' or contain 'google'"
    return ""


def invalid_bucket(url: AnyPath) -> str:
    """The sentence, with the fix, that says why Cloud Storage refuses the bucket name of the
    ``gs://`` URL ``url``; ``""`` when it does not, and for other URLs and local paths."""
    if not local(url).startswith(("gs://", "gcs://")):
        return ""
    bucket = bucket_of(url)
    if not (problem := bucket_name_problem(bucket)):
        return ""
    return (
        f'"{bucket}" is not a valid Cloud Storage bucket name ({problem}). Put the name of a bucket you created '
        "in the URL, or create one with a valid name (https://cloud.google.com/storage/docs/buckets#naming)."
    )


def check_bucket_name(url: AnyPath, where: str, error: type[XlafitError] = StorageError) -> None:
    """Raises ``error`` ("WHERE: why the name is refused, and the fix") when ``url`` is a
    ``gs://`` URL whose bucket name Cloud Storage refuses (:func:`bucket_name_problem`).
    ``where`` names the setting and the URL, as the user gave them. A store's URL with a slash
    missing (:func:`malformed_url`) is refused here too."""
    if problem := malformed_url(os.fspath(url)):
        raise error(f"{where}: {problem}")
    if invalid := invalid_bucket(url):
        raise error(f"{where}: {invalid}")


def check_bucket(url: AnyPath, what: str) -> None:
    """Raises :class:`StorageError` when ``url``'s bucket name is invalid or the bucket does
    not exist (``what``: the setting that named it, for the message). gcsfs would otherwise
    create it on ``mkdir``."""
    check_bucket_name(url, f"{what} {url}")
    if not bucket_exists(url):
        bucket = bucket_of(url)
        raise StorageError(
            f"{what} {url}: the bucket gs://{bucket} does not exist. Create it (gcloud storage buckets create "
            f"gs://{bucket}, docs/guides/cloud-storage.md) or fix the URL."
        )


def files_under(directory: epath.Path) -> dict[str, epath.Path]:
    """Every file under ``directory`` by its relative name, sorted (local paths or URLs)."""
    if not is_url(directory):
        root = Path(directory)
        return {str(p.relative_to(root)): as_path(p) for p in sorted(root.rglob("*")) if p.is_file()}
    refresh(directory)
    fs, inner = filesystem(directory)
    found = fs.find(inner)
    prefix = os.fspath(directory).rstrip("/")
    return {name[len(inner) + 1 :]: as_path(f"{prefix}/{name[len(inner) + 1 :]}") for name in sorted(found)}


def move(source: epath.Path, target: epath.Path) -> None:
    """Moves a file or directory tree. Local: one rename. URL: every object is copied, then
    the originals are deleted, so an interruption leaves two copies, never none."""
    if not is_url(source):
        Path(source).rename(target)
        return
    fs, inner = filesystem(source)
    _, dest = filesystem(target)
    fs.invalidate_cache(inner)
    if fs.isdir(inner):
        fs.copy(inner + "/", dest + "/", recursive=True)
        fs.rm(inner, recursive=True)
    else:
        fs.copy(inner, dest)
        fs.rm(inner)
    fs.invalidate_cache()


def dated_sibling(path: epath.Path, label: str, when: datetime.datetime | None = None) -> epath.Path:
    """``<path>-<label>-<UTC time>`` beside ``path`` (``runs/a-before-restart-20261123-101500``),
    with ``-2``, ``-3``... when that exists already."""
    when = when or datetime.datetime.now(datetime.UTC)
    base = f"{path.name}-{label}-{when:%Y%m%d-%H%M%S}"
    candidate, n = path.parent / base, 1
    while candidate.exists():
        n += 1
        candidate = path.parent / f"{base}-{n}"
    return candidate


def upload(local: Path, target: epath.Path) -> None:
    """Copies the local file ``local`` to ``target`` whole (one object write on a store)."""
    fs, inner = filesystem(target)
    if is_url(target):
        fs.put_file(os.fspath(local), inner)
    else:
        Path(target).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(local, target)


def download_dir(source: AnyPath, local: Path) -> Path:
    """Copies every file under ``source`` (a directory or URL) into ``local``; returns ``local``."""
    local.mkdir(parents=True, exist_ok=True)
    for name, path in files_under(as_path(source)).items():
        (local / name).parent.mkdir(parents=True, exist_ok=True)
        (local / name).write_bytes(path.read_bytes())
    return local


def upload_dir(local: Path, target: epath.Path) -> None:
    """Copies every file under the local directory ``local`` to ``target`` (a directory or URL)."""
    for path in sorted(p for p in local.rglob("*") if p.is_file()):
        upload(path, target / str(path.relative_to(local)))


class LocalCopy:
    """A local working directory that stands for ``target`` (a directory or URL).

    For a local ``target`` it *is* ``target``. For a URL it is a temporary directory:
    files are fetched from the URL (:meth:`fetch`), grow locally (appends, TensorBoard's
    event files) and go up whole at :meth:`upload`, only those that changed since the last
    one. An object store has no append, and re-uploading an event file at every flush costs
    the whole file each time; uploading at checkpoints bounds what a crash can lose to the
    steps that the resumed run trains again anyway.

    Example:
        >>> import tempfile
        >>> copy = LocalCopy(tempfile.mkdtemp())
        >>> copy.local == Path(copy.target)
        True
    """

    def __init__(self, target: AnyPath) -> None:
        self.target = as_path(target)
        self.remote = is_url(target)
        if self.remote:
            self.local = Path(tempfile.mkdtemp(prefix="xlafit-run-"))
            atexit.register(shutil.rmtree, self.local, ignore_errors=True)
        else:
            self.local = Path(self.target)
        self._uploaded: dict[str, tuple[int, int]] = {}  # relative name -> (size, mtime_ns) last uploaded

    def fetch(self, name: str) -> Path:
        """``target/name`` copied into the local directory when it exists there; its local path."""
        local = self.local / name
        if self.remote:
            remote = self.target / name
            try:
                if remote.exists():
                    local.parent.mkdir(parents=True, exist_ok=True)
                    local.write_bytes(remote.read_bytes())
                    self._uploaded[name] = _signature(local)
            except Exception as e:
                raise StorageError(describe_error(remote, e)) from e
        return local

    def upload(self) -> list[str]:
        """Uploads every local file that changed since the last upload; returns their names.

        Raises:
            StorageError: an upload failed; the message names the URL.
        """
        if not self.remote:
            return []
        sent = []
        for path in sorted(p for p in self.local.rglob("*") if p.is_file()):
            name = str(path.relative_to(self.local))
            signature = _signature(path)
            if self._uploaded.get(name) == signature:
                continue
            try:
                upload(path, self.target / name)
            except Exception as e:
                raise StorageError(describe_error(self.target / name, e)) from e
            self._uploaded[name] = signature
            sent.append(name)
        return sent

    def close(self) -> None:
        """Uploads what changed and removes the local directory (URL targets only)."""
        if self.remote:
            try:
                self.upload()
            finally:
                shutil.rmtree(self.local, ignore_errors=True)


def _signature(path: Path) -> tuple[int, int]:
    st = path.stat()
    return st.st_size, st.st_mtime_ns
