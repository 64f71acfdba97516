"""What a notebook does with a :class:`xlafit.Trainer`, cell after cell: the model object it
passed in, fit run again, an interrupt, more epochs on the same run directory (the
twenty-first newcomer walk)."""

from __future__ import annotations

import os
import signal

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import xlafit
from xlafit.config import OptimizerConfig, TrainerConfig
from xlafit.data.dataset import ArrayDataset
from xlafit.errors import CheckpointError, DataError, Preempted
from xlafit.models.lora import ADAPTER, apply_lora


class MLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.hidden = nnx.Linear(8, 16, rngs=rngs)
        self.norm = nnx.BatchNorm(16, rngs=rngs)
        self.out = nnx.Linear(16, 4, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.out(nnx.relu(self.norm(self.hidden(x))))


def loss_fn(model, batch):
    logits = model(batch["x"])
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])
    return losses, {"accuracy": (logits.argmax(-1) == batch["y"]).astype(np.float32)}


def _data(n=256, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 8)).astype(np.float32)
    return {"x": x, "y": (x[:, :4].argmax(-1)).astype(np.int32)}


def _trainer(model, strategy, epochs=2, **kwargs):
    config = TrainerConfig(epochs=epochs, log_every_steps=0, **kwargs.pop("config", {}))
    optimizer = kwargs.pop("optimizer", optax.adam(1e-2))
    return xlafit.Trainer(model, loss_fn, optimizer, strategy=strategy, global_batch=32, config=config, **kwargs)


def _values(tree):
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


class Interrupting(ArrayDataset):
    """The data, with SIGINT sent to this process at its ``at``-th ``take`` (a kernel's
    interrupt button is SIGINT to the kernel), ``times`` times."""

    def __init__(self, arrays, at, times=1):
        super().__init__(arrays)
        self.at, self.times, self.takes = at, times, 0

    def take(self, indices, epoch=0):
        self.takes += 1
        if self.takes == self.at:
            for _ in range(self.times):
                os.kill(os.getpid(), signal.SIGINT)
        return super().take(indices, epoch)


def test_the_model_given_holds_the_trained_values_after_fit_and_after_fit_again(strategy8):
    """Its values were those it was made with (the trainer trains a copy), so a notebook's next
    cell, ``model(x)``, used the untrained model without a word. And a second fit must leave it
    usable (the steps donate the trainer's own arrays)."""
    data = _data()
    model = MLP(nnx.Rngs(0))
    before = _values(nnx.state(model, nnx.Param))
    trainer = _trainer(model, strategy8)
    trainer.fit(data)
    trained = nnx.state(trainer.model())
    assert all(np.array_equal(a, b) for a, b in zip(_values(nnx.state(model)), _values(trained), strict=True))
    assert not all(np.array_equal(a, b) for a, b in zip(before, _values(nnx.state(model, nnx.Param)), strict=True))
    model.eval()
    np.testing.assert_array_equal(np.asarray(model(data["x"])), np.asarray(trainer.model()(data["x"])))
    again = _trainer(model, strategy8)  # a new trainer of the trained model: trains on from its values
    again.fit(data)
    assert all(
        np.array_equal(a, b) for a, b in zip(_values(nnx.state(model)), _values(nnx.state(again.model())), strict=True)
    )
    assert np.isfinite(np.asarray(model(data["x"]))).all()  # not donated away by the second fit


def test_a_frozen_base_is_left_as_it_is_and_the_adapters_written_back(strategy8):
    model = apply_lora(MLP(nnx.Rngs(0)), ("hidden", "out"), rank=2, alpha=4, rngs=nnx.Rngs(1))
    base = model.hidden.base_module.kernel.get_value()
    _trainer(model, strategy8, trainable=ADAPTER).fit(_data())
    assert model.hidden.base_module.kernel.get_value() is base  # not copied: training never changes it
    assert float(np.abs(np.asarray(model.hidden.lora_b.get_value())).max()) > 0


def test_fit_again_on_a_finished_trainer_says_it_trains_nothing(strategy8, capsys):
    trainer = _trainer(MLP(nnx.Rngs(0)), strategy8, epochs=1)
    trainer.fit(_data())
    capsys.readouterr()
    again = trainer.fit(_data())
    out = capsys.readouterr().out
    assert "this trainer's run is finished: step 8 is its last (1 epochs), so fit trains nothing more" in out
    assert again.history == []


def test_an_interrupt_without_a_run_directory_goes_on_in_memory_to_the_uninterrupted_end(strategy8, capsys):
    """Ctrl-C (the kernel's interrupt) with no run_dir said "run the cell again (with the same run
    directory)"; fit again goes on from the step in memory, to the uninterrupted run's values,
    and the model given holds the step's values at the stop."""
    data = _data()
    whole = _trainer(MLP(nnx.Rngs(0)), strategy8)
    whole.fit(data)
    model = MLP(nnx.Rngs(0))
    cut = _trainer(model, strategy8)
    with pytest.raises(Preempted) as e:
        cut.fit(Interrupting(data, at=5))
    assert "no run directory, nothing saved. Calling fit again on this trainer goes on from there" in str(e.value)
    assert "same run directory" not in str(e.value)
    stopped = e.value.step
    assert 0 < stopped < 16
    assert all(
        np.array_equal(a, b) for a, b in zip(_values(nnx.state(model)), _values(nnx.state(cut.model())), strict=True)
    )
    capsys.readouterr()
    cut.fit(data)
    assert f"going on from step {stopped} (epoch {stopped // 8 + 1} of 2), held in this trainer's memory" in (
        capsys.readouterr().out
    )
    assert all(
        np.array_equal(a, b) for a, b in zip(_values(cut.state.params), _values(whole.state.params), strict=True)
    )


def test_an_interrupt_during_the_start_up_stops_before_the_first_step_without_a_traceback(strategy8):
    """Interrupting in fit's first second (the eval step's compile) raised a raw KeyboardInterrupt."""
    data = _data()
    with pytest.raises(Preempted, match="stopped at step 0; before its first step, nothing new to save"):
        _trainer(MLP(nnx.Rngs(0)), strategy8).fit(data, eval=Interrupting(data, at=1))


def test_more_epochs_on_a_run_of_an_optimizer_config_keeps_its_schedule_or_is_refused(strategy8, tmp_path):
    """Resuming with more epochs made a new warmup-and-decay schedule: the rate jumped from the
    old one's end back up mid-run, without a word. The recipes refuse it; so does the trainer,
    naming decay_steps, with which the run trains on at the schedule's last rate."""
    data = _data()
    config = OptimizerConfig(learning_rate=1e-2, reference_batch=32, warmup_steps=2)
    _trainer(MLP(nnx.Rngs(0)), strategy8, optimizer=config, run_dir=tmp_path).fit(data)
    with pytest.raises(CheckpointError) as e:
        _trainer(MLP(nnx.Rngs(0)), strategy8, epochs=4, optimizer=config, run_dir=tmp_path).fit(data)
    assert "learning-rate schedule of 16 steps" in str(e.value) and "this run's spans 32" in str(e.value)
    assert "OptimizerConfig(..., decay_steps=16)" in str(e.value)
    kept = OptimizerConfig(learning_rate=1e-2, reference_batch=32, warmup_steps=2, decay_steps=16)
    result = _trainer(MLP(nnx.Rngs(0)), strategy8, epochs=4, optimizer=kept, run_dir=tmp_path).fit(data)
    assert result.state.step == 32


def test_the_learning_rate_line_of_an_optimizer_config_says_its_warmup_and_decay(strategy8, capsys):
    """The line named the scaled peak alone; a warmup longer than the run was cut without a word."""
    config = OptimizerConfig(learning_rate=1e-2, reference_batch=32, warmup_steps=100)
    _trainer(MLP(nnx.Rngs(0)), strategy8, optimizer=config).fit(_data())
    out = capsys.readouterr().out
    assert "100 warmup steps, more than the schedule's 16: the rate rises to " in out
    assert "the run ends before the peak and before any decay" in out
    config = OptimizerConfig(learning_rate=1e-2, reference_batch=32, warmup_steps=4)
    _trainer(MLP(nnx.Rngs(0)), strategy8, optimizer=config).fit(_data())
    assert "4 warmup steps, cosine decay over 12 steps (optimizer.decay_steps=16: warmup and decay)" in (
        capsys.readouterr().out
    )


def test_an_evaluation_set_without_a_key_the_loss_reads_is_named(strategy8):
    data = _data()
    with pytest.raises(
        DataError, match=r"the loss reads batch\['y'\], which the evaluation data lacks \(its keys: x\)"
    ):
        _trainer(MLP(nnx.Rngs(0)), strategy8).fit(data, eval={"x": data["x"][:64]})


def test_a_second_interrupt_in_a_kernel_stops_the_cell_and_keeps_the_kernel(tmp_path):
    """A second interrupt exited the process at once: in a Jupyter kernel that killed the
    kernel, every variable of the session with it. There it raises KeyboardInterrupt."""
    import nbformat
    from nbclient import NotebookClient

    from helpers import user_env

    nb = nbformat.v4.new_notebook()
    nb.cells = [
        nbformat.v4.new_code_cell(
            "import os, signal, time, numpy as np, optax, xlafit\n"
            "from flax import nnx\n"
            "from xlafit.data.dataset import ArrayDataset\n"
            "class Interrupting(ArrayDataset):  # the interrupt button, pressed twice at the third batch\n"
            "    takes = 0\n"
            "    def take(self, indices, epoch=0):\n"
            "        self.takes += 1\n"
            "        if self.takes == 3:\n"
            "            os.kill(os.getpid(), signal.SIGINT)\n"
            "            time.sleep(0.5)  # the handler runs in the main thread, between the two\n"
            "            os.kill(os.getpid(), signal.SIGINT)\n"
            "        return super().take(indices, epoch)\n"
            "kept = np.arange(10)\n"
            "data = {'x': np.eye(4, dtype=np.float32).repeat(16, 0), 'y': np.arange(64, dtype=np.int32) // 16}\n"
            "loss = lambda m, b: optax.softmax_cross_entropy_with_integer_labels(m(b['x']), b['y'])\n"
            "trainer = xlafit.Trainer(nnx.Linear(4, 4, rngs=nnx.Rngs(0)), loss, optax.sgd(0.1), global_batch=16,\n"
            "                         config=xlafit.config.TrainerConfig(epochs=50, log_every_steps=0), prefetch=0)"
        ),
        nbformat.v4.new_code_cell("trainer.fit(Interrupting(data))"),
        nbformat.v4.new_code_cell("print('the kernel holds', kept.sum())"),
    ]
    client = NotebookClient(nb, timeout=300, kernel_name="python3", allow_errors=True)
    client.execute(env=user_env(), cwd=str(tmp_path))
    errors = [o for o in nb.cells[1].outputs if o.output_type == "error"]
    assert [e.ename for e in errors] == ["KeyboardInterrupt"], nb.cells[1].outputs
    said = "".join(o.get("text", "") for o in nb.cells[1].outputs)
    assert "interrupt again to stop at once, without it (the kernel and its variables stay)" in said
    assert "the kernel holds 45" in "".join(o.get("text", "") for o in nb.cells[2].outputs)


def test_a_model_nobody_else_holds_is_freed_once_the_trainer_has_placed_it(strategy8):
    """The write-back must not keep the model given alive for the run: a recipe's model read
    from Hugging Face files would stay in memory beside the trained state."""
    import gc
    import weakref

    model = MLP(nnx.Rngs(0))
    held = weakref.ref(model)
    trainer = _trainer(model, strategy8, epochs=1)
    del model
    gc.collect()
    assert held() is None
    trainer.fit(_data())  # nothing to write into: trains all the same
