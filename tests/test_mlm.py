"""Masked-LM data: preparing shards, the memory-mapped split cache, masking, the dataset."""

import hashlib
import json
import os
import re
import subprocess
import sys
import time

import numpy as np
import pytest

from helpers import mlm_dataset
from xlafit.data import mlm
from xlafit.data.text import korean_demo_files
from xlafit.errors import DataError


@pytest.mark.parametrize("packing", ["sentences", "pairs"])
def test_prepare_is_deterministic_and_well_formed(korean_tokenizer, packing):
    files = korean_demo_files()
    # one folder per parametrization: the memory filesystem lives as long as the process
    first, second = f"memory://mlm-a-{packing}", f"memory://mlm-b-{packing}"
    m1 = mlm.prepare(korean_tokenizer, files, first, seq_len=64, packing=packing, show_progress=False)
    m2 = mlm.prepare(korean_tokenizer, files, second, seq_len=64, packing=packing, show_progress=False)
    assert m1["splits"] == m2["splits"]
    a, _ = mlm.load_split(first, "train")
    b, _ = mlm.load_split(second, "train")
    assert all(np.array_equal(a[k], b[k]) for k in a)
    ids, types, length = a["input_ids"], a["token_type_ids"], a["length"]
    assert len(ids) == m1["splits"]["train"]["sequences"] > 100
    assert length.sum() == m1["splits"]["train"]["tokens"]
    assert (ids[:, 0] == mlm.CLS).all() and (ids[np.arange(len(ids)), length - 1] == mlm.SEP).all()
    assert ((np.arange(64)[None] < length[:, None]) | (ids == mlm.PAD)).all()  # padding only after the end
    if packing == "sentences":
        assert (length == 64).mean() > 0.9 and (types == 0).all()
    else:
        for row, n in zip(types[:50], length[:50], strict=True):
            change = np.flatnonzero(np.diff(row[:n]))
            assert len(change) == 1 and row[0] == 0 and row[n - 1] == 1  # A then B


def test_prepare_names_bad_input(tmp_path, korean_tokenizer):
    from xlafit.data.text import expand_inputs

    with pytest.raises(DataError, match="no input file matches"):
        expand_inputs([str(tmp_path / "nothing*.txt")])
    with pytest.raises(DataError, match="no tokenizer.json"):
        mlm.prepare(tmp_path, korean_demo_files(), str(tmp_path / "out"))
    (tmp_path / "latin1.txt").write_bytes("caf\xe9\n".encode("latin-1"))
    with pytest.raises(DataError, match=r"latin1.txt:1 \(byte 3\) is not UTF-8"):
        mlm.prepare(korean_tokenizer, [str(tmp_path / "latin1.txt")], str(tmp_path / "out"), show_progress=False)
    for name, text in (("empty.txt", ""), ("blank.txt", "\n\n\n")):
        (tmp_path / name).write_text(text)
        with pytest.raises(DataError, match=f"--input .*{name}: no text to train on") as e:
            mlm.prepare(korean_tokenizer, [str(tmp_path / name)], str(tmp_path / name[:-4]), show_progress=False)
        assert "\n" not in str(e.value) and not (tmp_path / name[:-4] / "manifest.json").exists()
    out = tmp_path / "ok"
    mlm.prepare(korean_tokenizer, korean_demo_files(), str(out), seq_len=64, show_progress=False)
    shard = out / "train-00000.parquet"
    shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(DataError, match="train-00000.parquet is damaged or was changed"):
        mlm.load_split(str(out), "train")
    manifest = json.loads((out / "manifest.json").read_text())
    del manifest["splits"]["train"]["shards"][0]["sha256"]  # as data prepared before checksums
    (out / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(DataError, match="train-00000.parquet cannot be read"):
        mlm.load_split(str(out), "train")


def test_an_out_that_is_a_file_or_a_shard_size_below_one_is_refused_before_tokenizing(
    tmp_path, korean_tokenizer, capsys
):
    """``--out FILE`` failed with FileExistsError once every line was tokenized; ``--shard-size
    0`` wrote one shard per sequence."""
    from xlafit.cli import main

    taken = tmp_path / "notes.txt"
    taken.write_text("the user's")
    args = ["data", "mlm", "--tokenizer", str(korean_tokenizer), "--input", *korean_demo_files()]
    assert main([*args, "--out", str(taken)]) == 2
    assert f"--out {taken} is a file; give a directory for the MLM shards" in capsys.readouterr().err
    assert taken.read_text() == "the user's"
    assert main([*args, "--out", str(tmp_path / "mlm"), "--shard-size", "0"]) == 2
    assert "--shard-size 0 must be at least 1" in capsys.readouterr().err
    assert not (tmp_path / "mlm").exists()


def test_an_out_that_already_holds_prepared_data_is_refused_unless_overwrite(
    tmp_path, monkeypatch, korean_tokenizer, capsys
):
    """Preparing into a directory that held earlier MLM data replaced it silently and left the
    shards the new manifest no longer lists (a run resuming there mixed two datasets); now it
    needs --overwrite, which removes them."""
    from xlafit.cli import main

    monkeypatch.setenv("XLAFIT_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "mlm"
    args = ["data", "mlm", "--tokenizer", str(korean_tokenizer), "--input", *korean_demo_files()]
    args += ["--seq-len", "64", "--out", str(out)]
    assert main([*args, "--shard-size", "50"]) == 0
    assert len(list(out.glob("train-*.parquet"))) > 1
    (out / "notes.txt").write_text("the user's")
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    capsys.readouterr()
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "already holds prepared MLM data (eval-00000.parquet, " in err and "pass --overwrite" in err
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == before  # nothing written or removed
    assert main([*args, "--overwrite"]) == 0
    names = " ".join(sorted(p.name for p in out.iterdir()))  # the new shards' names are the earlier's + a tag
    assert re.fullmatch(
        r"eval-00000\.(\w{8})\.parquet manifest.json notes.txt tokenizer train-00000\.\1\.parquet", names
    )
    data, _ = mlm.load_split(str(out), "train")
    assert len(data["input_ids"]) == json.loads((out / "manifest.json").read_text())["splits"]["train"]["sequences"]
    # an overwrite that fails changes nothing: the earlier data still loads
    before = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    (tmp_path / "blank.txt").write_text("\n\n")
    with pytest.raises(DataError, match="no text to train on"):
        mlm.prepare(korean_tokenizer, [str(tmp_path / "blank.txt")], str(out), overwrite=True, show_progress=False)
    assert {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()} == before
    assert len(mlm.MLMDataset.from_prepared(str(out), "train")) == len(data["input_ids"])


def test_split_is_decoded_once_into_a_memory_mapped_cache(tmp_path, monkeypatch, caplog, korean_tokenizer):
    monkeypatch.setenv("XLAFIT_CACHE", str(tmp_path / "cache"))
    url, files = str(tmp_path / "data"), korean_demo_files()
    manifest = mlm.prepare(korean_tokenizer, files, url, seq_len=64, shard_size=100, show_progress=False)
    shards = [tmp_path / "data" / s["path"] for s in manifest["splits"]["train"]["shards"]]
    assert len(shards) > 3
    mapped, _ = mlm.load_split(url, "train")
    in_memory, _ = mlm.load_split(url, "train", memory_map=False)
    assert all(isinstance(a, np.memmap) and not a.flags.writeable for a in mapped.values())
    assert all(np.array_equal(mapped[k], in_memory[k]) and mapped[k].dtype == in_memory[k].dtype for k in mapped)
    assert mapped["input_ids"].dtype == np.uint16 and len(mapped["length"]) == manifest["splits"]["train"]["sequences"]
    caches = lambda: sorted(p.name for p in (tmp_path / "cache" / "mlm").iterdir() if "-train-" in p.name)  # noqa: E731
    assert len(caches()) == 1
    monkeypatch.chdir(tmp_path)
    assert mlm.load_split("data", "train")[0]["input_ids"].filename == mapped["input_ids"].filename  # one key

    # A later load opens the cache and reads no shard.
    saved = {s: s.read_bytes() for s in shards}
    for s in shards:
        s.unlink()
    again, _ = mlm.load_split(url, "train")
    assert np.array_equal(again["input_ids"], in_memory["input_ids"])

    # A shard replaced by another valid one of the same size is caught by its checksum.
    for s, data in saved.items():
        s.write_bytes(data)
    shards[0].write_bytes(saved[shards[1]])
    with pytest.raises(DataError, match=f"{shards[0].name} is damaged or was changed"):
        mlm.load_split(url, "train", memory_map=False)

    # Prepared again (another seed): a new cache, the old one removed, and so is what a
    # process killed while decoding left a day ago.
    first = caches()
    stale = tmp_path / "cache" / "mlm" / "killed.abc.tmp"
    stale.mkdir()
    os.utime(stale, (time.time() - 2 * 86400,) * 2)
    mlm.prepare(korean_tokenizer, files, url, seq_len=64, shard_size=100, seed=1, show_progress=False, overwrite=True)
    new, _ = mlm.load_split(url, "train")
    assert len(caches()) == 1 and caches() != first and not stale.exists()
    assert not np.array_equal(new["input_ids"][:100], in_memory["input_ids"][:100])

    # No writable cache: read into memory, with a warning that says where and why.
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("XLAFIT_CACHE", str(tmp_path / "file"))
    with caplog.at_level("WARNING", logger="xlafit"):
        fallback, _ = mlm.load_split(url, "train")
    assert not isinstance(fallback["input_ids"], np.memmap) and np.array_equal(fallback["input_ids"], new["input_ids"])
    assert "reading it into memory" in caplog.text


def test_processes_building_one_split_cache_at_once_agree(tmp_path, korean_tokenizer):
    """Two processes of one host decode the same split into the cache at the same time (the
    start of a multi-process run): one rename wins, both read the same, nothing is left over."""
    url = str(tmp_path / "data")
    mlm.prepare(korean_tokenizer, korean_demo_files(), url, seq_len=64, shard_size=50, show_progress=False)
    # os._exit right after the answer: once in a full suite run (2026-11-25, 1 of 3 runs) a child
    # died with "terminate called without an active exception", a C++ abort that looks like
    # interpreter-exit teardown (cause not found). The answer is still checked, so a crash
    # before it fails the test; exit-time teardown is not what this test is about.
    code = (
        "import hashlib, os, sys; from xlafit.data import mlm; a, _ = mlm.load_split(sys.argv[1], 'train'); "
        "print(type(a['input_ids']).__name__, hashlib.sha256(a['input_ids'].tobytes()).hexdigest(), flush=True); "
        "os._exit(0)"
    )
    env = {**os.environ, "XLAFIT_CACHE": str(tmp_path / "cache"), "JAX_PLATFORMS": "cpu"}
    procs = [
        subprocess.Popen([sys.executable, "-c", code, url], env=env, stdout=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    outputs = [p.communicate(timeout=120)[0].strip() for p in procs]
    assert all(p.returncode == 0 for p in procs)
    expected = mlm.load_split(url, "train", memory_map=False)[0]["input_ids"]
    assert outputs == [f"memmap {hashlib.sha256(expected.tobytes()).hexdigest()}"] * 2
    assert [p.name.split("-")[1] for p in (tmp_path / "cache" / "mlm").iterdir()] == ["train"]


def test_masking_rates_and_static_shapes():
    ds = mlm_dataset(max_predictions=20)
    batch = ds.take(np.arange(len(ds)), epoch=0)
    w = batch["masked_weights"]
    assert batch["masked_positions"].shape == batch["masked_ids"].shape == w.shape == (400, 20)
    real = ds.arrays["length"] - 2
    expected = np.minimum(20, np.maximum(1, np.rint(real * 0.15)))
    assert np.array_equal(w.sum(1), expected)
    rows, cols = np.nonzero(w)
    pos = batch["masked_positions"][rows, cols]
    original = ds.arrays["input_ids"][rows, pos]
    assert np.array_equal(batch["masked_ids"][rows, cols], original)
    assert not np.isin(original, [mlm.CLS, mlm.SEP, mlm.PAD]).any()
    now = batch["input_ids"][rows, pos]
    mask_share, same_share = (now == mlm.MASK).mean(), (now == original).mean()
    assert 0.77 < mask_share < 0.83 and 0.08 < same_share < 0.13  # 80% [MASK], 10% kept (+ random hits)
    unmasked = np.ones(ds.arrays["input_ids"].shape, bool)
    unmasked[rows, pos] = False
    assert np.array_equal(batch["input_ids"][unmasked], ds.arrays["input_ids"][unmasked])


def test_masks_are_a_function_of_seed_epoch_and_example():
    ds = mlm_dataset()
    whole = ds.take(np.arange(64), epoch=3)
    alone = ds.take(np.array([17]), epoch=3)  # another batch composition, the same example
    assert all(np.array_equal(whole[k][17], alone[k][0]) for k in whole)
    assert not np.array_equal(ds.take(np.arange(64), epoch=4)["masked_positions"], whole["masked_positions"])
    other_seed = mlm_dataset(seed=1).take(np.arange(64), epoch=3)
    assert not np.array_equal(other_seed["masked_positions"], whole["masked_positions"])


def test_whole_word_masking_takes_whole_words():
    ds = mlm_dataset(whole_word=True)
    batch = ds.take(np.arange(len(ds)), epoch=0)
    ids = ds.arrays["input_ids"]
    pieces = 0
    for r in range(len(ds)):
        chosen = set(batch["masked_positions"][r][batch["masked_weights"][r] > 0].tolist())
        for p in chosen:  # a chosen word's pieces (ids >= 500 continue the word before) are all chosen
            if ids[r, p + 1] >= 500:
                assert p + 1 in chosen, (r, p)
            if ids[r, p] >= 500 and p > 1:
                assert p - 1 in chosen, (r, p)
                pieces += 1
    assert pieces > 300  # the test saw many multi-piece words


def test_a_tokenizer_replaced_in_prepared_data_is_refused(tmp_path, monkeypatch, korean_tokenizer):
    """A tokenizer/ swapped for another one after preparation trained with the wrong vocabulary
    (and a run copied it), although the manifest records the tokenizer's sha256."""
    import shutil

    from xlafit.data.tokenizer import train_tokenizer

    monkeypatch.setenv("XLAFIT_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "mlm"
    mlm.prepare(korean_tokenizer, korean_demo_files(), str(out), seq_len=64, show_progress=False)
    assert len(mlm.MLMDataset.from_prepared(str(out), "train")) > 0
    (tmp_path / "other.txt").write_text("the quick brown fox jumps over the lazy dog\n" * 20)
    train_tokenizer([str(tmp_path / "other.txt")], 120, tmp_path / "other", show_progress=False)
    shutil.rmtree(out / "tokenizer")
    shutil.copytree(tmp_path / "other", out / "tokenizer")
    says = rf"{out}/tokenizer differs from the tokenizer the data was prepared with \(sha256 .*; restore it, or prepare"
    with pytest.raises(DataError, match=says):
        mlm.MLMDataset.from_prepared(str(out), "train")
    (out / "tokenizer" / "tokenizer.json").unlink()
    with pytest.raises(DataError, match=r"tokenizer has no tokenizer.json; restore it, or prepare the data again"):
        mlm.MLMDataset.from_prepared(str(out), "train")


def test_a_manifest_whose_seq_len_was_changed_is_named(tmp_path, monkeypatch, korean_tokenizer):
    """A manifest edited from seq_len 32 to 64 failed with numpy's "cannot reshape array"."""
    monkeypatch.setenv("XLAFIT_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "mlm"
    mlm.prepare(korean_tokenizer, korean_demo_files(), str(out), seq_len=32, show_progress=False)
    manifest = json.loads((out / "manifest.json").read_text())
    (out / "manifest.json").write_text(json.dumps({**manifest, "seq_len": 64}))
    says = r"train-00000.parquet holds sequences of 32 tokens, not the manifest's seq_len=64: the manifest was changed"
    for memory_map in (True, False):
        with pytest.raises(DataError, match=says):
            mlm.load_split(str(out), "train", memory_map=memory_map)
