"""Paths that may be URLs (src/xlafit/io/paths.py): a store without its client library is one
line naming the install, and ``file://`` is a local path."""

from __future__ import annotations

import subprocess
import sys

import pytest

from xlafit.errors import StorageError
from xlafit.io.paths import as_path, filesystem, is_url, local, require_store


@pytest.fixture
def without_gcsfs(tmp_path):
    """A PYTHONPATH on which `import gcsfs` fails, as on a machine where it is not installed."""
    (tmp_path / "gcsfs").mkdir()
    (tmp_path / "gcsfs" / "__init__.py").write_text("raise ImportError('No module named gcsfs')\n")
    return str(tmp_path)


def test_file_urls_are_local_paths(tmp_path):
    url = f"file://{tmp_path}/run"
    assert local(url) == f"{tmp_path}/run" and not is_url(url)
    (as_path(url)).mkdir()
    assert (tmp_path / "run").is_dir()
    assert filesystem(url)[1] == f"{tmp_path}/run"


def test_an_unknown_store_is_one_line():
    with pytest.raises(StorageError, match=r"no storage is known for nosuch://; use a local path, file://, gs://"):
        require_store("nosuch://bucket/run")


@pytest.mark.parametrize(
    "command",
    [
        ["train", "mnist", "--simulate", "2", "--run-dir", "gs://my-bucket/runs/mnist"],
        ["data", "images", "--input", "{images}", "--out", "gs://my-bucket/images"],
    ],
)
def test_gs_without_gcsfs_is_one_line_naming_the_install(command, without_gcsfs, tmp_path):
    images = tmp_path / "images" / "a"
    images.mkdir(parents=True)
    from PIL import Image

    Image.new("RGB", (8, 8)).save(images / "one.png")
    argv = [c.format(images=tmp_path / "images") for c in command]
    env = {"PYTHONPATH": without_gcsfs, "PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "JAX_PLATFORMS": "cpu"}
    out = subprocess.run([sys.executable, "-m", "xlafit", *argv], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 2, out.stderr[-2000:]
    assert out.stderr.strip().splitlines() == [
        f"xlafit: error: {argv[-1]}: gs:// needs a client library that is not installed: pip install 'xlafit[gcs]'."
    ]
