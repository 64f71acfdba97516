"""The image pipeline: ImageFolder -> shards + manifest, checksums, deterministic augmentation,
Grain worker processes (the same batches for any worker count), damaged images."""

import contextlib
import hashlib
import io
import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import psutil
import pytest
from PIL import Image

from helpers import long_form
from xlafit.cli import main
from xlafit.data.dataset import StreamedDataset
from xlafit.data.images import Augment, ImageDataset, SyntheticImages, find_images, load_split, prepare
from xlafit.data.images.cache import ImageSplit
from xlafit.data.loader import TakeRequests, TrainOrder, eval_batches
from xlafit.errors import DataError


def write_folder(root: Path, classes=("cat", "dog", "eel"), per_class=6, seed=0) -> Path:
    """An ImageFolder of random RGB images of varied sizes, JPEG and PNG mixed."""
    rng = np.random.default_rng(seed)
    for c in classes:
        (root / c).mkdir(parents=True)
        for i in range(per_class):
            pixels = rng.integers(0, 256, (20 + 3 * i, 30 - i, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(root / c / f"{i}.{'png' if i % 2 else 'jpg'}")
    return root


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XLAFIT_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_prepare_writes_shards_with_checksums_and_names_a_corrupt_image(tmp_path, cache):
    folder = write_folder(tmp_path / "in")
    (folder / "dog" / "broken.jpg").write_bytes(b"\xff\xd8\xff\xe0 not really a jpeg")
    manifest = prepare(folder, str(tmp_path / "out"), eval_fraction=0.25, shard_size=5, workers=1)

    assert manifest["classes"] == ["cat", "dog", "eel"] and manifest["channels"] == 3
    train, evaluation = manifest["splits"]["train"], manifest["splits"]["eval"]
    assert train["examples"] + evaluation["examples"] == 18  # the broken file is left out...
    assert train["skipped"] == [{"file": "dog/broken.jpg", "error": "OSError: Truncated File Read"}]
    assert 0 < evaluation["examples"] < 9
    for shard in train["shards"]:  # ...and every shard's checksum is the file's
        assert hashlib.sha256((tmp_path / "out" / shard["path"]).read_bytes()).hexdigest() == shard["sha256"]
    assert [s["examples"] for s in train["shards"]][:-1] == [5] * (len(train["shards"]) - 1)
    assert json.loads((tmp_path / "out" / "manifest.json").read_text()) == manifest

    images, _ = load_split(str(tmp_path / "out"), "train")
    assert len(images) == train["examples"]
    name = images.file(0)
    assert images.encoded(0) == (folder / name).read_bytes()  # stored as encoded, not decoded
    assert images.labels[0] == ["cat", "dog", "eel"].index(name.split("/")[0])

    with pytest.raises(DataError, match=r"dog/broken.jpg cannot be decoded .*--on-corrupt skip"):
        prepare(folder, str(tmp_path / "out2"), on_corrupt="stop", workers=1)


def test_train_and_val_folders_are_the_splits_and_must_share_classes(tmp_path):
    write_folder(tmp_path / "in" / "train", per_class=2)
    write_folder(tmp_path / "in" / "val", per_class=1, seed=1)
    splits, classes = find_images(tmp_path / "in")
    assert classes == ["cat", "dog", "eel"] and (len(splits["train"]), len(splits["eval"])) == (6, 3)
    (tmp_path / "in" / "val" / "fox").mkdir()
    with pytest.raises(DataError, match="different class folders .*fox"):
        find_images(tmp_path / "in")
    with pytest.raises(DataError, match="no class folders"):
        find_images(tmp_path / "in" / "train" / "cat")


def test_split_folders_are_never_taken_for_classes(tmp_path):
    """A review found train/ alone (or train/ + valid/) read as one image folder whose classes
    were the splits: every image labelled by its split, and 100% accuracy for nothing."""
    write_folder(tmp_path / "alone" / "train", per_class=4)
    splits, classes = find_images(tmp_path / "alone", eval_fraction=0.5)
    assert classes == ["cat", "dog", "eel"] and len(splits["train"]) + len(splits["eval"]) == 12
    assert len(splits["eval"]) > 0

    write_folder(tmp_path / "kaggle" / "train", per_class=2)
    write_folder(tmp_path / "kaggle" / "valid", per_class=1, seed=1)
    splits, classes = find_images(tmp_path / "kaggle")
    assert classes == ["cat", "dog", "eel"] and (len(splits["train"]), len(splits["eval"])) == (6, 3)
    with pytest.raises(DataError, match=r"--eval-fraction 0.1 .*own held-out split \(valid/\); drop --eval-fraction"):
        find_images(tmp_path / "kaggle", eval_fraction=0.1)

    write_folder(tmp_path / "no_train" / "val", per_class=1)
    with pytest.raises(DataError, match=r"has a val/ folder but no train/ beside it; name the training split"):
        find_images(tmp_path / "no_train")

    # A class that happens to be called "train" holds images: it stays a class.
    folder = write_folder(tmp_path / "vehicles", classes=("bus", "car", "train"), per_class=1)
    assert find_images(folder)[1] == ["bus", "car", "train"]


def test_a_changed_shard_is_refused_by_name(tmp_path, cache):
    prepare(write_folder(tmp_path / "in"), str(tmp_path / "out"), shard_size=8, workers=1)
    shard = tmp_path / "out" / "train-00001.parquet"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 1
    shard.write_bytes(bytes(data))
    with pytest.raises(DataError, match=r"train-00001.parquet is damaged or was changed: its sha256 differs"):
        load_split(str(tmp_path / "out"), "train")
    assert not list((cache / "images").glob("*-train-*[!p]"))  # nothing half-built is left as a cache entry


def test_cli_data_images(tmp_path, cache, capsys):
    folder = write_folder(tmp_path / "in", per_class=2)
    (folder / "eel" / "bad.png").write_bytes(b"\x89PNG\r\n\x1a\n truncated")
    assert main(["data", "images", "--input", str(folder), "--out", str(tmp_path / "out"), "--workers", "1"]) == 0
    out = capsys.readouterr().out
    assert "train: 6 images of 3 of the 3 classes in 1 shard(s)" in out
    assert "skipped 1 that cannot be decoded: eel/bad.png" in out


def test_augmentation_is_a_pure_function_of_seed_epoch_and_index():
    rng = np.random.default_rng(0)
    png = _encode(rng.integers(0, 256, (40, 60, 3), dtype=np.uint8), "PNG")
    jpeg = _encode(rng.integers(0, 256, (300, 200, 3), dtype=np.uint8), "JPEG")
    aug = Augment(image_size=16, seed=5)
    for encoded in (png, jpeg):
        a = aug(encoded, epoch=1, index=7)
        assert a.shape == (16, 16, 3) and a.dtype == np.uint8
        assert np.array_equal(a, aug(encoded, epoch=1, index=7))  # no hidden state
        others = [aug(encoded, epoch=e, index=i) for e, i in ((2, 7), (1, 8))]
        assert all(not np.array_equal(a, o) for o in others)  # a new crop per epoch and per example
    # Crops lie inside the image, their area and aspect ratio in the ranges asked for.
    for index in range(200):
        left, top, right, bottom = aug.box(60, 40, 0, index)
        w, h = right - left, bottom - top
        assert 0 <= left and 0 <= top and right <= 60 and bottom <= 40
        assert 0.08 * 2400 * 0.9 <= w * h <= 2400 and 3 / 4 * 0.9 <= w / h <= 4 / 3 * 1.1
    flips = [aug.flip(0, i) for i in range(400)]
    assert 150 < sum(flips) < 250
    evaluation = Augment(image_size=16, train=False, eval_crop_fraction=0.5)
    assert evaluation.box(60, 40, 0, 0) == (20.0, 10.0, 40.0, 30.0)  # the centre, the same every epoch
    assert np.array_equal(evaluation(jpeg, 0, 1), evaluation(jpeg, 3, 1))
    grey = Augment(image_size=8, channels=1)(png, 0, 0)
    assert grey.shape == (8, 8, 1)


def _encode(pixels: np.ndarray, fmt: str) -> bytes:
    import io

    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format=fmt)
    return buf.getvalue()


def test_one_and_three_worker_processes_give_the_same_batches_and_resume_continues(tmp_path, cache):
    prepare(write_folder(tmp_path / "in", per_class=10), str(tmp_path / "out"), workers=1)
    train = ImageDataset.from_prepared(str(tmp_path / "out"), "train", Augment(image_size=12, seed=1))
    assert isinstance(train, StreamedDataset) and train.classes == ["cat", "dog", "eel"]
    order = TrainOrder(len(train), global_batch=8, seed=3)  # 3 steps an epoch
    requests = TakeRequests.between(order, 0, 7, steps_per_call=2)  # calls cross into epoch 2
    reference = [train.take(idx, epoch) for idx, epoch in requests]  # decoded in this process
    assert [len(b["label"]) for b in reference] == [16, 8, 16, 8, 8]
    for workers in (1, 3):  # in call order; and interleaved unevenly (calls 0 and 3, 1 and 4, 2)
        train.workers = workers
        batches = list(train.stream(requests))
        assert len(batches) == len(reference)
        for got, want in zip(batches, reference, strict=True):
            assert np.array_equal(got["image"], want["image"]) and np.array_equal(got["label"], want["label"])
    # A resumed run asks from its step on: the same batches as the uninterrupted run's tail.
    train.workers = 1
    resumed = list(train.stream(TakeRequests.between(order, 4, 7, steps_per_call=2)))  # steps 4-5, 6
    tail = [reference[2]["image"][8:], reference[3]["image"], reference[4]["image"]]  # steps 4, 5, 6
    assert np.array_equal(np.concatenate([b["image"] for b in resumed]), np.concatenate(tail))
    # Evaluation batches (padded, masked) come from the workers too, the same as decoded here.
    evaluation = ImageDataset(train.split, Augment(image_size=12, train=False), workers=1)
    streamed = list(eval_batches(evaluation, 16))
    evaluation.workers = 0
    for (got, got_mask), (want, want_mask) in zip(streamed, eval_batches(evaluation, 16), strict=True):
        assert np.array_equal(got["image"], want["image"]) and np.array_equal(got_mask, want_mask)
    assert sum(m.sum() for _, m in streamed) == len(train)


def _split_with_a_bad_image(tmp_path) -> ImageSplit:
    rng = np.random.default_rng(0)
    blobs = [_encode(rng.integers(0, 256, (10, 10, 3), dtype=np.uint8), "PNG") for _ in range(4)]
    blobs[2] = blobs[2][:40]  # truncated
    offsets = np.cumsum([0] + [len(b) for b in blobs])
    files = np.array([f"c/{i}.png".encode() for i in range(4)])
    return ImageSplit(np.frombuffer(b"".join(blobs), np.uint8), offsets, np.arange(4, dtype=np.int32), files)


@pytest.mark.parametrize("workers", [0, 1])
def test_an_image_that_cannot_be_decoded_is_skipped_and_named_or_stops(tmp_path, workers, caplog):
    split = _split_with_a_bad_image(tmp_path)
    requests = [(np.array([0, 2, 3]), 0), (np.array([2, 1, 0]), 1)]
    skip = ImageDataset(split, Augment(image_size=8), workers=workers)
    batches = list(skip.stream(requests))
    assert batches[0]["label"].tolist() == [0, 3, 3] and batches[1]["label"].tolist() == [3, 1, 0]  # the next instead
    assert np.array_equal(batches[0]["image"][1], skip.take(np.array([3]))["image"][0])
    assert list(skip.skipped) == ["c/2.png"]
    assert "skipping c/2.png: it cannot be decoded" in caplog.text and "(1 image(s) skipped)" in caplog.text
    assert caplog.text.count("skipping c/2.png") == 1  # named once, however often it is drawn
    stop = ImageDataset(split, Augment(image_size=8), workers=workers, on_corrupt="stop")
    with pytest.raises(DataError, match=r"image c/2.png \(example 2\) cannot be decoded .*data.on_corrupt=skip"):
        list(stop.stream(requests))  # from a worker process: its error, raised here; the worker is not lost


@pytest.mark.parametrize("workers", [0, 1])
def test_an_evaluation_image_that_cannot_be_decoded_is_masked_not_counted_twice(tmp_path, workers):
    """A review found the stand-in (the next image) counted twice in evaluation."""
    from xlafit.data.loader import eval_batches

    evaluation = ImageDataset(_split_with_a_bad_image(tmp_path), Augment(image_size=8, train=False), workers=workers)
    (batch, mask), (last, last_mask) = eval_batches(evaluation, 3)
    assert set(batch) == {"image", "label"}  # the dataset's "valid" column is folded into the mask
    assert mask.tolist() == [1.0, 1.0, 0.0] and last_mask.tolist() == [1.0, 0.0, 0.0]  # c/2.png; padding
    assert batch["label"].tolist() == [0, 1, 3] and list(evaluation.skipped) == ["c/2.png"]


def test_synthetic_images_are_imagenet_shaped_and_deterministic():
    ds = SyntheticImages(100, image_size=32, num_classes=1000, seed=2)
    a, b = ds.take(np.array([5, 7, 5])), SyntheticImages(100, image_size=32, num_classes=1000, seed=2).take([5])
    assert a["image"].shape == (3, 32, 32, 3) and a["image"].dtype == np.uint8
    assert np.array_equal(a["image"][0], b["image"][0]) and a["label"][0] == b["label"][0] == a["label"][2]
    assert 0 <= a["label"].min() and a["label"].max() < 1000


def test_the_mnist_demo_folder_reads_back_the_embedded_digits(cache):
    from xlafit.data import mnist
    from xlafit.data.images import mnist_demo, read_manifest

    where = mnist_demo.build()
    assert mnist_demo.build() == where  # once
    _, _, manifest = read_manifest(where)
    assert manifest["classes"] == [str(d) for d in range(10)] and manifest["channels"] == 1
    assert (manifest["splits"]["train"]["examples"], manifest["splits"]["eval"]["examples"]) == (4000, 1000)
    digits = mnist.load_embedded(as_uint8=True)["test"]
    evaluation = ImageDataset.from_prepared(where, "eval", Augment(28, train=False, eval_crop_fraction=1.0, channels=1))
    names = [evaluation.split.file(i) for i in range(len(evaluation))]
    order = np.argsort([int(n.split("/")[-1].removesuffix(".png")) for n in names])  # test/<digit>/<n>.png
    batch = evaluation.take(order[:200])
    # The whole path (PNG file -> shard -> cache -> decode -> full-image "crop" at 28 px) gives the digits back.
    assert np.array_equal(batch["image"][..., 0], digits["image"][:200])
    assert np.array_equal(batch["label"], digits["label"][:200])


def test_each_process_takes_its_rows_of_every_request():
    order = TrainOrder(100, global_batch=16, seed=4)
    whole = TakeRequests.between(order, 0, 12, steps_per_call=3)
    halves = [TakeRequests.between(order, 0, 12, 3, process_index=p, process_count=2) for p in (0, 1)]
    for i in range(len(whole)):
        (idx, epoch), (a, ea), (b, eb) = whole[i], halves[0][i], halves[1][i]
        assert epoch == ea == eb and len(a) == len(b) == len(idx) // 2
        rows = idx.reshape(-1, 16)  # [k, 16]: each step's global batch, process 0 its first 8 rows
        assert np.array_equal(a.reshape(-1, 8), rows[:, :8]) and np.array_equal(b.reshape(-1, 8), rows[:, 8:])
    assert [int(e) for _, e in whole] == [0, 0, 1, 1]  # 6 steps an epoch, calls of 3


def test_grain_workers_end_when_the_training_process_is_killed(tmp_path, cache):
    """kill -9 of the process that reads (preemption, the OOM killer) must not leave its Grain
    workers behind: without the watch thread they lived on, idle, holding their memory."""
    prepare(write_folder(tmp_path / "in", per_class=4), str(tmp_path / "out"), workers=1)
    script = tmp_path / "reader.py"
    script.write_text(
        "import sys, time\n"
        "from xlafit.data.images.dataset import ImageDataset\n"
        "from xlafit.data.images.transforms import Augment\n"
        "from xlafit.data.loader import TakeRequests, TrainOrder\n"
        "if __name__ == '__main__':\n"
        "    train = ImageDataset.from_prepared(sys.argv[1], 'train', Augment(image_size=8), workers=2)\n"
        "    batches = train.stream(TakeRequests.between(TrainOrder(len(train), 4, 0), 0, 500, steps_per_call=1))\n"
        "    next(batches)\n"
        "    print('reading', flush=True)\n"
        "    time.sleep(300)  # the workers fill their buffers and wait\n"
    )
    proc = subprocess.Popen([sys.executable, str(script), str(tmp_path / "out")], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "reading"
        workers = psutil.Process(proc.pid).children(recursive=True)
        assert len([p for p in workers if "spawn_main" in " ".join(p.cmdline())]) == 2
        proc.kill()
        proc.wait()
        _, alive = psutil.wait_procs(workers, timeout=10)
        assert not alive, f"{len(alive)} Grain process(es) outlived the killed reader"
    finally:
        proc.kill()


def test_an_out_that_already_holds_prepared_images_is_refused_unless_overwrite(tmp_path, capsys):
    """Preparing into a directory that holds earlier shards replaced them silently (and left the
    shards the new manifest no longer lists); now it needs --overwrite, which removes those."""
    out = tmp_path / "out"
    prepare(write_folder(tmp_path / "in"), str(out), shard_size=4, workers=1)  # 18 images: 5 shards
    (out / "notes.txt").write_text("the user's")
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    small = write_folder(tmp_path / "small", classes=("x", "y"), per_class=2)
    with pytest.raises(
        DataError, match=r"already holds prepared images \(manifest.json, train-00000.parquet, .*--overwrite"
    ):
        prepare(small, str(out), workers=1)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # nothing written or removed
    args = ["data", "images", "--input", str(small), "--out", str(out), "--workers", "1"]
    assert main(args) == 2 and "--overwrite" in capsys.readouterr().err
    assert main([*args, "--overwrite"]) == 0
    names = " ".join(sorted(p.name for p in out.iterdir()))  # the new shard's name is the earlier's + a tag
    assert re.fullmatch(r"manifest.json notes.txt train-00000\.\w{8}\.parquet", names)
    assert len(load_split(str(out), "train")[0]) == 4
    # an overwrite that stops at a corrupt image changes nothing: the earlier images still load
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    (small / "x" / "broken.jpg").write_bytes(b"\xff\xd8\xff\xe0 not really a jpeg")
    with pytest.raises(DataError, match="broken.jpg cannot be decoded"):
        prepare(small, str(out), workers=1, on_corrupt="stop", overwrite=True, shard_size=1)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert len(load_split(str(out), "train")[0]) == 4


@pytest.mark.parametrize("channels", [1, 3])
def test_a_16_bit_png_keeps_its_brightness(channels):
    """Pillow's conversion of a 16-bit grey PNG clips every value above 255: the image came out white."""
    rng = np.random.default_rng(0)
    pixels = rng.integers(0, 65536, (8, 8), dtype=np.uint16)
    png = _encode(pixels, "PNG")
    assert Image.open(io.BytesIO(png)).mode.startswith("I")  # 16 bits a pixel in the file
    out = Augment(image_size=8, train=False, eval_crop_fraction=1.0, channels=channels)(png, 0, 0)
    assert out.shape == (8, 8, channels)
    for c in range(channels):
        assert np.array_equal(out[..., c], (pixels >> 8).astype(np.uint8))


@pytest.mark.parametrize("empty_class", [True, False])
def test_images_directly_in_the_input_folder_are_named_with_the_fix(tmp_path, capsys, empty_class):
    """Images at the top of --input, beside an empty class folder, were reported as "no .jpg, ...
    files under its class folders", which does not say where they are or where they go."""
    flat = write_folder(tmp_path / "flat", classes=("all",), per_class=3)
    for image in (flat / "all").iterdir():
        image.rename(flat / image.name)
    if not empty_class:
        (flat / "all").rmdir()
    assert main(["data", "images", "--input", str(flat), "--out", str(tmp_path / "o"), "--workers", "1"]) == 2
    err = capsys.readouterr().err
    assert f"the 3 image(s) of {flat} sit directly in it" in err
    assert f"one folder per class ({flat / 'cat'}/*.jpg, {flat / 'dog'}/*.jpg, ...)" in err
    assert ("its folder(s) all hold none" in err) == empty_class


def test_an_empty_class_folder_is_refused_by_name(tmp_path):
    """An empty class folder was a class with no image: a label the model learns never to predict."""
    folder = write_folder(tmp_path / "in", per_class=1)
    (folder / "fox").mkdir()
    with pytest.raises(DataError, match=r"class folder\(s\) fox of .* hold no .*add images or remove the folder"):
        find_images(folder)


def test_a_class_the_eval_split_takes_whole_is_refused_by_name(tmp_path):
    """One folder split by --eval-fraction: a class of one image could land in evaluation only."""
    folder = write_folder(tmp_path / "in", per_class=1)
    with pytest.raises(DataError, match=r"--eval-fraction 0.9 holds out every image of the class\(es\) .*smaller"):
        find_images(folder, eval_fraction=0.9)
    assert len(find_images(folder, eval_fraction=0.0)[0]["train"]) == 3


def test_a_file_name_that_is_not_utf8_is_prepared_and_named_readably(tmp_path, cache):
    """Such a name (bytes kept as they were by the file system) raised UnicodeEncodeError."""
    import os

    folder = write_folder(tmp_path / "in", per_class=2)
    odd = os.fsdecode(bytes(folder / "cat") + b"/caf\xe9.png")  # Latin-1, not UTF-8
    Image.fromarray(np.zeros((8, 8, 3), np.uint8)).save(odd, format="PNG")
    manifest = prepare(folder, str(tmp_path / "out"), eval_fraction=0.5, workers=1)
    assert sum(s["examples"] for s in manifest["splits"].values()) == 7
    names = [
        split.file(i)
        for name in ("train", "eval")
        for split in [load_split(str(tmp_path / "out"), name)[0]]
        for i in range(len(split))
    ]
    assert "cat/caf\\xe9.png" in names


@pytest.mark.parametrize(
    "text, message",
    [
        ('{"format": "xlafit-images-v1", "splits": {', r"manifest.json is damaged \(Expecting"),
        ('{"format": "xlafit-images-v1", "splits": {}}', r"manifest.json is damaged: it lacks classes, channels"),
        ("[1, 2]", "is not an xlafit image manifest"),
    ],
)
def test_a_damaged_manifest_is_named_with_the_fix(tmp_path, cache, text, message):
    """It raised the JSONDecodeError, KeyError or AttributeError of the code that read it."""
    prepare(write_folder(tmp_path / "in", per_class=1), str(tmp_path / "out"), workers=1)
    (tmp_path / "out" / "manifest.json").write_text(text)
    with pytest.raises(DataError, match=message + ".*prepare"):
        load_split(str(tmp_path / "out"), "train")


_SIGINT_AT_EVERY_MOMENT = """
import glob, time
from xlafit.data.images.preparation import _worker_pool

def sigint_held_off(pid):  # in each thread: blocked (until the initializer ignores it), or ignored
    for status in glob.glob(f"/proc/{pid}/task/*/status"):
        fields = dict(line.split(":", 1) for line in open(status) if ":" in line)
        if not (int(fields["SigBlk"], 16) | int(fields["SigIgn"], 16)) & 2:
            return False
    return True

if __name__ == "__main__":
    with _worker_pool(2) as pool:
        seen = []
        end = time.monotonic() + 3
        while time.monotonic() < end:
            seen += [sigint_held_off(w.pid) for w in pool._pool]
    print(len(seen), all(seen))
"""


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads the signal masks in /proc (Linux)")
def test_preparation_workers_never_take_ctrl_c_themselves(tmp_path):
    """From its first instant, a worker blocks SIGINT (until its initializer ignores it) or
    ignores it. Starting the pool's resource tracker unblocks SIGINT in the calling thread; in
    a fresh interpreter that start comes with the pool, and the workers must not be born after it."""
    script = tmp_path / "workers.py"
    script.write_text(_SIGINT_AT_EVERY_MOMENT)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    samples, held_off = done.stdout.split()
    assert int(samples) > 10 and held_off == "True", done.stdout


@long_form(
    28,
    "test_preparation_workers_never_take_ctrl_c_themselves, test_a_pool_whose_terminate_hangs_still_ends_with_its_"
    "workers_killed and test_ctrl_c_while_the_workers_start_is_left_to_the_parent_and_prints_nothing",
)
def test_ctrl_c_during_preparation_is_one_line_leaves_no_worker_and_the_rerun_finishes(tmp_path):
    """Ctrl-C reaches the whole process group (a terminal, a notebook's "Interrupt kernel"):
    one line, exit 130, the workers gone; the shards left without a manifest are recognised as
    an unfinished preparation and replaced by the rerun."""
    import io
    import os
    import signal
    import subprocess
    import sys
    import time

    from PIL import Image

    # Enough for the worker pool (2,048 images or more), each slow enough to decode (600 x 600
    # pixels, ~5 ms; 2 KB on disk, one file linked 2,100 times) that the preparation is still
    # running seconds after its first shard appears.
    original = tmp_path / "one.png"
    Image.new("RGB", (600, 600), (3, 0, 0)).save(original)
    for i in range(2100):
        folder = tmp_path / "in" / ("a" if i % 2 else "b")
        folder.mkdir(parents=True, exist_ok=True)
        os.link(original, folder / f"{i}.png")
    out = tmp_path / "out"
    command = [sys.executable, "-m", "xlafit", "data", "images", "--input", str(tmp_path / "in"), "--out", str(out)]
    command += ["--workers", "2", "--shard-size", "64"]
    # As from a terminal: Ctrl-C not ignored. A suite started in the background (`make test &`)
    # passes SIGINT down ignored, and a Python started so never sees it (exit 0, no message).
    as_from_a_terminal = (
        "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); os.execv(sys.argv[1], sys.argv[1:])"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", as_from_a_terminal, *command],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        env={**os.environ, "PYTHONFAULTHANDLER": "1"},  # SIGABRT: every thread's stack, should it hang
    )
    deadline = time.monotonic() + 120
    while not list(out.glob("*.parquet")) and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.05)
    assert proc.poll() is None, "finished before it could be interrupted"
    os.killpg(proc.pid, signal.SIGINT)
    try:
        _, stderr = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:  # a hang: where each thread of the command stands
        os.kill(proc.pid, signal.SIGABRT)
        _, stderr = proc.communicate(timeout=30)
        with contextlib.suppress(ProcessLookupError):  # the workers, if any are left
            os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail(f"no exit within 60 s of Ctrl-C; the command's threads:\n{stderr[-6000:]}")
    assert proc.returncode == 130, stderr[-3000:]
    assert stderr.strip().splitlines() == ["xlafit: interrupted"]
    for _ in range(100):  # terminated workers take a moment to be reaped
        left = subprocess.run(["ps", "-o", "pid=,cmd=", "-g", str(proc.pid)], capture_output=True, text=True).stdout
        if not left.strip():
            break
        time.sleep(0.1)
    assert not left.strip(), f"processes left: {left}"
    assert list(out.glob("*.parquet")) and not (out / "manifest.json").exists()
    # The rerun reads the same 2,100 files, small now (their one inode rewritten in place):
    # it has nothing to be slow for.
    small = io.BytesIO()
    Image.new("RGB", (8, 8), (3, 0, 0)).save(small, "PNG")
    with open(original, "r+b") as f:
        f.write(small.getvalue())
        f.truncate()
    rerun = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert "unfinished preparation are replaced" in rerun.stderr
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["splits"]["train"]["examples"] == 2100


def test_a_pool_whose_terminate_hangs_still_ends_with_its_workers_killed(monkeypatch):
    """Pool.terminate joins the pool's threads and can wait on a queue lock a worker holds;
    the interrupted command then hung. Past a few seconds the workers are killed instead."""
    import threading
    import time

    from xlafit.data.images import preparation

    with preparation._worker_pool(2) as pool:
        workers = list(pool._pool)
        assert all(w.is_alive() for w in workers)
        hang = threading.Event()
        monkeypatch.setattr(pool, "terminate", hang.wait)  # never set: a terminate that does not return
        t0 = time.monotonic()
        preparation._stop(pool, wait_s=0.5)
        assert time.monotonic() - t0 < 5

        def running(pid):  # the pool's own thread may reap a worker first: ask the OS, not the Process
            try:
                return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
            except psutil.NoSuchProcess:
                return False

        deadline = time.monotonic() + 10
        while any(running(w.pid) for w in workers) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(running(w.pid) for w in workers)
        hang.set()
        monkeypatch.undo()


def test_ctrl_c_while_the_workers_start_is_left_to_the_parent_and_prints_nothing(tmp_path, capfd):
    """A Ctrl-C that reaches a worker before its initializer has run (its interpreter takes a
    second to start) printed that worker's KeyboardInterrupt traceback under the command's one
    line. Each worker here is interrupted the moment it is started."""
    import os
    import signal

    from xlafit.data.images.preparation import _check_image, _worker_pool

    Image.new("RGB", (4, 4)).save(tmp_path / "a.png")
    with _worker_pool(2) as pool:
        for worker in pool._pool:  # no public handle on the processes
            os.kill(worker.pid, signal.SIGINT)
        checked = list(pool.imap(_check_image, [str(tmp_path / "a.png")] * 8, chunksize=1))
        pids = {worker.pid for worker in pool._pool}
    assert [c[1:] for c in checked] == [(3, None)] * 8
    assert "KeyboardInterrupt" not in capfd.readouterr().err
    assert pids == {worker.pid for worker in pool._pool}, "a worker died and was replaced"


def test_files_that_are_not_images_are_named_not_ignored_in_silence(tmp_path, caplog):
    for name in ("cat", "dog"):
        (tmp_path / "in" / name).mkdir(parents=True)
        Image.new("RGB", (8, 8)).save(tmp_path / "in" / name / "1.png")
    (tmp_path / "in" / "cat" / "2.webp").write_bytes(b"RIFF....WEBP")
    (tmp_path / "in" / "cat" / ".DS_Store").write_bytes(b"")
    with caplog.at_level("WARNING", logger="xlafit"):
        manifest = prepare(tmp_path / "in", str(tmp_path / "out"), workers=1)
    assert manifest["ignored"] == ["cat/2.webp"]
    assert "1 file(s) are not .jpg/.jpeg/.png images and are left out: cat/2.webp" in caplog.text


def test_a_raw_image_folder_as_prepared_data_suggests_where_to_prepare_it(tmp_path):
    (tmp_path / "shapes" / "circle").mkdir(parents=True)
    Image.new("RGB", (8, 8)).save(tmp_path / "shapes" / "circle" / "1.png")
    url = str(tmp_path / "shapes")
    with pytest.raises(DataError, match="is an image folder, not prepared images") as e:
        load_split(url, "train")
    assert f"--input {url} --out {url}-prepared" in str(e.value)


@pytest.mark.parametrize("inside", [".", "shards"])
def test_an_out_inside_the_input_folder_is_refused(tmp_path, inside):
    """``--out`` inside ``--input`` wrote shards into the image folder, whose next preparation
    took the shards' folder for a class."""
    folder = write_folder(tmp_path / "in", classes=("cat", "dog"), per_class=2)
    with pytest.raises(DataError, match=r"lies inside --input .*; give an --out outside the image folder"):
        prepare(folder, str(folder / inside), workers=1)
    assert sorted(p.name for p in folder.iterdir()) == ["cat", "dog"]


def test_a_single_class_is_refused(tmp_path):
    """One class folder was prepared, and a run on it reported loss 0 and accuracy 1."""
    one = write_folder(tmp_path / "one", classes=("cat",), per_class=2)
    with pytest.raises(DataError, match=rf"{one} has one class \(cat\): a classifier needs two or more"):
        prepare(one, str(tmp_path / "o"), workers=1)
    write_folder(tmp_path / "splits" / "train", classes=("cat",), per_class=2)
    write_folder(tmp_path / "splits" / "val", classes=("cat",), per_class=1)
    with pytest.raises(DataError, match=r"train has one class \(cat\)"):
        prepare(tmp_path / "splits", str(tmp_path / "o"), workers=1)
    assert not (tmp_path / "o").exists()
