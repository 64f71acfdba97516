"""What a run tells people and machines: progress, ``metrics.jsonl`` and TensorBoard.

Only process 0 writes; every other process stays quiet. The run directory may be a URL
(``gs://bucket/run``): the files are then written in a local copy and uploaded whole at
every checkpoint (:meth:`RunReport.sync`) and at the end, because an object store has no
append and TensorBoard's writer would upload its whole event file at every flush.

On a resume, ``metrics.jsonl`` keeps the records up to the checkpoint the run resumed
from and drops the later ones (the steps between that checkpoint and the interruption,
which the resumed run trains and logs again), so every logged step appears once.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import sys
from pathlib import Path
from typing import Any

from tqdm import tqdm

from xlafit.errors import WriteError, write_failed
from xlafit.io.paths import AnyPath, LocalCopy

# What tensorboardX imports only for the types of tensors it accepts (torch's) and for logdirs
# of its own in a bucket (google.cloud.storage): most of a training command's start-up,
# about 1.6 CPU-seconds, though xlafit logs Python numbers to a local folder.
_TENSORBOARDX_OPTIONAL = ("torch", "google.cloud.storage")


def _summary_writer(logdir: Path, purge_step: int | None = None) -> Any:
    """tensorboardX's ``SummaryWriter`` for ``logdir``, imported without the modules of
    ``_TENSORBOARDX_OPTIONAL`` (each guarded there by ``except ImportError``) where nothing
    imported them yet; they stay importable afterwards. ``purge_step`` (a resume): its new
    event file starts with TensorBoard's restart marker (a ``SessionLog.START`` at that step),
    after which TensorBoard drops the earlier files' events from that step on: the steps a
    killed run logged after its last checkpoint, which the resumed run logs again."""
    blocked = [name for name in _TENSORBOARDX_OPTIONAL if name not in sys.modules]
    for name in blocked:
        sys.modules[name] = None  # type: ignore[assignment]  # `import name` raises ImportError
    try:
        from tensorboardX import SummaryWriter
    finally:
        for name in blocked:
            if sys.modules.get(name, "") is None:
                del sys.modules[name]
    return SummaryWriter(str(logdir), purge_step=purge_step)


class RunReport:
    """Writes metrics records and shows progress.

    Every logged step prints one line, ``[train] step ...`` with all its metrics; on a terminal,
    and in a Jupyter notebook with ipywidgets (Colab, Kaggle), a progress bar with the ETA is
    drawn beside the lines, which print through it.

    Args:
        run_dir: where ``metrics.jsonl`` and ``tensorboard/`` go, a path or URL; None
            writes no files.
        total_steps: the run's last step, for the bar and ETA.
        start_step: where the bar starts (non-zero on resume); earlier records after it
            are dropped from ``metrics.jsonl``, and marked for TensorBoard to drop.
        enabled: False on processes other than 0.
        evaluates_again: a finished run evaluated again (its command run once more): its
            earlier evaluation of ``start_step`` is dropped, so that the step keeps one.

    Raises:
        StorageError: ``run_dir`` is a URL that cannot be read (the message names it).
        WriteError: ``metrics.jsonl`` or ``tensorboard/`` cannot be written (a full disk, a
            read-only directory); the message names it and the fix.
    """

    def __init__(
        self,
        run_dir: AnyPath | None,
        total_steps: int,
        start_step: int = 0,
        enabled: bool = True,
        evaluates_again: bool = False,
    ) -> None:
        self.enabled = enabled
        self._jsonl = None
        self._tb = None
        self._bar = None
        self._copy: LocalCopy | None = None
        self._metrics: Any = None
        # The records the run logged before this resume, up to the step it resumes from.
        self.earlier: list[dict[str, Any]] = []
        if not enabled:
            return
        if run_dir is not None:
            self._copy = LocalCopy(run_dir)
            self._copy.local.mkdir(parents=True, exist_ok=True)
            metrics = self._copy.fetch("metrics.jsonl")
            self._metrics = self._copy.target / "metrics.jsonl"  # the name the user knows (a URL stays one)
            try:
                self.earlier = _keep_until(metrics, start_step, evaluated=evaluates_again)
                self._jsonl = open(metrics, "a", encoding="utf-8")
            except OSError as e:
                raise write_failed(self._metrics, e) from None
            try:
                self._tb = _summary_writer(self._copy.local / "tensorboard", start_step + 1 if start_step else None)
            except OSError as e:
                self.close()
                raise write_failed(self._copy.target / "tensorboard", e) from None
        bar = notebook_tqdm() if in_notebook() else tqdm if sys.stderr.isatty() else None
        if bar is not None:
            self._bar = bar(total=total_steps, initial=start_step, unit="step", dynamic_ncols=True, leave=True)

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
            try:
                self._jsonl.write(json.dumps({"split": prefix, **record}) + "\n")
                self._jsonl.flush()
            except OSError as e:
                raise write_failed(self._metrics, e) from None
        if self._tb is not None:
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)):
                    self._tb.add_scalar(f"{prefix}/{key}", value, step)
            try:
                self._tb.flush()
            except OSError as e:
                raise write_failed(self._tb.logdir, e) from None
        shown = "  ".join(
            _fmt(k, v) for k, v in record.items() if k not in ("step", "epoch") and not k.startswith(EXPERT_TOKENS)
        )
        # The line comes first, printed through the bar (above it on a terminal), the bar's
        # advance after: its postfix keeps a few metrics in view, the line has them all
        # (grad_norm, learning_rate, DPO's and GRPO's rewards).
        self.print(f"[{prefix}] step {step} epoch {record.get('epoch', '')}  {shown}")
        if self._bar is not None and prefix == "train":
            brief = "  ".join(_fmt(k, v) for k, v in record.items() if k in _BAR_KEYS)
            self._bar.set_postfix_str(brief, refresh=False)
            self._bar.update(step - self._bar.n)
            if self._bar.total and self._bar.n >= self._bar.total:
                # Done: closed at 100 %, so what follows (the evaluation, the checkpoint, the
                # result) prints below it instead of clearing and redrawing it each time.
                self._bar.close()
                self._bar = None

    def sync(self) -> None:
        """Uploads what changed to a URL run directory (nothing to do for a local one).
        The trainer calls it before each checkpoint, so the bucket's metrics always reach
        at least the newest checkpoint.

        Raises:
            StorageError: the upload failed; the message names the URL.
        """
        if self._copy is not None and self._copy.remote:
            if self._tb is not None:
                self._tb.flush()
            self._copy.upload()

    def close(self) -> None:
        """Closes the bar, the files and the TensorBoard writer, each even when another fails
        (a writer left open prints tracebacks when the process exits).

        Raises:
            WriteError: what was left to write could not be (a full disk); the message names it.
        """
        failed: WriteError | None = None
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        if self._jsonl is not None:
            jsonl, self._jsonl = self._jsonl, None
            try:
                jsonl.close()
            except OSError as e:
                failed = write_failed(self._metrics, e)
                with contextlib.suppress(OSError):
                    jsonl.close()  # a second close only releases the descriptor
        if self._tb is not None:
            tb, self._tb = self._tb, None
            error = _close_tensorboard(tb)
            if error is not None and failed is None:
                failed = write_failed(tb.logdir, error)
        if self._copy is not None:
            copy, self._copy = self._copy, None
            copy.close()
        if failed is not None:
            raise failed


def _close_tensorboard(tb: Any) -> OSError | None:
    """Closes TensorBoard's writer; returns the error of a final flush that failed (a full
    disk), after stopping the writer anyway: tensorboardX marks a writer closed only once its
    flush succeeds, and otherwise tries again from its exit handler, which prints a traceback
    after xlafit's own message. What was left to write is lost either way."""
    try:
        tb.close()
        return None
    except OSError as e:
        for writer in (tb.all_writers or {}).values():
            events = writer.event_writer
            with contextlib.suppress(Exception):
                events._worker.stop()
            with contextlib.suppress(Exception):
                events._ev_writer.close()
            events._closed = True  # tensorboardX's own flag: its exit handler then does nothing
        tb.file_writer = tb.all_writers = None
        return e


def in_notebook() -> bool:
    """True inside a Jupyter kernel (Colab, Kaggle, JupyterLab), whose output is no terminal
    but shows a widget progress bar where ipywidgets is installed."""
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None and hasattr(ipython, "get_ipython") else None
    return shell is not None and hasattr(shell, "kernel")


def notebook_tqdm() -> type[tqdm] | None:
    """Jupyter's widget bar where ipywidgets is installed (Colab, Kaggle), else None: no bar.
    The text bar cannot redraw in place in a notebook, which shows stderr (the bar) and stdout
    (the lines printed through it) as separate outputs: every line left another copy of it."""
    if importlib.util.find_spec("ipywidgets") is None:
        return None
    from tqdm.notebook import tqdm as widget_tqdm

    return widget_tqdm


# Metrics of one value per expert (expert_tokens/0, ...): written, not printed (a line per
# 128 experts would drown the rest).
EXPERT_TOKENS = "expert_tokens/"
_BAR_KEYS = ("loss", "accuracy", "masked_accuracy", "examples_per_sec", "tokens_per_sec", "mfu")


def _fmt(key: str, value: Any) -> str:
    if isinstance(value, float):
        if key == "learning_rate":
            return f"{key}={value:.3g}"
        return f"{key}={value:.4f}" if abs(value) < 1000 else f"{key}={value:.0f}"
    return f"{key}={value}"


def _keep_until(path: Path, step: int, evaluated: bool = False) -> list[dict[str, Any]]:
    """Drops the records of ``metrics.jsonl`` after ``step`` (and a line cut short by a
    crash; with ``evaluated``, the evaluation of ``step`` itself, about to be made again),
    rewriting the file atomically (untouched when there is nothing to drop); returns the
    records kept."""
    if not path.exists():
        return []
    lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
    kept, records = [], []
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue  # half a line: the process died while writing it
        again = evaluated and record.get("split") == "eval" and record.get("step") == step
        if line.endswith("\n") and record.get("step", 0) <= step and not again:
            kept.append(line)
            records.append(record)
    if len(kept) != len(lines):
        tmp = path.with_name(path.name + ".tmp")
        try:
            tmp.write_text("".join(kept), encoding="utf-8")
            os.replace(tmp, path)  # atomic: the file is the old one or the new one, never a part
        finally:
            tmp.unlink(missing_ok=True)
    return records
