"""The notebooks under examples/ are stored without outputs and run as stored.

Each notebook runs in a Jupyter kernel (nbclient) on 8 simulated CPU devices, with
``XLAFIT_NOTEBOOK_TEST=1``: a notebook reads it to skip what needs the service it was written
for (installing, mounting Drive) and to train a few steps instead of a few epochs.
"""

import os
import sys
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "examples").glob("*.ipynb"))


def test_the_tpu_quickstart_is_there():
    assert ROOT / "examples" / "tpu_quickstart.ipynb" in NOTEBOOKS


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_stored_without_outputs(path):
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, f"{path.name}, cell {i}: clear its outputs"


def run(path: Path, tmp_path: Path) -> nbformat.NotebookNode:
    nb = nbformat.read(path, as_version=4)
    env = {
        **os.environ,
        "XLAFIT_NOTEBOOK_TEST": "1",
        "XLAFIT_SIMULATE_DEVICES": "8",
        "JAX_PLATFORMS": "cpu",
        # The kernel and the notebook's `!xlafit ...` use this tree and this environment.
        "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
        "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]),
    }
    env.pop("MPLBACKEND", None)  # the kernel's own: figures inline
    client = NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}})
    client.execute(env=env)
    return nb


def text_of(cell: nbformat.NotebookNode) -> str:
    parts = []
    for out in cell.get("outputs", []):
        if out.output_type == "stream":
            parts.append(out.text)
        elif "data" in out:
            parts.append(out.data.get("text/plain", ""))
    return "".join(parts)


def test_tpu_quickstart_runs_checks_trains_resumes_and_plots(tmp_path):
    nb = run(ROOT / "examples" / "tpu_quickstart.ipynb", tmp_path)
    code = [c for c in nb.cells if c.cell_type == "code"]
    outputs = [text_of(c) for c in code]
    everything = "\n".join(outputs)
    assert "8 x cpu" in everything or "devices: 8" in everything or "8 devices" in everything, everything[-3000:]
    assert "colab = v5e-1" in everything, everything[-3000:]  # check --tpu for the attached slice
    resumed = next(o for c, o in zip(code, outputs, strict=True) if "resumes at step 10" in c.source)
    assert "resumed from checkpoint 10" in resumed, resumed[-2000:]
    assert "test accuracy:" in resumed
    assert any("image/png" in out.get("data", {}) for c in code for out in c.outputs), "no inline plot"
    assert "intact" in everything.lower(), everything[-2000:]  # xlafit inspect
