"""The CPU chat demo (the Makefile's demo-chat) trained with LoRA on a bfloat16 base and on a
4-bit (NF4) one: the final train and eval losses of both, and their ratio.

Trains the demo's base model on the arithmetic text (as ``make demo-chat``), exports it, then
runs the demo's LoRA fine-tune on the chat data twice from that export, once per
``lora.base_dtype``, with every other setting the same. A run whose directory already holds its
final evaluation is read, not trained again.

    python benchmarks/qlora/demo.py --dir /tmp/qlora-demo --json out.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

XLAFIT = [sys.executable, "-m", "xlafit"]
LORA = "lora.rank=16 lora.alpha=32 lora.targets=q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj".split()
BASE_DTYPES = ("bfloat16", "nf4")


def commands(d: Path) -> dict[str, list[str]]:
    """The demo's commands (the Makefile's demo-chat), the LoRA one once per base dtype."""
    out = {
        "base": [*XLAFIT, "train", "llm", "--simulate", "8", "--run-dir", str(d / "demo-chat-base"), "--restart",
                 "data.demo=arithmetic", "data.seq_len=96", "trainer.epochs=8", "optimizer.learning_rate=0.006"],
        "export": [*XLAFIT, "export", "hf", str(d / "demo-chat-base"), "--out", str(d / "demo-chat-base-hf")],
    }  # fmt: skip
    for dtype in BASE_DTYPES:
        out[f"lora-{dtype}"] = [
            *XLAFIT, "train", "llm", "--simulate", "8", "--run-dir", str(d / f"demo-chat-lora-{dtype}"), "--restart",
            f"model.init_from_hf={d / 'demo-chat-base-hf'}", "data.demo=chat", "data.seq_len=96", *LORA,
            f"lora.base_dtype={dtype}", "trainer.epochs=4", "optimizer.learning_rate=0.01",
        ]  # fmt: skip
    return out


def final(run: Path) -> dict[str, float] | None:
    """The last train and eval losses in ``run``'s metrics.jsonl (None: the run has no final eval)."""
    path = run / "metrics.jsonl"
    if not path.exists():
        return None
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    train = [r for r in rows if r.get("split") == "train"]
    evals = [r for r in rows if r.get("split") == "eval"]
    if not train or not evals or evals[-1]["step"] != train[-1]["step"]:
        return None
    return {"step": train[-1]["step"], "train_loss": train[-1]["loss"], "eval_loss": evals[-1]["loss"],
            "eval_token_accuracy": evals[-1]["token_accuracy"]}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", type=Path, required=True, help="where the runs are written")
    parser.add_argument("--json", type=Path, help="write the result here too")
    args = parser.parse_args()
    cmds = commands(args.dir)
    if final(args.dir / "demo-chat-base") is None:
        subprocess.run(cmds["base"], check=True)
    if not (args.dir / "demo-chat-base-hf" / "config.json").exists():
        subprocess.run(cmds["export"], check=True)
    runs = {}
    for dtype in BASE_DTYPES:
        run = args.dir / f"demo-chat-lora-{dtype}"
        if final(run) is None:
            subprocess.run(cmds[f"lora-{dtype}"], check=True)
        runs[dtype] = final(run)
    bf16, nf4 = runs["bfloat16"], runs["nf4"]
    assert bf16 is not None and nf4 is not None
    result = {
        "commands": {name: " ".join(cmd[2:]) for name, cmd in cmds.items()},
        "runs": runs,
        "nf4_over_bfloat16": {key: nf4[key] / bf16[key] for key in ("train_loss", "eval_loss")},
    }
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
