"""The chat demo's data: short arithmetic conversations a tiny model learns in a minute on a
CPU, the same questions and answers as plain text (to pretrain on), and a tokenizer with a
chat template (ChatML, its answers marked for the loss), made once into the user cache; and
preference pairs on sums (a right and a wrong answer), to tune the chat model with DPO; and
questions with their answers as prompts, to tune it with GRPO and an exact-answer reward.

Example:
    >>> records = conversations(3, seed=0)
    >>> records[0]["messages"][-1]["role"]
    'assistant'
"""

from __future__ import annotations

import hashlib
import json
import random
import sys
import tempfile
from pathlib import Path
from typing import Any

from xlafit.data import clm
from xlafit.io.cache import cache_dir

__all__ = [
    "CHATML",
    "SPECIALS",
    "conversations",
    "demo_files",
    "grpo_file",
    "grpo_prompts",
    "held_out_questions",
    "held_out_sums",
    "preference_file",
    "preference_pairs",
]

# ChatML (Qwen's layout), the assistant's turn and its end marked as what the model generates.
CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] + '<|im_end|>' }}"
    "{% endgeneration %}{{ '\\n' }}{% else %}{{ message['content'] + '<|im_end|>' + '\\n' }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
SPECIALS = ["<|im_start|>", "<|im_end|>"]
_WORDS = {"plus": lambda a, b: a + b, "minus": lambda a, b: a - b, "times": lambda a, b: a * b}
VERSION = "chat-demo-3"  # 3: its tokenizer puts <s> before a text (train_bpe's post-processor)
PREFERENCE_VERSION = "2"  # the pairs' layout and held-out split (a new one makes a new file)
GRPO_VERSION = "1"  # the prompts' layout and held-out split


def conversations(n: int, seed: int = 0) -> list[dict[str, Any]]:
    """``n`` conversations: a question about two small numbers and its answer, some with a
    system turn and some with a second question."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        messages: list[dict[str, str]] = []
        if rng.random() < 0.3:
            messages.append({"role": "system", "content": "You answer arithmetic questions in one sentence."})
        for _ in range(1 + (rng.random() < 0.25)):
            word = rng.choice(sorted(_WORDS))
            a, b = rng.randint(0, 9), rng.randint(0, 9)
            messages.append({"role": "user", "content": f"What is {a} {word} {b}?"})
            messages.append({"role": "assistant", "content": f"{a} {word} {b} is {_WORDS[word](a, b)}."})
        out.append({"messages": messages})
    return out


def demo_files(n: int = 3000, vocab_size: int = 400) -> tuple[str, str, str]:
    """``(records, text, tokenizer directory)``: ``n`` conversations as JSON lines, other
    questions with their answers as plain text (one document each, blank lines between), and
    a byte-level BPE tokenizer trained on both with ChatML's tokens and template, made once
    in the cache."""
    key = json.dumps([VERSION, n, vocab_size])
    target = cache_dir() / f"chat-demo-{hashlib.sha256(key.encode()).hexdigest()[:12]}"
    if (target / "tokenizer" / "tokenizer_config.json").exists():
        return str(target / "chat.jsonl"), str(target / "text.txt"), str(target / "tokenizer")
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        root = Path(tmp)
        records = conversations(n)
        (root / "chat.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n")
        documents = [
            " ".join(m["content"] for m in r["messages"] if m["role"] != "system") for r in conversations(n, 1)
        ]
        (root / "text.txt").write_text("\n\n".join(documents) + "\n")
        tok = clm.train_bpe([str(root / "text.txt")], vocab_size, root / "tokenizer")
        tok.add_special_tokens(SPECIALS)
        tok.save(str(root / "tokenizer" / "tokenizer.json"))
        config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": clm.BOS,
            "eos_token": "<|im_end|>",
            "pad_token": clm.PAD,
            "chat_template": CHATML,
        }
        (root / "tokenizer" / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
        print(f"made the chat demo's data and tokenizer in {target} (once)", file=sys.stderr, flush=True)
        try:
            root.rename(target)
        except OSError:  # another process finished first
            if not (target / "tokenizer" / "tokenizer_config.json").exists():
                raise
        else:
            Path(tmp).mkdir()  # the context manager removes the (now empty) directory it made
    return str(target / "chat.jsonl"), str(target / "text.txt"), str(target / "tokenizer")


def held_out_sums() -> list[tuple[int, int]]:
    """The sums ``a plus b`` (``a, b`` in 0..9) that :func:`preference_pairs` never asks: a
    fifth of them, two for each ``a`` and two for each ``b``, to measure a tuned model on
    questions its pairs did not hold."""
    return [(a, b) for a in range(10) for b in range(10) if (3 * a + b) % 5 == 0]


def preference_pairs(n: int, seed: int = 0) -> list[dict[str, Any]]:
    """``n`` preference pairs in TRL's conversational layout: a question ``What is a plus
    b?``, the right answer chosen, an answer off by 1 to 3 rejected; the sums of
    :func:`held_out_sums` left out."""
    rng = random.Random(seed)
    held = set(held_out_sums())
    asked = [(a, b) for a in range(10) for b in range(10) if (a, b) not in held]
    out = []
    for _ in range(n):
        a, b = rng.choice(asked)
        wrong = a + b + rng.choice([-3, -2, -1, 1, 2, 3])
        out.append(
            {
                "prompt": [{"role": "user", "content": f"What is {a} plus {b}?"}],
                "chosen": [{"role": "assistant", "content": f"{a} plus {b} is {a + b}."}],
                "rejected": [{"role": "assistant", "content": f"{a} plus {b} is {wrong}."}],
            }
        )
    return out


def preference_file(n: int = 2000) -> str:
    """:func:`preference_pairs` as JSON lines, made once in the cache (the demo's tokenizer
    is :func:`demo_files`')."""
    target = cache_dir() / f"chat-demo-preferences-{PREFERENCE_VERSION}-{n}.jsonl"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=target.parent, delete=False, suffix=".tmp") as f:
            f.write("\n".join(json.dumps(r) for r in preference_pairs(n)) + "\n")
        Path(f.name).replace(target)
    return str(target)


def held_out_questions() -> list[tuple[int, str, int]]:
    """``(a, word, b)`` of every operation (plus, minus, times) on the pairs of
    :func:`held_out_sums`: the questions :func:`grpo_prompts` never asks (60)."""
    return [(a, word, b) for word in sorted(_WORDS) for a, b in held_out_sums()]


def answer(a: int, word: str, b: int) -> str:
    """The chat demo's answer to ``What is a word b?``: ``a word b is result.``"""
    return f"{a} {word} {b} is {_WORDS[word](a, b)}."


def grpo_prompts() -> list[dict[str, Any]]:
    """Every question ``What is a word b?`` (``a, b`` in 0..9, plus, minus and times) but
    :func:`held_out_questions`, in TRL's conversational prompt layout, with the full answer
    as the ``answer`` column an exact-answer reward compares with (240)."""
    held = set(held_out_questions())
    return [
        {"prompt": [{"role": "user", "content": f"What is {a} {word} {b}?"}], "answer": answer(a, word, b)}
        for word in sorted(_WORDS)
        for a in range(10)
        for b in range(10)
        if (a, word, b) not in held
    ]


def grpo_file() -> str:
    """:func:`grpo_prompts` as JSON lines, made once in the cache."""
    target = cache_dir() / f"chat-demo-grpo-{GRPO_VERSION}.jsonl"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=target.parent, delete=False, suffix=".tmp") as f:
            f.write("\n".join(json.dumps(r) for r in grpo_prompts()) + "\n")
        Path(f.name).replace(target)
    return str(target)
