"""Keras 3 models in xlafit.Trainer (src/xlafit/integrations/keras/): the same evaluation as
Keras' own fit, 8 devices equal to 1, exact evaluation, bit-exact resume, the trained values
back in the Keras model, and the errors for what does not carry over."""

import os
import subprocess
import sys
from pathlib import Path

os.environ.setdefault("KERAS_BACKEND", "jax")

import jax  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import pytest  # noqa: E402

import xlafit  # noqa: E402
from helpers import long_form  # noqa: E402
from xlafit.config import TrainerConfig  # noqa: E402
from xlafit.errors import ConfigError
from xlafit.integrations.keras import KerasLoss, KerasModule, fit, optax_from_keras  # noqa: E402

# Keras' layers broadcast biases by rank promotion, which the suite's strict setting forbids;
# Keras' own fit/evaluate/predict run under this (xlafit's adapter sets it for its calls).
keras_numpy = jax.numpy_rank_promotion("allow")


def build(seed=0, dropout=0.3, l2=1e-3):
    """A model with everything that has state or extra losses: L2, BatchNorm, Dropout."""
    keras.utils.set_random_seed(seed)
    return keras.Sequential(
        [
            keras.Input((8,)),
            keras.layers.Dense(32, activation="relu", kernel_regularizer=keras.regularizers.L2(l2) if l2 else None),
            keras.layers.BatchNormalization(),
            keras.layers.Dropout(dropout),
            keras.layers.Dense(3),
        ]
    )


def data(n, seed):
    """A 3-class problem a small MLP learns to ~90%: the argmax of a fixed linear map."""
    x = np.random.default_rng(seed).normal(size=(n, 8)).astype(np.float32)
    w = np.random.default_rng(99).normal(size=(8, 3))
    return x, (x @ w).argmax(-1).astype(np.int32)


LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def trainer(model, strategy, run_dir=None, epochs=2, **config):
    return xlafit.Trainer(
        model,
        KerasLoss(LOSS, ["accuracy"]),
        optax.adam(1e-2),
        strategy=strategy,
        global_batch=64,
        config=TrainerConfig(epochs=epochs, log_every_steps=0, **config),
        run_dir=run_dir,
    )


def leaves(tree):
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


def test_reaches_the_evaluation_of_keras_own_fit(strategy8):
    x, y = data(1024, 0)
    xv, yv = data(1000, 1)
    ours = trainer(build(), strategy8, epochs=6).fit({"x": x, "y": y}, eval={"x": xv, "y": yv}).eval
    theirs = build()
    theirs.compile(optimizer=keras.optimizers.Adam(1e-2), loss=LOSS, metrics=["accuracy"])
    with keras_numpy:
        theirs.fit(x, y, batch_size=64, epochs=6, verbose=0)
        keras_loss, keras_accuracy = theirs.evaluate(xv, yv, batch_size=100, verbose=0)
    # Two runs differ in data order and dropout masks; 1000 examples at ~90% accuracy give a
    # standard error of 0.0095 per run, so 0.04 is three standard errors of the difference.
    assert ours["accuracy"] > 0.85 and keras_accuracy > 0.85
    assert abs(ours["accuracy"] - keras_accuracy) < 0.04
    assert abs(ours["loss"] - keras_loss) < 0.1


def test_evaluation_equals_keras_evaluate_and_loss_adds_regularisation(strategy8):
    model = build()
    model.compile(loss=LOSS, metrics=["accuracy"])
    xv, yv = data(203, 1)  # not a multiple of the batch: the last batch is padded and masked
    t = xlafit.Trainer(model, None, optax.adam(1e-3), strategy=strategy8, global_batch=64)
    ours = t.evaluate({"x": xv, "y": yv})
    with keras_numpy:
        keras_loss, keras_accuracy = model.evaluate(xv, yv, batch_size=203, verbose=0)
        reg = float(sum(model.losses))
    assert ours["count"] == 203 and reg > 0
    np.testing.assert_allclose(ours["loss"], keras_loss, rtol=1e-5)
    np.testing.assert_allclose(ours["accuracy"], keras_accuracy, rtol=1e-6)
    # The same weights without the L2 term: the difference is the L2 loss, counted once.
    plain = xlafit.Trainer(build(l2=0), LOSS, optax.adam(1e-3), strategy=strategy8, global_batch=64)
    np.testing.assert_allclose(plain.evaluate({"x": xv, "y": yv})["loss"] + reg, keras_loss, rtol=1e-5)


def test_8_devices_equal_1_and_resume_is_bit_exact_and_writes_back(strategy8, strategy1, tmp_path):
    x, y = data(512, 0)
    full = trainer(build(), strategy8, epochs=2).fit({"x": x, "y": y})
    one = trainer(build(), strategy1, epochs=2).fit({"x": x, "y": y})
    # Dropout masks come from Keras' seed state over the global batch and BatchNorm reduces
    # over the global batch: 8 devices train the 1-device model, to float rounding.
    for a, b in zip(
        leaves((full.state.params, full.state.model_state)),
        leaves((one.state.params, one.state.model_state)),
        strict=True,
    ):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    trainer(build(), strategy8, tmp_path, epochs=2, stop_at_step=5).fit({"x": x, "y": y})
    # A new process would build the model afresh: another seed proves nothing comes from it.
    model = build(seed=7)
    resumed = trainer(model, strategy8, tmp_path, epochs=2).fit({"x": x, "y": y})
    assert int(resumed.state.step) == 16
    for a, b in zip(leaves(resumed.state), leaves(full.state), strict=True):
        np.testing.assert_array_equal(a, b)  # params, Adam moments, BatchNorm and dropout seed state
    # The trained values are the Keras model's: predict, save and load see them.
    trained = leaves(resumed.state.params) + leaves(resumed.state.model_state)
    for ours, variable in zip(trained, model.trainable_variables + model.non_trainable_variables, strict=True):
        np.testing.assert_array_equal(ours, np.asarray(variable.value))
    model.save(tmp_path / "model.keras")
    with keras_numpy:
        loaded = keras.models.load_model(tmp_path / "model.keras")
        np.testing.assert_array_equal(loaded.predict(x[:8], verbose=0), model.predict(x[:8], verbose=0))


def test_fit_gives_keras_history_names_with_mixed_bfloat16(strategy8):
    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    try:
        model = build(dropout=0.0)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss=LOSS, metrics=["accuracy"])
    x, y = data(256, 0)
    history = fit(model, x, y, batch_size=64, epochs=2, validation_data=data(100, 1), strategy=strategy8)
    assert sorted(history.history) == ["accuracy", "loss", "val_accuracy", "val_loss"]
    assert history.epoch == [0, 1] and all(len(v) == 2 for v in history.history.values())
    assert history.history["loss"][-1] < history.history["loss"][0]
    assert history.result.train_compiles == 1
    assert {a.dtype for a in leaves(history.result.state.params)} == {np.dtype("float32")}  # bf16 compute only
    with keras_numpy:
        val_loss, val_accuracy = model.evaluate(*data(100, 1), verbose=0)  # the Keras model holds the result
    np.testing.assert_allclose(history.history["val_loss"][-1], val_loss, rtol=1e-3)
    assert history.history["val_accuracy"][-1] == pytest.approx(val_accuracy, abs=0.011)


@pytest.mark.parametrize(
    "make",
    [
        lambda: keras.optimizers.Adam(1e-2, beta_1=0.8, epsilon=1e-7),
        lambda: keras.optimizers.AdamW(1e-2, weight_decay=0.1, beta_2=0.99),
    ],
)
def test_keras_adam_translates_to_optax_with_keras_arithmetic(make):
    keras_adam = make()
    variable = keras.Variable(np.ones(4, np.float32))
    tx = optax_from_keras(keras_adam)
    params = np.ones(4, np.float32)
    state = tx.init(params)
    for i in range(20):
        grad = np.linspace(-1, 1, 4).astype(np.float32) * (i + 1)
        keras_adam.apply_gradients([(grad, variable)])
        updates, state = tx.update(grad, state, params)
        params = optax.apply_updates(params, updates)
    # Keras' formula (epsilon before the bias correction), rounded in another order: float32 noise.
    np.testing.assert_allclose(np.asarray(variable.value), params, rtol=2e-7, atol=1e-7)


@pytest.mark.parametrize(
    "kwargs, says",
    [
        ({"callbacks": [keras.callbacks.ModelCheckpoint("m.keras")]}, "ModelCheckpoint -> run_dir="),
        ({"callbacks": [keras.callbacks.EarlyStopping()]}, "EarlyStopping -> epochs="),
        ({"validation_split": 0.1}, "pass validation_data="),
        ({"metrics": [keras.metrics.AUC()]}, "keeps state across batches"),
        ({"optimizer": keras.optimizers.RMSprop()}, "pass an optax transformation"),
        ({"loss": None}, "not compiled with a loss"),
    ],
)
def test_keras_features_that_do_not_carry_over_name_the_xlafit_way(strategy8, kwargs, says):
    x, y = data(64, 0)
    args = {"loss": LOSS, "optimizer": optax.sgd(0.1), **kwargs}
    with pytest.raises(ConfigError, match=says.replace("(", r"\(")):
        fit(build(), x, y, batch_size=64, strategy=strategy8, **args)


def test_another_keras_backend_is_refused_with_the_fix(tmp_path):
    code = (
        "import keras\nfrom xlafit.integrations.keras import KerasModule\nfrom xlafit.config import ConfigError\n"
        "try:\n    KerasModule(keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)]))\n"
        "except ConfigError as e:\n    print(e)\n"
    )
    env = {**os.environ, "KERAS_BACKEND": "numpy", "KERAS_HOME": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert "set KERAS_BACKEND=jax before keras is imported" in out.stdout, out.stderr[-2000:]


def test_unbuilt_model_and_wrong_batch_keys_are_explained(strategy8):
    with pytest.raises(ConfigError, match="not built"):
        KerasModule(keras.Sequential([keras.layers.Dense(2)]))
    t = trainer(build(), strategy8)
    with pytest.raises(ConfigError, match="need the keys 'x'"):
        t.evaluate({"image": np.zeros((64, 8), np.float32), "label": np.zeros(64, np.int32)})


def test_xlafit_check_takes_a_keras_model_file():
    from xlafit.check import check_file

    report = check_file(Path(__file__).parent / "check_cases" / "keras_model.py")
    assert report.ok and report.traced and report.ran and report.flops_per_step > 0


def test_xlafit_checks_rewrite_for_a_keras_model_is_in_keras_ops(tmp_path):
    """A branch on a value in a Keras model's loss is rule 1; the rewrite it shows is written
    in keras.ops (it showed jnp.where)."""
    from xlafit.check import check_file

    path = tmp_path / "branchy.py"
    path.write_text(
        (Path(__file__).parent / "check_cases" / "keras_model.py").read_text() + "\n\ndef loss_fn(y_true, y_pred):\n"
        "    if keras.ops.sum(y_pred) > 0:\n"
        "        y_pred = y_pred * 2\n"
        "    return keras.ops.mean(y_pred, axis=-1)\n"
    )
    (finding,) = check_file(path).findings
    assert finding.rule == 1 and finding.code == "if keras.ops.sum(y_pred) > 0:", finding
    assert "keras.ops.where(" in finding.fix and "jnp." not in finding.fix


def test_invariant_chunks_are_refused_for_keras_with_the_fix():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dropout(0.5), keras.layers.Dense(2)])
    model.compile(loss="mse")
    config = xlafit.config.TrainerConfig(invariant_chunks=8)
    with pytest.raises(xlafit.config.ConfigError, match="trainer.invariant_chunks=null"):
        xlafit.Trainer(model, None, optax.sgd(0.1), global_batch=8, config=config)


# A run of build() on data(512, 0), killed with SIGKILL by its own watcher thread once
# checkpoint KILL_AFTER exists (while training goes on), or run to the end (KILL_AFTER 0).
KILLED_RUN = """
import os, signal, sys, threading, time
from pathlib import Path
sys.path.insert(0, sys.argv[1])
import optax
import xlafit
from test_keras import LOSS, build, data
from xlafit.checkpoint import fingerprint
from xlafit.config import TrainerConfig
from xlafit.integrations.keras import KerasLoss

run_dir, kill_after, seed = Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
x, y = data(512, 0)
trainer = xlafit.Trainer(
    build(seed=seed), KerasLoss(LOSS, ["accuracy"]), optax.adam(1e-2), strategy=xlafit.connect(), global_batch=64,
    config=TrainerConfig(epochs=6, log_every_steps=0, checkpoint_every_steps=4), run_dir=run_dir,
)

def kill_once_saved():
    while not any(p.name.isdigit() and int(p.name) >= kill_after for p in (run_dir / "checkpoints").glob("*")):
        time.sleep(0.002)
    os.kill(os.getpid(), signal.SIGKILL)

if kill_after:
    threading.Thread(target=kill_once_saved, daemon=True).start()
state = trainer.fit({"x": x, "y": y}).state
print("FINGERPRINT", int(state.step), fingerprint((state.params, state.model_state, state.opt_state)))
"""


@long_form(30, "test_8_devices_equal_1_and_resume_is_bit_exact_and_writes_back")
def test_killed_with_sigkill_then_resumed_ends_bit_identical(strategy8, tmp_path):
    """kill -9 in the middle of a run (checkpoints every 4 steps), then the same program again
    with a model built from another seed: the end state (parameters, BatchNorm statistics,
    dropout seed, Adam moments) has the fingerprint of an uninterrupted run."""
    from xlafit.checkpoint import fingerprint

    x, y = data(512, 0)
    full = trainer(build(), strategy8, epochs=6).fit({"x": x, "y": y}).state
    expected = f"FINGERPRINT 48 {fingerprint((full.params, full.model_state, full.opt_state))}"
    script = tmp_path / "run.py"
    script.write_text(KILLED_RUN)
    run = [sys.executable, str(script), str(Path(__file__).parent), str(tmp_path / "run")]
    killed = subprocess.run([*run, "20", "0"], capture_output=True, text=True, timeout=300)
    assert killed.returncode == -9, killed.stderr[-3000:]
    saved = sorted(int(p.name) for p in (tmp_path / "run" / "checkpoints").glob("*") if p.name.isdigit())
    assert saved and 20 <= max(saved) < 48, saved
    resumed = subprocess.run([*run, "0", "7"], capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resum" in resumed.stdout + resumed.stderr
    assert expected in resumed.stdout, resumed.stdout[-2000:]


def test_a_rerun_fit_of_a_finished_run_says_so_and_returns_its_whole_history(strategy8, tmp_path, capsys):
    """A notebook cell run twice with the same run_dir: the second run trains nothing, says the
    run is finished (never "epoch 3 of 2"), and returns the history the first one logged."""
    model = build(dropout=0.0)
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss=LOSS, metrics=["accuracy"])
    x, y = data(256, 0)
    args = dict(batch_size=64, epochs=2, validation_data=data(100, 1), strategy=strategy8, run_dir=tmp_path / "run")
    first = fit(model, x, y, **args)
    capsys.readouterr()
    again = fit(model, x, y, **args)
    out = capsys.readouterr().out
    assert "the run is finished: checkpoint 8 is its last step (2 epochs)" in out and "epoch 3" not in out
    assert again.history == first.history and again.epoch == [0, 1]
    assert again.history["val_accuracy"][-1] == first.history["val_accuracy"][-1]


def two_in_two_out(seed=0):
    """A Functional model with two inputs and two outputs (a class and a value)."""
    keras.utils.set_random_seed(seed)
    a, b = keras.Input((8,), name="a"), keras.Input((4,), name="b")
    h = keras.layers.Dense(16, activation="relu")(keras.layers.Concatenate()([a, b]))
    return keras.Model([a, b], [keras.layers.Dense(3, name="cls")(h), keras.layers.Dense(1, name="value")(h)])


def test_two_inputs_and_two_outputs_train_as_keras_own_fit_does(strategy8):
    """Keras' fit takes x and y as lists (or dicts by name): one step on one batch of 64 gives
    the weights Keras' own fit gives, and the history names each output's metric."""
    rng = np.random.default_rng(0)
    xa, xb = rng.normal(size=(64, 8)).astype(np.float32), rng.normal(size=(64, 4)).astype(np.float32)
    y_cls, y_val = rng.integers(0, 3, 64).astype(np.int32), rng.normal(size=(64, 1)).astype(np.float32)
    compile_args = dict(loss=[LOSS, "mse"], loss_weights=[1.0, 0.5], metrics=[["accuracy"], []])
    theirs, ours = two_in_two_out(), two_in_two_out()
    theirs.compile(optimizer=keras.optimizers.SGD(0.1), **compile_args)
    ours.compile(optimizer=keras.optimizers.SGD(0.1), **compile_args)
    with keras_numpy:
        theirs.fit([xa, xb], [y_cls, y_val], batch_size=64, epochs=1, shuffle=False, verbose=0)
    history = fit(ours, [xa, xb], [y_cls, y_val], batch_size=64, epochs=1, strategy=strategy8)
    for mine, keras_own in zip(ours.get_weights(), theirs.get_weights(), strict=True):
        np.testing.assert_allclose(mine, keras_own, rtol=1e-5, atol=1e-6)
    assert sorted(history.history) == ["cls_accuracy", "loss"]
    # The same data as dicts by input and output name, with validation data.
    by_name = fit(
        two_in_two_out(),
        {"a": xa, "b": xb},
        {"cls": y_cls, "value": y_val},
        batch_size=32,
        epochs=2,
        loss={"cls": LOSS, "value": "mse"},
        optimizer=optax.adam(1e-2),
        validation_data=({"a": xa, "b": xb}, {"cls": y_cls, "value": y_val}),
        strategy=strategy8,
    )
    assert by_name.history["loss"][1] < by_name.history["loss"][0] and "val_loss" in by_name.history
    with pytest.raises(ConfigError, match=r"the model has 2 outputs \(cls, value\): give y as a list of 2 arrays"):
        fit(two_in_two_out(), [xa, xb], y_cls, batch_size=32, loss=LOSS, optimizer=optax.sgd(0.1), strategy=strategy8)


@pytest.mark.parametrize(
    ("loss", "labels", "message"),
    [
        ("sparse_categorical_crossentropy", "one-hot", r"one-hot \(\[.*, 3\]\) but the loss sparse_categorical_cross"),
        ("categorical_crossentropy", "indices", r"class indices \(\[.*\]\) but the loss categorical_crossentropy"),
    ],
)
def test_labels_that_do_not_fit_the_loss_are_named(strategy8, loss, labels, message):
    x, y = data(64, 0)
    y = np.eye(3, dtype=np.float32)[y] if labels == "one-hot" else y
    model = build(dropout=0.0)
    with pytest.raises(ConfigError, match=message) as e:
        fit(model, x, y, batch_size=32, loss=loss, optimizer=optax.sgd(0.1), strategy=strategy8)
    assert "\n" not in str(e.value)


def test_an_nnx_style_loss_fn_given_with_a_keras_model_is_named(strategy8):
    """loss_fn(model, batch) beside a Keras model was called as loss(y_true, y_pred) and failed
    in JAX ("does not support string indexing; got idx='y'")."""

    def loss_fn(model, batch):
        return keras.losses.sparse_categorical_crossentropy(batch["y"], model(batch["x"]), from_logits=True)

    with pytest.raises(ConfigError, match=r"this one takes \(model, batch\), the form of an nnx.Module's loss_fn"):
        xlafit.Trainer(build(dropout=0.0), loss_fn, optax.sgd(0.1), strategy=strategy8, global_batch=32)


@pytest.mark.parametrize("exclude", ["var_names", "var_list"])
def test_adamw_weight_decay_exclusions_train_as_keras_own_fit(strategy8, exclude):
    """AdamW.exclude_from_weight_decay lives outside get_config(); the excluded variables were
    decayed all the same (the biases 1e-3 off Keras' after 5 steps)."""

    def compiled():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(1)])
        adamw = keras.optimizers.AdamW(0.01, weight_decay=0.5)
        if exclude == "var_names":
            adamw.exclude_from_weight_decay(var_names=["bias"])
        else:  # the first layer's kernel and bias
            adamw.exclude_from_weight_decay(var_list=model.layers[0].trainable_variables)
        model.compile(optimizer=adamw, loss="mse")
        return model

    x, _ = data(64, 0)
    y = x @ np.arange(8, dtype=np.float32)
    theirs, ours = compiled(), compiled()
    with keras_numpy:
        theirs.fit(x, y, batch_size=64, epochs=5, shuffle=False, verbose=0)
    fit(ours, x, y, batch_size=64, epochs=5, strategy=strategy8, config=TrainerConfig(log_every_steps=0))
    for mine, keras_own in zip(ours.get_weights(), theirs.get_weights(), strict=True):
        np.testing.assert_allclose(mine, keras_own, rtol=1e-5, atol=1e-6)
    with pytest.raises(ConfigError, match=r"pass the model too: optax_from_keras\(optimizer, model\)"):
        optax_from_keras(compiled().optimizer)


def test_a_keras_loss_reduced_by_sum_is_refused_and_none_trains_as_the_default(strategy8):
    """reduction="sum" trained as a mean (a step the batch size times smaller than Keras'
    fit takes); None is the per-example values themselves, which xlafit averages."""
    with pytest.raises(ConfigError, match=r"reduction='sum'.*use the default reduction"):
        KerasLoss(keras.losses.MeanSquaredError(reduction="sum"))
    x, y = data(64, 0)
    histories = [
        fit(
            build(dropout=0.0),
            x,
            y,
            batch_size=32,
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=reduction),
            optimizer=optax.sgd(0.1),
            strategy=strategy8,
        ).history["loss"]
        for reduction in ("sum_over_batch_size", None)
    ]
    assert histories[0] == histories[1]


def test_fit_takes_steps_per_execution_from_model_compile(strategy8, capsys):
    """model.compile(steps_per_execution=4) was ignored: fit ran one step per call."""
    model = build(dropout=0.0)
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss=LOSS, steps_per_execution=4)
    fit(model, *data(64, 0), batch_size=8, strategy=strategy8)
    assert "steps per call: 4" in capsys.readouterr().out


def test_a_scalar_keras_loss_with_validation_data_is_refused_the_keras_way(strategy8):
    """It was the generic ValueError, which spoke of optax's and torch's losses."""
    x, y = data(64, 0)
    model = build(dropout=0.0)
    with pytest.raises(ConfigError, match=r"one value per example, e\.g\. keras\.losses\.MeanSquaredError\(reduction="):
        loss = lambda t, p: keras.ops.mean(p)  # noqa: E731
        fit(model, x, y, batch_size=32, loss=loss, optimizer=optax.sgd(0.1), validation_data=(x, y), strategy=strategy8)


def test_fit_with_an_optimizer_config_plans_and_says_its_schedule(strategy8, capsys):
    """The twenty-first walk: fit(..., optimizer=OptimizerConfig(...)) printed no learning-rate
    line, and a warmup in epochs was a raw ValueError (its schedule was built without the
    run's epoch length)."""
    from xlafit.config import OptimizerConfig

    config = OptimizerConfig(name="adam", learning_rate=1e-2, reference_batch=16, warmup_epochs=1)
    history = fit(
        build(dropout=0.0), *data(64, 0), batch_size=8, epochs=2, optimizer=config, loss=LOSS, strategy=strategy8
    )
    out = capsys.readouterr().out
    assert "learning rate: 0.01 at batch 16 -> peak 0.005 at global batch 8 (linear scaling), 8 warmup steps" in out
    assert len(history.history["loss"]) == 2
