"""What DPO on the arithmetic pairs of ``make demo-dpo`` changed: greedy exact-match accuracy
on sums, and the preference accuracy of DPO's implicit reward on pairs of sums its training
pairs never asked (``chat_demo.held_out_sums``).

    python benchmarks/preference/dpo_arithmetic.py --reference runs/demo-chat-start-hf --tuned runs/demo-dpo \\
        --beta 0.5 --out benchmarks/results/DATE/dpo/arithmetic.json

``--reference``: the model DPO started from (a Hugging Face directory or a run); ``--tuned``:
the DPO run (or its export). Exact match: the answer ``a plus b is a+b.`` to ``What is a plus
b?``, greedy, on the held-out sums and on the sums the pairs asked. Preference accuracy: for
each held-out sum and each wrong answer off by 1 to 3, whether ``β (log π - log π_ref)`` of
the right answer exceeds the wrong one's (TRL's ``rewards/accuracies``).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

from xlafit.data import chat_demo
from xlafit.data.preference import load_pairs
from xlafit.generator import Generator
from xlafit.train.preference import reference_logps


def exact_match(model: Generator, sums: list[tuple[int, int]]) -> tuple[float, list[str]]:
    answers = model([f"What is {a} plus {b}?" for a, b in sums], max_new_tokens=16)
    right = [ans.strip() == f"{a} plus {b} is {a + b}." for (a, b), ans in zip(sums, answers, strict=True)]
    return float(np.mean(right)), answers


def held_out_pairs(sums: list[tuple[int, int]]) -> list[dict]:
    pairs = []
    for a, b in sums:
        for off in (-3, -2, -1, 1, 2, 3):
            pairs.append(
                {
                    "prompt": [{"role": "user", "content": f"What is {a} plus {b}?"}],
                    "chosen": [{"role": "assistant", "content": f"{a} plus {b} is {a + b}."}],
                    "rejected": [{"role": "assistant", "content": f"{a} plus {b} is {a + b + off}."}],
                }
            )
    return pairs


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reference", required=True)
    p.add_argument("--tuned", required=True)
    p.add_argument("--beta", type=float, default=0.1)
    p.add_argument("--out", help="a JSON file for every answer and score (default: none, printed only)")
    args = p.parse_args(argv)
    held = chat_demo.held_out_sums()
    asked = [(a, b) for a in range(10) for b in range(10) if (a, b) not in set(held)]
    reference, tuned = Generator.load(args.reference), Generator.load(args.tuned)
    result: dict = {"reference": args.reference, "tuned": args.tuned, "beta": args.beta}
    for name, model in (("reference", reference), ("tuned", tuned)):
        held_acc, held_answers = exact_match(model, held)
        asked_acc, _ = exact_match(model, asked)
        result[name] = {
            "exact_match_held_out": held_acc,
            "exact_match_asked": asked_acc,
            "answers_held_out": dict(zip([f"{a}+{b}" for a, b in held], held_answers, strict=True)),
        }
        print(f"{name}: exact match {held_acc:.3f} on {len(held)} held-out sums, {asked_acc:.3f} on {len(asked)} asked")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "held_out_pairs.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in held_out_pairs(held)))
        pairs, _ = load_pairs([str(path)], tuned.tokenizer, tuned.template, seq_len=48, eval_fraction=0)
    ref = reference_logps(reference.model, pairs.arrays)
    now = reference_logps(tuned.model, pairs.arrays)
    rewards = args.beta * (now - ref)
    result["held_out_pairs"] = len(pairs)
    result["preference_accuracy_held_out"] = float(np.mean(rewards[:, 0] > rewards[:, 1]))
    result["reward_margin_held_out"] = float(np.mean(rewards[:, 0] - rewards[:, 1]))
    result["reference_prefers_chosen_held_out"] = float(np.mean(ref[:, 0] > ref[:, 1]))
    result["tuned_prefers_chosen_held_out"] = float(np.mean(now[:, 0] > now[:, 1]))
    print(
        f"held-out pairs ({len(pairs)}): preference accuracy {result['preference_accuracy_held_out']:.3f}, margin "
        f"{result['reward_margin_held_out']:.3f}; log p(right) > log p(wrong): reference "
        f"{result['reference_prefers_chosen_held_out']:.3f}, tuned {result['tuned_prefers_chosen_held_out']:.3f}"
    )
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
