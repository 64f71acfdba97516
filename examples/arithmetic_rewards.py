"""Reward functions for GRPO on the chat demo's arithmetic questions (``make demo-grpo``).

Each takes TRL's keywords: the prompts, the completions (conversations: one assistant
message each), and the prompt records' other columns (here ``answer``, the full expected
answer ``3 plus 4 is 7.``), one item per completion, and returns one float per completion.

    xlafit train llm model.objective=grpo data.demo=grpo \\
        model.grpo.rewards=examples/arithmetic_rewards.py:exact_answer,right_number \\
        model.grpo.reward_weights=1,0.5 ...
"""


def exact_answer(prompts, completions, answer, **kwargs):
    """1 for the expected answer exactly (its number and its wording), else 0."""
    return [1.0 if c[0]["content"].strip() == a else 0.0 for c, a in zip(completions, answer, strict=True)]


def right_number(prompts, completions, answer, **kwargs):
    """1 where the number after the last ``is`` is the expected one (the wording aside), else 0."""
    out = []
    for c, a in zip(completions, answer, strict=True):
        said = c[0]["content"].rsplit(" is ", 1)[-1].strip().rstrip(".")
        out.append(1.0 if said == a.rsplit(" is ", 1)[-1].rstrip(".") else 0.0)
    return out
