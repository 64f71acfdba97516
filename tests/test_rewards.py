"""Reward functions of GRPO (xlafit.train.rewards): read from a Python file by name, called
with TRL's keywords, and each way a reward file or function can be wrong refused in one line
that names the function, the prompt and the fix."""

import numpy as np
import pytest

from xlafit.errors import ConfigError, RewardError
from xlafit.train.rewards import check_arguments, load_rewards, score

G = 2
PROMPT_INDEX = [40, 40, 7, 7]  # two prompts of the data, two completions each


def kwargs():
    return {
        "prompts": ["a", "a", "b", "b"],
        "completions": ["1", "22", "333", "boom"],
        "completion_ids": [[1], [2, 2], [3, 3, 3], [4]],
        "answer": ["1", "1", "3", "3"],
    }


def write(tmp_path, source, name="rewards.py"):
    path = tmp_path / name
    path.write_text(source)
    return str(path)


def test_functions_are_read_by_name_and_called_with_the_columns(tmp_path):
    path = write(
        tmp_path,
        "import helper\n"
        "def exact(prompts, completions, answer, **kwargs):\n"
        "    return [float(c == a) for c, a in zip(completions, answer)]\n"
        "def length(prompts, completions, completion_ids, **kwargs):\n"
        "    return [helper.SCALE * len(i) for i in completion_ids]\n",
    )
    write(tmp_path, "SCALE = 0.5\n", "helper.py")  # a neighbour the file imports
    rewards = load_rewards(f"{path}:exact,length")
    assert [name for name, _ in rewards] == ["exact", "length"]
    values = score(rewards, kwargs(), PROMPT_INDEX, G)
    np.testing.assert_array_equal(values, [[1, 0.5], [0, 1], [0, 1.5], [0, 0.5]])


@pytest.mark.parametrize(
    ("source", "spec", "message"),
    [
        ("def f(:\n", "f", r"is not Python: line 1: .*; give a \.py file that defines f"),
        ("def f(**k): return []\n", "g", r"has no function 'g' \(it defines f\); name one it defines"),
        ("f = 3\n", "f", r"f in .* is a int, not a function"),
        ("raise RuntimeError('no GPU')\n", "f", r"failed while being loaded: RuntimeError: no GPU; fix it"),
    ],
    ids=["not-python", "no-such-function", "not-callable", "raises-on-load"],
)
def test_a_reward_file_that_cannot_serve_is_refused(tmp_path, source, spec, message):
    path = write(tmp_path, source)
    with pytest.raises(ConfigError, match=message) as e:
        load_rewards(f"{path}:{spec}")
    assert "\n" not in str(e.value)


def test_a_missing_file_and_a_spec_without_functions_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="is not a file"):
        load_rewards(f"{tmp_path}/none.py:f")
    with pytest.raises(ConfigError, match="give a Python file and its reward functions"):
        load_rewards(f"{tmp_path}/none.py")


def test_an_edited_file_is_read_again(tmp_path):
    path = write(tmp_path, "def f(**k): return [1.0] * len(k['prompts'])\n")
    assert score(load_rewards(f"{path}:f"), kwargs(), PROMPT_INDEX, G)[0, 0] == 1.0
    write(tmp_path, "def f(**k):\n    return [2.0] * len(k['prompts'])\n")
    assert score(load_rewards(f"{path}:f"), kwargs(), PROMPT_INDEX, G)[0, 0] == 2.0


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (
            "return [1 / (c != 'boom') for c in completions]",
            r"reward function bad raised ZeroDivisionError: division by zero on the completions of the prompt of "
            r"record 8 of the data \(counted from 1\); fix the function",
        ),
        ("return [1.0, 2.0]", r"reward function bad returned 2 values for 4 completions; return one float per"),
        (
            "return [0.0, 0.0, float('nan'), 0.0]",
            r"reward function bad returned nan for completion 1 of 2 of the prompt of record 8 of the data \(counted "
            r"from 1\); return a finite number",
        ),
        ("return [0.0, None, 0.0, 0.0]", r"returned None for completion 2 of 2 of the prompt of record 41 of the data"),
        ("return 1.0", r"reward function bad returned a float, not a list"),
        # the fifth walk: a text that spells a number was taken as one (TRL's tensor refuses it)
        ("return ['1', '0', '1', '0']", r"returned '1' for completion 1 of 2 of the prompt of record 41 of the data"),
    ],
    ids=["raises", "wrong-count", "nan", "none", "not-a-list", "text"],
)
def test_a_reward_function_that_misbehaves_is_named_with_its_prompt(tmp_path, body, message):
    path = write(tmp_path, f"def ok(**k):\n    return [0.0] * 4\ndef bad(prompts, completions, **k):\n    {body}\n")
    with pytest.raises(RewardError, match=message) as e:
        score(load_rewards(f"{path}:ok,bad"), kwargs(), PROMPT_INDEX, G)
    assert "\n" not in str(e.value)


def test_a_function_that_takes_a_column_the_prompts_lack_is_refused_before_training(tmp_path):
    """The tenth walk: `def f(prompts, completions, solution, **kw)` on prompts with an `answer`
    column failed on the first batch with "fix the function (or that record)", advice no
    record can follow."""
    body = "    return [0.0] * len(prompts)\n"
    path = write(
        tmp_path,
        f"def f(prompts, completions, solution, **kw):\n{body}"
        f"def g(prompts, completions, answer, style='a', **kw):\n{body}",
    )
    check_arguments(load_rewards(f"{path}:g"), ["answer"])  # a default, or a column: taken
    with pytest.raises(ConfigError) as e:
        check_arguments(load_rewards(f"{path}:g,f"), ["answer"])
    assert str(e.value) == (
        "reward function f takes solution, which the prompts' records do not have (their columns: answer; every "
        "function also gets prompts, completions, completion_ids, and trainer_state if it takes it); add that field "
        "to every record, or give the argument a default."
    )


def test_trainer_state_is_given_to_the_functions_that_take_it_and_async_ones_are_awaited(tmp_path):
    """The fourteenth walk: TRL gives its reward functions ``trainer_state`` (a curriculum reads
    its step) and awaits ``async def`` ones; xlafit refused the first ("add that field to every
    record") and failed the second at the first batch ("returned a coroutine")."""
    import asyncio

    from xlafit.train.rewards import TrainerState

    path = write(
        tmp_path,
        "import asyncio\n"
        "def curriculum(prompts, completions, trainer_state, **kwargs):\n"
        "    return [trainer_state.global_step / trainer_state.max_steps] * len(prompts)\n"
        "def strict(prompts, completions, completion_ids, answer):\n"  # no **kwargs: given no state
        "    return [float(len(i)) for i in completion_ids]\n"
        "async def judged(prompts, completions, **kwargs):\n"
        "    await asyncio.sleep(0)\n"
        "    return [kwargs['trainer_state'].epoch] * len(prompts)\n",
    )
    rewards = load_rewards(f"{path}:curriculum,strict,judged")
    check_arguments(rewards, ["answer"])
    state = TrainerState(global_step=3, max_steps=12, epoch=0.5)
    expected = [[0.25, 1, 0.5], [0.25, 2, 0.5], [0.25, 3, 0.5], [0.25, 1, 0.5]]
    np.testing.assert_array_equal(score(rewards, kwargs(), PROMPT_INDEX, G, state), expected)

    async def in_a_running_loop():  # a notebook's kernel runs its cells inside an event loop
        return score(rewards, kwargs(), PROMPT_INDEX, G, state)

    np.testing.assert_array_equal(asyncio.run(in_a_running_loop()), expected)


@pytest.mark.parametrize(
    ("signature", "message"),
    [
        (
            "prompts, completion, answer, **kw",
            "reward function f takes completion, which the prompts' records do not have (their columns: answer; "
            "every function also gets prompts, completions, completion_ids, and trainer_state if it takes it); "
            "rename it (completion -> completions), or give the argument a default.",
        ),
        (
            "prompts, completions, log_metric, **kw",
            "reward function f takes log_metric (TRL's logging hook), which xlafit does not give: the run logs each "
            "function's mean and standard deviation itself (rewards/f/mean, rewards/f/std); take it out of the "
            "signature, or give it a default (None).",
        ),
    ],
    ids=["typo", "trl-hook"],
)
def test_a_misspelt_argument_or_a_trl_logging_hook_is_named_as_what_it_is(tmp_path, signature, message):
    """The fourteenth walk: `completion` for `completions` was told "add that field to every
    record, or give the argument a default", neither a fix for a typo."""
    path = write(tmp_path, f"def f({signature}):\n    return [0.0] * len(prompts)\n")
    with pytest.raises(ConfigError) as e:
        check_arguments(load_rewards(f"{path}:f"), ["answer"])
    assert str(e.value) == message


def test_a_function_reading_a_trl_hook_from_kwargs_is_told_xlafit_does_not_give_it(tmp_path):
    path = write(tmp_path, "def f(prompts, completions, **kw):\n    kw['log_extra']('x', [])\n")
    with pytest.raises(RewardError, match=r"raised KeyError: 'log_extra' .*; xlafit gives trainer_state to a function"):
        score(load_rewards(f"{path}:f"), kwargs(), PROMPT_INDEX, G)
