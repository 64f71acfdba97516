"""The ``xlafit`` command: parses arguments and calls the library, nothing else."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from collections.abc import Sequence

import yaml

from xlafit import errors
from xlafit.errors import (
    BenchError,
    CheckpointError,
    ConfigError,
    DataError,
    DeviceError,
    HFFormatError,
    NonFiniteError,
    Preempted,
    RecompileError,
    StorageError,
)
from xlafit.parallel.cluster import COORDINATOR_ENV, NUM_PROCESSES_ENV, PROCESS_ID_ENV, SIMULATE_ENV


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="xlafit",
        description="Data-parallel training on every XLA device: TPU cores, GPUs, CPUs.",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    def add_simulate(p: argparse.ArgumentParser) -> None:
        p.add_argument(
            "--simulate",
            type=int,
            metavar="N",
            help=f"use N simulated CPU devices (rehearse an N-core TPU); also ${SIMULATE_ENV}",
        )
        job = p.add_argument_group("multi-process job (docs/multihost.md); default: from the environment")
        job.add_argument("--coordinator", metavar="HOST:PORT", help=f"process 0's address; also ${COORDINATOR_ENV}")
        job.add_argument("--num-processes", type=int, metavar="P", help=f"also ${NUM_PROCESSES_ENV}")
        job.add_argument("--process-id", type=int, metavar="I", help=f"this process, 0..P-1; also ${PROCESS_ID_ENV}")

    devices = sub.add_parser("devices", help="show the platform, processes, devices and the training mesh")
    add_simulate(devices)
    devices.add_argument(
        "--mesh",
        metavar="DATA,FSDP,TENSOR",
        default="-1,1,1",
        help="mesh sizes as the run's mesh.data, mesh.fsdp, mesh.tensor (one may be -1); default -1,1,1",
    )

    train = sub.add_parser(
        "train",
        help="train a recipe",
        description="Train a recipe. Overrides are dotted key=value pairs, e.g. trainer.epochs=3 "
        "data.per_device_batch=32. `xlafit config RECIPE` shows every key.",
    )
    train.add_argument("recipe", help="recipe name: mnist, bert, resnet")
    train.add_argument("overrides", nargs="*", metavar="key.sub=value", help="config overrides")
    add_simulate(train)
    train.add_argument("--run-dir", help="where config, metrics, TensorBoard logs and checkpoints go")
    train.add_argument(
        "--data-dir",
        help="the recipe's data (mnist: a directory of IDX files; bert: the output of `xlafit data mlm`; "
        "resnet: of `xlafit data images`)",
    )
    train.add_argument("--config", help="a YAML preset to use instead of the recipe's own")
    train.add_argument(
        "--checkpoint-dir", help="checkpoints here instead of RUN_DIR/checkpoints: a path or gs://bucket/dir"
    )
    train.add_argument(
        "--restart",
        action="store_true",
        help="start over: the earlier run (checkpoints, metrics) moves to RUN_DIR-before-restart-<time>",
    )
    train.add_argument("-v", "--verbose", action="store_true", help="log compiles and checkpoint events")

    launch = sub.add_parser(
        "launch",
        help="run a command as a P-process job on this machine (rehearse a pod slice)",
        description="Start P processes of COMMAND that join one JAX job, each with D simulated CPU "
        "devices: xlafit launch --processes 2 --devices-per-process 4 -- xlafit train mnist",
    )
    launch.add_argument("--processes", type=int, default=2, metavar="P")
    launch.add_argument("--devices-per-process", type=int, default=4, metavar="D")
    launch.add_argument(
        "--log-dir",
        help="where processes 1..P-1 write their output (default: a new folder under $XLAFIT_CACHE/launch, "
        "else ~/.cache/xlafit/launch)",
    )
    launch.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command each process runs")

    bench = sub.add_parser(
        "bench",
        help="benchmark a recipe: compile time, step time, input wait, MFU, against peers",
        description="Each configuration trains in its own process for --steps steps after --warmup; "
        "the table shows medians over --repeats runs. Example: xlafit bench mnist --simulate 8 "
        "--devices 1,all --compare torch --plot bench.png",
    )
    bench.add_argument("recipe", help="recipe name: mnist or resnet")
    bench.add_argument("--devices", default="1,all", help="xlafit device counts, comma-separated; 'all' = every device")
    bench.add_argument("--compare", default="", help="peers, comma-separated: torch, torch-compile")
    bench.add_argument("--steps", type=int, default=60, help="timed steps per run")
    bench.add_argument("--epochs", type=float, help="time this many epochs instead of --steps")
    bench.add_argument(
        "--warmup", type=int, default=10, help="untimed steps first (the compile and, on CPUs, the heap's growth)"
    )
    bench.add_argument("--repeats", type=int, default=3, help="runs per configuration, interleaved")
    bench.add_argument("--batch", type=int, default=128, help="global batch, the same for every configuration")
    bench.add_argument(
        "--steps-per-call",
        default="1",
        metavar="K",
        help="xlafit steps per compiled call, comma-separated (a row each)",
    )
    bench.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="xlafit compute dtype")
    bench.add_argument(
        "--data", default="embedded", help="'embedded' (4,000 real digits), 'synthetic', or a directory of IDX files"
    )
    bench.add_argument(
        "--examples", type=int, help="size of the synthetic training set (default: 60,000 digits, 8 batches of images)"
    )
    bench.add_argument("--depth", type=int, default=50, help="resnet: 18, 34, 50, 101 or 152")
    bench.add_argument("--width", type=int, default=64, help="resnet: stem channels (64: the standard ResNet)")
    bench.add_argument("--image-size", type=int, default=224, help="resnet: image height and width")
    bench.add_argument("--simulate", type=int, metavar="N", help="on a CPU, 'all' means N simulated devices")
    bench.add_argument("--json", metavar="FILE", help="write the table and every run as JSON")
    bench.add_argument("--plot", metavar="FILE.png", help="draw the table as a PNG chart")
    bench.add_argument("--profile", type=int, default=0, metavar="STEPS", help="trace STEPS more steps per xlafit row")
    bench.add_argument("--profile-dir", default="runs/bench-profile", help="where --profile writes its traces")

    inspect = sub.add_parser(
        "inspect",
        help="list a run's checkpoints (intact or not) and fingerprint its parameters",
        description="Lists the checkpoints of RUN_DIR with step, time, size and integrity, and prints the "
        "SHA-256 fingerprint of the newest intact checkpoint's parameters (or --step S's).",
    )
    inspect.add_argument("run_dir", metavar="RUN_DIR", help="a run or checkpoint directory, local or a URL (gs://...)")
    inspect.add_argument("--step", type=int, help="fingerprint this checkpoint instead of the newest intact one")
    inspect.add_argument("--json", action="store_true", help="print JSON")

    tokenizer = sub.add_parser("tokenizer", help="train a WordPiece tokenizer (Korean-safe defaults)")
    tok_sub = tokenizer.add_subparsers(dest="tokenizer_command", required=True)
    tok_train = tok_sub.add_parser(
        "train",
        help="train a BERT WordPiece vocabulary on text files",
        description="Train a BERT WordPiece tokenizer with Hugging Face tokenizers. Accents are kept (NFD would "
        "split Hangul into jamo) and case is kept unless --lowercase. Prints the unknown-token rate and "
        "tokens per word. Example: xlafit tokenizer train --input corpus/*.txt --vocab-size 32000 --out tok",
    )
    tok_train.add_argument("--input", nargs="+", required=True, metavar="FILE", help="text files, globs, dirs or URLs")
    tok_train.add_argument("--vocab-size", type=int, default=32000)
    tok_train.add_argument("--out", required=True, metavar="DIR")
    tok_train.add_argument("--min-frequency", type=int, default=2)
    tok_train.add_argument("--lowercase", action="store_true", help="lowercase Latin text (Hangul is unaffected)")
    tok_train.add_argument("--strip-accents", action="store_true", help="NFD + drop accents: breaks Hangul, off")

    data = sub.add_parser("data", help="prepare training data")
    data_sub = data.add_subparsers(dest="data_command", required=True)
    data_mlm = data_sub.add_parser(
        "mlm",
        help="tokenize text into fixed-length masked-LM sequences (Parquet shards + manifest)",
        description="Stream text files through a tokenizer and pack them into sequences of --seq-len tokens, "
        "written as Parquet shards plus manifest.json to a directory or fsspec URL (gs:// needs gcsfs). "
        "Input: one sentence or paragraph per line, documents separated by blank lines (or one per file).",
    )
    data_mlm.add_argument("--tokenizer", required=True, metavar="DIR", help="from `xlafit tokenizer train`")
    data_mlm.add_argument("--input", nargs="+", required=True, metavar="FILE", help="text files, globs, dirs or URLs")
    data_mlm.add_argument("--out", required=True, metavar="URL", help="a directory or fsspec URL")
    data_mlm.add_argument("--seq-len", type=int, default=128)
    data_mlm.add_argument(
        "--packing",
        choices=("sentences", "pairs"),
        default="sentences",
        help="sentences: [CLS] text... [SEP] across lines and documents (RoBERTa); "
        "pairs: [CLS] A [SEP] B [SEP] with token types (BERT)",
    )
    data_mlm.add_argument("--doc-boundary", choices=("blank", "file"), default="blank")
    data_mlm.add_argument("--eval-fraction", type=float, default=0.05, help="documents held out for evaluation")
    data_mlm.add_argument("--seed", type=int, default=0)
    data_mlm.add_argument("--shard-size", type=int, default=65536, help="sequences per shard")
    data_images = data_sub.add_parser(
        "images",
        help="an image folder (class/*.jpg|png) -> shards of encoded images + labels + manifest",
        description="Read an ImageFolder (class/*.jpg|png, or train/ and val/ of such folders) and write the "
        "encoded images, labels and file names as Parquet shards plus manifest.json (per-shard SHA-256) to a "
        "directory or fsspec URL. Every image is decoded once here, so an unreadable one is named now.",
    )
    data_images.add_argument("--input", required=True, metavar="DIR", help="an image folder")
    data_images.add_argument("--out", required=True, metavar="URL", help="a directory or fsspec URL")
    data_images.add_argument(
        "--eval-fraction", type=float, default=0.0, help="held out for evaluation, when --input has no val/ folder"
    )
    data_images.add_argument("--seed", type=int, default=0)
    data_images.add_argument("--shard-size", type=int, default=1024, help="images per shard")
    data_images.add_argument(
        "--on-corrupt", choices=("skip", "stop"), default="skip", help="an image that cannot be decoded"
    )
    data_images.add_argument("--workers", type=int, help="processes decoding to check (default: every core)")
    data_images.add_argument(
        "--overwrite", action="store_true", help="replace images prepared in --out before (refused without it)"
    )

    export = sub.add_parser("export", help="export a run's model to another library's format")
    export_sub = export.add_subparsers(dest="export_command", required=True)
    export_hf = export_sub.add_parser(
        "hf",
        help="write a run as a Hugging Face directory (bert: BertForMaskedLM, resnet: ResNetForImageClassification)",
        description="Writes config.json and model.safetensors (bert: and the tokenizer's files); load them with "
        "transformers.BertForMaskedLM.from_pretrained(DIR) and AutoTokenizer.from_pretrained(DIR), or "
        "transformers.ResNetForImageClassification.from_pretrained(DIR).",
    )
    export_hf.add_argument("run_dir", metavar="RUN_DIR")
    export_hf.add_argument("--out", required=True, metavar="DIR")
    export_hf.add_argument("--step", type=int, help="this checkpoint instead of the newest intact one")

    check = sub.add_parser(
        "check",
        help="check a train step against the XLA rules on the CPU, before the TPU",
        description="Trace and run one train step on the CPU, map failures to the XLA rules (1: data-dependent "
        "control flow, 2: data-dependent shapes, 3: too many input shapes) with file and line and the "
        "standard rewrite, scan the data's shapes, and estimate per-device memory and FLOPs. TARGET is a "
        "recipe name or a Python file defining `model` (an nnx.Module), `loss_fn(model, batch)` and `batch` "
        "(a dict of arrays), optionally `dataset` (examples) or `lengths`. Exit 1 when a rule is violated. "
        "With --tpu, compile the real train and eval steps for TPU slices with the TPU compiler (libtpu, "
        "no TPU needed) and report per-core HBM, whether it fits, FLOPs and a roofline estimate; exit 1 "
        "when a target does not fit.",
    )
    check.add_argument("target", metavar="TARGET", help="a recipe name (mnist, bert, resnet) or path/to/file.py")
    check.add_argument("overrides", nargs="*", metavar="key.sub=value", help="config overrides (recipes)")
    check.add_argument("--per-device-batch", type=int, help="estimate memory and FLOPs at this batch per device")
    check.add_argument("--global-batch", type=int, help="check that it divides over --devices")
    check.add_argument("--devices", type=int, help="devices to plan for (default: this machine's)")
    check.add_argument("--max-shapes", type=int, default=8, help="input shapes allowed before rule 3 is flagged")
    check.add_argument(
        "--tpu",
        metavar="TARGETS",
        help="compile for these TPU slices, comma-separated: v2-8, v3-8, v4-8, v5e-1/4/8, v5p-8, v6e-1/4/8, "
        "tpu7x-8, pod slices such as v4-32 or v5e-256",
    )
    check.add_argument(
        "--max-batch", action="store_true", help="with --tpu: find the largest per-core batch that fits each target"
    )
    check.add_argument("--json", action="store_true", help="print JSON")

    config = sub.add_parser("config", help="print a recipe's resolved config")
    config.add_argument("recipe")
    config.add_argument("overrides", nargs="*", metavar="key.sub=value")
    return parser


def _train(args: argparse.Namespace) -> int:
    from xlafit.recipes import load_config
    from xlafit.run import train_and_evaluate

    overrides = list(args.overrides)
    if args.simulate is not None:
        overrides.append(f"run.simulate_devices={args.simulate}")
    if args.run_dir:
        overrides.append(f"run.run_dir={args.run_dir}")
    if args.data_dir:
        overrides.append(f"data.data_dir={args.data_dir}")
    if args.checkpoint_dir:
        overrides.append(f"run.checkpoint_dir={args.checkpoint_dir}")
    if args.restart:
        overrides.append("run.resume=false")
    train_and_evaluate(load_config(args.recipe, overrides, preset=args.config))
    # A SIGTERM from here on finds the work done: exit 0 rather than die by the signal.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    return 0


def _ints(flag: str, text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ConfigError(f"{flag} {text!r}: expected whole numbers separated by commas, e.g. 1,4.") from None


def _bench(args: argparse.Namespace) -> int:
    import json

    from xlafit.bench import format_table, plot, run_bench

    # Checked before the benchmark runs, not after its minutes of work.
    for flag, path in (("--json", args.json), ("--plot", args.plot)):
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
        steps_per_call=_ints("--steps-per-call", args.steps_per_call),
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


def _inspect(args: argparse.Namespace) -> int:
    import json

    from xlafit.checkpoint import Checkpointer, fingerprint
    from xlafit.run import checkpoints_of

    directory = str(checkpoints_of(args.run_dir))  # a run or checkpoint directory, local or gs://
    ckpt = Checkpointer(directory)
    infos = ckpt.list()
    usable = [i.step for i in infos if i.usable]
    step = args.step if args.step is not None else (usable[-1] if usable else None)
    if args.step is not None and args.step not in [i.step for i in infos]:
        raise ConfigError(f"no checkpoint {args.step} in {directory}; there are: {[i.step for i in infos]}.")
    digest = fingerprint(ckpt.restore_params(step)) if step is not None else None
    ckpt.close()
    # A scheduler or script acts on the exit code: a corrupt newest checkpoint means the next
    # resume loses the steps since the one before it.
    newest_corrupt = bool(infos) and not infos[-1].usable
    code = errors.DAMAGED if step is None or newest_corrupt else 0
    if args.json:
        rows = [
            {
                "step": i.step,
                "time": i.time.isoformat(),
                "time_source": i.time_source,
                "size_bytes": i.size_bytes,
                "status": i.status,
            }
            for i in infos
        ]
        print(json.dumps({"checkpoints": rows, "fingerprint": {"step": step, "sha256": digest}}, indent=2))
        return code
    print(f"{'step':>8}  {'written (UTC)':<21}  {'size':>10}  status")
    for i in infos:
        mark = "  " if i.time_source == "commit" else " *"
        print(f"{i.step:>8}  {i.time:%Y-%m-%d %H:%M:%S}{mark}  {i.size_bytes / 2**20:>7.2f} MiB  {i.status}")
    if any(i.time_source != "commit" for i in infos):
        print("       * no commit time recorded in the checkpoint: the files' last modification time")
    if step is None:
        print("no intact checkpoint")
        return code
    print(f"parameters at step {step}: sha256 {digest}")
    if newest_corrupt:
        print(
            f"checkpoint {infos[-1].step}, the newest, is corrupt: resuming sets it aside and continues from "
            f"checkpoint {[i.step for i in infos if i.usable][-1]}, losing the steps in between."
        )
    return code


def _tokenizer(args: argparse.Namespace) -> int:
    from xlafit.data.text import expand_inputs
    from xlafit.data.tokenizer import measure, train_tokenizer

    files = expand_inputs(args.input)
    print(f"training a {args.vocab_size}-token WordPiece vocabulary on {len(files)} file(s)", flush=True)
    tok = train_tokenizer(
        files,
        args.vocab_size,
        args.out,
        min_frequency=args.min_frequency,
        lowercase=args.lowercase,
        strip_accents=args.strip_accents,
        show_progress=sys.stderr.isatty(),
    )
    size = tok.get_vocab_size()
    floor = " (more than --vocab-size: every character of the text gets a token, twice with ## inside words)"
    print(f"vocabulary: {size} tokens -> {args.out}" + (floor if size > args.vocab_size else ""))
    print(f"on the training text: {measure(tok, files)}")
    return 0


def _data(args: argparse.Namespace) -> int:
    if args.data_command == "images":
        return _data_images(args)
    from xlafit.data.mlm import prepare
    from xlafit.data.text import expand_inputs

    files = expand_inputs(args.input)
    manifest = prepare(
        args.tokenizer,
        files,
        args.out,
        seq_len=args.seq_len,
        packing=args.packing,
        doc_boundary=args.doc_boundary,
        eval_fraction=args.eval_fraction,
        seed=args.seed,
        shard_size=args.shard_size,
        show_progress=sys.stderr.isatty(),
    )
    for split, info in manifest["splits"].items():
        fill = info["tokens"] / max(info["sequences"] * args.seq_len, 1)
        print(
            f"{split}: {info['documents']:,} documents -> {info['sequences']:,} sequences of {args.seq_len} "
            f"({info['tokens']:,} tokens, {fill:.1%} not padding) in {len(info['shards'])} shard(s)"
        )
    print(f"written to {args.out} (manifest.json)")
    return 0


def _data_images(args: argparse.Namespace) -> int:
    from xlafit.data.images import prepare

    manifest = prepare(
        args.input,
        args.out,
        eval_fraction=args.eval_fraction,
        seed=args.seed,
        shard_size=args.shard_size,
        on_corrupt=args.on_corrupt,
        workers=args.workers,
        overwrite=args.overwrite,
    )
    classes = len(manifest["classes"])
    for split, info in manifest["splits"].items():
        print(f"{split}: {info['examples']:,} images of {classes} classes in {len(info['shards'])} shard(s)")
        if info["skipped"]:
            names = ", ".join(s["file"] for s in info["skipped"][:5])
            more = f" and {len(info['skipped']) - 5} more" if len(info["skipped"]) > 5 else ""
            print(f"  skipped {len(info['skipped'])} that cannot be decoded: {names}{more} (listed in the manifest)")
    print(f"written to {args.out} (manifest.json)")
    return 0


def _check(args: argparse.Namespace) -> int:
    from xlafit.check import check_file, check_recipe, to_json
    from xlafit.parallel.cluster import start_backends

    if not args.tpu:  # the CPU check: without libtpu's start-up errors on a host with libtpu, no TPU
        start_backends()
    options = {
        "per_device_batch": args.per_device_batch,
        "global_batch": args.global_batch,
        "devices": args.devices,
        "max_shapes": args.max_shapes,
        "tpu": args.tpu,
        "max_batch": args.max_batch,
    }
    if args.max_batch and not args.tpu:
        raise ConfigError("--max-batch searches per TPU target: add --tpu, e.g. --tpu v3-8 --max-batch.")
    if args.target.endswith(".py") or os.path.sep in args.target:
        report = check_file(args.target, **options)
    else:
        report = check_recipe(args.target, args.overrides, **options)
    print(to_json(report) if args.json else report.format())
    return 0 if report.ok else 1


def _export(args: argparse.Namespace) -> int:
    from xlafit.export import export_hf

    out, step = export_hf(args.run_dir, args.out, args.step)
    from xlafit.io.paths import as_path

    files = "config.json, model.safetensors" + (", tokenizer" if (as_path(out) / "tokenizer.json").exists() else "")
    print(f"exported checkpoint {step} of {args.run_dir} to {out}: {files}")
    return 0


def configure_logging(verbose: bool) -> None:
    """xlafit's messages at WARNING (INFO with ``--verbose``), libraries' at WARNING.

    gcsfs logs every exception it gives up on with its traceback (``_request out of retries``,
    ``non-retriable exception``) and then raises it; xlafit names that same error with the
    fix (:func:`xlafit.io.paths.describe_error`), so those tracebacks are dropped unless verbose.
    """
    logging.basicConfig(
        level=logging.INFO if verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s"
    )
    # Orbax and absl are chatty at INFO; keep xlafit's own messages only.
    for name in ("absl", "orbax", "jax"):
        logging.getLogger(name).setLevel(logging.WARNING)
    gcsfs = logging.getLogger("gcsfs")
    gcsfs.removeFilter(_raised_again)
    if not verbose:
        gcsfs.addFilter(_raised_again)


def _raised_again(record: logging.LogRecord) -> bool:
    return record.exc_info is None


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["launch"]:
        # Everything after "--" belongs to the launched command, options included.
        args = parser.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
        command = argv[argv.index("--") + 1 :] if "--" in argv else args.command
        from xlafit.parallel.launch import launch

        return launch(command, args.processes, args.devices_per_process, args.log_dir)
    # Overrides may come before or after options (`train mnist --simulate 8 trainer.epochs=3`);
    # argparse's subparsers stop collecting positionals at the first option, so gather the rest.
    args, extra = parser.parse_known_args(argv)
    unknown = [e for e in extra if e.startswith("-") or not hasattr(args, "overrides")]
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    if extra:
        args.overrides = [*args.overrides, *extra]
    # The job flags travel as the environment variables that xlafit.connect() reads.
    for flag, env in (
        ("coordinator", COORDINATOR_ENV),
        ("num_processes", NUM_PROCESSES_ENV),
        ("process_id", PROCESS_ID_ENV),
    ):
        if getattr(args, flag, None) is not None:
            os.environ[env] = str(getattr(args, flag))
    configure_logging(verbose=getattr(args, "verbose", False))
    try:
        if args.command == "devices":
            from xlafit.parallel.cluster import connect

            try:
                sizes = tuple(int(v) for v in args.mesh.split(","))
            except ValueError:
                sizes = ()
            if len(sizes) != 3:
                raise ConfigError(f"--mesh {args.mesh}: give three whole numbers DATA,FSDP,TENSOR, e.g. --mesh -1,4,2.")
            print(connect(args.simulate, mesh=sizes).describe())
            return 0
        if args.command == "config":
            from xlafit.recipes import load_config

            print(yaml.safe_dump(load_config(args.recipe, args.overrides).to_dict(), sort_keys=False), end="")
            return 0
        if args.command == "bench":
            return _bench(args)
        if args.command in ("inspect", "export"):
            # They read checkpoints without connect(): start the backends as it does, without
            # libtpu's start-up errors on a host that has libtpu but no TPU.
            from xlafit.parallel.cluster import start_backends

            start_backends()
        if args.command == "inspect":
            return _inspect(args)
        if args.command == "tokenizer":
            return _tokenizer(args)
        if args.command == "data":
            return _data(args)
        if args.command == "export":
            return _export(args)
        if args.command == "check":
            return _check(args)
        return _train(args)
    except (
        ConfigError,
        DeviceError,
        DataError,
        BenchError,
        CheckpointError,
        HFFormatError,
        RecompileError,
        StorageError,
    ) as e:
        print(f"xlafit: error: {e}", file=sys.stderr)
        return errors.USAGE
    except Preempted as e:
        print(f"xlafit: {e}", file=sys.stderr)
        return errors.PREEMPTED
    except NonFiniteError as e:
        print(f"xlafit: error: {e}", file=sys.stderr)
        return errors.NONFINITE
    except KeyboardInterrupt:
        print("xlafit: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
