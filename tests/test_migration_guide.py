"""docs/guides/migration.md: its xlafit programs run as written and train.

By default each program runs on 400 of the 4,000 embedded training digits and 200 test
digits (the real loader, sliced), to keep the suite short: it shows the program runs
end to end and learns. ``XLAFIT_STRESS=1`` runs them on the whole split, as a reader would,
and checks the accuracy they reach.
"""

import contextlib
import io
import os
import re
from pathlib import Path

import pytest

from helpers import use_few_digits

GUIDE = Path(__file__).resolve().parents[1] / "docs" / "guides" / "migration.md"
FULL = os.environ.get("XLAFIT_STRESS") == "1"


def programs():
    """The guide's Python blocks that are xlafit programs (the TensorFlow and PyTorch/XLA
    ones cannot run here: no TPU, no TensorFlow)."""
    blocks = re.findall(r"```python\n(.*?)```", GUIDE.read_text(encoding="utf-8"), re.S)
    return [b for b in blocks if "import xlafit" in b]


def test_the_guide_has_its_four_xlafit_programs():
    assert len(programs()) == 4


def test_its_other_python_blocks_are_marked_as_needing_a_tpu():
    """The TensorFlow and PyTorch/XLA programs are shown, not run: tests/test_docs.py skips a
    block only when it is marked so."""
    text = GUIDE.read_text(encoding="utf-8")
    blocks = re.findall(r"(<!-- needs: tpu -->\n)?```python\n(.*?)```", text, re.S)
    assert [bool(marked) for marked, body in blocks] == ["import xlafit" not in body for _, body in blocks]
    assert sum(bool(marked) for marked, _ in blocks) == 2


@pytest.mark.parametrize("index, accuracy", [(0, 0.85), (1, 0.85), (2, 0.8), (3, 0.8)])
def test_guide_program_runs_as_written(index, accuracy, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the programs write runs/ where they run
    if not FULL:
        use_few_digits(monkeypatch)
        accuracy = 0.2  # chance is 0.1; a few steps on 400 digits
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(programs()[index], f"{GUIDE.name}[{index}]", "exec"), {"__name__": "__main__"})
    printed = out.getvalue()
    value = float(re.search(r"(?:val_accuracy|test accuracy): ([0-9.]+)", printed).group(1))
    assert value > accuracy, printed[-2000:]
    if index == 0:
        assert (tmp_path / "runs" / "keras-mnist" / "model.keras").exists()
        assert (tmp_path / "runs" / "keras-mnist" / "metrics.jsonl").exists()
