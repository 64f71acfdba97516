"""The resnet recipe end to end through the command: a pulse on a tiny prepared image folder
(Grain workers decoding PNG and JPEG files), kill -9 at random moments then resume (the end
state has the fingerprint of an uninterrupted run), and the synthetic source.

The demo's own promise (the 5,000 MNIST digits, >= 0.97 in under 4 minutes on 2 cores) is
measured in BENCHMARKS.md ("ResNet demo"); it takes too long for the suite.
"""

import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import yaml
from PIL import Image

from helpers import long_form
from xlafit.checkpoint import Checkpointer
from xlafit.checkpoint import fingerprint as checkpoint_fingerprint
from xlafit.data.images import prepare

XLAFIT = [sys.executable, "-m", "xlafit"]
KILL_LOOPS = int(os.environ.get("XLAFIT_KILL_LOOPS", "1"))  # XLAFIT_KILL_LOOPS=20: the long version


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    cache = tmp_path_factory.mktemp("cache")
    return {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"} | {
        "PYTHONUNBUFFERED": "1",
        "XLAFIT_CACHE": str(cache),
    }


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    """Three classes of 24 small images each (a bright square whose corner says the class), prepared."""
    root = tmp_path_factory.mktemp("images")
    rng = np.random.default_rng(0)
    for label, name in enumerate(("a", "b", "c")):
        (root / "in" / name).mkdir(parents=True)
        for i in range(24):
            pixels = rng.integers(0, 60, (16, 16, 3), dtype=np.uint8)
            y, x = (label // 2) * 8, (label % 2) * 8
            pixels[y : y + 8, x : x + 8] = 220
            Image.fromarray(pixels).save(root / "in" / name / f"{i}.{'jpg' if i % 3 == 0 else 'png'}")
    prepare(root / "in", str(root / "out"), eval_fraction=0.25, workers=1)
    return root / "out"


def train_cmd(run_dir, shards, *extra):
    return [
        *XLAFIT,
        *("train", "resnet", "--simulate", "2", "--data-dir", str(shards), "--run-dir", str(run_dir)),
        *("model.width=4", "data.image_size=12", "data.global_batch=8", "data.eval_global_batch=16"),
        *("data.workers=2", "trainer.epochs=1", "trainer.log_every_steps=1", "trainer.checkpoint_every_steps=1"),
        *extra,
    ]


class Segment:
    """One run of the training command whose output is watched for step 3's train line."""

    def __init__(self, cmd, env):
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        self.lines: list[str] = []
        self.training = threading.Event()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self):
        for line in self.proc.stdout:
            self.lines.append(line)
            if line.startswith("[train] step 3 "):  # checkpoint 2 is written by now
                self.training.set()
        self.training.set()  # the process ended

    def finish(self, timeout=300):
        rc = self.proc.wait(timeout=timeout)
        self._reader.join(timeout=10)
        return rc


def fingerprint(run_dir):
    ckpt = Checkpointer(str(run_dir / "checkpoints"))
    try:
        infos = ckpt.list()
        assert all(i.usable for i in infos), infos
        step = infos[-1].step
        return step, checkpoint_fingerprint(ckpt.restore_params(step))
    finally:
        ckpt.close()


@long_form(65, "test_images.py's resume with 1 and 3 grain workers and test_preemption.py's kill -9 loop")
def test_resnet_pulse_then_kill_9_with_grain_workers_and_resume_equals_uninterrupted(tmp_path, shards, env):
    reference = tmp_path / "uninterrupted"
    out = subprocess.run(train_cmd(reference, shards), capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "train step compiled 1 time(s), eval step 1 time(s)" in out.stdout
    assert 0.0 <= float(out.stdout.split("test accuracy: ")[1].split()[0]) <= 1.0
    records = [json.loads(line) for line in (reference / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["split"] == "train"]
    assert len(train) == 7 and all("input_wait_s" in r for r in train)  # 57 images: 7 steps of 8
    assert np.isfinite([r["loss"] for r in train]).all()
    cfg = yaml.safe_load((reference / "config.yaml").read_text())
    # What the data and the preset decided is recorded: a resume checks against it.
    assert cfg["data"]["num_classes"] == 3 and cfg["data"]["image_size"] == 12
    assert cfg["data"]["normalisation"] == "imagenet" and cfg["model"]["small_stem"] is True

    rng = random.Random(1)
    run_dir = tmp_path / "killed"
    for _ in range(KILL_LOOPS):
        seg = Segment(train_cmd(run_dir, shards), env)
        assert seg.training.wait(timeout=120), "no progress"
        time.sleep(rng.uniform(0.0, 0.6))  # a checkpoint every step: often mid-save, workers mid-batch
        if seg.proc.poll() is not None:
            assert seg.finish() == 0, "".join(seg.lines)[-3000:]
            break
        seg.proc.send_signal(signal.SIGKILL)
        assert seg.finish() == -signal.SIGKILL
    seg = Segment(train_cmd(run_dir, shards), env)
    assert seg.finish() == 0, "".join(seg.lines)[-3000:]
    assert "resumed from checkpoint" in "".join(seg.lines), "".join(seg.lines)
    want = fingerprint(reference)
    assert want[0] == 7 and fingerprint(run_dir) == want


def test_synthetic_source_and_the_imagenet_preset_resolve_without_files():
    """``model.preset=resnet50 data.source=synthetic``: ImageNet's shapes and the preset's sizes,
    with no file read (tests/test_resnet.py trains a synthetic run end to end)."""
    from xlafit.recipes import load_config
    from xlafit.recipes.resnet import from_data, load_data, normalisation, resnet_config

    cfg = load_config("resnet", ["model.preset=resnet50", "data.source=synthetic", "data.synthetic_examples=64"])
    train, evaluation = load_data(cfg)
    batch = train.take(np.arange(4))
    assert batch["image"].shape == (4, 224, 224, 3) and batch["image"].dtype == np.uint8
    cfg = from_data(cfg, train)
    assert (cfg.data.global_batch, cfg.data.image_size, cfg.data.num_classes) == (1024, 224, 1000)
    assert (cfg.data.crop_scale_min, cfg.data.hflip, cfg.data.eval_crop_fraction) == (0.08, True, 0.875)
    assert (cfg.model.width, cfg.model.small_stem, cfg.model.zero_init_residual) == (64, False, True)
    # Goyal et al.'s SGD: Nesterov momentum, weight decay on the kernels only (not on biases
    # and batch-norm parameters; which leaves that is: tests/test_optim.py)
    assert (cfg.optimizer.name, cfg.optimizer.nesterov, cfg.optimizer.weight_decay_on) == ("sgd", True, "matrices")
    net = resnet_config(cfg, cfg.data.num_classes, 3)
    assert net.depths == (3, 4, 6, 3) and net.bottleneck and normalisation(cfg) == "imagenet"


def test_a_run_from_before_model_conv_went_resumes_with_a_note(tmp_path, caplog, capsys):
    """A resnet run's config.yaml (or a user's override) with model.conv, the setting that chose
    oneDNN's convolutions: dropped with one note, nothing reported as changed, nothing refused."""
    from xlafit.recipes import load_config
    from xlafit.run import check_continuation

    cfg = load_config("resnet", [f"run.run_dir={tmp_path}"])
    old = cfg.to_dict()
    old["model"]["conv"] = "auto"
    cpu = old.pop("cpu")
    old["run"].update(
        {
            "xla_cpu_fast_paths": cpu["fast_paths"],
            "xla_cpu_ynn_fusion": cpu["ynn_fusion"],
            "cpu_keep_memory": cpu["keep_memory"],
            "cpu_async_dispatch": cpu["async_dispatch"],
        }
    )
    (tmp_path / "checkpoints" / "7").mkdir(parents=True)
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(old, sort_keys=False))
    with caplog.at_level("WARNING", logger="xlafit"):
        check_continuation(tmp_path, cfg)
    (note,) = [r.getMessage() for r in caplog.records]
    assert note.startswith(f"note: {tmp_path}/config.yaml: run.xla_cpu_fast_paths is now cpu.fast_paths; ")
    assert "run.cpu_async_dispatch is now cpu.async_dispatch" in note
    assert note.endswith("model.conv (ResNet's convolutions are XLA's on every platform): no longer a setting, ignored")
    assert "changed" not in capsys.readouterr().out
    caplog.clear()
    with caplog.at_level("WARNING", logger="xlafit"):
        assert load_config("resnet", ["model.conv=xla"]).model == cfg.model
    assert "the overrides: model.conv (ResNet's convolutions are XLA's on every platform)" in caplog.text


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["model.bn_group=4"], "model.bn_group=4 does not divide the 2 examples each device normalises at a time"),
        (["model.bn_group=3", "data.per_device_batch=8"], "use one of [1, 2, 4, 8] or a larger batch"),
        (
            ["model.bn_group=8", "data.per_device_batch=8", "trainer.accumulate_steps=2"],
            "the 4 examples each device normalises at a time (data.per_device_batch=8, trainer.accumulate_steps=2)",
        ),
        (
            ["model.bn_group=4", "data.per_device_batch=8", "data.global_batch=64", "trainer.invariant_chunks=32"],
            "the 2 examples each device normalises at a time (data.per_device_batch=8, trainer.invariant_chunks=32)",
        ),
        (
            ["model.bn=global", "model.bn_group=null", "trainer.invariant_chunks=8"],
            "model.bn=global normalises with the whole batch's statistics, but trainer.invariant_chunks=8",
        ),
        (
            ["model.bn=global", "model.bn_group=null", "data.per_device_batch=8", "trainer.accumulate_steps=2"],
            "but trainer.accumulate_steps=2 runs the model on one micro-batch at a time",
        ),
    ],
)
def test_batch_norm_settings_the_batch_cannot_honour_are_refused_by_name(overrides, message):
    """Before: a group larger than the per-device batch but dividing the global one trained
    silently with groups spanning devices; one dividing neither failed inside the traced
    model with a raw ValueError naming the global batch. bn=global with invariant chunks
    normalised each chunk alone, and with accumulation each micro-batch alone."""
    from xlafit.errors import ConfigError
    from xlafit.recipes import load_config
    from xlafit.recipes.resnet import build_model, check_bn_group, from_data, load_data

    base = ["data.source=synthetic", "data.synthetic_examples=64", "data.image_size=16", "model.preset=resnet18"]
    cfg = load_config("resnet", [*base, "model.width=4", "model.bn=local", "data.per_device_batch=2", *overrides])
    train, _ = load_data(cfg)
    cfg = from_data(cfg, train)
    with pytest.raises(ConfigError) as e:
        build_model(cfg, train)
    assert message in str(e.value)
    ok = load_config("resnet", [*base, "model.bn=local", "model.bn_group=4", "data.per_device_batch=8"])
    check_bn_group(from_data(ok, train))  # 4 divides 8
    unresolved = load_config("resnet", [*base, "model.bn=local", "model.bn_group=4"])  # no per-device batch yet
    check_bn_group(from_data(unresolved, train))


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("model.label_smoothing=1.5", "model.label_smoothing=1.5 must lie in [0, 1)"),
        ("model.width=0", "model: width=0 must be positive"),
        ("trainer.accumulate_steps=2", "trainer.accumulate_steps=2 runs the model on one micro-batch at a time"),
    ],
)
def test_model_settings_are_refused_before_any_data_is_read(tmp_path, override, message):
    """A review found these errors raised after the data was loaded (ImageNet's first read
    copies and checks about 140 GB) and the run directory written."""
    from xlafit.errors import ConfigError
    from xlafit.recipes import load_config
    from xlafit.run import train_and_evaluate

    missing = tmp_path / "not-prepared-yet"
    overrides = [f"data.data_dir={missing}", "model.preset=resnet18", override, f"run.run_dir={tmp_path / 'run'}"]
    with pytest.raises(ConfigError, match=re.escape(message)):
        train_and_evaluate(load_config("resnet", overrides))
    assert not (tmp_path / "run").exists()


def test_an_exported_run_names_its_classes_and_prepares_images_as_its_evaluation(tmp_path, shards):
    """``xlafit export hf`` of a run on an image folder: ``id2label`` holds the folder's class
    names (recorded in the run's classes.json) and ``preprocessor_config.json`` makes Hugging
    Face's image processor give the pixels xlafit's evaluation transform gives, so
    ``pipeline("image-classification")`` works on image files as they are."""
    transformers = pytest.importorskip("transformers")
    from PIL import Image

    from xlafit.data.images import Augment
    from xlafit.export import export_hf
    from xlafit.recipes import load_config
    from xlafit.run import train_and_evaluate

    overrides = [f"data.data_dir={shards}", "data.image_size=12", "data.eval_crop_fraction=1.0", "data.workers=0"]
    overrides += ["data.global_batch=8", "model.preset=resnet18", "model.width=4", "trainer.epochs=1"]
    train_and_evaluate(load_config("resnet", [*overrides, f"run.run_dir={tmp_path / 'run'}"]))
    assert json.loads((tmp_path / "run" / "classes.json").read_text()) == ["a", "b", "c"]
    out, *_ = export_hf(tmp_path / "run", tmp_path / "hf")

    hf_config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert hf_config["id2label"] == {"0": "a", "1": "b", "2": "c"}
    processor = transformers.AutoImageProcessor.from_pretrained(out)
    photo = shards.parent / "in" / "b" / "1.png"
    theirs = processor(images=Image.open(photo), return_tensors="np")["pixel_values"][0]  # [C, H, W]
    ours = Augment(image_size=12, train=False, eval_crop_fraction=1.0, channels=3)(photo.read_bytes(), 0, 0)
    mean, std = np.array([0.485, 0.456, 0.406]), np.array([0.229, 0.224, 0.225])  # the run's "imagenet"
    np.testing.assert_allclose(theirs.transpose(1, 2, 0), (ours / 255.0 - mean) / std, atol=1e-5)
    classify = transformers.pipeline("image-classification", model=out)
    assert {r["label"] for r in classify(str(photo), top_k=3)} == {"a", "b", "c"}


def test_data_with_no_evaluation_images_trains_without_evaluation(tmp_path, caplog, capsys):
    """One folder prepared with the default ``--eval-fraction 0``: the run trains and says why it
    does not evaluate (it raised a bare StopIteration compiling the eval step). In this process:
    the train command's subprocesses are tested above."""
    from xlafit.recipes import load_config
    from xlafit.run import train_and_evaluate

    rng = np.random.default_rng(1)
    for name in ("a", "b"):
        (tmp_path / "in" / name).mkdir(parents=True)
        for i in range(8):
            Image.fromarray(rng.integers(0, 256, (10, 10, 3), dtype=np.uint8)).save(tmp_path / "in" / name / f"{i}.png")
    prepare(tmp_path / "in", str(tmp_path / "out"), workers=1)
    overrides = [
        *(f"data.data_dir={tmp_path / 'out'}", f"run.run_dir={tmp_path / 'run'}", "model.width=4"),
        *("data.image_size=12", "data.global_batch=8", "data.workers=0", "trainer.epochs=1"),
        "trainer.log_every_steps=1",
    ]
    train_and_evaluate(load_config("resnet", overrides))
    assert "holds no evaluation images, so this run trains without evaluation" in caplog.text
    assert "--eval-fraction 0.05" in caplog.text
    # The twenty-fourth walk: the data line, and the demo preset on your images said before training
    assert "warning: model.preset=demo on your images: the MNIST demo's settings" in caplog.text
    captured = capsys.readouterr()
    assert "data: " + str(tmp_path / "out") + ": 16 images of 2 classes, 3 channel(s), trained at 12 px" in captured.err
    out = captured.out
    assert "[train] step 2 " in out and "[eval]" not in out
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["split"] == "train"] == [1, 2]
    assert not [r for r in records if r["split"] == "eval"]


@pytest.mark.parametrize("size", ["0", "-5"])
def test_an_image_size_below_one_is_refused_by_name(size):
    from xlafit.errors import ConfigError
    from xlafit.recipes import load_config
    from xlafit.recipes.resnet import load_data

    cfg = load_config("resnet", [f"data.image_size={size}", "data.source=synthetic"])
    with pytest.raises(ConfigError, match=rf"data.image_size={size} must be at least 1"):
        load_data(cfg)


def test_a_run_knows_the_data_it_trained_on_and_is_scored_on_a_folder_held_out_whole(tmp_path, shards, caplog):
    """The twenty-fourth walk. A data directory prepared again in place (the same path, other
    images or another split) was resumed on and scored as the run's "own evaluation split"
    without a word (15 of 22 such images had been trained on); and a folder of new images could
    not be scored (--eval-fraction 1 was refused). The run keeps its data's shards
    (data_shards.json): a resume or a score on data prepared again is refused, naming it;
    --eval-fraction 1 holds every image out, for xlafit eval --data; data with other classes
    is named with both lists."""
    import shutil

    from xlafit.errors import ConfigError
    from xlafit.recipes import load_config
    from xlafit.run import train_and_evaluate
    from xlafit.run_eval import evaluate_run

    data = tmp_path / "data"
    shutil.copytree(shards, data)
    overrides = [
        *(f"data.data_dir={data}", f"run.run_dir={tmp_path / 'run'}", "model.width=4", "data.image_size=12"),
        *("data.global_batch=8", "data.workers=0", "trainer.epochs=1", "trainer.stop_at_step=2"),
    ]
    train_and_evaluate(load_config("resnet", overrides))
    assert (tmp_path / "run" / "data_shards.json").exists()
    prepare(shards.parent / "in", str(data), eval_fraction=0.25, seed=1, workers=1, overwrite=True)  # in place
    with pytest.raises(ConfigError, match=r"cannot resume .*data_shards.json differs from this run's prepared images"):
        train_and_evaluate(load_config("resnet", overrides))
    with pytest.raises(ConfigError, match=r"cannot score .* on its own evaluation data: its data_shards.json differs"):
        evaluate_run(str(tmp_path / "run"))
    # every image held out: a folder to score the run on, all of it
    prepare(shards.parent / "in", str(tmp_path / "all"), eval_fraction=1.0, workers=1)
    (score,) = evaluate_run(str(tmp_path / "run"), data=str(tmp_path / "all"))
    assert score.step == 2 and score.metrics["count"] == 72
    # other classes: both lists named
    (tmp_path / "two").mkdir()
    for name in ("a", "b"):
        shutil.copytree(shards.parent / "in" / name, tmp_path / "two" / name)
    prepare(tmp_path / "two", str(tmp_path / "two-out"), eval_fraction=1.0, workers=1)
    with pytest.raises(ConfigError, match=r"does not fit .*the run's: \[\"a\", \"b\", \"c\"\]; now: \[\"a\", \"b\"\]"):
        evaluate_run(str(tmp_path / "run"), data=str(tmp_path / "two-out"))


def test_a_class_with_no_held_out_image_is_said(tmp_path, caplog):
    rng = np.random.default_rng(2)
    for name, count in (("big", 30), ("rare", 2)):
        (tmp_path / "in" / name).mkdir(parents=True)
        for i in range(count):
            Image.fromarray(rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)).save(tmp_path / "in" / name / f"{i}.png")
    # seed 0 draws one image of "big" and none of "rare" (the draw is a hash of each file's name and the seed)
    manifest = prepare(tmp_path / "in", str(tmp_path / "out"), eval_fraction=0.1, seed=0, workers=1)
    assert "held out no image of the class(es) rare" in caplog.text
    assert manifest["splits"]["eval"]["classes"] == 1 and manifest["splits"]["train"]["classes"] == 2


def test_an_export_normalises_each_channel_as_the_model_did(tmp_path, shards, capsys):
    """The twenty-fourth walk: colour images trained with data.normalisation=mnist (one mean,
    repeated per channel by the model) exported a one-value mean, on which transformers'
    pipeline failed; greyscale images exported ImageNet's three values for a one-channel model.
    The processor normalises each channel as the model did; a greyscale model's export says how
    to give it one channel (transformers' processors give three)."""
    transformers = pytest.importorskip("transformers")

    from xlafit.export import export_hf
    from xlafit.recipes import load_config
    from xlafit.run import train_and_evaluate

    common = ["model.small_stem=false", "model.width=4", "data.image_size=12", "data.global_batch=8", "data.workers=0"]
    common += ["trainer.stop_at_step=1"]
    settings = [f"data.data_dir={shards}", f"run.run_dir={tmp_path / 'rgb'}", "data.normalisation=mnist", *common]
    train_and_evaluate(load_config("resnet", settings))
    export_hf(tmp_path / "rgb", tmp_path / "rgb-hf")
    processor = json.loads((tmp_path / "rgb-hf" / "preprocessor_config.json").read_text())
    assert processor["image_mean"] == pytest.approx([0.1307] * 3)
    assert processor["image_std"] == pytest.approx([0.3081] * 3)
    classify = transformers.pipeline("image-classification", model=str(tmp_path / "rgb-hf"))
    assert len(classify(str(shards.parent / "in" / "a" / "1.png"), top_k=3)) == 3

    rng = np.random.default_rng(4)
    for name in ("a", "b"):
        (tmp_path / "grey" / name).mkdir(parents=True)
        for i in range(8):
            pixels = rng.integers(0, 256, (10, 10), dtype=np.uint8)
            Image.fromarray(pixels, "L").save(tmp_path / "grey" / name / f"{i}.png")
    prepare(tmp_path / "grey", str(tmp_path / "grey-out"), workers=1)
    settings = [f"data.data_dir={tmp_path / 'grey-out'}", f"run.run_dir={tmp_path / 'g'}", *common]
    train_and_evaluate(load_config("resnet", settings))
    capsys.readouterr()
    export_hf(tmp_path / "g", tmp_path / "g-hf")
    assert "the model takes single-channel (greyscale) images" in capsys.readouterr().out
    processor = json.loads((tmp_path / "g-hf" / "preprocessor_config.json").read_text())
    assert (
        len(processor["image_mean"]) == 1
        and json.loads((tmp_path / "g-hf" / "config.json").read_text())["num_channels"] == 1
    )
