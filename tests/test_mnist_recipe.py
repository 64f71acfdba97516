"""The demo's promise: the MNIST recipe reaches >= 95% on the 1,000 held-out digits (here
after 3 of its 8 epochs, 0.962 measured; the whole demo prints 0.969, README), and a 1-device
run of the same config trains the very same model as an 8-device one.

The preset sets trainer.invariant_chunks=8: gradients are summed over 8 fixed chunks in a
fixed order, so the two runs are bit-identical. Without it they agree to ~1e-7 for a few
dozen steps, then training amplifies the different all-reduce order until a few test digits
flip (measured: 0.970 vs 0.967).
"""

import json
import re

import jax
import pytest

from tests.test_cli import run


def _final_eval(run_dir):
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if r["split"] == "eval"][-1]


# The JAX the project pins (below 0.12): its XLA:CPU keeps the CNN bit-identical on any device count.
PINNED_XLA = tuple(int(x) for x in jax.__version__.split(".")[:2]) < (0, 12)


def _eval_at(run_dir, epoch):
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return next(r for r in records if r["split"] == "eval" and r["epoch"] == epoch)


@pytest.mark.slow
def test_mnist_recipe_reaches_95_percent_on_8_and_1_devices(tmp_path):
    results, evals, train_losses = {}, {}, {}
    # The first 3 of the demo's 8 epochs on 8 devices, the first one on 1 device (the same
    # schedule: stop_at_step keeps it), to keep the suite short. test_trainer.py and
    # test_multiprocess.py check whole runs across device and process counts.
    for devices, extra in (
        (8, ["trainer.stop_at_step=93", "trainer.log_every_steps=5"]),
        (1, ["trainer.stop_at_step=31", "trainer.log_every_steps=5"]),
    ):
        run_dir = tmp_path / f"d{devices}"
        out = run("train", "mnist", "--simulate", str(devices), "--run-dir", str(run_dir), *extra)
        assert out.returncode == 0, out.stderr
        assert "train step compiled 1 time(s), eval step 1 time(s)" in out.stdout
        final = _final_eval(run_dir)
        assert final["count"] == 1000
        results[devices] = re.search(r"^test accuracy: ([0-9.]+)$", out.stdout, re.M)
        evals[devices] = final
        records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        train_losses[devices] = [r["loss"] for r in records if r["split"] == "train"]
    accuracy = float(results[8].group(1))
    assert accuracy >= 0.95 and evals[8]["accuracy"] == pytest.approx(accuracy, abs=1e-4)
    ones = train_losses[1]
    assert len(ones) >= 4
    if PINNED_XLA:
        assert train_losses[8][: len(ones)] == ones  # bit for bit, at every logged step
    else:  # newer XLA:CPU rounds the CNN apart per device count (docs/explanations/determinism.md)
        assert train_losses[8][: len(ones)] == pytest.approx(ones, rel=1e-5)
    # Evaluation after epoch 1 (the model is the same; XLA's reduction order differs, so the
    # count of correct digits is equal and the mean loss equal to float rounding)
    first = {d: _eval_at(tmp_path / f"d{d}", epoch=1) for d in (8, 1)}
    assert first[8]["accuracy"] == first[1]["accuracy"]
    assert first[8]["loss"] == pytest.approx(first[1]["loss"], rel=1e-6)
