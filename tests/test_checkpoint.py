"""Checkpointer: what `list` reports about the checkpoints on disk."""

import datetime
import json
import os

import numpy as np

from xlafit.checkpoint import Checkpointer


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
