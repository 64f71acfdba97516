"""Installing xlafit the documented way, outside the repository: ``python -m build`` makes the
sdist and, from it, the wheel; the notebooks' install cell installs that wheel into a fresh
venv that cannot see the source tree; the installed ``xlafit`` lists the devices, knows the
step model's rates, and trains MNIST.

The fresh venv reads the dependencies already installed here (a ``.pth`` line naming this
environment's site-packages: nothing is downloaded, ``PIP_NO_INDEX``), so pip still resolves
the wheel's requirements against them and refuses a wheel whose requirements they do not meet.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
import tomllib
import venv
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from helpers import write_mnist_idx

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "examples" / "finetune_on_colab_tpu.ipynb"


def install_cell() -> str:
    """The notebook's install cell (the one that runs pip)."""
    cells = json.loads(NOTEBOOK.read_text())["cells"]
    sources = ["".join(c["source"]) for c in cells if c["cell_type"] == "code"]
    (cell,) = [s for s in sources if "pip" in s and "install" in s]
    return "import os\n" + cell


@pytest.fixture(scope="module")
def dist(tmp_path_factory) -> Path:
    pytest.importorskip("build")
    out = tmp_path_factory.mktemp("dist")
    subprocess.run(
        [sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out), str(ROOT)],
        check=True, capture_output=True, text=True,
    )  # fmt: skip
    return out


@pytest.fixture(scope="module")
def fresh(tmp_path_factory) -> Path:
    """A venv with pip and no xlafit, reading the dependencies installed here."""
    home = tmp_path_factory.mktemp("fresh")
    venv.create(home / "venv", with_pip=True)
    python = home / "venv" / "bin" / "python"
    site = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True, capture_output=True, text=True,
    ).stdout.strip()  # fmt: skip
    # A path line adds the directory only: its .pth files (this checkout's editable install) stay unread.
    (Path(site) / "dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return python


def run(python: Path, *args: str, cwd: Path, **kw) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "XLA_FLAGS")}
    env.update(PIP_NO_INDEX="1", PIP_DISABLE_PIP_VERSION_CHECK="1", JAX_PLATFORMS="cpu")
    return subprocess.run([str(python), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=600, **kw)


def test_the_sdist_and_the_wheel_carry_the_package_and_its_data(dist):
    import tarfile
    import zipfile

    (wheel,) = dist.glob("xlafit-*.whl")
    (sdist,) = dist.glob("xlafit-*.tar.gz")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {"xlafit/cli/__init__.py", "xlafit/recipes/llm.yaml", "xlafit/predict/rates.json"} <= names
    # xlafit's training chat templates (xlafit.data.templates)
    assert {"xlafit/data/chat_templates/qwen3.jinja", "xlafit/data/chat_templates/mistral-v0.3.jinja"} <= names
    assert not any(n.startswith(("tests/", "benchmarks/")) for n in names)
    assert any(n.endswith("/src/xlafit/predict/rates.json") for n in tarfile.open(sdist).getnames())


def test_the_notebook_cell_installs_the_wheel_into_a_fresh_venv_that_then_trains(dist, fresh, tmp_path):
    (wheel,) = dist.glob("xlafit-*.whl")
    work = tmp_path / "notebook"
    work.mkdir()
    (work / wheel.name).write_bytes(wheel.read_bytes())  # uploaded next to the notebook
    before = run(fresh, "-c", "import xlafit", cwd=work)
    assert before.returncode != 0, "the fresh venv must not see this checkout's xlafit"

    installed = run(fresh, "-c", install_cell(), cwd=work)
    assert installed.returncode == 0, installed.stderr[-3000:]
    where = run(fresh, "-c", "import xlafit; print(xlafit.__file__)", cwd=work).stdout.strip()
    assert where.startswith(str(fresh.parents[1])), where  # the wheel's copy, not the source tree
    again = run(fresh, "-c", install_cell(), cwd=work)
    assert "already installed" in again.stdout

    xlafit = fresh.parent / "xlafit"
    assert "llm" in run(xlafit, "--help", cwd=work).stdout
    assert "cpu" in run(xlafit, "devices", cwd=work).stdout
    rates = run(
        fresh, "-c", "from xlafit.predict.rates import rates_for; print(rates_for('TPU v5 lite') is not None)", cwd=work
    )
    assert rates.stdout.strip() == "True", rates.stderr[-2000:]
    # An epoch of 2 steps and an evaluation: 256 of the embedded digits of each split, as IDX
    # files (the quickstart notebook's test trains on the embedded digits themselves).
    (work / "digits").mkdir()
    write_mnist_idx(work / "digits", train=256, test=256)
    trained = run(
        xlafit, "train", "mnist", "--simulate", "2", "--data-dir", "digits", "--run-dir", "runs/a", "trainer.epochs=1",
        cwd=work,
    )  # fmt: skip
    assert trained.returncode == 0, trained.stderr[-3000:]
    assert "steps: 2/epoch" in trained.stdout and "(256 examples)" in trained.stdout
    assert "test accuracy" in trained.stdout


def test_every_jax_requirement_is_bound_as_the_base_one():
    """An extra's bare ``jax[tpu]`` let pip backtrack to a 2021 jax whose libtpu is not on PyPI."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    requirements = [
        Requirement(r) for r in [*project["dependencies"], *sum(project["optional-dependencies"].values(), [])]
    ]
    bounds = {str(r.specifier) for r in requirements if r.name == "jax"}
    assert len(bounds) == 1 and "<" in bounds.pop()
