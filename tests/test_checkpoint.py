"""Checkpointer: what `list` reports about the checkpoints on disk."""

import asyncio
import datetime
import gc
import json
import os
import shutil
import time

import jax
import numpy as np
import pytest
from etils import epath
from orbax.checkpoint._src import asyncio_utils

from xlafit.checkpoint import SEAL, Checkpointer
from xlafit.integrity import checksums, write_seal


def _state(step):
    return {"params": {"w": np.full(3, step, np.float32)}, "step": np.int32(step)}


def test_list_reports_when_a_checkpoint_was_written_not_when_its_files_changed(tmp_path):
    """Issue 21: `inspect` showed the files' modification time, which moves when a file is
    copied, touched or damaged. The commit record's time does not; without one (as older
    Orbax wrote), the modification time is reported and said to be one."""
    before = datetime.datetime.now(datetime.UTC)
    ckpt = Checkpointer(tmp_path, keep=5, async_save=False)
    ckpt.save(1, _state(1))
    ckpt._manager.wait_until_finished()
    # checkpoint 2 without a commit time, sealed so (as older Orbax wrote it)
    record = tmp_path / "2" / "_CHECKPOINT_METADATA"
    ckpt.save(2, _state(2))
    ckpt.wait()
    metadata = json.loads(record.read_text())
    metadata.pop("commit_timestamp_nsecs")
    record.write_text(json.dumps(metadata))
    write_seal(epath.Path(tmp_path / "2"), 2)
    after = datetime.datetime.now(datetime.UTC)
    long_ago = datetime.datetime(2001, 1, 1, tzinfo=datetime.UTC).timestamp()
    for path in tmp_path.rglob("*"):
        os.utime(path, (long_ago, long_ago))

    first, second = ckpt.list()
    ckpt.close()
    assert (first.status, second.status) == ("intact", "intact")
    assert first.time_source == "commit" and before <= first.time <= after
    assert second.time_source == "mtime" and second.time.year == 2001


def test_orbax_waits_for_the_reads_a_failed_one_leaves_before_closing_its_loop(tmp_path):
    """A restore reads every array at once; when one read failed, Orbax closed its event loop
    with the others in flight, and each printed a traceback ("Event loop is closed") or
    "Exception ignored" later. The reads still pending finish first."""
    Checkpointer(tmp_path).close()  # Orbax's synchronous calls now settle their reads
    settled = []

    async def slow_read():
        try:
            await asyncio.sleep(0.2)
        finally:
            settled.append("slow read")

    async def failing_read():
        raise ValueError("OUT_OF_RANGE")

    async def restore():
        await asyncio.gather(slow_read(), failing_read())

    with pytest.raises(ValueError, match="OUT_OF_RANGE"):
        asyncio_utils.run_sync(restore())
    assert settled == ["slow read"]


def test_an_unreadable_unsealed_checkpoint_is_skipped_with_one_line(tmp_path, capfd):
    """Tester's report: falling back past an unsealed checkpoint that cannot be read printed
    a warning with a 60-line TensorStore spec, then about 100 "Event loop is closed"
    tracebacks. One line names the checkpoint and the error's first line; nothing else."""
    rng = np.random.default_rng(0)
    state = {f"w{i}": rng.standard_normal((128, 128), np.float32) for i in range(64)}
    ckpt = Checkpointer(tmp_path, keep=5)
    ckpt.save(1, state)
    ckpt.save(2, state)
    ckpt.wait()
    (tmp_path / "2" / SEAL).unlink()
    biggest = max((p for p in (tmp_path / "2").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    os.truncate(biggest, 1000)
    capfd.readouterr()
    _, step = ckpt.restore({k: np.zeros_like(v) for k, v in state.items()})
    ckpt.close()
    gc.collect()  # abandoned reads printed "Exception ignored" when collected
    out, err = capfd.readouterr()
    assert step == 1
    assert out.count("\n") == 1 and out.startswith("warning: checkpoint 2 (") and " is unreadable (" in out, out
    assert "TensorStore" not in out and err == "", err[-2000:]


# --------------------------------------------------------------------------- sealing and array checksums


def _random_state(step):
    """Random float32 weights: incompressible, so a flipped bit in the data file is a changed value."""
    rng = np.random.default_rng(step)
    return {"params": {"w": rng.standard_normal((64, 32), np.float32)}, "step": np.int32(step)}


def _flip(path, bit):
    data = bytearray(path.read_bytes())
    data[bit // 8] ^= 1 << (bit % 8)
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("sealed", [True, False])
def test_a_flipped_bit_in_a_checkpoints_data_is_never_resumed_from(tmp_path, capsys, sealed):
    """Issue 63 (5): a checkpoint committed but not yet sealed (a kill -9 before its seal, or
    before the next save sealed it) was restored unchecked: single flipped bits in its data
    resumed silently from changed values. Each flip now falls back to the previous
    checkpoint with a line naming the changed one, or restores exactly what was saved; an
    unsealed checkpoint is checked against the checksums saved with its arrays."""
    original = tmp_path / "original"
    ckpt = Checkpointer(original, keep=5)
    ckpt.save(1, _random_state(1))
    ckpt.save(2, _random_state(2))
    ckpt.wait()
    ckpt.close()
    if not sealed:  # killed between Orbax's commit and the seal
        (original / "2" / SEAL).unlink()
    data = sorted(p for p in (original / "2" / "default").rglob("*") if p.is_file())  # TensorStore's files
    sizes = [p.stat().st_size for p in data]
    chunk = data[sizes.index(max(sizes))]  # the weights: 8 KiB of floats, compressed, then an index
    rng = np.random.default_rng(7)
    flips = [(chunk, int(b)) for b in rng.choice(6000 * 8, 24, replace=False)]  # in the floats
    flips += [(data[i], int(rng.integers(sizes[i] * 8))) for i in rng.integers(len(data), size=16)]
    like = {"params": {"w": np.zeros((64, 32), np.float32)}, "step": np.int32(0)}
    caught = 0
    for n, (path, bit) in enumerate(flips):
        work = tmp_path / f"flip{n}"
        shutil.copytree(original, work)
        _flip(work / path.relative_to(original), bit)
        capsys.readouterr()
        ckpt = Checkpointer(work, keep=5)
        state, step = ckpt.restore(like)
        ckpt.close()
        out = capsys.readouterr().out
        if step == 1:
            caught += 1
            assert out.startswith("warning: checkpoint 2 (") and out.count("\n") == 1, out
            assert " is corrupt: " in out or " is unreadable (" in out, out
            np.testing.assert_array_equal(state["params"]["w"], _random_state(1)["params"]["w"])
        else:  # the flip changed nothing that is read (a spare bit of an index node)
            assert out == "", out
            np.testing.assert_array_equal(state["params"]["w"], _random_state(2)["params"]["w"])
        shutil.rmtree(work)
    assert caught >= 24  # each flip in the floats changes them, and is caught
    print(f"{'sealed' if sealed else 'unsealed'}: {caught} of {len(flips)} single-bit flips caught")


def test_a_checkpoint_is_sealed_once_committed_without_waiting_for_the_next_save(tmp_path):
    """Issue 63 (5): the seal was written only by the next save (a whole checkpoint interval
    later) or at the end of the run; a kill -9 meanwhile left the newest checkpoint unsealed.
    It is written in the background as soon as Orbax commits the save."""
    ckpt = Checkpointer(tmp_path, keep=5)
    ckpt.save(1, _random_state(1))
    deadline = time.monotonic() + 60
    while not (tmp_path / "1" / SEAL).exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert (tmp_path / "1" / SEAL).exists()
    assert ckpt.verify(1) == "intact"
    ckpt.close()


def test_the_checksums_of_an_array_are_the_same_on_any_devices_and_change_with_any_one_bit(strategy8):
    """The sums computed on the devices (any sharding) equal the host's, and every single-bit
    flip of the array changes them."""
    x = np.random.default_rng(0).standard_normal((16, 8), np.float32)
    host = checksums({"x": x})
    sharded = jax.device_put(x, jax.sharding.NamedSharding(strategy8.mesh, jax.sharding.PartitionSpec("data")))
    assert checksums({"x": sharded}) == checksums({"x": jax.device_put(x, jax.devices()[0])}) == host
    words = x.view(np.uint32).reshape(-1)
    seen = set()
    for i in range(words.size):
        for k in range(32):
            flipped = words.copy()
            flipped[i] ^= np.uint32(1 << k)
            seen.add(checksums({"x": flipped.view(np.float32).reshape(x.shape)})["x"])
    assert host["x"] not in seen
    for dtype in ("bfloat16", "float16", "int8", "bool", "int32"):
        y = jax.numpy.asarray(np.arange(24).reshape(4, 6) % 3).astype(dtype)
        assert checksums({"y": y}) == checksums({"y": np.asarray(y)}), dtype


@pytest.mark.parametrize("sealed", [True, False])
@pytest.mark.parametrize("key", ["item_handlers", "metrics", "commit_timestamp_nsecs"])
def test_a_renamed_key_in_orbaxs_step_metadata_falls_back_to_the_previous_checkpoint(tmp_path, capsys, key, sealed):
    """Issue 63's walk: one flipped bit renaming a key of a step's ``_CHECKPOINT_METADATA``
    ("metrics" -> "metricr") made Orbax's CheckpointManager raise a ValueError traceback
    while it opened the directory, before any of xlafit's checks. The step is now passed
    over as other corruptions are, with one line naming it, sealed or not."""
    ckpt = Checkpointer(tmp_path, keep=5)
    ckpt.save(1, _state(1))
    ckpt.save(2, _state(2))
    ckpt.close()
    if not sealed:
        (tmp_path / "2" / SEAL).unlink()
    record = tmp_path / "2" / "_CHECKPOINT_METADATA"
    text = record.read_text()
    record.write_text(text.replace(f'"{key}"', f'"{key[:-1]}{chr(ord(key[-1]) ^ 1)}"', 1))  # one bit
    capsys.readouterr()

    ckpt = Checkpointer(tmp_path, keep=5)
    statuses = [(i.step, i.status.split(":")[0]) for i in ckpt.list()]
    state, step = ckpt.restore(_state(0))
    ckpt.save(3, _state(3))  # the run goes on, in the same directory
    ckpt.close()
    out = capsys.readouterr().out
    assert statuses == [(1, "intact"), (2, "corrupt" if sealed else "unsealed")]
    assert step == 1 and state["params"]["w"].tolist() == [1.0] * 3
    assert out.startswith("warning: checkpoint 2 (") and out.count("\n") == 1 and " is corrupt: " in out, out
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith("corrupt-")) == ["1", "3"]


def test_a_save_on_cpu_devices_compiles_no_program_for_each_replica(tmp_path, strategy8):
    """Orbax saved a replicated array in parts, one per replica, each part sliced on its
    device by a program of its own: eight compiles an array on 8 simulated CPU devices,
    about 2 CPU-seconds of each MNIST run's saves. CPU devices share one memory, so one
    replica writes it whole; the only program is the checksums' (one for the whole state)."""
    replicated = jax.sharding.NamedSharding(strategy8.mesh, jax.sharding.PartitionSpec())
    # shapes of their own (a program compiled earlier in this process would hide a new one)
    state = {f"w{i}": jax.device_put(np.full((8 * (11 + i), 3), i, np.float32), replicated) for i in range(4)}
    compiles = []

    def count(event, duration, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(event)

    jax.monitoring.register_event_duration_secs_listener(count)
    try:
        ckpt = Checkpointer(tmp_path, async_save=False)
        ckpt.save(1, state)
        ckpt.wait()
    finally:
        jax.monitoring.unregister_event_duration_listener(count)
    assert len(compiles) <= 1, f"{len(compiles)} programs compiled to save 4 replicated arrays"
    restored, _ = ckpt.restore(state, step=1)
    ckpt.close()
    assert all(np.array_equal(restored[k], state[k]) for k in state)
