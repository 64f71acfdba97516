"""``xlafit check --tpu``'s report: one target's lines, the targets side by side, JSON."""

from __future__ import annotations

import dataclasses
from typing import Any

from xlafit.check.program import MAX_PROBES, TargetReport, used_bytes
from xlafit.check.speed import above_prediction, outside_band
from xlafit.platform import hardware as tpu


def seconds(x: float) -> str:
    """``289 ms`` under a second, ``9.17 s`` above."""
    return f"{x * 1e3:.3g} ms" if x < 1 else f"{x:.3g} s"


def gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if abs(n) >= 2**30 / 100 else f"{n / 2**20:.1f} MiB"


def rate(x: float | None, unit: str = "") -> str:
    """A rate in three digits with its SI prefix: ``rate(12345, "tokens/s")`` is ``12.3k tokens/s``."""
    if not x:
        return "-"
    for scale, prefix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if x >= scale:
            return f"{x / scale:.3g}{prefix} {unit}".rstrip()
    return f"{x:.3g} {unit}".rstrip()


def target_peak(r: TargetReport) -> str:
    t = tpu.parse_target(r.target)
    return f"{t.peak_flops / 1e12:.4g} TFLOP/s bf16 per core"


def format_report(r: TargetReport) -> str:
    """One target's report, as lines for a terminal."""
    shared = (
        f"; each batch shard is shared by a tensor group of {r.devices // r.batch_shards} cores"
        if r.batch_shards and r.batch_shards != r.devices
        else ""
    )
    batch = f"per-core batch {r.per_device_batch} (global {r.per_device_batch * r.batch_shards}{shared}), "
    if r.error is not None and r.error.kind == "batch":  # no per-core batch: the error says why
        batch = ""
    head = f"{r.target} ({r.devices} x {r.device_kind}), {batch}{r.steps_per_call} step(s) per call"
    lines = [head, f"  {r.layout}"] if r.layout and "replicated" not in r.layout else [head]
    if r.hosts > 1:  # the program is one; running it takes a process on each VM
        lines.append(
            f"  a multi-host slice: {r.hosts} TPU VMs of {r.devices // r.hosts} devices, one process each; run the "
            "same command on every VM with XLAFIT_DISTRIBUTED=1 (the multi-host guide)"
        )
    if r.error is not None:
        where = f" at {r.error.file}:{r.error.line}" if r.error.file and r.error.line else ""
        lines.append(f"  ✗ {r.error.title}{where}")
        if r.error.code:
            lines.append(f"      {r.error.line} | {r.error.code}")
        lines.append(f"    {r.message}")
        return "\n".join(lines)
    lines += _fit_lines(r) + _eval_lines(r) + _rollout_lines(r) + _verdict_lines(r) + _speed_lines(r)
    lines += _rollout_speed_lines(r)
    if r.train_fits:
        lines.append(f"  compiled in {r.compile_s:.1f} s on this machine")
    if r.probes:
        lines.append(_probe_line(r))
    lines += lever_lines(r)
    return "\n".join(lines)


def _fit_lines(r: TargetReport) -> list[str]:
    """The verdict: HBM per core and its parts, or by how much it is over and the levers."""
    cap = f"{gib(r.capacity)} per core ({r.capacity_source})"
    if not r.train_fits:
        need = f" needs {gib(r.memory['total'])}," if "total" in r.memory else ""
        over = f" over by {gib(-(r.margin or 0))}" if r.margin is not None else ""
        lines = [f"  ✗ train step does not fit:{need} {cap}{over}", f"    the compiler: {r.message}"]
        state = r.memory.get("state")
        if state and r.capacity and state >= r.capacity:  # then the levers are the state's (check.levers)
            lines.append(
                f"    no per-core batch fits: the train state alone (parameters, optimizer state) takes {gib(state)} "
                f"per core, more than the {gib(r.capacity)} there; only splitting or moving the state helps:"
            )
            lines += [f"      - {lever}" for lever in r.levers] or [
                "      - none known to xlafit for this program: a smaller model, or smaller parameters and optimizer "
                "state (bfloat16, LoRA's frozen base)"
            ]
        elif r.levers:
            made_of = f" (the train state takes {gib(state)} per core)" if state else ""
            lines.append(f"    levers, most promising first{made_of}:")
            lines += [f"      - {lever}" for lever in r.levers]
        return lines
    m = r.memory
    parts = ", ".join(
        f"{k} {gib(m[k])}" for k in ("state", "batch", "outputs", "temporaries", "generated code") if k in m
    )
    if "host memory" in m:  # trainer.optimizer_offload's state: beside the HBM, not in it
        parts += f"; in the host's memory, beside the HBM: {gib(m['host memory'])}"
    used = used_bytes(m) or 0
    if "peak" in m:  # the compiler's own count is what must fit; the parts are said beside it
        lines = [
            f"  HBM per core: {gib(used)} of {cap} (the compiler's peak)",
            f"    its buffers: {parts}: {gib(m['total'])} in all, each counted whether or not live at once",
        ]
    else:
        lines = [f"  HBM per core: {gib(used)} of {cap}", f"    {parts}"]
    if (r.margin or 0) >= 0:
        share = used / r.capacity if r.capacity else 0
        lines.append(f"  ✓ train step fits, {gib(r.margin or 0)} to spare ({share:.0%} used)")
    else:  # accepted by the compiler, whose own peak is what must fit
        lines.append(
            f"  ✓ train step fits, with nothing to spare: the compiler placed it within {gib(r.capacity)}; the parts "
            "above add up to more because buffers that are never live at the same time are each counted"
        )
    return lines


def lever_lines(r: TargetReport) -> list[str]:
    """The levers compiled (:mod:`xlafit.check.lever_fits`): one line each, with its memory and,
    where it fits, the predicted step and its error band (or "not validated")."""
    if not r.lever_fits:
        return []
    batch = r.lever_fits[0].per_device_batch
    where = "the run's batch" if not r.train_fits else "the smallest batch that does not fit"
    n = sum(1 for f in r.lever_fits if f.fits is not None)
    took = sum(f.compile_s for f in r.lever_fits)
    spent = f", {took:.0f} s on this machine" if took else ""
    lines = [f"  with each lever, compiled (train step, {batch} per core: {where}; {n} compile(s){spent}):"]
    for f in r.lever_fits:
        setting = " ".join(f.overrides)
        if f.fits:
            step = "-"
            if f.step_s:
                band = (
                    f" ±{f.band_median:.0%}"
                    if f.band_median is not None
                    else " (not validated)"
                    if f.predicted
                    else " (roofline)"
                )
                tokens = f", {rate(f.tokens_per_s, 'tokens/s')}" if f.tokens_per_s else ""
                step = f"{seconds(f.step_s)}{band}{tokens}"
            lines.append(f"    ✓ {setting} ({f.name}): fits, {gib(f.memory or 0)} per core; step {step}")
        elif f.fits is False:
            need = f" needs {gib(f.memory)}" if f.memory else ""
            why = f": {f.message}" if f.message and "state alone" in f.message else ""
            lines.append(f"    ✗ {setting} ({f.name}): does not fit,{need}{why}")
        else:
            lines.append(f"    - {setting} ({f.name}): not compiled: {f.message}")
    if not any(f.fits for f in r.lever_fits):
        smaller = "a smaller batch, " if batch > 1 else ""  # one a core is the smallest
        lines.append(f"    none of these fits: {smaller}a larger slice, a smaller model, or another lever listed above")
    return lines


def _eval_lines(r: TargetReport) -> list[str]:
    """The eval step's verdict: what the compiler placed (its peak, the sum of its buffers
    beside), or by how much it is over and the eval batch that fits."""
    e = r.eval
    if e is None:
        return []
    head = f"  {'✓' if e.fits else '✗'} eval step (batch {e.per_device_batch} per core)"
    if e.fits:
        used = e.peak or e.total or 0
        what = "the compiler's peak" if e.peak else "its buffers"
        parts = (
            f" (its buffers add up to {gib(e.total)}: temporaries never live at the same time are each counted)"
            if e.total and e.total > max(used, r.capacity)  # a sum over the capacity, placed by the compiler
            else ""
        )
        return [
            f"{head} fits: {what} {gib(used)} of {gib(r.capacity)} per core{parts}, compiled in {e.compile_s:.1f} s"
        ]
    need = f" needs {gib(e.needed)}," if e.needed else ""
    over = f" over by {gib(e.needed - r.capacity)}" if e.needed and r.capacity else ""
    lines = [f"{head} does not fit:{need} {gib(r.capacity)} per core{over}", f"    the compiler: {e.message}"]
    probes = ", ".join(f"{p.per_device_batch}{'✓' if p.fits else '✗'} {p.seconds:.1f}s" for p in e.probes)
    if e.fix:
        lines.append(f"    fix: {e.fix} ({e.largest} per core, the largest that compiles; probes: {probes})")
    else:
        lines.append(
            f"    no eval batch fits, not even one example per core (probes: {probes}): the train step's levers "
            "below shrink it too"
        )
    return lines


def _rollout_lines(r: TargetReport) -> list[str]:
    """The programs beside the steps (GRPO's rollout): each one's verdict and memory per core."""
    lines = []
    for p in r.rollout:
        head = f"  {'✓' if p.fits else '✗'} {p.name} ({p.rows} rows over all cores)"
        if p.fits:
            used = p.peak or p.total or 0
            what = "the compiler's peak" if p.peak else "its buffers"
            lines.append(
                f"{head} fits: {what} {gib(used)} of {gib(r.capacity)} per core, compiled in {p.compile_s:.1f} s"
            )
        elif p.failed:
            lines += [
                f"{head} does not compile for this layout: the TPU compiler failed, not for memory (another layout "
                f"may compile: more rows a batch shard, or mesh.data)",
                f"    the compiler: {p.message}",
            ]
        else:
            need = f" needs {gib(p.needed)}," if p.needed else ""
            over = f" over by {gib(p.needed - r.capacity)}" if p.needed and r.capacity else ""
            lines += [f"{head} does not fit:{need} {gib(r.capacity)} per core{over}", f"    the compiler: {p.message}"]
    return lines


def _verdict_lines(r: TargetReport) -> list[str]:
    """The run's verdict, from every program it compiles (:func:`xlafit.check.program.decide`),
    where it differs from the train step's own: a run whose eval step does not fit dies at its
    first evaluation."""
    if r.fits is not False or not r.train_fits:
        return []
    fix = f"; {r.eval.fix}" if r.eval is not None and r.eval.fix else ""
    where = "evaluation, after the training up to it" if "eval step" in r.unfit else "rollout"
    failed = [p.name for p in r.rollout if p.failed]
    verdict = "does not compile" if failed and len(failed) == len(r.unfit) else "does not fit"
    return [f"  ✗ the run {verdict}: its {' and '.join(r.unfit)} does not (a run dies at its first {where}){fix}"]


def _speed_lines(r: TargetReport) -> list[str]:
    """FLOPs per step (XLA's count against the analytic one), the step model's prediction
    with its measured error, and the roofline estimate (and why, when it is above the prediction)."""
    lines = []
    if r.flops_per_step:
        analytic = ""
        if r.analytic_flops_per_step:
            analytic = (
                f" (analytic {r.analytic_flops_per_step:.4g}, XLA/analytic "
                f"{r.flops_per_step / r.analytic_flops_per_step:.3f})"
            )
        lines.append(f"  FLOPs per core per step (XLA): {r.flops_per_step:.4g}{analytic}")
        if r.steps_per_call > 1 and r.flops_per_call:
            lines.append(f"    per call of {r.steps_per_call} steps: {r.flops_per_call:.4g}")
    tokens = f", {rate(r.tokens_per_s, 'tokens/s')}" if r.tokens_per_s else ""
    if r.predicted and r.step_s:
        rates = "" if r.rates == "built-in" else f"; rates from {r.rates}"
        # Under 1 ms, launch and dispatch (not in the step model) decide the step: no throughput from it.
        speed = (
            "the device's work alone, no throughput predicted"
            if outside_band(r.step_s)
            else f"{rate(r.examples_per_s, 'examples/s')}{tokens}"
        )
        lines.append(f"  step (predicted, not measured): {predicted_step(r)}, {speed}")
        lines.append(f"    {r.band}" if r.outside_band else f"    the step model's error: {r.band}{rates}")
    elif r.band:
        lines.append(f"  {r.band}")
    if r.bound_s and r.compute_s is not None and r.memory_s is not None:
        lines.append(f"  roofline estimate: {seconds(r.bound_s)}, the larger of")
        lines.append(
            f"    compute {seconds(r.compute_s)} at {target_peak(r)} (a strict lower bound); memory "
            f"{seconds(r.memory_s)} for XLA's count of {r.bytes_per_step or 0:.3g} bytes accessed (may "
            "overstate HBM traffic)"
        )
        if r.predicted and r.step_s and (why := above_prediction(r.step_s, r.compute_s, r.memory_s)):
            lines.append(f"    {why}")
    return lines


def _rollout_speed_lines(r: TargetReport) -> list[str]:
    """The rollout's programs (:mod:`xlafit.check.rollout_speed`): each one's predicted run with
    its band (or "not validated"), a decode loop's part beside its weights-read floor, and the
    rollout's share of a generation batch's whole step (the rollout, then its train steps)."""
    priced = [p for p in r.rollout if p.run_s]
    if not priced:
        return []
    t = tpu.parse_target(r.target)
    how = "predicted, not measured" if any(p.predicted for p in priced) else "roofline estimate"
    lines = [f"  rollout ({how}), one generation batch of {priced[0].rows} rows:"]
    for p in priced:
        band = f" ±{p.band_median:.0%}" if p.band_median is not None else " (not validated)" if p.predicted else ""
        lines.append(f"    {p.name}: {seconds(p.run_s or 0)}{band if p.predicted else ' (roofline estimate)'}")
        if p.band:
            lines.append(f"      {p.band}" if p.band_median is None else f"      the step model's error: {p.band}")
        if p.decode_steps and p.decode_s is not None and p.floor_s is not None:
            links = f"; {seconds(p.decode_collective_s)} of it collectives" if p.decode_collective_s else ""
            lines.append(
                f"      its decode loop: {p.decode_steps} steps (each runs, its rows stopped or not), "
                f"{seconds(p.decode_s)}: {p.decode_flops or 0:.3g} FLOPs, {p.decode_bytes or 0:.3g} HBM bytes per "
                f"core{links}"
            )
            kept = ""
            if p.on_chip:  # the loop's state in on-chip memory: weights, or the cache, which may be more
                kept = (
                    f", less the {gib(p.on_chip)} the loop keeps in on-chip memory,"
                    if p.on_chip < (p.weights or 0)
                    else f" (the loop keeps {gib(p.on_chip)} in on-chip memory: no weight read from HBM is left),"
                )
            lines.append(
                f"      the loop's floor: {seconds(p.floor_s)}, {p.decode_steps} steps each reading the policy's "
                f"{gib(p.weights or 0)} of weights per core (each core's shard){kept} from HBM at "
                f"{t.hbm_bandwidth / 1e9:.0f} GB/s"
            )
            if p.decode_s < p.floor_s:
                lines.append("      below the floor: the prediction is too fast for this loop; the floor bounds it")
    if r.grpo_step_s and r.step_s and r.rollout_s is not None and r.rollout_share is not None:
        lines.append(
            f"    a whole GRPO step: the rollout {seconds(r.rollout_s)} + {r.steps_per_call} train step(s) x "
            f"{seconds(r.step_s)} = {seconds(r.grpo_step_s)}; the rollout's share {r.rollout_share:.0%}"
        )
    return lines


def predicted_step(r: TargetReport) -> str:
    """``452 ms ±9 %``: the predicted step with its median measured error."""
    band = f" ±{r.band_median:.0%}" if r.band_median is not None else ""
    return f"{seconds(r.step_s)}{band}" if r.step_s else "-"


def _probe_line(r: TargetReport) -> str:
    """--max-batch's answer; at the search's limit it is a lower bound, and says so."""
    probes = ", ".join(f"{p.per_device_batch}{'✓' if p.fits else '✗'} {p.seconds:.1f}s" for p in r.probes)
    if r.max_batch_limit is not None and r.max_batch is not None and r.max_batch >= r.max_batch_limit:
        answer = f">= {r.max_batch} (the search's limit; --max-batch-limit {r.max_batch_limit * 4} searches further)"
    else:
        refused = min((p.per_device_batch for p in r.probes if not p.fits), default=None)
        bound = f" ({refused} does not)" if refused is not None and refused > (r.max_batch or 0) + 8 else ""
        if bound and len(r.probes) >= MAX_PROBES:
            bound = f" ({refused} does not; the batches between were not compiled: {MAX_PROBES} probes at most)"
        answer = f"{r.max_batch}{bound}"
    line = f"  largest per-core batch that fits: {answer}   probes: {probes}"
    at = r.max_batch_speed
    if at is not None:  # its probe's program, priced as the run's batch is above
        if at["predicted"]:
            tokens = f", {rate(at['tokens_per_s'], 'tokens/s')}" if at["tokens_per_s"] else ""
            speed = (
                "the device's work alone, no throughput predicted"
                if outside_band(at["step_s"])
                else f"{rate(at['examples_per_s'], 'examples/s')}{tokens}"
            )
            band = at["band"] if at["outside_band"] else f"the step model's error: {at['band']}"
            line += f"\n    at {r.max_batch} per core (predicted, not measured): step {seconds(at['step_s'])}, {speed}"
            line += f"; {band}"
        else:  # no step model for the device: the roofline estimate, as above
            speed = f"~{rate(at['examples_per_s'], 'examples/s')}"
            line += f"\n    at {r.max_batch} per core: roofline estimate ~{seconds(at['step_s'])}, {speed}"
    if r.eval is not None:  # the search compiles the train step; the eval step has a batch of its own
        line += "\n    (the train step's; the eval step is checked at its own batch, data.eval_global_batch, above)"
    return line


def format_table(reports: list[TargetReport]) -> str:
    """Targets side by side: verdict, HBM per core, largest batch, predicted step (or the
    roofline estimate, marked ``~``, where the device has no step model; ``?`` and no
    throughput under 1 ms, where launch and dispatch decide the step)."""
    rows = [("target", "fits", "HBM/core", "of", "max batch", "step (predicted)", "examples/s", "compile")]
    for r in reports:
        total = used_bytes(r.memory)
        rows.append(
            (
                r.target,
                "error" if r.error is not None else "yes" if r.fits else "no",
                gib(total) if total else "-",
                gib(r.capacity) if r.capacity else "-",
                str(r.max_batch) if r.max_batch is not None else "-",
                f"{predicted_step(r)}{'?' if r.outside_band else ''}"
                if r.predicted
                else f"~{seconds(r.bound_s)} (roofline)"
                if r.bound_s
                else "-",
                "-"
                if outside_band(r.step_s)
                else rate(r.examples_per_s)
                if r.predicted or not r.examples_per_s
                else f"~{rate(r.examples_per_s)}",
                f"{r.compile_s:.0f} s" if r.compile_s else "-",
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in rows)


def to_json(r: TargetReport) -> dict[str, Any]:
    out = dataclasses.asdict(r)
    out["error"] = None if r.error is None else {**dataclasses.asdict(r.error), "title": r.error.title}
    out["fits"], out["unfit"] = r.fits, r.unfit
    out["flops_per_call"] = r.flops_per_call
    out["margin"] = r.margin
    out["rollout_s"], out["grpo_step_s"], out["rollout_share"] = r.rollout_s, r.grpo_step_s, r.rollout_share
    return out
