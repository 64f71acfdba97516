"""The demo's promise: the MNIST recipe reaches >= 95% on the 1,000 held-out digits, and a
1-device run of the same config ends with (nearly) the same accuracy as an 8-device one.

"Nearly": 8 and 1 devices sum gradients in a different order, so parameters differ by ~1e-7
relative after 20 steps (test_trainer.py), but training amplifies that: after the recipe's
248 Adam steps with dropout they differ by 1-9% per tensor (measured), and a handful of the
1,000 test digits near the decision boundary can flip. Measured: 0.970 (8) vs 0.967 (1).
"""

import json
import re

import pytest

from tests.test_cli import run


def _final_eval(run_dir):
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if r["split"] == "eval"][-1]


@pytest.mark.slow
def test_mnist_recipe_reaches_95_percent_on_8_and_1_devices(tmp_path):
    results = {}
    for devices in (8, 1):
        run_dir = tmp_path / f"d{devices}"
        out = run("train", "mnist", "--simulate", str(devices), "--run-dir", str(run_dir))
        assert out.returncode == 0, out.stderr
        accuracy = float(re.search(r"^test accuracy: ([0-9.]+)$", out.stdout, re.M).group(1))
        assert "train step compiled 1 time(s), eval step 1 time(s)" in out.stdout
        final = _final_eval(run_dir)
        assert final["count"] == 1000
        assert final["accuracy"] == pytest.approx(accuracy, abs=1e-4)
        results[devices] = accuracy
    assert results[8] >= 0.95
    assert abs(results[8] - results[1]) <= 0.005, results
