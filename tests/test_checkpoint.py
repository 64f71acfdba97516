"""Checkpointer: what `list` reports about the checkpoints on disk."""

import asyncio
import datetime
import gc
import json
import os

import numpy as np
import pytest
from orbax.checkpoint._src import asyncio_utils

from xlafit.checkpoint import SEAL, Checkpointer


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
    # checkpoint 2 without a commit time, before the seal covers it
    record = tmp_path / "2" / "_CHECKPOINT_METADATA"
    ckpt.save(2, _state(2))
    ckpt._manager.wait_until_finished()
    metadata = json.loads(record.read_text())
    metadata.pop("commit_timestamp_nsecs")
    record.write_text(json.dumps(metadata))
    ckpt.wait()
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
