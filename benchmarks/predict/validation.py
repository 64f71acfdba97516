"""Predicted against measured, for every measured step the project holds
(``benchmarks/validation``): the H200's training steps and their largest kernels, and
the published MaxText runs on TPUs, each predicted by today's step model with the built-in
rates (``src/xlafit/predict/rates.json``, made by ``benchmarks/predict/fit_rates.py``).

    python benchmarks/predict/validation.py [--json FILE] [--kernels]

Prints Markdown tables (the Performance page's) with the median and worst error of the steps
held out of the fits.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
from pathlib import Path

from fit_rates import TPU_FITTED, VALIDATION

from xlafit.predict.rates import BUILT_IN, load_rates
from xlafit.predict.validation import Check, covering, gpu_checks, kernel_units, tpu_checks, tpu_rows


def _summary(checks: list[Check]) -> str:
    held = [abs(c.error) for c in checks if c.role == "held out"]
    if not held:
        return "no held-out steps"
    return f"held out: {len(held)} steps, median error {statistics.median(held):.1%}, worst {max(held):.1%}"


def _table(checks: list[Check]) -> list[str]:
    lines = [
        "| step | device | measured | predicted | error | role | note |",
        "|---|---|---:|---:|---:|---|---|",
    ]
    for c in checks:
        lines.append(
            f"| {c.id} | {c.device} | {c.measured_s * 1e3:,.1f} ms | {c.predicted_s * 1e3:,.1f} ms | "
            f"{c.error:+.1%} | {c.role} | {c.note} |"
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", metavar="FILE", help="write every check as JSON")
    parser.add_argument(
        "--kernels", action="store_true", help="also list the H200 kernels that make up 80 %% of each step"
    )
    parser.add_argument(
        "--h200-peak-stream",
        type=float,
        metavar="BYTES_PER_S",
        help="what if: price the H200's element-wise kernels wider than its 4-byte stream up to this bandwidth "
        "instead of the fastest wide stream its micro-benchmarks measured (xlafit.predict.model.stream_rate)",
    )
    args = parser.parse_args()
    rows = load_rates(BUILT_IN)
    h200 = next(r for r in rows if r.device_kind == "NVIDIA H200")
    if args.h200_peak_stream:
        h200 = dataclasses.replace(h200, stream_bytes_per_element=4, hbm_peak_bytes_per_s=args.h200_peak_stream)
    gpu = gpu_checks(VALIDATION / "gpu-h200", h200)
    tpu = tpu_checks(VALIDATION / "tpu", tpu_rows(rows), TPU_FITTED)
    basis = "rates from micro-benchmarks only"
    if args.h200_peak_stream:
        basis = f"what if: wide element-wise kernels up to {args.h200_peak_stream / 1e12:g} TB/s"
    print(f"GPU ({basis}; " + _summary(gpu) + ")\n")
    print("\n".join(_table(gpu)))
    print("\nTPU (published MaxText runs; " + _summary(tpu) + ")\n")
    print("\n".join(_table(tpu)))
    kernels = {}
    for workload in (c.id for c in gpu):
        units = covering(kernel_units(VALIDATION / "gpu-h200", workload, h200))
        within = sum(abs(u.error) <= 0.3 for u in units)
        kernels[workload] = [dataclasses.asdict(u) | {"error": u.error} for u in units]
        print(
            f"\n{workload}: {within} of the {len(units)} kernels (or library groups) that make up 80 % of the step "
            "within 30 %"
        )
        if args.kernels:
            for u in units:
                print(
                    f"  {u.name[:48]:48s} {','.join(u.kinds):22s} measured {u.measured_s * 1e3:7.3f} ms  "
                    f"predicted {u.predicted_s * 1e3:7.3f} ms  {u.error:+.0%}"
                )
    if args.json:
        out = {
            "rates": [r.to_json() for r in rows],
            "h200": h200.to_json(),
            "gpu": [dataclasses.asdict(c) | {"error": c.error} for c in gpu],
            "tpu": [dataclasses.asdict(c) | {"error": c.error} for c in tpu],
            "kernels": kernels,
        }
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
        print(f"\nJSON: {args.json}")


if __name__ == "__main__":
    main()
