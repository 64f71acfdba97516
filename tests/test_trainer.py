"""The trainer's promises: data parallel = one device, k steps per call = k calls,
exact evaluation, exact resume, one compile."""

import ast
import contextlib
import io
import json
import logging
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import xlafit
from helpers import cnn_trainer
from xlafit.config import TrainerConfig
from xlafit.data import mnist
from xlafit.recipes import mnist as mnist_recipe
from xlafit.train import trainer as trainer_module
from xlafit.train.loop import itstime


@pytest.fixture(scope="module")
def digits():
    splits = mnist.load_embedded()
    return {k: v[:640] for k, v in splits["train"].items()}, {k: v[:200] for k, v in splits["test"].items()}


def _cnn_trainer(strategy, *, steps_per_call=1, stop_at_step=20, run_dir=None, epochs=2, tx=None):
    return cnn_trainer(
        strategy,
        run_dir,
        tx=tx,
        epochs=epochs,
        stop_at_step=stop_at_step,
        log_every_steps=5,
        steps_per_call=steps_per_call,
    )


@pytest.fixture(scope="module")
def uninterrupted(strategy8, digits, tmp_path_factory):
    """The 20 steps of ``_cnn_trainer`` on 8 devices, evaluated at each epoch's end, with a run
    directory: its result, the directory and what it printed. The reference of three tests
    (each trainer compiles its programs anew)."""
    train, test = digits
    run_dir = tmp_path_factory.mktemp("uninterrupted")
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        trainer = _cnn_trainer(strategy8, stop_at_step=None, run_dir=run_dir)
        result = trainer.fit(train, eval=test)
        trainer.close()
    return result, run_dir, printed.getvalue()


def _params(result):
    return jax.device_get(nnx.to_pure_dict(result.state.params))


def _assert_trees_close(a, b, rtol, atol):
    for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(x, y, rtol=rtol, atol=atol, err_msg=jax.tree_util.keystr(path))


def _assert_relative_norm(a, b, tol):
    """||a - b|| / ||b|| <= tol for every parameter tensor."""
    for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(a), jax.tree.leaves(b), strict=True):
        rel = np.linalg.norm(np.asarray(x, np.float64) - y) / np.linalg.norm(np.asarray(y, np.float64))
        print(f"{jax.tree_util.keystr(path)}: relative difference {rel:.2e}")
        assert rel <= tol, f"{jax.tree_util.keystr(path)}: relative difference {rel:.2e} > {tol:.0e}"


# Tolerance for 20 steps of the CNN, with dropout, on 8 devices vs 1: per parameter tensor,
# ||p8 - p1|| / ||p1|| <= 1e-5. The runs differ only in the order of floating-point sums
# (the cross-device all-reduce vs one device's reduction); dropout masks are identical
# because random bits do not depend on the sharding. Measured here: about 1e-7.
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_eight_devices_equal_one_device(strategy8, strategy1, digits, uninterrupted, optimizer, tol=1e-5):
    train, _ = digits
    tx = optax.sgd(0.05, momentum=0.9) if optimizer == "sgd" else None  # None: _cnn_trainer's Adam
    r8 = _cnn_trainer(strategy8, tx=tx).fit(train) if tx else uninterrupted[0]
    r1 = _cnn_trainer(strategy1, tx=tx).fit(train)
    assert int(r8.state.step) == int(r1.state.step) == 20
    _assert_relative_norm(_params(r8), _params(r1), tol)
    # The parameters did move: the comparison is not between two initial states.
    init = nnx.to_pure_dict(nnx.state(xlafit.models.MnistCNN(rngs=nnx.Rngs(params=0, dropout=1)), nnx.Param))
    assert np.abs(_params(r8)["fc1"]["kernel"] - np.asarray(init["fc1"]["kernel"])).max() > 1e-3
    # The batch is split over the devices; the parameters are replicated.
    assert len(r8.state.params["fc1"]["kernel"].value.sharding.device_set) == 8


def test_invariant_chunks_make_8_devices_and_1_bit_identical(strategy8, strategy1, digits):
    train, test = digits
    config = TrainerConfig(epochs=2, stop_at_step=6, invariant_chunks=8, steps_per_call=2)
    results, evals = [], []
    for strategy in (strategy8, strategy1):
        model = xlafit.models.MnistCNN(rngs=nnx.Rngs(params=0, dropout=1))
        trainer = xlafit.Trainer(
            model, mnist_recipe.loss_fn, optax.adam(1e-3), strategy=strategy, global_batch=64, config=config
        )
        results.append(trainer.fit(train))
        evals.append(trainer.evaluate(test))
    _assert_trees_close(_params(results[0]), _params(results[1]), 0, 0)
    assert [r["loss"] for r in results[0].history] == [r["loss"] for r in results[1].history]
    # The evaluation of the same model: XLA's reduction order differs over 8 devices and 1, so
    # the count of correct digits is equal and the mean loss equal to float rounding: a float32
    # sum of 200 positive losses in another order is at most 199 x eps apart (Higham's bound; on
    # one x86 CPU the two differed by 1.3e-6, over the 1e-6 this test asked before).
    assert evals[0]["count"] == evals[1]["count"] == 200
    assert evals[0]["accuracy"] == evals[1]["accuracy"]
    assert evals[0]["loss"] == pytest.approx(evals[1]["loss"], rel=199 * float(np.finfo(np.float32).eps))


def test_invariant_chunks_must_fit_the_devices(strategy8):
    config = TrainerConfig(invariant_chunks=4)
    with pytest.raises(ValueError, match="invariant_chunks=4 must be a multiple of the 8 devices"):
        xlafit.Trainer(
            nnx.Linear(2, 2, rngs=nnx.Rngs(0)),
            lambda m, b: b["x"],
            optax.sgd(0.1),
            strategy=strategy8,
            global_batch=64,
            config=config,
        )


def test_steps_per_call(strategy8, digits, uninterrupted):
    train, _ = digits
    r1, _, _ = uninterrupted
    r4 = _cnn_trainer(strategy8, steps_per_call=4).fit(train)
    _assert_trees_close(_params(r4), _params(r1), 1e-5, 1e-7)
    # 20 steps in calls of 4 within 10-step epochs: 4,4,2 | 4,4 -> two shapes, two compiles.
    assert r4.train_compiles == 2
    assert r1.train_compiles == 1


def test_evaluation_counts_every_example_once(strategy8):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(203, 5)).astype(np.float32)  # 203: not a multiple of 64
    y = rng.integers(0, 3, 203).astype(np.int32)
    model = nnx.Linear(5, 3, rngs=nnx.Rngs(0))
    w, b = np.asarray(model.kernel.value, np.float64), np.asarray(model.bias.value, np.float64)

    def loss_fn(model, batch):
        logits = model(batch["x"])
        losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])
        return losses, {"accuracy": (logits.argmax(-1) == batch["y"]).astype(jnp.float32)}

    trainer = xlafit.Trainer(model, loss_fn, optax.sgd(0.1), strategy=strategy8, global_batch=64)
    got = trainer.evaluate({"x": x, "y": y})

    logits = x.astype(np.float64) @ w + b
    log_probs = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    expected_loss = -log_probs[np.arange(203), y].mean()
    assert got["count"] == 203
    assert got["loss"] == pytest.approx(expected_loss, rel=1e-6)
    assert got["accuracy"] == pytest.approx((logits.argmax(-1) == y).mean(), abs=1e-12)
    assert trainer.eval_step.compiles == 1  # the padded last batch reuses the program


def test_stop_and_resume_equals_uninterrupted(strategy8, digits, uninterrupted, tmp_path, capsys):
    train, test = digits
    full, _, printed = uninterrupted
    assert "stopped at step" not in printed
    first = _cnn_trainer(strategy8, stop_at_step=7, epochs=2, run_dir=tmp_path)
    part = first.fit(train)
    first.close()
    assert int(part.state.step) == 7
    assert (
        "stopped at step 7 of 20 (trainer.stop_at_step=7) with a checkpoint; to go on, run again with a later "
        "trainer.stop_at_step or without it"
    ) in capsys.readouterr().out  # a stop at a step said nothing: it looked like the end of the run
    behind = _cnn_trainer(strategy8, stop_at_step=5, epochs=2, run_dir=tmp_path)
    assert int(behind.fit(train).state.step) == 7
    behind.close()
    assert (
        "nothing trained: the run is at step 7, past trainer.stop_at_step=5; to go on, run again with a later "
        "trainer.stop_at_step or without it"
    ) in capsys.readouterr().out  # it said nothing and exited 0
    # resume=False over those checkpoints: refused before any step (its first save failed,
    # "checkpoint for step 10 already exists", though messages offered it as the way to start over)
    over = _cnn_trainer(strategy8, stop_at_step=None, epochs=2, run_dir=tmp_path)
    over.resume = False
    with pytest.raises(xlafit.ConfigError, match=r"holds the checkpoints of an earlier run \(the newest at step 7\)"):
        over.fit(train)
    over.close()
    second = _cnn_trainer(strategy8, stop_at_step=None, epochs=2, run_dir=tmp_path)
    resumed = second.fit(train, eval=test)
    second.close()
    assert int(resumed.state.step) == 20
    # Bit for bit: same batches, same dropout masks, same optimizer moments.
    _assert_trees_close(_params(resumed), _params(full), 0, 0)
    assert resumed.eval == full.eval
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir() if p.name.isdigit()) == ["10", "20", "7"]


def test_a_run_stopped_before_its_evaluation_and_run_again_compiles_nothing(strategy8, digits, tmp_path, capsys):
    """The ninth walk: a run stopped at step 3 (its evaluation at the epoch's end, step 10) and
    run again with the same stop trains nothing and evaluates nothing, yet compiled the eval
    step and said so ("train step compiled 0 time(s), eval step 1 time(s)")."""
    train, test = digits
    first = _cnn_trainer(strategy8, stop_at_step=3, run_dir=tmp_path)
    done = first.fit(train, eval=test)
    first.close()
    assert (done.train_compiles, done.eval_compiles) == (1, 1)  # compiled ahead: a broken loss fails early
    capsys.readouterr()
    again = _cnn_trainer(strategy8, stop_at_step=3, run_dir=tmp_path)
    result = again.fit(train, eval=test)
    again.close()
    assert int(result.state.step) == 3 and (result.train_compiles, result.eval_compiles) == (0, 0)
    assert "compiled" not in capsys.readouterr().out


def test_train_step_compiles_once_and_logs(uninterrupted):
    result, run_dir, _ = uninterrupted
    assert result.train_compiles == 1 and result.eval_compiles == 1
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train_records = [r for r in records if r["split"] == "train"]
    assert [r["step"] for r in train_records] == [5, 10, 15, 20]
    for key in ("step", "epoch", "loss", "accuracy", "learning_rate", "examples_per_sec", "step_time_s", "compiles"):
        assert key in train_records[0] or key == "learning_rate", key
    assert train_records[-1]["compiles"] == 1
    assert [r["step"] for r in records if r["split"] == "eval"] == [10, 20]
    assert any((run_dir / "tensorboard").iterdir())


def test_global_batch_must_divide(strategy8):
    with pytest.raises(ValueError, match="does not divide over 8 devices"):
        xlafit.Trainer(
            nnx.Linear(2, 2, rngs=nnx.Rngs(0)), lambda m, b: b["x"], optax.sgd(0.1), strategy=strategy8, global_batch=12
        )


@pytest.mark.parametrize(
    ("step", "every", "total", "previous", "due"),
    [
        (20, 10, None, None, True),  # a multiple of every
        (21, 10, None, None, False),
        (24, 10, None, 18, True),  # a call of 6 steps ran over step 20
        (29, 10, None, 24, False),  # ... and the next one did not reach 30
        (7, 10, 7, None, True),  # the last step is always a time
        (7, 0, 7, None, True),  # every=0: only the last step
        (7, 0, None, None, False),  # every=0 and no total: never
        (10, 10, 10, 9, True),
    ],
)
def test_itstime(step, every, total, previous, due):
    assert itstime(step, every, total, previous=previous) is due


def test_the_trainer_imports_no_integration():
    """The trainer knows no framework: a foreign model reaches it through train/adapter.py."""
    tree = ast.parse(Path(trainer_module.__file__).read_text())
    imported = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    imported += [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    assert "xlafit.train.adapter" in imported  # the test reads the right file
    assert [m for m in imported if m.startswith("xlafit.integrations")] == []


def test_a_first_save_that_never_finished_is_said_before_training_starts_over(strategy1, digits, tmp_path):
    """The fifth walk: killed while writing its first checkpoint, a run started again from step
    1 without a word that the steps before were kept nowhere (Orbax then removed the unfinished
    save, in a warning of its own)."""
    train, _ = digits
    (tmp_path / "checkpoints" / "12.orbax-checkpoint-tmp").mkdir(parents=True)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        trainer = _cnn_trainer(strategy1, stop_at_step=1, run_dir=tmp_path)
        trainer.fit(train)
        trainer.close()
    assert "no complete checkpoint in" in printed.getvalue()
    assert (
        "the save of step 12 did not finish" in printed.getvalue() and "starts again from step 0" in printed.getvalue()
    )


def test_a_save_that_never_finished_after_a_checkpoint_is_said_in_the_runs_words(strategy1, digits, tmp_path, caplog):
    """The tenth walk: killed while saving after an earlier checkpoint, a run went on from that
    checkpoint saying nothing of the lost save, and Orbax's warning (`Removing existing directory
    since it is not finalized`) said it when the step was saved again."""
    train, _ = digits
    with contextlib.redirect_stdout(io.StringIO()):
        trainer = _cnn_trainer(strategy1, stop_at_step=2, run_dir=tmp_path)
        trainer.fit(train)
        trainer.close()
    (tmp_path / "checkpoints" / "3.orbax-checkpoint-tmp").mkdir()  # what a kill during the save of step 3 leaves
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed), caplog.at_level(logging.INFO):
        trainer = _cnn_trainer(strategy1, stop_at_step=3, run_dir=tmp_path)
        assert int(trainer.fit(train).state.step) == 3
        trainer.close()
    said = "the save of step 3 did not finish (the process stopped while writing it; it is discarded): going on from"
    assert f"{said} checkpoint 2" in printed.getvalue()
    assert "not finalized" not in caplog.text and (tmp_path / "checkpoints" / "3").is_dir()


def test_a_finished_run_evaluated_again_keeps_one_evaluation_of_its_last_step(strategy1, digits, tmp_path):
    """The sixth walk: each run of a finished run's command appended another evaluation of its
    last step to metrics.jsonl (a script averaging by step counted it 2, 3, ... times)."""
    train, test = digits
    for _ in range(3):  # the first trains and evaluates; the others find the run finished and evaluate
        with contextlib.redirect_stdout(io.StringIO()):
            trainer = _cnn_trainer(strategy1, stop_at_step=None, run_dir=tmp_path, epochs=1)
            trainer.fit(train, eval=test)
            trainer.close()
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["split"] == "eval"] == [10]
