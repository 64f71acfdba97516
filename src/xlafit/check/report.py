"""The report of ``xlafit check``: findings, input shapes, memory, FLOPs and the TPU targets."""

from __future__ import annotations

import dataclasses
from typing import Any

from xlafit.check.program import TargetReport
from xlafit.check.rules import Finding
from xlafit.check.tpu_report import format_report as format_tpu_report
from xlafit.check.tpu_report import format_table
from xlafit.check.tpu_report import to_json as tpu_json
from xlafit.data.shapes import Plan, format_plans


@dataclasses.dataclass
class Report:
    target: str
    findings: list[Finding] = dataclasses.field(default_factory=list)
    traced: bool = False
    ran: bool = False
    shapes: dict[str, Any] | None = None
    plans: list[Plan] | None = None
    memory: dict[str, int] | None = None
    flops_per_step: float | None = None
    batch: dict[str, Any] = dataclasses.field(default_factory=dict)
    tpu: list[TargetReport] | None = None  # with --tpu: one report per TPU target
    # A recipe's settings the answer is for (the batch, the sequence, the model: defaults
    # included), as overrides, and the command that asks again with them written out.
    assumed: list[str] = dataclasses.field(default_factory=list)
    command: str = ""
    notes: list[str] = dataclasses.field(default_factory=list)  # what works, and what the user should know

    @property
    def ok(self) -> bool:
        """No rule violated and, with ``--tpu``, every target compiled and fits."""
        return not self.findings and all(t.fits and t.error is None for t in self.tpu or [])

    def to_json(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["findings"] = [{**dataclasses.asdict(f), "title": f.title, "fix": f.fix} for f in self.findings]
        out["plans"] = [{**dataclasses.asdict(p), "shapes": p.shapes, "waste": p.waste} for p in self.plans or []]
        out["tpu"] = [tpu_json(t) for t in self.tpu] if self.tpu is not None else None
        out["ok"] = self.ok
        return out

    def format(self) -> str:
        lines = [f"xlafit check {self.target}"]
        if self.assumed:
            lines += [f"  for: {' '.join(self.assumed)}", f"  to change any of them: {self.command}"]
        if self.tpu is not None:
            lines.append(f"  trace: {'ok' if self.traced else 'failed'} (for the TPU; nothing runs here)")
        else:
            lines.append(
                f"  trace: {'ok' if self.traced else 'failed'}   run on the example batch: "
                f"{'ok' if self.ran else 'not run' if not self.traced else 'failed'}"
            )
        lines += [f"  note: {note}" for note in self.notes]
        for f in self.findings:
            where = f" at {f.file}:{f.line}" if f.file and f.line else " in the data" if f.rule == 3 else ""
            lines += ["", f"✗ {f.title}{where}"]
            if f.code:
                lines.append(f"    {f.line} | {f.code}")
            lines.append(f"  {f.message}")
            if f.fix:
                lines += ["  the standard rewrite:", *("    " + s for s in f.fix.splitlines())]
        if self.shapes is not None:
            s = self.shapes
            if s.get("one_shape"):  # the recipe packs or pads its examples: rule 3 holds
                head = (
                    f"input shapes: one (the examples are packed or padded to rows of one length); fed one per row "
                    f"instead, the {s['examples']} examples' {s['distinct']} lengths would compile {s['distinct']} "
                    "programs"
                )
            else:
                head = (
                    f"input shapes: {s['distinct']} distinct over {s['examples']} examples -> {s['distinct']} "
                    "compiles if fed as they are"
                )
            lines += ["", head]
            if self.plans:
                lines += ["  padding plans (rule 3):", *("    " + r for r in format_plans(self.plans).splitlines())]
        if self.memory is not None or self.flops_per_step is not None:
            b = self.batch
            lines += [
                "",
                f"per device at batch {b.get('per_device')} ({b.get('devices')} device(s), global {b.get('global')}):",
            ]
            if self.memory:
                m = self.memory
                lines.append("  memory (XLA): " + ", ".join(f"{k} {_size(v)}" for k, v in m.items()))
            if self.flops_per_step:
                lines.append(f"  FLOPs per step (XLA cost analysis): {self.flops_per_step:.4g}")
        for t in self.tpu or []:
            lines += ["", format_tpu_report(t)]
        if self.tpu and len(self.tpu) > 1:
            lines += ["", format_table(self.tpu)]
        lines += ["", self._summary()]
        return "\n".join(lines)

    def _summary(self) -> str:
        """The last line: the findings, and how many TPU targets the run fits."""
        problems = len(self.findings) + sum(1 for t in self.tpu or [] if not t.fits or t.error is not None)
        line = "no rule violated" if not self.findings else f"{len(self.findings)} problem(s) found"
        if self.tpu:
            fit = sum(1 for t in self.tpu if t.fits)
            line += f"; fits {fit} of {len(self.tpu)} TPU target(s)" if problems or fit else ""
            erred = [t.target for t in self.tpu if t.error is not None]
            if erred:  # not a memory verdict: the run could not be compiled there as set
                line += f" ({', '.join(erred)}: not compiled, see above)"
        return line


def _size(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:,.1f} {unit}"
    return f"{n} B"


# --------------------------------------------------------------------------- locating
