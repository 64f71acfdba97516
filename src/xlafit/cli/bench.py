"""``xlafit bench RECIPE``: compile time, step time, input wait and MFU against peers."""

from __future__ import annotations

import argparse
import json
import os

from xlafit.cli.common import ints
from xlafit.errors import ConfigError


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "bench",
        help="benchmark a recipe: compile time, step time, input wait, MFU, against peers",
        description="Each configuration trains in its own process for --steps steps after --warmup; "
        "the table shows medians over --repeats runs. Example: xlafit bench mnist --simulate 8 "
        "--devices 1,all --compare torch --plot bench.png. With --calibrate (no recipe): measure this "
        "machine's achievable rates (matrix products, memory streams, a training step) and write the "
        "calibration file that check, plan and bench then use for its device kind.",
    )
    p.add_argument("recipe", nargs="?", help="recipe name: mnist or resnet (not with --calibrate)")
    p.add_argument(
        "--calibrate",
        action="store_true",
        help="measure this device's rates for the step model and write its calibration file (a few minutes "
        "on an accelerator; --calibrate-sizes tiny: seconds, for a try)",
    )
    p.add_argument("--calibrate-sizes", choices=("full", "tiny"), default="full", help="--calibrate's problem sizes")
    p.add_argument("--out", metavar="FILE.json", help="--calibrate: write here instead of the user cache (to share it)")
    p.add_argument("--devices", default="1,all", help="xlafit device counts, comma-separated; 'all' = every device")
    p.add_argument(
        "--compare",
        default="",
        help="peers, comma-separated: torch (eager), torch-compile, xlafit-torch (mnist: PyTorch's module "
        "trained by xlafit)",
    )
    p.add_argument("--steps", type=int, default=60, help="timed steps per run")
    p.add_argument("--epochs", type=float, help="time this many epochs instead of --steps")
    p.add_argument(
        "--warmup", type=int, default=10, help="untimed steps first (the compile and, on CPUs, the heap's growth)"
    )
    p.add_argument("--repeats", type=int, default=3, help="runs per configuration, interleaved")
    p.add_argument("--batch", type=int, default=128, help="global batch, the same for every configuration")
    p.add_argument(
        "--steps-per-call",
        default="1",
        metavar="K",
        help="xlafit steps per compiled call, comma-separated (a row each)",
    )
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="xlafit compute dtype")
    p.add_argument(
        "--data", default="embedded", help="'embedded' (4,000 real digits), 'synthetic', or a directory of IDX files"
    )
    p.add_argument(
        "--examples", type=int, help="size of the synthetic training set (default: 60,000 digits, 8 batches of images)"
    )
    p.add_argument("--depth", type=int, default=50, help="resnet: 18, 34, 50, 101 or 152")
    p.add_argument("--width", type=int, default=64, help="resnet: stem channels (64: the standard ResNet)")
    p.add_argument("--image-size", type=int, default=224, help="resnet: image height and width")
    p.add_argument("--simulate", type=int, metavar="N", help="on a CPU, 'all' means N simulated devices")
    p.add_argument("--json", metavar="FILE", help="write the table and every run as JSON")
    p.add_argument("--plot", metavar="FILE.png", help="draw the table as a PNG chart")
    p.add_argument("--profile", type=int, default=0, metavar="STEPS", help="trace STEPS more steps per xlafit row")
    p.add_argument("--profile-dir", default="runs/bench-profile", help="where --profile writes its traces")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    if args.calibrate:
        return _calibrate(args)
    if not args.recipe:
        raise ConfigError("xlafit bench needs a recipe (mnist or resnet), or --calibrate.")
    if args.out:
        raise ConfigError(
            f"--out {args.out} is where --calibrate writes its calibration; a benchmark's table goes to --json "
            f"{args.out} (and its chart to --plot FILE.png)."
        )
    from xlafit.bench import format_table, plot, run_bench  # the library when the command runs: a fast --help

    # Checked before the benchmark runs, not after its minutes of work.
    for flag, path in (("--json", args.json), ("--plot", args.plot)):
        if path and os.path.isdir(path):
            example = os.path.join(path, "bench.json" if flag == "--json" else "bench.png")
            raise ConfigError(f"{flag} {path} is a folder; give a file in it, e.g. {flag} {example}.")
        folder = os.path.dirname(os.path.abspath(path)) if path else None
        if folder and not os.path.isdir(folder):
            raise ConfigError(f"{flag} {path}: the folder {folder} does not exist; create it or write elsewhere.")
    result = run_bench(
        args.recipe,
        devices=[d.strip() for d in args.devices.split(",") if d.strip()],
        compare=[c.strip() for c in args.compare.split(",") if c.strip()],
        steps=args.steps,
        epochs=args.epochs,
        warmup=args.warmup,
        repeats=args.repeats,
        batch=args.batch,
        steps_per_call=ints("--steps-per-call", args.steps_per_call),
        dtype=args.dtype,
        data=args.data,
        examples=args.examples,
        simulate=args.simulate,
        depth=args.depth,
        width=args.width,
        image_size=args.image_size,
        profile=args.profile,
        profile_dir=args.profile_dir,
    )
    print(format_table(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
        print(f"JSON: {args.json}")
    if args.plot:
        plot(result, args.plot)
        print(f"chart: {args.plot}")
    if args.profile:
        print(f"profiles: {args.profile_dir} (tensorboard --logdir {args.profile_dir}, or xprof, or Perfetto)")
    return 0


def _calibrate(args: argparse.Namespace) -> int:
    import sys
    from pathlib import Path

    from xlafit.parallel.cluster import start_backends
    from xlafit.predict.calibrate import calibrate, write

    if args.recipe:
        raise ConfigError(f"--calibrate measures the device, not a recipe: drop {args.recipe!r}.")
    out = Path(args.out) if args.out else None
    if out is not None and not out.parent.is_dir():
        raise ConfigError(f"--out {out}: the folder {out.parent} does not exist; create it or write elsewhere.")
    start_backends()  # quietly: libtpu's start-up errors on a machine without a TPU
    rates, record = calibrate(args.calibrate_sizes, progress=lambda text: print(text, file=sys.stderr, flush=True))
    path = write(rates, out)
    step = record["step"]
    peak = rates.hbm_peak_bytes_per_s
    wide = f" (wider elements up to {peak / 1e9:.4g} GB/s)" if peak else " (wider elements no faster)"
    print(
        f"{rates.device_kind}: matrix products {rates.matmul_flops / 1e12:.4g} TFLOP/s (tile "
        f"{rates.matmul_tile[0]}x{rates.matmul_tile[1]} over {rates.units} unit(s)), streams "
        f"{rates.hbm_bytes_per_s / 1e9:.4g} GB/s + {rates.kernel_s * 1e6:.3g} us per kernel{wide}, element-wise "
        f"{(rates.vector_ops_per_s or 0) / 1e12:.3g} T ops/s"
    )
    print(
        f"training step: measured {step['measured_s'] * 1e3:.3g} ms, predicted with these rates "
        f"{step['predicted_s'] * 1e3:.3g} ms ({step['predicted_s'] / step['measured_s'] - 1:+.0%})"
    )
    print(
        f"calibration: {path} (check, plan and bench use it for {rates.device_kind}; share the file to plan "
        "elsewhere with it: --calibration FILE)"
    )
    if args.json:
        Path(args.json).write_text(json.dumps({"rates": rates.to_json(), "record": record}, indent=2) + "\n")
        print(f"JSON: {args.json}")
    return 0
