"""xlafit.run: resolving a config for the devices, the run directory and the resume check."""

import json
import time

import jax
import numpy as np
import optax
import pytest
import yaml
from flax import nnx

import xlafit
from helpers import use_few_digits
from xlafit.checkpoint import Checkpointer
from xlafit.config import DataConfig, OptimizerConfig, TrainerConfig, check_device_split, resolve_batch
from xlafit.data import as_dataset
from xlafit.errors import CheckpointError, ConfigError, DataError
from xlafit.recipes import load_config
from xlafit.run import check_continuation, describe_schedule, resolve
from xlafit.train.optim import make_optimizer


def _resolved(strategy, run_dir, *overrides, examples=1000):
    cfg = load_config("mnist", [f"run.run_dir={run_dir}", *overrides])
    return resolve(cfg, strategy, examples)[0]


def _with_checkpoint(run_dir, cfg):
    """A run directory as a run leaves it: config.yaml and one checkpoint folder."""
    (run_dir / "checkpoints" / "7").mkdir(parents=True)
    (run_dir / "config.yaml").write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))


def test_conflicting_batch_settings_are_one_error(strategy8):
    cfg = load_config("mnist", ["data.per_device_batch=32", "data.global_batch=128"])
    with pytest.raises(ConfigError, match=r"per_device_batch=32 and data.global_batch=128 disagree on 8 devices"):
        resolve_batch(cfg.data, 8)
    # agreeing settings, or either alone, resolve; the run records both as used
    assert resolve_batch(DataConfig(per_device_batch=16, global_batch=128), 8) == (16, 128)
    resolved = resolve(load_config("mnist"), strategy8, 1000)[0]
    assert (resolved.data.per_device_batch, resolved.data.global_batch) == (16, 128)


def test_a_device_count_that_splits_no_batch_setting_names_them_all_at_once():
    """--simulate 3 on mnist met the global batch, the eval batch and the invariant chunks one
    error at a time; one message names the three and the overrides that run."""
    with pytest.raises(ConfigError) as caught:
        check_device_split(load_config("mnist"), 3)
    message = str(caught.value)
    for setting in ("data.global_batch=128", "data.eval_global_batch=256", "trainer.invariant_chunks=8"):
        assert f"\n  {setting}" in message
    assert message.endswith(
        "add: data.global_batch=126 data.eval_global_batch=255 trainer.invariant_chunks=6 "
        "(or set data.per_device_batch instead)."
    )
    fixed = load_config("mnist", ["data.global_batch=126", "data.eval_global_batch=255", "trainer.invariant_chunks=6"])
    check_device_split(fixed, 3)
    # chunks that do not divide the batch: the largest multiple of the devices that does (it
    # offered null, which turns off the invariance the preset is there for)
    only_chunks = r"(?s)^trainer.invariant_chunks=8 .* over 4 devices.*add: trainer.invariant_chunks=4\.$"
    with pytest.raises(ConfigError, match=only_chunks):
        check_device_split(load_config("mnist", ["data.global_batch=12"]), 4)
    # with only a per-device batch (16 by default) the chunks are checked against its global batch
    with pytest.raises(ConfigError, match=r"add: trainer.invariant_chunks=16\.$"):
        check_device_split(load_config("mnist", ["data.global_batch=null", "trainer.invariant_chunks=24"]), 4)
    check_device_split(load_config("mnist"), 8)
    # The third walk: an eval batch that 3 devices do not split was told to "set data.per_device_batch",
    # which was set, and a per-device batch disagreeing with the global batch went unnamed.
    eval_64 = ["data.eval_global_batch=64"]
    with pytest.raises(ConfigError) as caught:
        check_device_split(load_config("llm", ["data.per_device_batch=2", "data.global_batch=4", *eval_64]), 3)
    message = str(caught.value)
    assert "\n  data.global_batch=4 (data.per_device_batch=2 x 3 devices is 6: set one of them)" in message
    assert message.endswith("add: data.global_batch=null data.eval_global_batch=63.")
    eval_only = r"(?s)^data.eval_global_batch=64 does not .*add: data.eval_global_batch=63\.$"
    with pytest.raises(ConfigError, match=eval_only):
        check_device_split(load_config("llm", ["data.per_device_batch=2", "data.global_batch=null", *eval_64]), 3)
    # The fourth walk: a run with no evaluation data was still asked to size its eval batch.
    check_device_split(load_config("llm", ["data.per_device_batch=2", "data.global_batch=null"]), 3, evaluates=False)


def test_more_epochs_on_a_schedule_that_ends_at_zero_are_not_offered_its_end(strategy8, tmp_path):
    """mnist's schedule ends at a rate of 0: the fix offered (decay_steps kept) trained the added
    epochs at 0, saving checkpoints of weights that never changed."""
    first = _resolved(strategy8, tmp_path, "trainer.epochs=2")
    assert first.optimizer.final_lr_fraction == 0
    _with_checkpoint(tmp_path, first)
    with pytest.raises(ConfigError) as err:
        check_continuation(tmp_path, _resolved(strategy8, tmp_path, "trainer.epochs=3"))
    message = str(err.value)
    assert "add optimizer.decay_steps" not in message
    assert "ends at a learning rate of 0 (optimizer.final_lr_fraction=0), so steps past its end would not train" in (
        message
    )


def test_more_epochs_keep_the_schedule_or_are_refused_with_the_fix(strategy8, tmp_path, capsys):
    first = _resolved(
        strategy8, tmp_path, "trainer.epochs=2", "optimizer.warmup_steps=2", "optimizer.final_lr_fraction=0.1"
    )
    assert first.optimizer.decay_steps == 2 * (1000 // 128)
    _with_checkpoint(tmp_path, first)
    longer = _resolved(
        strategy8, tmp_path, "trainer.epochs=3", "optimizer.warmup_steps=2", "optimizer.final_lr_fraction=0.1"
    )
    with pytest.raises(ConfigError) as err:
        check_continuation(tmp_path, longer)
    message = str(err.value)
    assert "optimizer.decay_steps: 14 in the run, 21 now" in message
    assert "trainer.epochs 2 -> 3" in message and "add optimizer.decay_steps=14" in message
    # with the run's horizon kept, more epochs are a safe change, announced
    kept = _resolved(
        strategy8,
        tmp_path,
        "trainer.epochs=3",
        "optimizer.warmup_steps=2",
        "optimizer.final_lr_fraction=0.1",
        "optimizer.decay_steps=14",
    )
    check_continuation(tmp_path, kept)
    assert "trainer.epochs 2 -> 3" in capsys.readouterr().out
    # and the schedule does stay: the rate after step 14 is the final one, no jump
    plan = make_optimizer(kept.optimizer, 128)
    rates = [float(plan.schedule(s)) for s in range(12, 21)]
    assert rates[1] >= rates[2] and max(rates[2:]) == pytest.approx(rates[2])


def test_a_resume_on_more_data_names_why_the_schedule_moved(strategy8, tmp_path):
    """More data makes an epoch longer, so the schedule's length (decay_steps, never given)
    differs: the refusal named a key the user never set and offered no value for it."""
    first = _resolved(strategy8, tmp_path, "trainer.epochs=2")
    _with_checkpoint(tmp_path, first)
    more = _resolved(strategy8, tmp_path, "trainer.epochs=2", "data.data_dir=more-digits", examples=1500)
    with pytest.raises(ConfigError) as err:
        check_continuation(tmp_path, more)
    message = str(err.value)
    assert "optimizer.decay_steps: 14 in the run, 22 now" in message
    assert "trainer.epochs x the steps of an epoch of this data (data.data_dir changed)" in message
    assert "add optimizer.decay_steps=14." in message
    # less data: the run's schedule alone would outlast the run, which stopped before its end
    less = _resolved(strategy8, tmp_path, "trainer.epochs=2", "data.data_dir=fewer-digits", examples=600)
    with pytest.raises(ConfigError) as err:
        check_continuation(tmp_path, less)
    assert (
        "add optimizer.decay_steps=14 and trainer.epochs=4 (with this data, 2 epochs are 8 steps: the run would stop "
        "before its schedule ends)."
    ) in str(err.value)


def test_a_resume_that_cuts_the_text_into_other_rows_is_refused(tmp_path):
    """data.seq_len (or data.demo) changed: the rows are others, and step N of the run would
    mean other examples; it was announced and went on (after an optimizer.decay_steps hint)."""
    cfg = load_config("llm", [f"run.run_dir={tmp_path}", "data.seq_len=64", "data.demo=arithmetic"])
    _with_checkpoint(tmp_path, cfg)
    # the sixth walk: a changed held-out share (as a refusal once suggested) evaluated on trained records
    for change in ("data.seq_len=96", "data.demo=chat", "data.eval_fraction=0.5", "data.loss_on=all"):
        other = load_config("llm", [f"run.run_dir={tmp_path}", "data.seq_len=64", "data.demo=arithmetic", change])
        key = change.partition("=")[0]
        with pytest.raises(ConfigError, match=rf"cannot resume .*: {key}: .* in the run, .* now\. This change breaks"):
            check_continuation(tmp_path, other)


@pytest.mark.parametrize("damage", ["missing", "garbage", "not a config"])
def test_resume_refuses_without_a_readable_config(strategy8, tmp_path, damage):
    cfg = _resolved(strategy8, tmp_path)
    _with_checkpoint(tmp_path, cfg)
    path = tmp_path / "config.yaml"
    if damage == "missing":
        path.unlink()
    else:
        path.write_text("{{ not: yaml" if damage == "garbage" else "- a list\n")
    before = path.read_bytes() if path.exists() else None
    other = _resolved(strategy8, tmp_path, "optimizer.learning_rate=0.1")
    with pytest.raises(ConfigError, match="cannot resume .*--restart"):
        check_continuation(tmp_path, other)
    assert (path.read_bytes() if path.exists() else None) == before  # nothing overwritten


def test_resume_names_the_recipe_the_directory_holds(strategy8, tmp_path):
    cfg = _resolved(strategy8, tmp_path)
    saved = cfg.to_dict()
    saved["recipe"] = "bert"
    (tmp_path / "checkpoints" / "3").mkdir(parents=True)
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(saved))
    with pytest.raises(ConfigError, match="it holds a bert run, and this is mnist") as e:
        check_continuation(tmp_path, cfg)
    saved["recipe"] = "llm"  # the thirteenth walk: "a llm run"
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(saved))
    with pytest.raises(ConfigError, match="it holds an llm run, and this is mnist"):
        check_continuation(tmp_path, cfg)
    # each way out once (the eleventh walk: "another --run-dir" twice)
    assert str(e.value).count("another --run-dir") == 1 and "--restart (run.resume=false)" in str(e.value)


def test_a_run_refused_at_its_start_warns_of_nothing_it_would_have_done(tmp_path, monkeypatch, caplog):
    """The twelfth walk: a run refused for another recipe's run directory first warned about
    its invariant chunks' bit-identity, of a run that never starts."""
    use_few_digits(monkeypatch)
    cfg = load_config("mnist", [f"run.run_dir={tmp_path}", "cpu.fast_paths=true"])  # a chunks warning
    saved = cfg.to_dict()
    saved["recipe"] = "bert"
    (tmp_path / "checkpoints" / "3").mkdir(parents=True)
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(saved))
    with caplog.at_level("WARNING", logger="xlafit"), pytest.raises(ConfigError, match="it holds a bert run"):
        xlafit.train_and_evaluate(cfg)
    assert "invariant_chunks" not in caplog.text


def test_resume_refuses_a_run_whose_checkpoints_were_all_set_aside(strategy8, tmp_path):
    """A run directory whose every checkpoint a resume moved aside as corrupt (as xlafit did
    before it kept them in place while none is intact) was started again from step 0 without
    a word, writing over its metrics; the fix is --restart."""
    cfg = _resolved(strategy8, tmp_path)
    _with_checkpoint(tmp_path, cfg)
    (tmp_path / "checkpoints" / "7").rename(tmp_path / "checkpoints" / "corrupt-7-20260101T000000")
    with pytest.raises(CheckpointError, match=r"set aside \(corrupt-7-20260101T000000\).* --restart"):
        check_continuation(tmp_path, cfg)


@pytest.mark.parametrize("resume", [True, False])
def test_a_checkpoint_dir_that_is_a_file_is_refused_in_one_line(strategy8, tmp_path, monkeypatch, resume):
    """Tester's report: `--checkpoint-dir afile.txt` (an existing file) ended in a
    NotADirectoryError traceback from the resume check (and from --restart's move aside);
    `--run-dir afile.txt` already got one line. Nothing is written."""
    use_few_digits(monkeypatch)
    (tmp_path / "afile.txt").write_text("notes")
    for where in ("afile.txt", "afile.txt/checkpoints"):
        overrides = [
            f"run.run_dir={tmp_path / 'run'}",
            f"run.checkpoint_dir={tmp_path / where}",
            f"run.resume={resume}",
        ]
        with pytest.raises(CheckpointError) as e:
            xlafit.train_and_evaluate(load_config("mnist", overrides))
        assert str(e.value) == (
            f"cannot keep checkpoints in {tmp_path / where}: {tmp_path / 'afile.txt'} is a file, not a directory. "
            "Choose another --checkpoint-dir (run.checkpoint_dir)."
        )
    assert not (tmp_path / "run").exists()
    with pytest.raises(CheckpointError, match="afile.txt is a file, not a directory"):  # a Trainer's checkpoint_dir
        Checkpointer(tmp_path / "afile.txt")


def test_schedule_line_says_what_a_short_run_does():
    o = OptimizerConfig(learning_rate=0.003, reference_batch=32, scaling="sqrt", warmup_steps=40)
    cfg = load_config("bert")
    plan = make_optimizer(o, 32, total_steps=24)
    line = describe_schedule(dataclasses_replace(cfg, o), plan)
    assert "40 warmup steps, more than the schedule's 24" in line and "before the peak" in line
    assert f"rises to {max(float(plan.schedule(s)) for s in range(24)):.4g}" in line
    # The sixth walk: a one-step run inside the warm-up "rises to 0": it trains nothing, and says so.
    one = describe_schedule(dataclasses_replace(cfg, o), make_optimizer(o, 32, total_steps=1))
    assert "every step of this run has learning rate 0" in one and "does not change the model" in one, one
    # A schedule shorter than the run (optimizer.decay_steps given): the warm-up ends at its
    # end, the peak is reached, and the rest of the run is at the schedule's last rate.
    line = describe_schedule(dataclasses_replace(cfg, o), plan, run_steps=30)
    assert "warmup over the schedule's 24 steps (of 40 asked)" in line and "before the peak" not in line
    assert f"then {float(plan.schedule(24)):.4g} for the run's last 6 steps" in line
    # The seventeenth walk: "0.005 at batch 32 -> peak 0.005 at global batch 8 (none scaling)".
    flat = OptimizerConfig(learning_rate=0.005, reference_batch=32, scaling="none", warmup_steps=4)
    line = describe_schedule(dataclasses_replace(cfg, flat), make_optimizer(flat, 8, total_steps=24))
    assert line.startswith("learning rate: peak 0.005, not scaled with the batch (optimizer.scaling=none), 4 warmup")
    short = OptimizerConfig(learning_rate=0.003, reference_batch=32, warmup_steps=4, final_lr_fraction=0.1)
    line = describe_schedule(dataclasses_replace(cfg, short), make_optimizer(short, 32, total_steps=24), 30)
    assert line.endswith(
        "4 warmup steps, cosine decay over 20 steps (optimizer.decay_steps=24: warmup and decay), then 0.0003 for the "
        "run's last 6 steps"
    )
    # A schedule that ends at 0 (every preset's): the steps past it run and save, changing nothing.
    to_zero = OptimizerConfig(learning_rate=0.003, reference_batch=32, warmup_steps=4, final_lr_fraction=0.0)
    line = describe_schedule(dataclasses_replace(cfg, to_zero), make_optimizer(to_zero, 32, total_steps=24), 30)
    assert line.endswith(
        "then 0 for the run's last 6 steps (warning: at a rate of 0 they do not change the model; "
        "optimizer.final_lr_fraction sets the end)"
    )


def test_schedule_line_warns_where_the_presets_warmup_takes_most_of_the_run():
    """The seventeenth walk: a 22-step llm run warmed up for 20 steps and decayed over 2, without a word."""
    cfg = load_config("llm")
    line = describe_schedule(cfg, make_optimizer(cfg.optimizer, 32, total_steps=22), 22)
    assert line.endswith(
        "20 warmup steps, cosine decay over 2 steps (optimizer.decay_steps=22: warmup and decay) (warning: the "
        "preset's 20 warmup steps are 91% of this run's 22, which trains mostly below its peak rate; set "
        "optimizer.warmup_steps, e.g. optimizer.warmup_steps=2)"
    ), line
    assert "warning" not in describe_schedule(cfg, make_optimizer(cfg.optimizer, 32, total_steps=40), 40)
    chosen = load_config("llm", ["optimizer.warmup_steps=19"])  # the user's own: said, not warned about
    assert "warning" not in describe_schedule(chosen, make_optimizer(chosen.optimizer, 32, total_steps=22), 22)


def dataclasses_replace(cfg, optimizer):
    import dataclasses

    return dataclasses.replace(cfg, optimizer=optimizer, data=dataclasses.replace(cfg.data, global_batch=32))


def test_data_of_the_wrong_type_names_the_accepted_types():
    with pytest.raises(DataError, match="must be a dict of NumPy arrays .* got a list"):
        as_dataset([np.zeros(3)])


class _Linear(nnx.Module):
    def __init__(self, rngs):
        self.dense = nnx.Linear(4, 2, rngs=rngs)

    def __call__(self, x):
        return self.dense(x)


def _linear_trainer(strategy, loss_fn, **config):
    return xlafit.Trainer(
        _Linear(nnx.Rngs(0)),
        loss_fn,
        optax.sgd(0.1),
        strategy=strategy,
        global_batch=16,
        config=TrainerConfig(epochs=2, log_every_steps=1, **config),
    )


def _per_example(model, batch):
    return optax.softmax_cross_entropy_with_integer_labels(model(batch["x"]), batch["y"])


def _scalar(model, batch):
    return _per_example(model, batch).mean()


def _data(n=70):
    rng = np.random.default_rng(0)
    return {"x": rng.standard_normal((n, 4), dtype=np.float32), "y": rng.integers(0, 2, n, dtype=np.int32)}


def test_scalar_loss_trains_like_per_example_and_evaluation_asks_for_per_example(strategy8, capsys):
    per_example = _linear_trainer(strategy8, _per_example).fit(_data())
    scalar = _linear_trainer(strategy8, _scalar).fit(_data())
    for a, b in zip(jax_leaves(per_example), jax_leaves(scalar), strict=True):
        np.testing.assert_array_equal(a, b)
    # 70 examples at global batch 16: 6 left out per epoch, and the run says so
    assert "each epoch trains on 64 of 70 examples" in capsys.readouterr().out
    # with an eval set, a scalar loss is refused before the first training step
    trainer = _linear_trainer(strategy8, _scalar)
    with pytest.raises(ValueError, match="evaluation needs loss_fn to return one loss per example"):
        trainer.fit(_data(), eval=_data(20))
    assert int(trainer.state.step) == 0


def jax_leaves(result):
    import jax

    return [np.asarray(x) for x in jax.tree.leaves(result.state.params)]


def test_preempted_is_public_with_its_exit_code():
    assert issubclass(xlafit.Preempted, Exception) and xlafit.errors.PREEMPTED == 75


def test_one_name_per_concept():
    import importlib

    # xlafit.train is the subpackage (the run is xlafit.run.train_and_evaluate), so dotted paths resolve
    assert importlib.import_module("xlafit.train.trainer").Trainer is xlafit.Trainer
    assert callable(xlafit.train.losses.masked_mean) and xlafit.train_and_evaluate.__module__ == "xlafit.run"


def test_a_run_from_before_the_cpu_section_resumes_with_a_note(strategy8, tmp_path, caplog, capsys):
    """config.yaml of a run written when the CPU settings were run.* keys (and resnet had
    model.conv): the moved keys are read under their new names, one note each; nothing differs."""
    cfg = _resolved(strategy8, tmp_path)
    _with_checkpoint(tmp_path, cfg)
    old = cfg.to_dict()
    cpu = old.pop("cpu")
    old["run"].update(
        xla_cpu_fast_paths=cpu["fast_paths"],
        xla_cpu_ynn_fusion=cpu["ynn_fusion"],
        cpu_keep_memory=cpu["keep_memory"],
        cpu_async_dispatch=cpu["async_dispatch"],
    )
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(old, sort_keys=False))
    with caplog.at_level("WARNING", logger="xlafit"):
        check_continuation(tmp_path, cfg)
    (note,) = [r.getMessage() for r in caplog.records]  # one line for all of them
    assert note.startswith(f"note: {tmp_path}/config.yaml: run.xla_cpu_fast_paths is now cpu.fast_paths; ")
    assert "run.cpu_keep_memory is now cpu.keep_memory" in note
    assert "changed" not in capsys.readouterr().out  # the same run: no setting reported as changed
    # An override in the old spelling still works, with the same note.
    with caplog.at_level("WARNING", logger="xlafit"):
        assert load_config("mnist", ["run.cpu_keep_memory=false"]).cpu.keep_memory is False
    assert "the overrides: run.cpu_keep_memory is now cpu.keep_memory" in caplog.text


def test_the_progress_bar_closes_at_100_percent_and_what_follows_prints_below_it(monkeypatch, capsys):
    """On a terminal, each line printed past the end used to clear the finished bar and draw
    it again (six 100 % bars for one run)."""
    import sys

    from xlafit.train.report import RunReport

    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    report = RunReport(None, total_steps=4)
    for step in (2, 4):
        report.record({"step": step, "loss": 1.0 / step})
    for line in ("[eval] step 4", "checkpoint saved", "test accuracy: 1.0"):
        report.print(line)
    report.close()
    err = capsys.readouterr().err
    assert err.count("4/4") == 1, err


def test_a_runs_tensorboard_files_are_written_without_importing_torch(tmp_path):
    """tensorboardX imports torch where it is installed (about a second of CPU in every
    `xlafit train` process, for torch tensors a run never logs) and Google Cloud Storage's
    client (for logdirs in a bucket, which xlafit never gives it); the run's writer loads it
    with both hidden, and torch imports as usual afterwards."""
    import subprocess
    import sys

    script = (
        "import sys\n"
        "from xlafit.train.report import RunReport\n"
        f"report = RunReport({str(tmp_path)!r}, total_steps=2)\n"
        "report.record({'step': 2, 'loss': 0.5})\n"
        "report.close()\n"
        "print('torch before:', 'torch' in sys.modules, 'google.cloud.storage' in sys.modules)\n"
        "import torch\n"
        "print('torch after:', torch.ones(2).sum().item())\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    said = [line for line in done.stdout.splitlines() if line.startswith("torch")]
    assert said == ["torch before: False False", "torch after: 2.0"], done.stdout
    assert [p.name.startswith("events.out.tfevents") for p in (tmp_path / "tensorboard").iterdir()] == [True]


def test_cpu_settings_that_cannot_apply_any_more_are_named(strategy8, monkeypatch, caplog):
    """`xlafit.connect()` first (the notebooks' order) starts JAX with the default XLA:CPU
    settings; a recipe run then asked for its own (mnist: cpu.fast_paths=false) and went on
    without them, silently, though its numbers then differ from `xlafit train`'s."""
    from xlafit.parallel import cluster
    from xlafit.platform.cpu import CpuConfig

    monkeypatch.setitem(cluster._APPLIED, "settings", CpuConfig())
    monkeypatch.setattr(cluster, "_WARNED", set())  # what this process said before: said again here
    xlafit.connect(cpu=CpuConfig())  # the same settings: nothing to say
    # nor for settings that change no result (resnet's async_dispatch, the suite's keep_memory)
    xlafit.connect(cpu=CpuConfig(keep_memory=False, async_dispatch=False))
    assert "cannot apply" not in caplog.text
    xlafit.connect(cpu=load_config("mnist").cpu)  # what train_and_evaluate asks for
    assert (
        "this run's XLA:CPU kernels (cpu.fast_paths=false) cannot apply: JAX started earlier in this process with "
        "cpu.fast_paths=true, cpu.ynn_fusion=" in caplog.text
    )
    assert "xlafit.connect(cpu=config.cpu)" in caplog.text
    caplog.clear()  # the fifth walk: a notebook's every stage said it again
    xlafit.connect(cpu=load_config("mnist").cpu)
    assert "cannot apply" not in caplog.text


def test_a_run_directory_of_other_files_is_refused(tmp_path):
    """--run-dir naming a folder of the user's own files wrote the run among them (and
    --restart then moved them all aside with it)."""
    from xlafit.rundir import refuse_foreign_dir

    def check(folder):
        refuse_foreign_dir(load_config("mnist", [f"run.run_dir={folder}"]))

    project = tmp_path / "project"
    (project / "src").mkdir(parents=True)
    for name in ("notes.txt", "a.py", "b.py"):
        (project / name).write_text("the user's")
    with pytest.raises(ConfigError) as e:
        check(project)
    assert str(e.value) == (
        f"--run-dir {project} holds files that are no xlafit run's (a.py, b.py, notes.txt and 1 more): the run would "
        "write its config, metrics and checkpoints among them, and --restart would move them all aside. Give a new "
        f"or empty directory, e.g. --run-dir {project / 'run'}."
    )
    (project / "config.yaml").write_text("recipe: mnist\n")  # a run's: resumed or restarted as before
    check(project)
    # process 1 of a job opens its log there before process 0 writes config.yaml (a race
    # that refused the job's own directory)
    (tmp_path / "job").mkdir()
    (tmp_path / "job" / "process-1.log").write_text("")
    check(tmp_path / "job")
    (tmp_path / "notebook" / ".ipynb_checkpoints").mkdir(parents=True)
    check(tmp_path / "notebook")
    check(tmp_path / "new")


def test_invariant_chunks_say_where_they_are_not_bit_identical(caplog, monkeypatch):
    """trainer.invariant_chunks promised bit-identical runs on any device count for every
    recipe; the llm recipe's end with other parameters on 1 and 8 devices (XLA rounds some
    per-chunk gradients differently in the two programs), and YNNPACK's CPU kernels round per
    layout. A run says so; the mnist preset (checked bit for bit, cpu.fast_paths=false) does not."""
    from xlafit.recipes import get_recipe
    from xlafit.run import warn_where_chunks_are_not_bit_identical

    def said(recipe, *overrides):
        caplog.clear()
        with caplog.at_level("WARNING", logger="xlafit"):
            warn_where_chunks_are_not_bit_identical(get_recipe(recipe), load_config(recipe, list(overrides)))
        return [r.getMessage() for r in caplog.records]

    assert said("mnist") == []  # the preset: invariant_chunks=8, cpu.fast_paths=false
    assert said("llm", "cpu.fast_paths=false") == []  # no invariant_chunks: nothing promised
    (llm,) = said("llm", "trainer.invariant_chunks=8", "cpu.fast_paths=false")
    assert llm.startswith("warning: trainer.invariant_chunks=8 sums the gradients in one fixed order, but the llm")
    assert "agree to float rounding" in llm and "docs/explanations/determinism.md" in llm
    (fast,) = said("mnist", "cpu.fast_paths=true")
    assert "cpu.fast_paths=true: YNNPACK's CPU kernels round differently per device layout" in fast
    assert "set cpu.fast_paths=false for bit-identical runs" in fast
    assert len(said("llm", "trainer.invariant_chunks=8")) == 2  # the llm preset keeps YNNPACK on
    # JAX 0.12's XLA:CPU rounds the MNIST CNN apart on 1 x 8 and 2 x 4 devices (the eleventh walk:
    # other parameters after an epoch, and no word of it).
    monkeypatch.setattr(jax, "__version__", "0.12.0.1")
    (newer,) = said("mnist")
    assert newer.startswith("warning: trainer.invariant_chunks=8: JAX 0.12.0.1's XLA:CPU rounds a per-chunk")
    assert "agree to float rounding, not bit for bit (they do on the JAX the suite pins, 0.10" in newer


def test_the_final_report_names_the_step_of_an_evaluation_made_before_the_stop(
    strategy8, tmp_path, monkeypatch, capsys
):
    """Issue 63's walk: a run stopped by trainer.stop_at_step between evaluations printed the
    last evaluation (an earlier step's model) as its "test:" line, as if of the model it
    stopped with. It names the step it evaluated; a run that evaluates at its stop does not."""
    use_few_digits(monkeypatch)  # 400 digits: 3 steps an epoch at global batch 128
    common = [f"run.run_dir={tmp_path}", "data.global_batch=128", "trainer.epochs=4"]
    xlafit.train_and_evaluate(load_config("mnist", [*common, "trainer.stop_at_step=4"]))
    last = capsys.readouterr().out.splitlines()
    report = next(line for line in last if line.startswith("test"))
    assert report.startswith("test (the last evaluation, at step 3; the run stopped at step 4): accuracy="), report
    xlafit.train_and_evaluate(load_config("mnist", [*common, "trainer.stop_at_step=6"]))
    report = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("test"))
    assert report.startswith("test: accuracy="), report


def test_the_perplexity_line_names_the_step_of_its_model_too():
    """The fourth walk: under a `test (the last evaluation, at step 4; the run stopped at step 5)`
    line, `perplexity:` stood unqualified, as if of the model the run stopped with."""
    from xlafit.run import final_report

    metrics = {"loss": 1.0, "token_accuracy": 0.5, "count": 2}
    early = final_report(metrics, at=4, last=5, unit="rows").splitlines()
    assert early[-1] == "perplexity (of the model at step 4): 2.72", early
    assert final_report(metrics, at=5, last=5, unit="rows").splitlines()[-1] == "perplexity: 2.72"


def test_the_last_epoch_is_evaluated_when_the_epochs_are_no_multiple_of_the_evaluation_period(
    strategy8, tmp_path, monkeypatch, capsys
):
    """The third walk: with trainer.epochs=3 and trainer.eval_every_epochs=2 the run evaluated at
    epoch 2 only, and its "test:" line and perplexity reported that epoch's model, not the one it
    ended with (and exported). The last epoch is evaluated too, as the setting's comment says."""
    use_few_digits(monkeypatch)  # 400 digits: 3 steps an epoch at global batch 128
    xlafit.train_and_evaluate(
        load_config("mnist", [f"run.run_dir={tmp_path}", "data.global_batch=128", "trainer.epochs=3",
                              "trainer.eval_every_epochs=2"])
    )  # fmt: skip
    out = capsys.readouterr().out
    report = next(line for line in out.splitlines() if line.startswith("test"))
    assert report.startswith("test: accuracy="), report  # step 9's model: no "(the last evaluation, at step 6 ...)"
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["split"] == "eval"] == [6, 9]  # the periodic one, the final one


def test_local_paths_are_recorded_absolute_and_compare_equal_however_given(strategy8, tmp_path, monkeypatch):
    """The fourth walk: a resume with `--data-dir` given absolute where the run was started with it
    relative was announced as a changed setting (so was --run-dir), and from another directory
    the recorded relative path named nothing. config.yaml records them absolute."""
    from xlafit.rundir import recorded

    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").mkdir()
    (tmp_path / "runs" / "r").mkdir(parents=True)
    tree = {"data": {"data_dir": "data", "tokenizer": "org/name"}, "run": {"run_dir": "runs/r"}, "model": {}}
    assert recorded(tree) == {
        "data": {"data_dir": str(tmp_path / "data"), "tokenizer": "org/name"},  # a hub id stays one
        "run": {"run_dir": str(tmp_path / "runs" / "r")},
        "model": {},
    }
    assert tree["data"]["data_dir"] == "data"  # the config itself is left as given
    # the seventh walk: a --restart run recorded run.resume: false, and its config.yaml given back
    # with --config started it over (moving its checkpoints aside) instead of going on
    assert recorded({"run": {"resume": False, "run_dir": "runs/r"}})["run"]["resume"] is True


def test_a_run_without_evaluation_data_is_not_asked_for_an_eval_batch_that_splits(strategy8):
    """The fourth walk: data.eval_fraction=0 with --simulate 3 was refused until the eval batch
    (64) was a multiple of 3, for an evaluation that would not run; the run takes its global batch."""
    cfg = load_config("llm", ["data.eval_global_batch=12"])  # 12 does not split over 8 devices
    with pytest.raises(ConfigError, match=r"data.eval_global_batch=12 does not divide evenly over 8 devices"):
        resolve(cfg, strategy8, 1000)
    resolved, run = resolve(cfg, strategy8, 1000, evaluates=False)
    assert resolved.data.eval_global_batch == run.eval_batch == resolved.data.global_batch == 32


def test_a_finished_run_run_again_prints_no_schedule_it_will_not_follow(strategy8, tmp_path, monkeypatch, capsys):
    """The sixth and seventh walks: a finished run's command run again printed its warm-up
    warning ("the run ends before the peak") above "the run is finished": it trains nothing."""
    use_few_digits(monkeypatch)  # 400 digits: 3 steps an epoch at global batch 128
    common = [f"run.run_dir={tmp_path}", "data.global_batch=128", "trainer.epochs=1", "optimizer.warmup_steps=20"]
    xlafit.train_and_evaluate(load_config("mnist", common))
    assert "20 warmup steps, more than the schedule's 3" in capsys.readouterr().out
    xlafit.train_and_evaluate(load_config("mnist", common))
    out = capsys.readouterr().out
    assert "the run is finished: checkpoint 3 is its last step" in out and "warmup steps" not in out, out
    assert "steps: " not in out, out  # the twenty-third walk: "steps: 3/epoch x 1 epochs = 3" though none trains


def test_a_run_in_a_directory_made_for_it_says_how_to_go_on_after_its_stop(strategy8, tmp_path, monkeypatch, capsys):
    """The eighth walk: without --run-dir, a run stopped at trainer.stop_at_step said "to go on,
    run again with a later trainer.stop_at_step", and doing so started over from step 0 in
    another new directory (a notebook's cell run again the same). It names the directory."""
    use_few_digits(monkeypatch)  # 400 digits: 3 steps an epoch at global batch 128
    monkeypatch.chdir(tmp_path)
    common = ["data.global_batch=128", "trainer.epochs=2"]
    xlafit.train_and_evaluate(load_config("mnist", [*common, "trainer.stop_at_step=2"]))
    (made,) = (tmp_path / "runs").iterdir()
    line = capsys.readouterr().out.splitlines()[-1]
    assert line == (
        f"Run again with --run-dir runs/{made.name} (run.run_dir=runs/{made.name}) to go on: the same command would "
        "start a new run."
    )
    result = xlafit.train_and_evaluate(load_config("mnist", [*common, f"run.run_dir=runs/{made.name}"]))
    assert "resumed from checkpoint 2" in capsys.readouterr().out and int(result.state.step) == 6
    xlafit.train_and_evaluate(
        load_config("mnist", [*common, f"run.run_dir={tmp_path / 'named'}", "trainer.stop_at_step=1"])
    )
    assert "the same command would start a new run" not in capsys.readouterr().out


def test_a_write_error_in_a_directory_made_for_the_run_names_it_to_go_on():
    """A full disk under a run without --run-dir said "then run the same command again to
    resume", which starts a new run: within the run, each stop's hint names the directory."""
    import errno

    from xlafit.errors import going_on_with, write_failed
    from xlafit.run import how_to_go_on

    full = OSError(errno.ENOSPC, "No space left on device")
    with going_on_with(how_to_go_on("runs/mnist-1")):
        said = str(write_failed("runs/mnist-1/metrics.jsonl", full))
    assert said.endswith("Free disk space, then run again with --run-dir runs/mnist-1 to go on: the same command "
                         "would start a new run."), said  # fmt: skip
    assert str(write_failed("runs/a/metrics.jsonl", full)).endswith("then run the same command again to resume.")


def test_a_signal_to_a_run_in_a_directory_made_for_it_names_the_directory_to_go_on(strategy8, tmp_path, monkeypatch):
    """A run without --run-dir stopped by SIGTERM or Ctrl-C said "Run the same command again
    to resume", and the same command started over from step 0 in another new directory. The
    stop names the directory, as a stop at trainer.stop_at_step does."""
    import os
    import signal

    from xlafit import run as run_module
    from xlafit.errors import Preempted

    use_few_digits(monkeypatch)  # 400 digits: 3 steps an epoch at global batch 128
    monkeypatch.chdir(tmp_path)

    class Interrupting:
        """The training data, with SIGINT to this process at its second batch."""

        def __init__(self, data):
            self.data, self.takes = data, 0

        def __getattr__(self, name):
            return getattr(self.data, name)

        def __len__(self):
            return len(self.data)

        def take(self, indices, epoch=0):
            self.takes += 1
            if self.takes == 2:
                os.kill(os.getpid(), signal.SIGINT)
            return self.data.take(indices, epoch)

    wrapped = []

    def interrupting(data):
        data = as_dataset(data)
        if not wrapped:  # the training data: the first the run reads
            wrapped.append(Interrupting(data))
            return wrapped[0]
        return data

    monkeypatch.setattr(run_module, "as_dataset", interrupting)
    with pytest.raises(Preempted) as stop:
        xlafit.train_and_evaluate(load_config("mnist", ["data.global_batch=128", "trainer.epochs=2"]))
    (made,) = (tmp_path / "runs").iterdir()
    assert f"stopped at step {stop.value.step}" in str(stop.value)
    assert f"Run again with --run-dir runs/{made.name} (run.run_dir=runs/{made.name}) to go on" in str(stop.value)
    assert "Run the same command again" not in str(stop.value)


def test_a_resume_marks_the_steps_after_its_checkpoint_for_tensorboard_to_drop(tmp_path):
    """metrics.jsonl drops the records a killed run logged after its last checkpoint; its
    TensorBoard event files kept them beside the resumed run's (steps 21-24 twice after a
    kill at 25 and a resume from 20). The resumed run's event file starts with TensorBoard's
    restart marker at the first step it logs again, as torch's SummaryWriter(purge_step=)."""
    import struct

    from tensorboardX.proto.event_pb2 import Event, SessionLog

    from xlafit.train.report import RunReport

    def events(path):  # TFRecord: length, its CRC, the Event, its CRC
        data, at, found = path.read_bytes(), 0, []
        while at < len(data):
            (n,) = struct.unpack("<Q", data[at : at + 8])
            found.append(Event.FromString(data[at + 12 : at + 12 + n]))
            at += 12 + n + 4
        return found

    first = RunReport(tmp_path, total_steps=40)
    for step in range(1, 26):
        first.record({"step": step, "loss": 1.0 / step})
    first.close()
    (killed,) = (tmp_path / "tensorboard").iterdir()
    assert not any(e.HasField("session_log") for e in events(killed))  # a run from step 0 marks nothing
    time.sleep(1.1)  # an event file's name holds the second it was made in
    resumed = RunReport(tmp_path, total_steps=40, start_step=20)
    resumed.record({"step": 21, "loss": 0.5})
    resumed.close()
    (new,) = [p for p in (tmp_path / "tensorboard").iterdir() if p != killed]
    marks = [(e.step, e.session_log.status) for e in events(new) if e.HasField("session_log")]
    assert marks == [(21, SessionLog.START)]
