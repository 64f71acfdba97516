"""What a run tells people and machines: progress, ``metrics.jsonl`` and TensorBoard.

Only process 0 writes; every other process stays quiet.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from tqdm import tqdm


class RunReport:
    """Writes metrics records and shows progress.

    On a terminal the progress is a bar with ETA; otherwise (CI, log files) it is one plain
    line per logged step.

    Args:
        run_dir: where ``metrics.jsonl`` and ``tensorboard/`` go; None writes no files.
        total_steps: the run's last step, for the bar and ETA.
        start_step: where the bar starts (non-zero on resume).
        enabled: False on processes other than 0.
    """

    def __init__(self, run_dir: Path | None, total_steps: int, start_step: int = 0, enabled: bool = True) -> None:
        self.enabled = enabled
        self._jsonl = None
        self._tb = None
        self._bar = None
        if not enabled:
            return
        if run_dir is not None:
            run_dir.mkdir(parents=True, exist_ok=True)
            self._jsonl = open(run_dir / "metrics.jsonl", "a", encoding="utf-8")
            from tensorboardX import SummaryWriter

            self._tb = SummaryWriter(str(run_dir / "tensorboard"))
        if sys.stderr.isatty():
            self._bar = tqdm(total=total_steps, initial=start_step, unit="step", dynamic_ncols=True, leave=True)

    def print(self, message: str) -> None:
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.write(message)
        else:
            print(message, flush=True)

    def record(self, record: dict[str, Any], prefix: str = "train") -> None:
        """Appends ``record`` to metrics.jsonl and TensorBoard, and shows it."""
        if not self.enabled:
            return
        step = record["step"]
        if self._jsonl is not None:
            self._jsonl.write(json.dumps({"split": prefix, **record}) + "\n")
            self._jsonl.flush()
        if self._tb is not None:
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)):
                    self._tb.add_scalar(f"{prefix}/{key}", value, step)
            self._tb.flush()
        shown = "  ".join(_fmt(k, v) for k, v in record.items() if k not in ("step", "epoch"))
        if self._bar is not None and prefix == "train":
            brief = "  ".join(_fmt(k, v) for k, v in record.items() if k in _BAR_KEYS)
            self._bar.set_postfix_str(brief, refresh=False)
            self._bar.update(step - self._bar.n)
        else:
            self.print(f"[{prefix}] step {step} epoch {record.get('epoch', '')}  {shown}")

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        if self._jsonl is not None:
            self._jsonl.close()
        if self._tb is not None:
            self._tb.close()


_BAR_KEYS = ("loss", "accuracy", "masked_accuracy", "examples_per_sec", "tokens_per_sec", "mfu")


def _fmt(key: str, value: Any) -> str:
    if isinstance(value, float):
        if key == "learning_rate":
            return f"{key}={value:.3g}"
        return f"{key}={value:.4f}" if abs(value) < 1000 else f"{key}={value:.0f}"
    return f"{key}={value}"
