"""What GRPO on the arithmetic questions of ``make demo-grpo`` changed: greedy exact-match
accuracy on the questions its prompts never asked (``chat_demo.held_out_questions``: 20
pairs of numbers x plus, minus, times) and on those they asked, before and after.

    python benchmarks/preference/grpo_arithmetic.py --start runs/demo-chat-start-hf --tuned runs/demo-grpo \\
        --out benchmarks/results/DATE/grpo/arithmetic.json

``--start``: the model GRPO started from (a Hugging Face directory or a run); ``--tuned``:
the GRPO run (or its export). Exact match: the answer ``a word b is result.`` to ``What is
a word b?``, greedy, up to 16 tokens.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from xlafit.data import chat_demo
from xlafit.generator import Generator


def exact_match(model: Generator, questions: list[tuple[int, str, int]]) -> tuple[float, list[str]]:
    answers = model([f"What is {a} {w} {b}?" for a, w, b in questions], max_new_tokens=16)
    right = [ans.strip() == chat_demo.answer(*q) for q, ans in zip(questions, answers, strict=True)]
    return float(np.mean(right)), answers


def measure(source: str, simulate: int | None) -> dict:
    model = (
        Generator.load(source, simulate=simulate) if Path(source, "config.yaml").exists() else Generator.load(source)
    )
    held = chat_demo.held_out_questions()
    asked = [(a, w, b) for w in ("minus", "plus", "times") for a in range(10) for b in range(10)]
    asked = [q for q in asked if q not in set(held)]
    held_acc, held_answers = exact_match(model, held)
    asked_acc, _ = exact_match(model, asked)
    per_op = {
        w: float(
            np.mean(
                [ans.strip() == chat_demo.answer(*q) for q, ans in zip(held, held_answers, strict=True) if q[1] == w]
            )
        )
        for w in ("minus", "plus", "times")
    }
    return {
        "source": source,
        "held_out_exact_match": held_acc,
        "held_out_by_operation": per_op,
        "asked_exact_match": asked_acc,
        "held_out_answers": {f"{a} {w} {b}": ans for (a, w, b), ans in zip(held, held_answers, strict=True)},
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--start", required=True)
    parser.add_argument("--tuned", required=True)
    parser.add_argument("--simulate", type=int, help="simulated CPU devices for a run's mesh (default: this host's)")
    parser.add_argument("--out")
    args = parser.parse_args()
    result = {"start": measure(args.start, args.simulate), "tuned": measure(args.tuned, args.simulate)}
    for name in ("start", "tuned"):
        r = result[name]
        print(f"{name}: held-out exact match {r['held_out_exact_match']:.3f} {r['held_out_by_operation']}, "
              f"asked {r['asked_exact_match']:.3f}", file=sys.stderr)  # fmt: skip
    gain = result["tuned"]["held_out_exact_match"] - result["start"]["held_out_exact_match"]
    result["held_out_gain_points"] = round(100 * gain, 1)
    text = json.dumps(result, indent=2)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
    print(f"held-out exact match: {100 * gain:+.1f} points")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
