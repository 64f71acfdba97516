"""``xlafit eval RUN [--data PATH] [--step N|all]``: a run's checkpoints scored without training."""

from __future__ import annotations

import argparse
import json
from typing import Any

from xlafit.cli.common import add_simulate, ints
from xlafit.errors import ConfigError


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "eval",
        help="score a run's checkpoints on its evaluation data or on new records, training nothing",
        description="Restores a run's checkpoint and evaluates it as the run does (the same loss and metrics, every "
        "example counted once), writing nothing in the run. --data: an llm run scores every record of the file or "
        "folder, encoded as it encoded its training data (tokenizer, chat template, data.seq_len, data.loss_on); "
        "another recipe reads the evaluation split of that data directory. Without --data: the run's own "
        "evaluation split. Example: xlafit eval runs/chat-lora --data held_out.jsonl --step all",
    )
    p.add_argument("run_dir", metavar="RUN_DIR", help="a run directory, local or a URL (gs://...)")
    p.add_argument(
        "overrides",
        nargs="*",
        metavar="key.sub=value",
        help="evaluation settings: data.eval_global_batch=N, mesh.*, cpu.*, model.attention, model.logits_chunk, "
        "model.remat",
    )
    p.add_argument(
        "--data",
        metavar="PATH",
        help="the records to score (llm: text, JSON-lines or Parquet files, a folder or glob of them, gs:// or "
        "hf://datasets/ URLs; mnist, bert, resnet: a data directory, its evaluation split); default: the run's own "
        "evaluation split",
    )
    p.add_argument(
        "--step",
        default=None,
        metavar="N[,N...]|all",
        help="the checkpoints to score: steps separated by commas, or all of the intact ones (default: the newest)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON line per checkpoint: run, step, data, metrics")
    add_simulate(p)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from xlafit.recipes import get_recipe  # the library when the command runs: a fast --help
    from xlafit.run import perplexity
    from xlafit.run_eval import evaluate_run, run_config

    steps: Any = None
    if args.step is not None:
        steps = "all" if args.step.strip() == "all" else sorted(set(ints("--step", args.step)))  # each once
        if not steps:
            raise ConfigError("--step '': give checkpoint steps separated by commas, or all.")
    cfg = run_config(args.run_dir, args.overrides)
    unit = get_recipe(cfg.recipe).eval_unit(cfg)
    data = args.data or "its evaluation split"

    def say(score: Any) -> None:
        if args.json:
            ppl = perplexity(score.metrics)  # as the line says it
            extra = {} if ppl is None else {"perplexity": ppl}
            record = {"run": args.run_dir, "step": score.step, "data": args.data, **score.metrics, **extra}
            print(json.dumps(record), flush=True)
        else:
            print(score.line(data, unit), flush=True)

    evaluate_run(args.run_dir, args.data, steps, args.overrides, args.simulate, on_score=say)
    return 0
